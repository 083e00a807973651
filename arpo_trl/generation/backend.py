"""A trainer's generation backend: one object, chosen once from the config, that starts the engine the rollouts run
on, installs its weight sync, and does what its mode needs around each rollout (`GenerationBackend`). This module's
is the in-process one (`InProcessBackend`): the cached engine (`cached_engine.py`) where it can run
(`in_process_engine`; 'auto': wherever it can), else the waves engine (`transformers_engine.py`),
both under the KV budget of `transformers_continuous_batching_config`; ranks with sharded parameters generate in
lockstep. vLLM's are `server/trainer_mode.py` and `colocate/trainer_mode.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

from trl.models.utils import unwrap_model_for_generation

from arpo_trl.generation.cached_engine import CachedTransformersEngine
from arpo_trl.generation.distributed import LockstepEngine
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.kv_budget import KVBudgetSetting
from arpo_trl.generation.support import cache_budget, cached_engine_blocker
from arpo_trl.generation.transformers_engine import TransformersEngine


def in_process_engine(args, model, tokenizer, sampling: SamplingSettings,
                      model_context: Callable[[], AbstractContextManager], lockstep: bool) -> TransformersEngine:
    """The engine for `args` (an `ARPOConfig`) over `model`, which `model_context` yields at each use. `lockstep`:
    ranks with sharded parameters, which must split their waves alike (the waves engine, unbounded)."""
    sampling = replace(sampling, generation_kwargs=dict(args.generation_kwargs or {}))
    # the KV budget (generation/kv_budget.py) from TRL's knob; ranks in lockstep must split their waves alike
    budget = KVBudgetSetting(unbounded=True) if lockstep else KVBudgetSetting.from_config(
        args.transformers_continuous_batching_config)
    engine_class, extra = TransformersEngine, {"synced_gpus": lockstep, "kv_budget": budget}
    blocker = cached_engine_blocker(model, args.generation_kwargs, args.cache_implementation, lockstep)
    if args.in_process_engine == "cached" and blocker:
        raise NotImplementedError(f"in_process_engine='cached': the cached engine cannot run here: {blocker}. Set "
                                  f"in_process_engine to 'waves' or 'auto'.")
    if args.in_process_engine == "cached" or (args.in_process_engine == "auto" and blocker is None):
        engine_class, extra = CachedTransformersEngine, {
            "max_cached_tokens": cache_budget(args.transformers_continuous_batching_config),
            "max_draft_tokens": args.max_draft_tokens, "kv_budget": budget}
    elif args.cache_implementation:
        sampling.generation_kwargs.setdefault("cache_implementation", args.cache_implementation)
    return engine_class(None, tokenizer, sampling=sampling, **extra, model_context=model_context)


class GenerationBackend:
    """What the trainer asks of its backend; the defaults do nothing. `trainer`: the `ARPOTrainer` it serves, whose
    `args`, `accelerator`, `model`, `sampler`, `engine` and `_trl` it reads."""

    weight_sync_mode: str | None = None  # `ARPOTrainer.vllm_weight_sync_mode`

    def __init__(self, trainer):
        self.trainer = trainer

    def start_engine(self):
        """The engine the rollouts run on (called once, when the user passed none)."""
        raise NotImplementedError

    def install_weight_sync(self) -> None:
        """Set TRL's per-step weight sync, once the engine exists."""

    def rollout(self, prompt_ids: list, m: int, policy: str | None, environments: Sequence | None):
        """This rank's rollout and its trajectories."""
        self.before_rollout()
        result = self.trainer.sampler.sample(prompt_ids, num_generations=m, branch_policy=policy,
                                             environments=environments)
        self.after_rollout()
        return result, result.trajectories

    def before_rollout(self) -> None:
        pass

    def after_rollout(self) -> None:
        pass

    def metrics(self, groups: int) -> dict[str, float]:
        """The backend's own `arpo/*` metrics of the rollout just logged."""
        return {}


class InProcessBackend(GenerationBackend):
    """No vLLM: the model being trained generates, through the trainer's model context (TRL's
    `unwrap_model_for_generation`); ranks with sharded parameters step their model calls together (`LockstepEngine`)."""

    def start_engine(self) -> TransformersEngine | LockstepEngine:
        trainer = self.trainer
        args, lockstep = trainer.args, trainer._trl.is_sharded() and trainer.accelerator.num_processes > 1
        engine = in_process_engine(args, trainer.model, trainer._trl.tokenizer, trainer._sampling(), lambda: (
            unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                        gather_deepspeed3_params=args.ds3_gather_for_generation,
                                        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)), lockstep)
        return LockstepEngine(engine, trainer.accelerator, trainer._trl.eos_token_ids[:1]) if lockstep else engine

    def after_rollout(self) -> None:
        if isinstance(self.trainer.engine, LockstepEngine):
            self.trainer.engine.finish_rollout()
