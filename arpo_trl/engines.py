"""Generation engines: continue a batch of token-id prefixes until a stop string, EOS or a per-prefix
token budget, returning the new ids with their sampling logprobs and per-token entropies.

The sampler only sees `GenerationEngine`; `TransformersEngine` runs the model being trained (PEFT
adapters active, exact logits), a vLLM server engine is the second implementation of the same method.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from arpo_trl.tags import first_stop

FinishReason = Literal["stop", "eos", "length"]


@dataclass
class Segment:
    """Newly generated tokens for one prefix. With `finish_reason == "stop"` the ids run up to and include
    the token that completes the stop string (which may overhang it); the sampler cuts at the tag."""

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]  # nats per token, by the engine's estimator (exact or top-k)
    finish_reason: FinishReason


class GenerationEngine(Protocol):
    vocab_size: int

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        """One segment per prefix; `max_new_tokens[i] >= 1` bounds segment `i`."""


def token_entropy(logprobs: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """-Σ p·log p over the last dim: exact, or over the top-k probabilities without renormalising (the
    reference's estimator from vLLM's top-10 logprobs)."""
    if top_k is not None and top_k < logprobs.shape[-1]:
        logprobs = logprobs.topk(top_k, dim=-1).values
    return torch.special.entr(logprobs.exp()).sum(-1)


class _TokenStatsRecorder(LogitsProcessor):
    """Records, at each decoding step, the entropy of the next-token distribution and (one step later,
    once the token is known) the sampled token's logprob. Keeps O(batch·vocab) memory, unlike
    `output_logits=True`. HF runs custom processors before the temperature warper, so we scale here."""

    def __init__(self, temperature: float, top_k: int | None):
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k = top_k
        self.entropies: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def _record_previous(self, sampled: torch.Tensor) -> None:
        if self._previous is not None:
            self.logprobs.append(self._previous.gather(-1, sampled[:, None]).squeeze(-1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:
            self._record_previous(input_ids[:, -1])
        logprobs = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.entropies.append(token_entropy(logprobs, self.top_k))
        self._previous = logprobs
        return scores

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._record_previous(last_tokens)
        self._previous = None
        return torch.stack(self.logprobs, 1), torch.stack(self.entropies, 1)


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
            tails = new[:, -self.window :].tolist()
            hits = [any(s in self.decode(t) for s in self.stop) for t in tails]
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
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        entropy_top_k: int | None = 10,
        eos_token_ids: Sequence[int] | None = None,
        generation_kwargs: dict | None = None,
        model_context: Callable[[], AbstractContextManager] | None = None,
        max_batch_size: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.entropy_top_k = entropy_top_k
        self.temperature = temperature
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        if any(e is None for e in eos):
            raise ValueError("TransformersEngine needs eos_token_ids: the tokenizer has no eos_token_id.")
        self.eos_token_ids = eos
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.pad_token_id = pad
        self.sampling = dict(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=top_p,
            top_k=top_k or None, min_p=min_p, repetition_penalty=repetition_penalty, eos_token_id=eos,
            pad_token_id=pad, **(generation_kwargs or {}),
        )
        self.model_context = model_context
        self.max_batch_size = max_batch_size

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        if len(prefixes) != len(max_new_tokens):
            raise ValueError("generate: one max_new_tokens entry per prefix is required.")
        if any(b < 1 for b in max_new_tokens):
            raise ValueError(f"generate: every max_new_tokens must be >= 1, got {list(max_new_tokens)}.")
        step = self.max_batch_size or len(prefixes) or 1
        context = self.model_context() if self.model_context else contextlib.nullcontext(self.model)
        with context as model, torch.no_grad():
            segments = []
            for i in range(0, len(prefixes), step):
                segments += self._generate_batch(model, prefixes[i : i + step], max_new_tokens[i : i + step], stop)
        return segments

    def _generate_batch(self, model, prefixes, budgets, stop) -> list[Segment]:
        device = next(model.parameters()).device
        width = max(len(p) for p in prefixes)
        input_ids = torch.full((len(prefixes), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, prefix in enumerate(prefixes):  # left padding
            input_ids[row, width - len(prefix) :] = torch.tensor(prefix)
            attention[row, width - len(prefix) :] = 1
        recorder = _TokenStatsRecorder(self.temperature, self.entropy_top_k)
        window = max([len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stop] + [1]) + 4
        criteria = _StopPerRow(width, budgets, stop, self._decode, window)
        config = GenerationConfig(max_new_tokens=max(budgets), **self.sampling)
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=config,
            logits_processor=[recorder], stopping_criteria=[criteria],
        )
        new = out[:, width:].cpu()
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


def normalized_entropy(entropies: Sequence[float], window: int, vocab_size: int) -> float:
    """Segment entropy as the reference measures it: the SUM of the first `window` per-token entropies,
    divided by ln|V| (VRT L284-305)."""
    return float(sum(entropies[:window])) / math.log(vocab_size)
