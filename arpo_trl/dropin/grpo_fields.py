"""The `GRPOConfig` settings `ARPOConfig` refuses, each with the reason a TRL user gets in one line
(docs/coming_from_grpo.md lists every other field and argument; tests/test_coming_from_grpo.py keeps both in step)."""

from __future__ import annotations

from typing import Any

# field -> (the setting that is refused, as a predicate on its value; why, and what to use instead)
REFUSED_FIELDS: dict[str, tuple[Any, str]] = {
    "max_tool_calling_iterations": (
        lambda value: value is not None,
        "TRL's own tool loop is off under ARPO; the sampler limits tool calls per path with max_tool_calls "
        "(default 3): set max_tool_calls instead",
    ),
    "use_transformers_paged": (  # checked first: TRL sets use_transformers_continuous_batching from it
        lambda value: bool(value),
        "it is TRL's deprecated name of use_transformers_continuous_batching, transformers' continuous batching "
        "engine, which ARPO does not use: set in_process_engine (auto, cached or waves)",
    ),
    "use_transformers_continuous_batching": (
        lambda value: bool(value),
        "ARPO generates in process with its own engines, which continue and fork each path in a KV cache; "
        "transformers' continuous batching engine is not used: set in_process_engine (auto, cached or waves)",
    ),
    "vllm_structured_outputs_regex": (
        lambda value: value is not None,
        "the sampler continues paths segment by segment (after each tool result and at each fork), which a single "
        "regex over the whole completion cannot constrain",
    ),
}


def check_grpo_fields(config: Any) -> None:
    """A ValueError in one line for a GRPOConfig setting ARPO cannot honour."""
    for name, (refused, reason) in REFUSED_FIELDS.items():
        value = getattr(config, name, None)
        if refused(value):
            raise ValueError(f"{name}={value!r} is not supported by ARPOTrainer: {reason}.")
