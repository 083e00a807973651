"""The colocated engine's weight sync: before a rollout, vLLM's copy of the policy becomes the trained one.

Merged weights, loaded tensor by tensor through the model's `load_weights` (as TRL's colocate mode does), rather than
a LoRA adapter loaded under a new name:
* a LoRA request makes every decode step pay the adapter's extra matmuls (docs/cpu_measurements.md), while a merged
  sync costs one copy of the weights per rollout;
* the same path serves full fine-tuning;
* vLLM then needs no `enable_lora`, no `max_lora_rank` and no adapter folder on disk.
Unlike TRL, the adapter is not merged into the trained model and unmerged again: each LoRA layer's weight is sent as
W + ΔW computed aside in float32 and rounded once, so the trained base weights never take a round trip through
merge/unmerge rounding (which in bf16 drifts them a little every step).
Every sync must cover the checkpoint vLLM loaded: after level-2 sleep vLLM's weights are discarded without a backup,
and its layerwise reload keeps a layer that gets no tensor as it is, and builds one that gets only some of its
tensors (q and k of a fused qkv, not v) from uninitialised memory (`model_loader/reload/layerwise.py::
finalize_layerwise_processing`, vLLM 0.22 and 0.31), logging no more than a warning. So a sync that misses a
checkpoint tensor fails, naming it (`SyncCoverage`).
Every sync ends with a prefix-cache reset: no block computed with the old weights serves a request after it.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Iterable, Iterator

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

logger = logging.getLogger("arpo_trl.trainer")


def check_mergeable(model) -> None:
    """Adapters whose merged weight is not W + ΔW (DoRA's magnitude vectors) cannot be sent this way."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and any((module.use_dora or {}).values()):
            raise NotImplementedError(f"vllm_mode='colocate' syncs merged LoRA weights; DoRA ({name}) is not "
                                      "supported: set use_dora=False, or use vllm_mode='server' (adapter sync).")


def _lora_deltas(model: PeftModel) -> dict[str, LoraLayer]:
    """Base-weight parameter name -> the LoRA layer whose active adapters add to it."""
    return {f"{name}.base_layer.weight": module for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and not module.merged
            and any(adapter in module.lora_A for adapter in module.active_adapters)}


def vllm_name(name: str) -> str:
    """A trained model's parameter name as vLLM's `load_weights` takes it (the Hugging Face checkpoint's name)."""
    return (name.removeprefix("base_model.model.").replace(".base_layer", "")
            .replace(".modules_to_save.default", ""))


@torch.no_grad()
def policy_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the policy being trained, LoRA merged: one tensor at a time, never a second model.
    Tied weights appear once (named_parameters drops duplicates; vLLM ties them the same way)."""
    deltas = _lora_deltas(model) if isinstance(model, PeftModel) else {}
    for name, param in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        tensor = param.detach()
        if (layer := deltas.get(name)) is not None:  # W + ΔW in float32, rounded once to W's dtype
            delta = sum(layer.get_delta_weight(a).float() for a in layer.active_adapters if a in layer.lora_A)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        yield vllm_name(name), tensor


# Checkpoint tensors vLLM's models do not load (rotary tables some old checkpoints saved); a tied head is not loaded
# either, it is the embedding (`tie_word_embeddings`).
NOT_LOADED = ("rotary_emb.inv_freq",)


def checkpoint_tensor_names(model: str, tied_embeddings: bool) -> set[str] | None:
    """The tensors vLLM loaded from the checkpoint `model` (a folder or a cached hub id) at its start: the names in its
    safetensors files; None where there are none to read (a .bin checkpoint)."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    def cached(name: str) -> str | None:
        return cached_file(model, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)

    if (index := cached("model.safetensors.index.json")) is not None:
        with open(index, encoding="utf-8") as f:
            names = set(json.load(f)["weight_map"])
    elif (single := cached("model.safetensors")) is not None:
        with safe_open(single, "pt") as f:
            names = set(f.keys())
    else:
        return None
    return {name for name in names if not name.endswith(NOT_LOADED)
            and not (tied_embeddings and name == "lm_head.weight")}


class SyncCoverage:
    """Checks that every sync sends each tensor vLLM holds: the checkpoint's (`checkpoint_tensor_names`), or, where
    those cannot be read, the ones the first sync sent."""

    def __init__(self, expected: set[str] | None):
        self.expected = expected

    def watch(self, tensors: Iterable[tuple[str, torch.Tensor]], seen: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            seen.add(name)
            yield name, tensor

    def check(self, seen: set[str]) -> None:
        if self.expected is None:
            self.expected = set(seen)
            return
        if missing := sorted(self.expected - seen):
            raise RuntimeError(
                f"The weight sync to colocated vLLM sent no tensor for {len(missing)} of the checkpoint's "
                f"{len(self.expected)} weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); vLLM "
                "would keep garbage there (after level-2 sleep its weights are discarded). The trained model's "
                "parameter names must map to the checkpoint's (`colocate.weight_sync.vllm_name`).")


class ColocatedWeightSync:
    """TRL's per-step `vllm_generation.sync_weights()` hook for the colocated engine (wakes it when it sleeps).
    `coverage`: what every sync must send (`SyncCoverage`; default: the ones the first sync sent)."""

    def __init__(self, engine, model_getter, coverage: SyncCoverage | None = None):
        self.engine = engine
        self.model_getter = model_getter
        self.coverage = coverage or SyncCoverage(None)
        self.last_seconds: float | None = None  # logged as arpo/weight_sync_seconds, then cleared
        self.syncs = 0

    def sync_weights(self) -> None:
        start = time.perf_counter()
        engine, seen = self.engine, set()
        release_cached_memory()
        engine.wake_up(["weights"])
        engine.load_weights(self.coverage.watch(policy_weights(self.model_getter()), seen))
        self.coverage.check(seen)
        release_cached_memory()
        engine.wake_up(["kv_cache"])
        engine.reset_prefix_cache()
        self.syncs += 1
        self.last_seconds = time.perf_counter() - start
        logger.debug("ARPO colocate: weights synced to vLLM in %.2f s.", self.last_seconds)

    def before_rollout(self) -> None:
        """A rollout needs vLLM awake, with the current weights (level-2 sleep dropped them; an evaluation rollout
        comes without TRL's per-step sync)."""
        if self.engine.weights_discarded:
            self.sync_weights()
        else:
            release_cached_memory()
            self.engine.wake_up()


def release_cached_memory() -> None:
    """Before vLLM wakes: the training phase's freed blocks go back to the device. vLLM 0.31's `CuMemAllocator.wake_up`
    does this itself (`gc.collect()`, `empty_cache()`), 0.22's does not, and its wake-up then maps the KV cache into
    memory torch's allocator still holds (TRL's `sync_weights` empties the cache first, "required to avoid OOM")."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
