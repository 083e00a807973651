"""Per-token entropy estimators and the segment statistic of ARPO's fork rule (paper §3.1: token entropy over the
vocabulary; ΔH between the k tokens after a tool result and the first segment's k tokens, over ln|V|).

* 'exact': -Σ p·log p over the whole vocabulary (a backend with logits: transformers).
* 'top_k_tail' (default where only top-k logprobs come back: a vLLM server): the known probabilities' terms plus the
  tail mass r = 1 - Σ p spread evenly over the |V| - n tokens not returned, -r·log(r / (|V| - n)). Of all
  distributions that agree with what the server returned it is the one of largest entropy (its tail tokens are each
  below the k-th probability whenever r/(|V|-n) <= p_k, as for any real tail), so it never reads a flat distribution
  as a peaked one; it is exact when the tail is empty or uniform, and rises with flattening (tests/test_entropy.py).
* 'top_k': the reference's estimator, Σ -p·log p over the top k, not renormalised, no tail (VRT, vLLM's top-10
  logprobs). Not monotone in the true entropy: a flat distribution over 1,000 tokens reads 0.07 nats at k=10, one
  peaked at p=0.5 reads 0.35.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ENTROPY_ESTIMATORS = ("auto", "exact", "top_k_tail", "top_k")
SEGMENT_STATISTICS = ("mean", "sum")
DEFAULT_SERVER_TOP_K = 20  # vLLM's default --max-logprobs: the most a server started without that flag returns


def check_entropy_args(estimator: str, top_k: int | None, statistic: str = "mean") -> None:
    """Raise a ValueError naming the field for an unknown estimator or statistic, or a k below 1."""
    if estimator not in ENTROPY_ESTIMATORS:
        raise ValueError(f"entropy_estimator must be one of {ENTROPY_ESTIMATORS}, got {estimator!r}.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"entropy_top_k must be an integer >= 1 or None, got {top_k!r}.")
    if statistic not in SEGMENT_STATISTICS:
        raise ValueError(f"segment_entropy must be one of {SEGMENT_STATISTICS}, got {statistic!r}.")


def resolve_estimator(estimator: str, has_logits: bool, backend: str) -> str:
    """'auto' is 'exact' where the backend has logits and 'top_k_tail' where it returns top-k logprobs only."""
    if estimator == "auto":
        return "exact" if has_logits else "top_k_tail"
    if estimator == "exact" and not has_logits:
        raise ValueError(f"entropy_estimator='exact' needs logits, which {backend} does not return (top-k logprobs "
                         "only); use 'top_k_tail' (or 'auto') with the largest entropy_top_k the server allows.")
    return estimator


def top_k_entropies(known: torch.Tensor, estimator: str, top_k: int, vocab_size: int) -> torch.Tensor:
    """Entropy per row from the logprobs a backend returned for it (padded with -inf): 'top_k' sums the top k of
    them; 'top_k_tail' uses all of them (the sampled token's too, when outside the top k) plus the tail term."""
    if estimator == "top_k":
        if top_k < known.shape[-1]:
            known = known.topk(top_k, dim=-1).values
        return torch.special.entr(known.exp()).sum(-1)
    if estimator != "top_k_tail":
        raise ValueError(f"top_k_entropies: estimator must be 'top_k' or 'top_k_tail', got {estimator!r}.")
    probs = known.double().exp()
    tail = (1.0 - probs.sum(-1)).clamp(min=0.0)
    unseen = (vocab_size - torch.isfinite(known).sum(-1)).clamp(min=1).double()
    tail_term = torch.where(tail > 0, -tail * torch.log(tail.clamp(min=1e-300) / unseen), torch.zeros_like(tail))
    return (torch.special.entr(probs).sum(-1) + tail_term).to(known.dtype)


def token_entropy(logprobs: torch.Tensor, estimator: str = "exact", top_k: int | None = None,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Entropy (nats) of each full next-token distribution in `logprobs` (last dim: the vocabulary) by `estimator`,
    the top-k ones seeing only the k largest logprobs, as a server would return them."""
    if estimator == "exact" or top_k is None:
        return torch.special.entr(logprobs.exp()).sum(-1)
    known = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1).values
    return top_k_entropies(known, estimator, top_k, vocab_size or logprobs.shape[-1])


def segment_entropy(entropies: Sequence[float], window: int, vocab_size: int, statistic: str = "mean") -> float:
    """A segment's normalised entropy from its per-token entropies.

    'sum' (the reference, VRT L284-305): the sum of the first `window` (k) entropies over ln|V|, so a segment shorter
    than k (a quick call, an early answer) reads as low entropy for its length alone. 'mean' (default): k × the mean
    over the first min(k, n) tokens, over ln|V|: the reference's value for every segment of k tokens or more (β keeps
    its scale), and a shorter segment counts at its own tokens' level instead of as if the missing ones had none."""
    first = list(entropies[:window])
    if not first:
        return 0.0
    total = sum(first) if statistic == "sum" else window * sum(first) / len(first)
    return float(total) / math.log(vocab_size)
