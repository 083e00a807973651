"""How the colocated vLLM engine is built: `ColocateSettings` (from the trainer's config and model) -> vLLM's
`EngineArgs`, and the process environment an in-process engine needs.

vLLM runs inside the training process under `distributed_executor_backend="external_launcher"`, as TRL's colocate
mode runs it: no engine-core or worker processes, the model on the trainer's device. Choices that differ from
vLLM's defaults, and why (what vLLM does otherwise is read from the source of vLLM 0.31.0 and 0.22.0; docs/one_gpu.md):
* prefix caching on: a fork or a continuation is a new request whose prefix the cache already holds;
* `logprobs_mode="processed_logprobs"`: the entropy and TRL's importance-sampling correction read the sampler's own
  distribution (after temperature and top-k/top-p), as our launcher's servers do;
* `max_logprobs=-1`: the k of the entropy estimate is ours to choose (`entropy_top_k`);
* `max_num_seqs`, `max_num_batched_tokens` always set (`batch_limits`): `LLMEngine.from_engine_args` defaults to
  `UsageContext.ENGINE_CONTEXT`, which `EngineArgs.get_batch_defaults` does not list, so
  `_set_default_max_num_seqs_and_batched_tokens_args` falls back to `SchedulerConfig`'s 128 and 2048;
* `async_scheduling=False` on every device: `VllmConfig.__post_init__` turns it on where the executor supports it,
  and `ExecutorWithExternalLauncher` (a `UniProcExecutor`) does, with a batch queue of 2
  (`EngineCore.step_with_batch_queue`: `step()` may return no output while requests run); `CpuPlatform.
  check_and_update_config` forces it off. Off, a GPU runs the scheduler our vLLM-CPU tests run;
* the V1 model runner on every device (`VLLM_USE_V2_MODEL_RUNNER=0`): vLLM 0.31 picks the V2 runner on CUDA
  (`VllmConfig.use_v2_model_runner`), vLLM-CPU the V1-based one, which the tests run;
* `OMP_NUM_THREADS` set to the trainer's thread count while the engine starts, on every device: unless it is set,
  vLLM 0.31's `Worker.load_model` calls `set_torch_threads_for_runtime()`, which sets the whole process (the
  trainer's) to one torch thread (vLLM-CPU's worker does the same);
* on a CPU, eager mode (there are no CUDA graphs) and 32-token KV blocks (vLLM-CPU's smallest), so that a fork
  reuses all but at most 31 tokens of its prefix; on a GPU, vLLM's defaults (CUDA graphs, 16-token blocks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from arpo_trl.preflight import free_port

CPU_BLOCK_SIZE = 32
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
# The prefill chunk, as TRL's colocate mode sets it (`trl/generation/vllm_generation.py`, "vLLM v1 memory profiler is
# misled by the high default"); without it `LLMEngine.from_engine_args` would take 2048 (see `batch_limits`).
MAX_NUM_BATCHED_TOKENS = 4096


def batch_limits(args) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) the colocated engine is given, never left to vLLM: built without a usage
    context, `LLMEngine.from_engine_args` resolves them to a server's smallest (128 and 2048). Sequences: two per path
    of a rollout (a rollout's paths, `per_device_train_batch_size` x `steps_per_generation`, plus as many speculative
    fill-ups and branches), so that no path of the tree waits in vLLM's queue."""
    return 2 * args.per_device_train_batch_size * args.steps_per_generation, MAX_NUM_BATCHED_TOKENS


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
    max_num_seqs: int  # requests decoding at once (`batch_limits`)
    max_num_batched_tokens: int  # tokens a step computes at most, prefill chunks included (`batch_limits`)
    cpu_kv_cache_gib: float = 1.0  # vLLM-CPU's KV cache (its VLLM_CPU_KVCACHE_SPACE), unless that is set
    model_impl: str = "vllm"  # `vllm_model_impl`


def engine_kwargs(settings: ColocateSettings) -> dict:
    """Keyword arguments of `vllm.EngineArgs` for `settings`."""
    kwargs = {
        "model": settings.model, "dtype": settings.dtype, "max_model_len": settings.max_model_len,
        "gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": settings.enable_sleep_mode,
        "seed": settings.seed, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1, "distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1,
        "model_impl": settings.model_impl, "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens, "async_scheduling": False,
    }
    if settings.device == "cpu":
        kwargs.update(enforce_eager=True, block_size=CPU_BLOCK_SIZE)
    return kwargs


def prepare_environment(settings: ColocateSettings, threads: int) -> dict[str, str | None]:
    """Set what an in-process engine reads from the environment; returns the previous values, for `restore`.

    * engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); one rank of one (the external launcher reads
      RANK/LOCAL_RANK/WORLD_SIZE and a rendezvous address, which must not collide with another run's);
    * vLLM drops torch to one thread unless OMP_NUM_THREADS is set (0.31's GPU worker and vLLM-CPU's), which would
      starve the training in the same process: it is set to the trainer's thread count, on every device;
    * the V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`, unless set), the one the vLLM-CPU tests run;
    * on a CPU, its KV cache size (`cpu_kv_cache_gib`)."""
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
              "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
              "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(threads),
              "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER") or "0"}
    if settings.device == "cpu":
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

    threads = torch.get_num_threads()
    previous, set_num_threads = prepare_environment(settings, threads), torch.set_num_threads
    try:
        return LLMEngine.from_engine_args(EngineArgs(**{**engine_kwargs(settings), **overrides}))
    finally:
        torch.set_num_threads = set_num_threads  # vLLM-CPU's worker replaces it process-wide
        if torch.get_num_threads() != threads:  # the trainer's threads, whatever the engine's start set
            torch.set_num_threads(threads)
        restore_environment(previous)


def restore_environment(previous: dict[str, str | None]) -> None:
    """Undo `prepare_environment` for the variables that only the engine's start reads."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        if key in previous:
            if previous[key] is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = previous[key]
