"""N-gram speculative decoding for the cached engine: drafts looked up in the rollout's own text, verified exactly.

A decode step pays a fixed cost (weights read, kernel launches, Python per layer) plus a cost per position. When few
rows run, as in a rollout's tail, the fixed cost dominates and one token per row per forward wastes it. The paths of
one rollout repeat each other (a prompt's samples, a branch and its parent, the same tool-call format), so the text
that followed the row's last few tokens elsewhere in the rollout is a good guess of what it writes next (prompt-lookup
decoding; vLLM's `ngram` speculative method). A step then feeds each row its sampled token and up to D draft tokens,
and keeps the drafts the target distribution accepts:

* draft token d at a position whose sampling distribution is p is accepted with probability p(d); on rejection the
  position's token is drawn from p without d (renormalised). The token emitted is distributed exactly as p
  (P(d) = p(d); P(x ≠ d) = (1 - p(d)) · p(x) / (1 - p(d))), so the trees are those of plain decoding. Logprobs and
  entropies come from the same logits plain decoding would use (p, not the residual). Greedy: accepted iff argmax.
* D is chosen per step to maximise expected tokens per unit of forward time: a row with L drafts yields
  1 + Σ_{j≤min(D, L)} αʲ tokens, α the acceptance rate seen so far, and a forward costs `DECODE_FORWARD_COST` +
  rows × (1 + D) positions, plus one more per row when D > 0 (several query positions take a slower attention path).
  Measured for SmolLM2-135M on a 2-core CPU: 1 row, 1 token 88 ms, 9 tokens 120 ms; 16 rows, 1 token 153 ms, 3 tokens
  336 ms; 128 rows, 1 token 516 ms, 2 tokens 1.4 s. So drafts pay in a rollout's tail, where few rows run, and not in
  its bulk; drafts that are rarely accepted give D = 0, a plain step.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_SIZES = (4, 3, 2)  # the longest suffix that occurred before wins
MAX_DRAFT_TOKENS = 8
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 16  # α before any draft was verified, worth this many drafted tokens
DECODE_FORWARD_COST = 24  # a decode forward's fixed cost in positions (88 ms for 1 row, ~3.7 ms per position more)


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

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` where it last occurred (in another
        sequence or earlier in `tokens`); empty when it never did."""
        if limit <= 0:
            return []
        for size in self.sizes:
            if len(tokens) >= size and (found := self.seen.get(tuple(tokens[-size:]))) is not None:
                source, end = found
                return list(source[end: end + limit])
        return []


def check_draft_tokens(max_draft_tokens: int) -> None:
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens must be an integer >= 0 (0: no speculative decoding), got "
                         f"{max_draft_tokens!r}.")


class Acceptance:
    """The acceptance rate α of the rollout's drafted tokens so far (with a prior), and the draft length it makes
    pay."""

    def __init__(self, max_draft: int = MAX_DRAFT_TOKENS):
        self.max_draft, self.drafted, self.accepted = max_draft, 0, 0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)

    def reset(self) -> None:
        """A new rollout learns α anew: what it samples then depends on its seed alone, not on earlier rollouts."""
        self.drafted = self.accepted = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def may_pay(self, rows: int) -> bool:
        """Whether drafts could pay for `rows` rows at all, were every row to hold `max_draft` of them (the bulk of a
        rollout skips the lookups when not)."""
        return self.draft_length([self.max_draft] * rows) > 0

    def draft_length(self, available: Sequence[int], forward_cost: int = DECODE_FORWARD_COST) -> int:
        """The D in 0..max(available) that maximises expected tokens per unit of forward time for rows that have
        `available` draft tokens each (see the module docstring)."""
        alpha, rows, longest = self.rate, len(available), min(self.max_draft, max(available, default=0))
        holding = [0] * (longest + 1)  # holding[j]: rows with at least j drafts
        for row in available:
            holding[min(row, longest)] += 1
        for j in range(longest - 1, 0, -1):
            holding[j] += holding[j + 1]
        best, best_value, tokens = 0, rows / (forward_cost + rows), float(rows)
        for length in range(1, longest + 1):
            tokens += alpha ** length * holding[length]
            if (value := tokens / (forward_cost + rows * (2 + length))) > best_value:
                best, best_value = length, value
        return best
