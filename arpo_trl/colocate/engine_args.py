"""How the colocated vLLM engine is built: `ColocateSettings` (from the trainer's config and model) -> vLLM's
`EngineArgs`, and the process environment an in-process engine needs.

vLLM runs inside the training process under `distributed_executor_backend="external_launcher"`, as TRL's colocate
mode runs it: no engine-core or worker processes, the model on the trainer's device. Choices that differ from a
server's defaults, and why:
* prefix caching on: a fork or a continuation is a new request whose prefix the cache already holds;
* `logprobs_mode="processed_logprobs"`: the entropy and TRL's importance-sampling correction read the sampler's own
  distribution (after temperature and top-k/top-p), as our launcher's servers do;
* `max_logprobs=-1`: the k of the entropy estimate is ours to choose (`entropy_top_k`);
* on a CPU, eager mode (there are no CUDA graphs) and 32-token KV blocks (vLLM-CPU's smallest), so that a fork
  reuses all but at most 31 tokens of its prefix; on a GPU, vLLM's defaults (CUDA graphs, 16-token blocks).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

CPU_BLOCK_SIZE = 32
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass(frozen=True)
class ColocateSettings:
    """What the colocated engine is built from; the trainer fills it from `ARPOConfig` (TRL's knobs)."""

    model: str  # the path or hub id vLLM loads the architecture and tokenizer from (weights are synced over it)
    dtype: str  # 'float32' | 'bfloat16' | 'float16': the trained model's, so that a sync copies exactly
    max_model_len: int  # prompt + completion budget (`vllm_max_model_length` when set)
    gpu_memory_utilization: float  # `vllm_gpu_memory_utilization`: vLLM's share of the GPU, its KV cache included
    enable_sleep_mode: bool  # `vllm_enable_sleep_mode`
    seed: int
    device: str  # 'cuda' | 'cpu'
    cpu_kv_cache_gib: float = 1.0  # vLLM-CPU's KV cache (its VLLM_CPU_KVCACHE_SPACE), unless that is set
    max_num_seqs: int | None = None  # requests decoding at once; None: vLLM's default
    model_impl: str = "vllm"  # `vllm_model_impl`


def engine_kwargs(settings: ColocateSettings) -> dict:
    """Keyword arguments of `vllm.EngineArgs` for `settings`."""
    kwargs = {
        "model": settings.model, "dtype": settings.dtype, "max_model_len": settings.max_model_len,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": settings.enable_sleep_mode,
        "seed": settings.seed, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1, "distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1,
        "model_impl": settings.model_impl,
    }
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.device == "cpu":
        kwargs.update(enforce_eager=True, block_size=CPU_BLOCK_SIZE)
    return kwargs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_environment(settings: ColocateSettings, threads: int) -> dict[str, str | None]:
    """Set what an in-process engine reads from the environment; returns the previous values, for `restore`.

    * engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); one rank of one (the external launcher reads
      RANK/LOCAL_RANK/WORLD_SIZE and a rendezvous address, which must not collide with another run's);
    * vLLM-CPU drops torch to one thread unless OMP_NUM_THREADS is set, which would starve the training in the same
      process: it is set to the trainer's thread count; and its KV cache size (`cpu_kv_cache_gib`)."""
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
              "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
              "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port())}
    if settings.device == "cpu":
        wanted["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(threads)
        wanted["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or f"{settings.cpu_kv_cache_gib:g}"
    previous = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    return previous


def start_llm_engine(settings: ColocateSettings, **overrides):
    """A vLLM `LLMEngine` in this process for `settings`, plus `overrides` of its `EngineArgs` (the environment it
    reads set only while it starts)."""
    import torch
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    previous, set_num_threads = prepare_environment(settings, torch.get_num_threads()), torch.set_num_threads
    try:
        return LLMEngine.from_engine_args(EngineArgs(**{**engine_kwargs(settings), **overrides}))
    finally:
        torch.set_num_threads = set_num_threads  # vLLM-CPU's worker replaces it process-wide
        restore_environment(previous)


def restore_environment(previous: dict[str, str | None]) -> None:
    """Undo `prepare_environment` for the variables that only the engine's start reads."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        if key in previous:
            if previous[key] is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = previous[key]
