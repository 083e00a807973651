"""The transformers backend's per-step records: each step's entropy (by the configured estimator, of the temperature-
scaled distribution over the vocabulary) and the sampled token's logprob under the distribution actually sampled,
after temperature, top-k, top-p and min-p, as vLLM's `processed_logprobs` are. TRL's importance-sampling correction
and off-policy mask compare these logprobs with the trainer's.

HF's `generate` runs custom logits processors after its own processors (penalties) but before its warpers, so the
engine leaves HF's warpers neutral and runs them here, in generate's order, between the two records.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from arpo_trl.entropy.estimators import token_entropy

# What the engine sets in HF's GenerationConfig so that HF adds no warper of its own (an unset field would take the
# model's generation_config value, or HF's global default top_k=50).
NEUTRAL_WARPERS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "typical_p": 1.0}


def sampling_warpers(temperature: float, top_k: int, top_p: float, min_p: float | None) -> list[LogitsProcessor]:
    """HF's warpers for these settings, in the order `generate` applies them; none for greedy decoding."""
    if temperature <= 0:
        return []
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=min_p))
    return warpers


class _Step(LogitsProcessor):
    """Hands each step's `(input_ids, scores)` to `record` and passes the scores on unchanged."""

    def __init__(self, record):
        self.record = record

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.record(input_ids, scores)
        return scores


class SampledDistributionRecorder:
    """`processors()` goes to `generate(logits_processor=...)`. At each step it records the entropy of the next-token
    distribution and keeps the sampled distribution's logprobs, from which (one step later, once the token is known)
    the sampled token's logprob is read. O(batch·vocab) memory, unlike `output_logits=True`."""

    def __init__(self, warpers: list[LogitsProcessor], temperature: float, estimator: str, top_k: int | None,
                 vocab_size: int):
        self.warpers = warpers
        self.temperature = temperature if temperature > 0 else 1.0
        self.estimator = estimator
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.entropies: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def processors(self) -> list[LogitsProcessor]:
        return [_Step(self.record_entropy), *self.warpers, _Step(self.record_distribution)]

    def _record_previous(self, sampled: torch.Tensor) -> None:
        if self._previous is not None:
            self.logprobs.append(self._previous.gather(-1, sampled[:, None]).squeeze(-1))

    def record_entropy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> None:
        self._record_previous(input_ids[:, -1])
        logprobs = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self.entropies.append(token_entropy(logprobs, self.estimator, self.top_k, self.vocab_size))

    def record_distribution(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> None:
        self._previous = torch.log_softmax(scores.float(), dim=-1)

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._record_previous(last_tokens)
        self._previous = None
        return torch.stack(self.logprobs, 1), torch.stack(self.entropies, 1)
