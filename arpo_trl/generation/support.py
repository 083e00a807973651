"""Which runs the cached engine can serve, and what TRL's knobs configure in it (`cached_engine.py`)."""

from __future__ import annotations

import json

import transformers
from packaging.version import Version

# transformers' cache API as the engine reads it (`DynamicCache.layers` filled by a forward); older releases (those
# vLLM 0.31 pins, < 5.18) leave it empty, so the colocate environment's in-process runs use the waves engine.
MIN_TRANSFORMERS = "5.20"
IN_PROCESS_ENGINES = ("auto", "cached", "waves")  # ARPOConfig.in_process_engine


def cache_budget(config: dict | str | None) -> int | None:
    """KV positions the prefix cache may hold, from TRL's `transformers_continuous_batching_config` (validated as
    `transformers.ContinuousBatchingConfig` keyword arguments): `num_blocks` × `block_size` when both are set."""
    from transformers.generation import ContinuousBatchingConfig

    kwargs = json.loads(config) if isinstance(config, str) else dict(config or {})
    ContinuousBatchingConfig(**kwargs)  # the same validation TRL applies
    blocks, size = kwargs.get("num_blocks"), kwargs.get("block_size", kwargs.get("page_size"))
    return blocks * size if blocks and size else None


# an allow-list, where the waves engine has a deny-list (engine.check_generation_kwargs): this engine samples
# itself and implements exactly these, while `model.generate` would run whatever else HF knows
SUPPORTED_KEYS = {"do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"}


def non_full_attention(config) -> list[str]:
    """The kinds of attention other than full attention over the whole sequence that a model config asks for: its
    `layer_types` beyond 'full_attention' (sliding windows, chunked, recurrent or linear layers), and
    'sliding_attention' where it sets `sliding_window` alone (Mistral, Mixtral, Phi-3, Starcoder2), unless
    `use_sliding_window` turns that off (Qwen2). Empty for a full-attention model."""
    config = config.get_text_config(decoder=True)
    kinds = {kind for kind in getattr(config, "layer_types", None) or [] if kind != "full_attention"}
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
        kinds.add("sliding_attention")
    return sorted(kinds)


def check_full_attention(model) -> None:
    """Cache entries are built as plain full-attention layers; a windowed or recurrent layer would be wrong."""
    if other := non_full_attention(model.config):
        raise ValueError(f"CachedTransformersEngine needs full-attention layers only; this model has {other} "
                         f"(layer_types / sliding_window): use the waves engine (in_process_engine='waves').")


def cached_engine_blocker(model, generation_kwargs: dict | None, cache_implementation: str | None,
                          sharded_processes: bool) -> str | None:
    """Why this engine cannot serve a run (a sentence), or None: what `in_process_engine='auto'` (ARPOConfig's
    default) checks before it picks this engine over the waves engine."""
    if sharded_processes:
        return "sharded parameters (ZeRO-3/FSDP) over several processes need the ranks' model calls in step"
    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        return f"transformers {transformers.__version__} predates the cache API it reads (>= {MIN_TRANSFORMERS})"
    if unsupported := sorted(set(generation_kwargs or {}) - SUPPORTED_KEYS):
        return f"generation_kwargs {unsupported} are not among the ones it samples with ({sorted(SUPPORTED_KEYS)})"
    if cache_implementation:
        return f"cache_implementation={cache_implementation!r} configures model.generate's cache"
    if other := non_full_attention(model.config):
        return f"the model's attention is not full attention only ({other}: layer_types / sliding_window)"
    return None
