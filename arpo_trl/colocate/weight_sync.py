"""The colocated engine's weight sync: before a rollout, vLLM's copy of the policy becomes the trained one.

Merged weights, loaded tensor by tensor through the model's `load_weights` (as TRL's colocate mode does), rather than
a LoRA adapter loaded under a new name:
* a LoRA request makes every decode step pay the adapter's extra matmuls (vLLM-CPU measured 10.6 vs 13.9 tok/s
  single-sequence and 72.7 vs 122 tok/s batched for SmolLM2, docs/server_mode.md), while a merged sync costs one
  copy of the weights per rollout;
* the same path serves full fine-tuning;
* vLLM then needs no `enable_lora`, no `max_lora_rank` and no adapter folder on disk.
Unlike TRL, the adapter is not merged into the trained model and unmerged again: each LoRA layer's weight is sent as
W + ΔW computed aside, so the trained base weights never take a round trip through merge/unmerge rounding (which in
bf16 drifts them a little every step).
Every sync ends with a prefix-cache reset: no block computed with the old weights serves a request after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

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
        if (layer := deltas.get(name)) is not None:
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            tensor = tensor + delta.to(tensor.dtype)
        yield vllm_name(name), tensor


class ColocatedWeightSync:
    """TRL's per-step `vllm_generation.sync_weights()` hook for the colocated engine (wakes it when it sleeps)."""

    def __init__(self, engine, model_getter):
        self.engine, self.model_getter = engine, model_getter
        self.last_seconds: float | None = None  # logged as arpo/weight_sync_seconds, then cleared
        self.syncs = 0

    def sync_weights(self) -> None:
        start = time.perf_counter()
        engine = self.engine
        engine.wake_up(["weights"])
        engine.load_weights(policy_weights(self.model_getter()))
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
            self.engine.wake_up()
