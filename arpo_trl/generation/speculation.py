"""N-gram speculative decoding for the cached engine: drafts looked up in the rollout's own text, verified exactly.

The paths of one rollout repeat each other (a prompt's samples, a branch and its parent), so the text that followed a
row's last few tokens elsewhere in the rollout is a good guess of what it writes next (prompt-lookup decoding; vLLM's
`ngram` method). A draft token d is kept iff the token plain decoding draws there with the position's keyed uniform,
F⁻¹(u), is d (`sampling.accept_drafts`), so the tokens and trees are those of plain decoding with the same seeds. The
draft length D maximises expected tokens (1 + Σ α_rowʲ per row) per unit of step cost (`DecodeCost.step`); each row
learns its own α before it samples, for free. docs/in_process_engine.md explains it; measurements:
docs/cpu_measurements.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from arpo_trl.generation.cost_model import DecodeCost

NGRAM_SIZES = (4, 3, 2)  # the longest suffix that occurred before wins
MAX_DRAFT_TOKENS = 8
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 16  # α before any draft was observed, worth this many drafted tokens
ROW_MEMORY = 0.5  # a row's α keeps this share of its previous value at each observation (recent steps weigh most)


class DraftIndex:
    """Where each n-gram of the rollout's token sequences last occurred (the sequences are the engine's own lists:
    a running row's grows as it decodes, and a later occurrence still points to the text after it)."""

    def __init__(self, sizes: Sequence[int] = NGRAM_SIZES):
        self.sizes = tuple(sorted(sizes, reverse=True))
        self.seen: dict[tuple[int, ...], tuple[list[int], int]] = {}

    def clear(self) -> None:
        self.seen.clear()

    def add(self, tokens: list[int], begin: int = 0) -> None:
        """Index the n-grams of `tokens` that end after position `begin` and have a continuation (a token after them:
        a row's own suffix is indexed only once it wrote the next token, so a lookup finds where it occurred before)."""
        for size in self.sizes:
            for end in range(max(begin, size - 1) + 1, len(tokens)):
                self.seen[tuple(tokens[end - size: end])] = (tokens, end)

    def _occurrence(self, tokens: list[int]) -> tuple[list[int], int] | None:
        """The sequence and position after the longest suffix of `tokens` where it last occurred, if it did."""
        for size in self.sizes:
            if len(tokens) >= size and (found := self.seen.get(tuple(tokens[-size:]))) is not None:
                return found
        return None

    def guess(self, tokens: list[int]) -> int:
        """The first token `draft` would give after `tokens`, or -1 when the suffix never occurred before."""
        if (found := self._occurrence(tokens)) is None:
            return -1
        source, end = found
        return source[end] if end < len(source) else -1

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` where it last occurred (in another
        sequence or earlier in `tokens`); empty when it never did."""
        if limit <= 0 or (found := self._occurrence(tokens)) is None:
            return []
        source, end = found
        return list(source[end: end + limit])


def check_draft_tokens(max_draft_tokens: int) -> None:
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens must be an integer >= 0 (0: no speculative decoding), got "
                         f"{max_draft_tokens!r}.")


class Acceptance:
    """The acceptance rate α of the rollout's drafted tokens so far (with a prior), and the draft length it makes
    pay."""

    def __init__(self, max_draft: int = MAX_DRAFT_TOKENS, cost: DecodeCost | None = None):
        self.max_draft = max_draft
        self.drafted = 0
        self.accepted = 0
        self.cost = cost  # the cached engine sets its device's before its first step (measured: `calibration.py`)

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)

    def reset(self) -> None:
        """A new rollout learns α anew: what it samples then depends on its seed alone, not on earlier rollouts."""
        self.drafted = self.accepted = 0

    def record(self, drafted: float, accepted: float) -> None:
        """Drafted tokens and how many were accepted (or, for observed ones, their summed acceptance chances)."""
        self.drafted += drafted
        self.accepted += accepted

    def may_pay(self, rows: int, alpha: float | None = None) -> bool:
        """Whether drafts could pay for `rows` rows at all, were every row to hold `max_draft` of them accepted at
        `alpha` (default: the rollout's rate); the bulk of a rollout skips the lookups when not."""
        return self.draft_length([self.max_draft] * rows, [self.rate if alpha is None else alpha] * rows) > 0

    def draft_length(self, available: Sequence[int], alphas: Sequence[float] | None = None) -> int:
        """The D in 0..max(available) that maximises expected tokens per unit of forward time for rows that have
        `available` draft tokens each, accepted at `alphas` per row (default: the rollout's rate; module docstring)."""
        rows, longest = len(available), min(self.max_draft, max(available, default=0))
        alphas = [self.rate] * rows if alphas is None else alphas
        best, best_value, tokens = 0, rows / self.cost.step(rows, 0), float(rows)
        for length in range(1, longest + 1):
            tokens += sum(alpha ** length for alpha, held in zip(alphas, available) if held >= length)
            if (value := tokens / self.cost.step(rows, length)) > best_value:
                best, best_value = length, value
        return best


class Speculator:
    """The cached engine's n-gram drafts over its running batch: the rollout's text indexed (`drafts`), each row's α
    learned as it samples and the rollout's (`acceptance`), and the drafts a step feeds. The engine verifies them
    (`CachedTransformersEngine._verify`) and reports what was accepted (`verified`). `enabled` False: no drafts."""

    def __init__(self, max_draft_tokens: int, enabled: bool):
        check_draft_tokens(max_draft_tokens)
        self.drafts = DraftIndex()
        self.acceptance = Acceptance(max_draft_tokens)
        self.enabled = enabled

    def reset(self) -> None:
        """A new rollout: its text and acceptance rate are learned anew."""
        self.drafts.clear(), self.acceptance.reset()

    def extended(self, request) -> None:
        """A row appended a token: index its newest n-grams."""
        if self.enabled:
            self.drafts.add(request.text, len(request.text) - 2)

    def joined(self, requests: Sequence) -> None:
        """Rows joined: index their text beyond what the prefix cache held; each starts from the rollout's α."""
        if self.enabled:
            for request in requests:
                self.drafts.add(request.text, request.cached - 1)
                request.alpha = self.acceptance.rate

    def observe(self, running, tempered: torch.Tensor, sampled: torch.Tensor | None) -> None:
        """Before the rows sample from `sampled` (None: greedy, from `tempered`'s argmax): for each row with a draft,
        the chance its first token would be accepted here, p(guess), which moves the row's α and the rollout's rate.
        A row whose draft was just rejected at this position was observed by the verification already."""
        if not self.enabled:
            return
        guesses = [self.drafts.guess(request.text) for request in running.requests]
        rejected = running.rejected.tolist()
        rows = [row for row, guess in enumerate(guesses) if guess >= 0 and not rejected[row]]
        if not rows:
            return
        index = torch.tensor(rows, device=tempered.device)
        tokens = torch.tensor([guesses[row] for row in rows], device=tempered.device)
        chances = (sampled[index, tokens].exp() if sampled is not None
                   else (tempered[index].argmax(-1) == tokens).double()).tolist()
        for row, chance in zip(rows, chances):
            _learn_alpha(running.requests[row], [chance])
        self.acceptance.record(len(rows), sum(chances))

    def propose(self, running) -> list[list[int]]:
        """Per row, the draft tokens this step feeds after its sampled one: as many as pay at the rows' own α."""
        requests = running.requests
        alphas = [request.alpha for request in requests]
        if not self.enabled or not self.acceptance.may_pay(len(requests), max(alphas)):
            return [[] for _ in requests]
        found = [self.drafts.draft(request.text, min(self.acceptance.max_draft, request.budget - len(request.ids)))
                 for request in requests]
        length = self.acceptance.draft_length([len(draft) for draft in found], alphas)
        return [draft[:length] for draft in found]

    def verified(self, request, tried: int, accepted: int, logprobs: Sequence[float] | None) -> None:
        """A row's verification: `tried` drafts judged, `accepted` kept; `logprobs` of the tokens judged (None:
        greedy, whose rows keep the argmax observations) move its α."""
        self.acceptance.record(tried, accepted)
        if logprobs is not None:
            _learn_alpha(request, [math.exp(logprob) for logprob in logprobs[:tried]])


def _learn_alpha(request, chances: list[float]) -> None:
    for chance in chances:
        request.alpha = ROW_MEMORY * request.alpha + (1 - ROW_MEMORY) * chance
