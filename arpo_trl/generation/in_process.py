"""Which in-process engine a trainer without vLLM generates with, read from TRL's knobs: the cached engine
(`cached_engine.py`) where it can run (`use_transformers_continuous_batching`; unset: wherever it can), else the waves
engine (`transformers_engine.py`), both under the KV budget of `transformers_continuous_batching_config`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

from arpo_trl.generation.cached_engine import CachedTransformersEngine
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
    if args.use_transformers_continuous_batching and blocker:
        raise NotImplementedError(f"use_transformers_continuous_batching=True: the cached engine cannot run here: "
                                  f"{blocker}. Set it to False (the waves engine) or leave it unset (auto).")
    if args.use_transformers_continuous_batching or (args.use_transformers_continuous_batching is None
                                                     and blocker is None):  # TRL's knob; None: where it can
        engine_class, extra = CachedTransformersEngine, {
            "max_cached_tokens": cache_budget(args.transformers_continuous_batching_config),
            "max_draft_tokens": args.max_draft_tokens, "kv_budget": budget}
    elif args.cache_implementation:
        sampling.generation_kwargs.setdefault("cache_implementation", args.cache_implementation)
    return engine_class(None, tokenizer, sampling=sampling, **extra, model_context=model_context)
