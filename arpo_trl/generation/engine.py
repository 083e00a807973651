"""The contract every generation engine implements: continue a batch of token-id prefixes until a stop
string, EOS or a per-prefix token budget, returning the new ids with their sampling logprobs and per-token entropies
(`Segment`); the sampling settings and checks they share.

The rollout only sees `GenerationEngine` and its `EngineTraits`; `transformers_engine.TransformersEngine` runs the
model being trained (PEFT adapters active, exact logits) in waves; `cached_engine.CachedTransformersEngine` runs it
event-driven with a prefix KV cache; `server.engine.VLLMServerEngine` generates through a vLLM server,
`colocate.engine.ColocatedVLLMEngine` through a vLLM engine inside the training process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

FinishReason = Literal["stop", "eos", "length"]


@dataclass
class GenerationCounters:
    """Positions an in-process engine's model computed: prefilled (prefix positions, padding included, not found in
    a cache), reused from a cache, and decoded (one forward position per generated token but the last)."""

    prefill_tokens: int = 0
    reused_tokens: int = 0
    decode_tokens: int = 0
    requests: int = 0
    prefill_forwards: int = 0  # forwards that prefilled (several requests may share one)
    decode_steps: int = 0  # decode forwards (the cached engine: one per step, all running rows together)
    adopted_rows: int = 0  # requests that went on in a held row, nothing prefilled (the cached engine: a probe's)
    kv_waits: int = 0  # steps × requests that waited for room in the KV budget (`generation/kv_budget.py`)
    kv_peak_bytes: int = 0  # the most KV held (the cached engine: rows' buffers and prefix cache; waves: a batch's)
    kv_peak_copy_bytes: int = 0  # the same, with a regrowing batch's old buffer while it is copied
    seconds: dict[str, float] = field(default_factory=dict)  # the cached engine's wall time per phase of its steps

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the wall time of the block to `seconds[phase]`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class Segment:
    """Newly generated tokens for one prefix. With `finish_reason == "stop"` the ids run up to and include
    the token that completes the stop string (which may overhang it); the sampler cuts at the tag."""

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]  # nats per token, by the engine's estimator (`arpo_trl.entropy`)
    finish_reason: FinishReason


@dataclass(frozen=True)
class EngineTraits:
    """What an engine can do beyond `generate`, stated by its class (or set per instance where it depends on how the
    engine was built): the runtime reads these, never probes the engine for methods."""

    event_driven: bool = False  # `agenerate` answers one path's request on its own: the event scheduler drives it
    continues_probes: bool = False  # `agenerate_continuing`: a probe's request decodes on past its k tokens
    # per-request options `agenerate` / `generate` take:
    # * "seed": its path's seed (`agenerate(..., seed=)`, `generate(..., seeds=)`); the engine then draws a path's
    #   tokens from it and their positions alone, so that a seed reproduces the rollout whatever the schedule
    #   (`generation/sampling.py`);
    # * "entropy_tokens": how many leading tokens of the request need their entropies (`agenerate(...,
    #   entropy_tokens=)`; the rule reads a segment's first k): the others may come without (NaN).
    request_options: frozenset[str] = frozenset()
    # every running row costs its share of a forward's compute (a CPU): a fill-up run ahead that a fork then drops is
    # time lost, so fill-ups run ahead only once their prompt is heard from (`runtime/prefetch.py`); on a GPU a decode
    # step costs about the same for 64 rows or 128
    compute_bound: bool = False


class GenerationEngine:
    """What the rollout needs of an engine: `generate` (a batch of prefixes, one `Segment` each) and `vocab_size`
    (ΔH is normalised by ln|V|). An engine whose `traits` say `event_driven` also answers one request at a time with
    `agenerate` (then `EventScheduler` drives every path on its own; a batch-only engine is driven in waves), and one
    that `continues_probes`, `agenerate_continuing`. The defaults here are a batch engine's."""

    traits: EngineTraits = EngineTraits()
    vocab_size: int
    eos_token_ids: list[int] | None = None  # None: the tokenizer's EOS
    counters: object | None = None  # in-process engines: the positions their model computed (`GenerationCounters`)

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        """One segment per prefix; `max_new_tokens[i] >= 1` bounds segment `i`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement generate().")

    async def agenerate(self, prefix: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> Segment:
        """One segment for one prefix (an event-driven engine's)."""
        raise NotImplementedError(f"{type(self).__name__} is not event-driven (its traits say so).")

    async def agenerate_continuing(self, prefix: Sequence[int], probe_tokens: int, max_new_tokens: int,
                                   stop: Sequence[str]) -> tuple[Segment, Any]:
        """The probe's first `probe_tokens`, and the task decoding on to `max_new_tokens` (None if it ended)."""
        raise NotImplementedError(f"{type(self).__name__} does not continue probes (its traits say so).")

    async def aclose(self) -> None:
        """After an event-driven rollout: release what its requests held."""

    def rollout_scope(self) -> contextlib.AbstractContextManager:
        """Held for a whole waves rollout (an engine may keep a cache that long)."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class SamplingSettings:
    """How both engines sample, carried from a config (`ARPOConfig`, the eval arguments) by `from_config`."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float | None = None
    repetition_penalty: float = 1.0
    entropy_estimator: str = "auto"  # arpo_trl.entropy: 'auto' (exact with logits, else 'top_k_tail'), ...
    entropy_top_k: int | None = None  # k of the top-k estimators; None: DEFAULT_SERVER_TOP_K
    eos_token_ids: Sequence[int] | None = None  # None: the tokenizer's EOS
    generation_kwargs: dict | None = field(default=None, hash=False)  # passed on to generate() / the request

    @classmethod
    def from_config(cls, config, **overrides) -> SamplingSettings:
        """The settings `config` has under these names (others keep their defaults), then `overrides`."""
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        return cls(**{**values, **overrides})

    def eos_ids(self, tokenizer, engine: str) -> list[int]:
        eos = list(self.eos_token_ids) if self.eos_token_ids else [tokenizer.eos_token_id]
        if any(e is None for e in eos):
            raise ValueError(f"{engine} needs eos_token_ids: the tokenizer has no eos_token_id.")
        return eos


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (as TRL's `GRPOTrainer.eos_token_ids`)."""
    extra = getattr(generation_config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([tokenizer.eos_token_id, *extra]))


# generate() options that cannot work with the sampler, and why: it grows one sequence per path, forks paths itself,
# bounds each request's tokens itself, and reads each token's logprob and entropy from its own logits processor.
_REFUSED_GENERATION_KWARGS = {
    "num_beams": (1, "beam search keeps several hypotheses per path; ARPO forks paths itself"),
    "num_beam_groups": (1, "beam search keeps several hypotheses per path; ARPO forks paths itself"),
    "num_return_sequences": (1, "the sampler asks for one continuation per path and forks them itself "
                                "(num_generations sets how many per prompt)"),
    "best_of": (1, "the sampler asks for one continuation per path and forks them itself"),
    "use_beam_search": (False, "beam search keeps several hypotheses per path; ARPO forks paths itself"),
    "max_new_tokens": (None, "the sampler sets each request's budget from max_completion_length"),
    "max_length": (None, "the sampler sets each request's budget from max_completion_length"),
    "stop_strings": (None, "the sampler stops at the tools' closing tags itself"),
    "assistant_model": (None, "assisted decoding skips the logits processors that record each token's logprob "
                              "and entropy"),
    "prompt_lookup_num_tokens": (None, "assisted decoding skips the logits processors that record each token's "
                                       "logprob and entropy"),
    # warpers the recorder does not run: HF would apply them after it, and the recorded logprobs would not be those
    # of the distribution sampled
    "typical_p": (1.0, "ARPO records each token's logprob after temperature, top_k, top_p and min_p only; use those"),
    "epsilon_cutoff": (0.0, "ARPO records each token's logprob after temperature, top_k, top_p and min_p only; use "
                            "those"),
    "eta_cutoff": (0.0, "ARPO records each token's logprob after temperature, top_k, top_p and min_p only; use those"),
}


def check_generation_kwargs(generation_kwargs: dict | None) -> dict:
    """`generation_kwargs`, or a ValueError in one line for an option that cannot work with branching."""
    for key, value in (generation_kwargs or {}).items():
        allowed, reason = _REFUSED_GENERATION_KWARGS.get(key, (value, ""))
        if value != allowed and value is not None:
            raise ValueError(f"generation_kwargs[{key!r}]={value!r} cannot work with ARPO's branching rollout: "
                             f"{reason}.")
    return dict(generation_kwargs or {})


def check_budgets(prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> None:
    if len(prefixes) != len(max_new_tokens):
        raise ValueError("generate: one max_new_tokens entry per prefix is required.")
    if any(b < 1 for b in max_new_tokens):
        raise ValueError(f"generate: every max_new_tokens must be >= 1, got {list(max_new_tokens)}.")


def stop_window(tokenizer, stop: Sequence[str]) -> int:
    """Tokens of decoded tail that can hold any stop string (a few spare: a string may start inside a token)."""
    return max([len(tokenizer.encode(s, add_special_tokens=False)) for s in stop] + [1]) + 4


def tail_has_stop(decode: Callable[[Sequence[int]], str], ids: Sequence[int], stop: Sequence[str], window: int) -> bool:
    """Whether the decoded last `window` tokens of `ids` contain a stop string (checked after every token)."""
    return bool(stop) and any(s in decode(ids[-window:]) for s in stop)
