"""Generation engines: continue a batch of token-id prefixes until a stop string, EOS or a per-prefix
token budget, returning the new ids with their sampling logprobs and per-token entropies.

The sampler only sees `GenerationEngine`; `TransformersEngine` runs the model being trained (PEFT
adapters active, exact logits) in waves; `generation.CachedTransformersEngine` runs it event-driven with a prefix KV
cache, and `server.engine.VLLMServerEngine` generates through a vLLM server.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

import torch
from transformers import GenerationConfig, StoppingCriteria

from arpo_trl.entropy import (
    DEFAULT_SERVER_TOP_K,
    SampledDistributionRecorder,
    check_entropy_args,
    resolve_estimator,
    sampling_warpers,
)
from arpo_trl.entropy.recorder import NEUTRAL_WARPERS
from arpo_trl.tools.tags import first_stop

FinishReason = Literal["stop", "eos", "length"]


@dataclass
class GenerationCounters:
    """Positions an in-process engine's model computed: prefilled (prefix positions, padding included, not found in
    a cache), reused from a cache, and decoded (one forward position per generated token but the last; with
    speculative decoding, every draft position fed, rejected and padding ones included)."""

    prefill_tokens: int = 0
    reused_tokens: int = 0
    decode_tokens: int = 0
    requests: int = 0
    prefill_forwards: int = 0  # forwards that prefilled (several requests may share one)
    drafted_tokens: int = 0  # n-gram drafts fed to decode steps (`generation/speculation.py`)
    accepted_tokens: int = 0  # drafts kept as generated tokens
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


class GenerationEngine(Protocol):
    """What the sampler needs. An engine may also offer `async agenerate(prefix, max_new_tokens, stop) -> Segment`
    (and `async aclose()`): the sampler then drives every path on its own (`arpo_trl.scheduling.EventScheduler`);
    a batch-only engine is driven in waves."""

    vocab_size: int

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        """One segment per prefix; `max_new_tokens[i] >= 1` bounds segment `i`."""


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


def _check_budgets(prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> None:
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


class _StopPerRow(StoppingCriteria):
    """Marks a row done when it reaches its own token budget or its recent text contains a stop string."""

    def __init__(self, prompt_width: int, budgets: Sequence[int], stop: Sequence[str], decode, window: int):
        self.prompt_width = prompt_width
        self.budgets = torch.tensor(list(budgets))
        self.stop = list(stop)
        self.decode = decode
        self.window = window

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, self.prompt_width :]
        done = self.budgets.to(input_ids.device) <= new.shape[1]
        if self.stop:
            hits = [tail_has_stop(self.decode, row, self.stop, self.window) for row in new.tolist()]
            done |= torch.tensor(hits, device=input_ids.device)
        return done


class TransformersEngine:
    """Samples with `model.generate`; entropy and logprobs come from the model's own logits.

    `model_context`, if given, is entered around each call and yields the model to use (the trainer passes
    TRL's `unwrap_model_for_generation`), so the engine always sees the current weights.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        sampling: SamplingSettings = SamplingSettings(),
        model_context: Callable[[], AbstractContextManager] | None = None,
        max_batch_size: int | None = None,
        synced_gpus: bool = False,
        kv_budget=None,
    ):
        self.model = model
        self.synced_gpus = synced_gpus  # every rank runs each call's decoding steps (sharded parameters)
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        extra = check_generation_kwargs(sampling.generation_kwargs)
        check_entropy_args(sampling.entropy_estimator, sampling.entropy_top_k)
        self.entropy_estimator = resolve_estimator(sampling.entropy_estimator, True, "TransformersEngine")
        self.entropy_top_k = sampling.entropy_top_k or DEFAULT_SERVER_TOP_K
        self.eos_token_ids = eos = sampling.eos_ids(tokenizer, "TransformersEngine")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.pad_token_id = pad
        # generation_kwargs override our settings, as they override GRPOTrainer's; the warpers among them are run by
        # the recorder (HF's own stay neutral), so that the recorded logprobs are those of the distribution sampled
        warp = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "min_p": sampling.min_p}
        warp.update({key: extra.pop(key) for key in list(warp) if key in extra})
        greedy = extra.pop("do_sample", True) is False
        self.temperature = t = 0.0 if greedy else float(warp["temperature"] or 0.0)
        top_p = 1.0 if warp["top_p"] is None else warp["top_p"]
        self.warper_settings = (t, warp["top_k"] or 0, top_p, warp["min_p"])
        self.sampling = {
            "do_sample": t > 0, **(NEUTRAL_WARPERS if t > 0 else {}), "repetition_penalty": sampling.repetition_penalty,
            "eos_token_id": eos, "pad_token_id": pad, **extra,
        }
        self.model_context = model_context
        self.max_batch_size = max_batch_size
        from arpo_trl.generation.kv_budget import KVBudgetSetting  # the package imports this module

        self.kv_setting = kv_budget or KVBudgetSetting()  # KV bytes, from free memory by default (waves: per call)
        self.counters = GenerationCounters()  # accumulated over the engine's life

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        _check_budgets(prefixes, max_new_tokens)
        from arpo_trl.generation.kv_budget import log_budget, wave_batches

        with model_for_generation(self.model, self.model_context) as model, eval_mode(model), torch.no_grad():
            budget, segments = log_budget(self, self.kv_setting.resolve(model)), []
            for batch in wave_batches(budget, list(map(len, prefixes)), max_new_tokens, self.max_batch_size):
                rows, budgets = prefixes[batch], max_new_tokens[batch]
                segments += self._generate_batch(model, rows, budgets, stop)
                held = len(rows) * budget.batch_bytes([max(map(len, rows)) + max(budgets)])  # model.generate's KV
                self.counters.kv_peak_bytes = max(self.counters.kv_peak_bytes, held)
        return segments

    def _generate_batch(self, model, prefixes, budgets, stop) -> list[Segment]:
        device = next(model.parameters()).device
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(prefixes), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, prefix in enumerate(prefixes):  # left padding
            input_ids[row, width - len(prefix) :] = torch.tensor(prefix)
            attention[row, width - len(prefix) :] = 1
        recorder = SampledDistributionRecorder(sampling_warpers(*self.warper_settings), self.temperature,
                                               self.entropy_estimator, self.entropy_top_k, self.vocab_size)
        criteria = _StopPerRow(width, budgets, stop, self._decode, stop_window(self.tokenizer, stop))
        config = GenerationConfig(max_new_tokens=max(budgets), **self.sampling)
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=config,
            logits_processor=recorder.processors(), stopping_criteria=[criteria], synced_gpus=self.synced_gpus or None,
        )
        new = out[:, width:].cpu()
        check_recorder_ran(len(recorder.entropies), new.shape[1], model)
        self.counters.prefill_tokens += len(prefixes) * width  # every wave re-prefills its rows, padded
        self.counters.decode_tokens += len(prefixes) * max(new.shape[1] - 1, 0)
        self.counters.requests += len(prefixes)
        self.counters.prefill_forwards += 1
        logprobs, entropies = recorder.finish(new[:, -1].to(device))
        return [
            self._segment(new[row].tolist(), logprobs[row].tolist(), entropies[row].tolist(), budgets[row], stop)
            for row in range(len(prefixes))
        ]

    def _segment(self, ids: list[int], logprobs, entropies, budget: int, stop) -> Segment:
        ids = ids[:budget]
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), None)
        scan = ids if eos_at is None else ids[: eos_at + 1]
        found = first_stop(scan, self._decode, stop)
        if found is not None:
            end, reason = found[0], "stop"
        elif eos_at is not None:
            end, reason = eos_at + 1, "eos"
        else:
            end, reason = len(ids), "length"
        return Segment(ids[:end], logprobs[:end], entropies[:end], reason)


def check_recorder_ran(steps: int, new_tokens: int, model) -> None:
    """The per-token logprobs and entropies come from our logits processor; a `generate` that did not call it once
    per new token would leave them missing or misaligned, so it is refused here, naming the likely cause."""
    if steps != new_tokens:
        raise RuntimeError(
            f"TransformersEngine: {type(model).__name__}.generate returned {new_tokens} new tokens but called ARPO's "
            f"logits processor {steps} times, so the tokens' logprobs and entropies are missing. Likely causes: a "
            "custom or remote-code `generate` that ignores `logits_processor`, or assisted decoding (assistant_model "
            "or prompt_lookup_num_tokens in generation_kwargs). Use the standard transformers `generate`, or a vLLM "
            "server (use_vllm=True)."
        )


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode inside, and each module back in its own mode after. A rollout samples the policy, not
    one dropout draw of it (LoRA's dropout would perturb the tokens, their logprobs and the entropies that decide
    forks; a vLLM server has none). Restored with `train()`, which modules may override (PEFT's DoRA clears a cache)."""
    modes = {module: module.training for module in model.modules()}
    if not any(modes.values()):
        yield model
        return
    model.train(False)
    try:
        yield model
    finally:
        model.train(modes[model])
        for module, training in modes.items():
            if module.training != training:  # a submodule the caller keeps in the other mode
                module.training = training


@contextlib.contextmanager
def decoding_attention(model):
    """Generate with SDPA where the model trains with FlexAttention, and switch back afterwards. FlexAttention
    compiles a kernel per input shape, and a decode step's shapes change every step: on a GPU it recompiled up to
    torch._dynamo's limit and then ran unfused (docs/gpu_checks.md). SDPA computes the same attention."""
    if getattr(model.config, "_attn_implementation", None) != "flex_attention":
        yield model
        return
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation("flex_attention")


def packable_head(model) -> torch.nn.Linear | None:
    """The model's LM head (a PEFT layer's base layer where adapters wrap it) if `packed_head` computes the same
    product with it: a plain `nn.Linear` in float32 on the CPU whose `forward` nothing else replaced (accelerate's
    offloading hooks do), with oneDNN in this build of torch, and a whole weight of its own: not a ZeRO-3 partition
    (gathered by hooks at each forward) or another sharded tensor."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(head, "base_layer", head)
    if type(head) is not torch.nn.Linear or "forward" in vars(head) or not torch.backends.mkldnn.is_available():
        return None
    for p in head.parameters(recurse=False):
        if type(p) is not torch.nn.Parameter or hasattr(p, "ds_id") or p.device.type != "cpu" \
                or p.dtype != torch.float32:
            return None
    return head if head.weight.shape == (head.out_features, head.in_features) else None


@contextlib.contextmanager
def packed_head(model):
    """Inside, the LM head multiplies with a copy of its weight packed once, where `packable_head` allows; yields
    whether it does. The weight must not change inside.

    On the CPU, `F.linear` hands the weight to MKL's sgemm, which repacks it into blocks on every call; at a decode
    step's few rows that costs more than the product, and most for the vocabulary-wide head: SmolLM2-135M's took
    39.5 ms for 6 rows and 16 ms for 1 on a 2-core CPU; oneDNN packs it once (0.07 s) and then took 12.7 ms for 6 rows
    (docs/in_process_engine.md). Packing every linear layer gained more at 6 rows, nothing at 16, and lost at 64. An
    input the packed product would treat differently (another dtype, autocast, autograd) goes to `F.linear`."""
    head = packable_head(model)
    if head is None:
        yield False
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(head.weight.detach())

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return torch.nn.functional.linear(x, head.weight, head.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, head.bias, "none", [], "")

    head.forward = forward
    try:
        yield True
    finally:
        del head.forward


@contextlib.contextmanager
def model_for_generation(model, model_context: Callable[[], AbstractContextManager] | None = None):
    """The model an engine generates with: through `model_context` where given (TRL's unwrap for generation, which
    merges or gathers the current weights), decoding through SDPA (`decoding_attention`), its head packed on the CPU
    (`packed_head`: the weights are fixed while an engine holds the model)."""
    with (model_context() if model_context else contextlib.nullcontext(model)) as held, decoding_attention(held), \
            packed_head(held):
        yield held
