"""From a vLLM completion to the sampler's `Segment`: what both vLLM engines (`server.engine.VLLMServerEngine` and
`colocate.engine.ColocatedVLLMEngine`) share. The entropy settings and the ids that may end a completion are resolved
once per engine, every completion passes the same contract (`server.responses.read_completion`), and each position's
top-k logprobs become its entropy in the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from arpo_trl.entropy import DEFAULT_SERVER_TOP_K, check_entropy_args, resolve_estimator, top_k_entropies
from arpo_trl.generation.engine import SamplingSettings, Segment
from arpo_trl.server.responses import CompletionRequest, Where, read_completion


class SegmentReader:
    """Reads one engine's completions (`/v1/completions` bodies) into checked `Segment`s.

    `engine` names the engine in errors about the sampling settings, `backend` the entropy source (top-k processed
    logprobs: 'top_k_tail' by default, or the reference's sum over them, 'top_k')."""

    def __init__(self, tokenizer, sampling: SamplingSettings, where: Where, engine: str, backend: str):
        check_entropy_args(sampling.entropy_estimator, sampling.entropy_top_k)
        self.estimator = resolve_estimator(sampling.entropy_estimator, False, backend)
        self.top_k = sampling.entropy_top_k or DEFAULT_SERVER_TOP_K
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = sampling.eos_ids(tokenizer, engine)
        # What may end a completion with finish_reason "stop" and no stop string: our EOS ids, or the model's own
        # EOS, which vLLM adds from its generation config (always a special token).
        self.end_ids = frozenset(self.eos_token_ids) | frozenset(tokenizer.all_special_ids)
        self.where = where
        self._tokenizer = tokenizer

    def read(self, body, budget: int, stop: Sequence[str], top_k: int | None = None) -> Segment:
        """The segment of a completion's JSON body, checked by `read_completion` (docs/server_mode.md). `top_k`: the
        logprobs the request asked for (default the engine's entropy top-k); 0, the sampled token's only: no
        entropy (NaN)."""
        top_k = self.top_k if top_k is None else top_k
        request = CompletionRequest(budget, list(stop), top_k, self.vocab_size, self.end_ids, self.decode)
        completion = read_completion(self.where, body, request)
        entropies = [math.nan] * len(completion.token_ids) if top_k == 0 else top_logprob_entropies(
            completion.top_logprobs, self.estimator, top_k, self.vocab_size)
        return Segment(completion.token_ids, completion.logprobs, entropies, completion.finish_reason)

    def decode(self, ids: list[int]) -> str:
        """The text vLLM matched stop strings against (the requests set skip_special_tokens=False)."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def top_logprob_entropies(tops: list[dict[int, float]], estimator: str, k: int, vocab_size: int) -> list[float]:
    """The estimator over each position's returned logprobs (top-k, plus the sampled token when it is outside them;
    padding with -inf adds nothing). `read_completion` checked every row: non-empty, no nulls. Only the k largest
    count: vLLM adds the sampled token when it is outside the top k, which would otherwise make the estimate depend
    on which token happened to be sampled."""
    if not tops:
        return []
    rows = [sorted(top.values(), reverse=True)[:k] for top in tops]
    width = max(map(len, rows))
    padded = torch.tensor([row + [-math.inf] * (width - len(row)) for row in rows], dtype=torch.float64)
    return top_k_entropies(padded, estimator, k, vocab_size).tolist()
