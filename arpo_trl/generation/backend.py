"""A trainer's generation backend: one object, chosen once from the config, that starts the engine the rollouts run
on, installs its weight sync, and does what its mode needs around each rollout (`GenerationBackend`). This module's
is the in-process one (`InProcessBackend`): the cached engine (`cached_engine.py`) where it can run
(`in_process_engine`; 'auto': wherever it can), else the waves engine (`transformers_engine.py`),
both under the KV budget of `transformers_continuous_batching_config`; ranks with sharded parameters generate in
lockstep. vLLM's are `server/trainer_mode.py` and `colocate/trainer_mode.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

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
            "max_cached_tokens": cache_budget(args.transformers_continuous_batching_config), "kv_budget": budget}
    elif args.cache_implementation:
        sampling.generation_kwargs.setdefault("cache_implementation", args.cache_implementation)
    return engine_class(None, tokenizer, sampling=sampling, **extra, model_context=model_context)


@dataclass(frozen=True)
class TrainerView:
    """What a generation backend sees of the trainer it serves, and all it sees: built by `ARPOTrainer`, handed in at
    construction. What the trainer sets later (its engine, its sampler) or wraps later (accelerate's model wrapper)
    is read through a call."""

    args: Any  # the `ARPOConfig`
    accelerator: Any
    tokenizer: Any
    eos_token_ids: list[int]  # TRL's: the tokenizer's and the generation config's
    sampling: SamplingSettings
    train_dataset: Any
    sharded: bool  # DeepSpeed ZeRO-3 or FSDP parameters
    model: Callable[[], Any]  # the model being trained, as the trainer holds it now
    model_wrapped: Callable[[], Any]  # as accelerate wrapped it (TRL's `unwrap_model_for_generation` takes it)
    engine: Callable[[], Any]  # the engine the rollouts run on, once started
    sample: Callable[..., Any]  # the trainer's `BranchingSampler.sample`
    install_weight_sync: Callable[[Any], None]  # set TRL's per-step weight-sync hook
    weight_sync: Callable[[], Any]  # the weight sync installed
    check_vespo_sampling_mode: Callable[[], None]  # refuse TRL's VESPO loss where it cannot get its logprobs


class GenerationBackend:
    """What the trainer asks of its backend; the defaults do nothing. `trainer`: what it sees of the trainer it serves
    (`TrainerView`)."""

    weight_sync_mode: str | None = None  # `ARPOTrainer.vllm_weight_sync_mode`

    def __init__(self, trainer: TrainerView):
        self.trainer = trainer

    def start_engine(self):
        """The engine the rollouts run on (called once, when the user passed none)."""
        raise NotImplementedError

    def install_weight_sync(self) -> None:
        """Set TRL's per-step weight sync, once the engine exists."""

    def rollout(self, prompt_ids: list, m: int, policy: str | None, environments: Sequence | None):
        """This rank's rollout and its trajectories."""
        self.before_rollout()
        result = self.trainer.sample(prompt_ids, num_generations=m, branch_policy=policy, environments=environments)
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
        args, lockstep = trainer.args, trainer.sharded and trainer.accelerator.num_processes > 1
        engine = in_process_engine(args, trainer.model(), trainer.tokenizer, trainer.sampling, lambda: (
            unwrap_model_for_generation(trainer.model_wrapped(), trainer.accelerator,
                                        gather_deepspeed3_params=args.ds3_gather_for_generation,
                                        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)), lockstep)
        return LockstepEngine(engine, trainer.accelerator, trainer.eos_token_ids[:1]) if lockstep else engine

    def after_rollout(self) -> None:
        if isinstance(engine := self.trainer.engine(), LockstepEngine):
            engine.finish_rollout()


MEASURED_PROMPTS = 50_000  # a larger dataset's prompts are not tokenized at startup (set max_prompt_length)


def prompt_budget(args, tokenizer, dataset) -> tuple[int, str]:
    """`max_prompt_length`, else the longest prompt of the training data as `arpo-trl train` measures it (chat
    template applied), else 1 (a dataset too large or without a `prompt` column is not measured); and where it came
    from. The vLLM backends size their engines with it."""
    if args.max_prompt_length is not None:
        return args.max_prompt_length, "max_prompt_length"
    from arpo_trl.preflight import prompt_token_lengths

    try:
        size = len(dataset)
        lengths = prompt_token_lengths(tokenizer, list(dataset["prompt"])) if 0 < size <= MEASURED_PROMPTS else []
    except (TypeError, KeyError, ValueError):  # no `prompt` column, no chat template: TRL says so itself
        lengths = []
    if not lengths:
        return 1, "a prompt (max_prompt_length unset, the data not measured)"
    return max(lengths), "the longest prompt (max_prompt_length unset)"
