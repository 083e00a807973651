"""How the cached engine draws tokens: the distributions at a position (repetition penalty, temperature, top-k/p,
min-p; their entropies), two-level inverse transform sampling, and the acceptance rule of speculative decoding (the
drafts come from `speculation.py`; a rejected draft is left out of the residual distribution)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from arpo_trl.entropy import token_entropy


def penalized(logits: torch.Tensor, penalty: float | None, rows: Sequence) -> torch.Tensor:
    """`logits` [rows, vocab] with the repetition penalty applied to each row's tokens (`rows`: each with its `prefix`
    and generated `ids`)."""
    if penalty is None or penalty == 1.0:
        return logits
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    return torch.cat([processor(torch.tensor([r.prefix + r.ids], device=logits.device), logits[i: i + 1])
                      for i, r in enumerate(rows)])


def distributions(scores: torch.Tensor, temperature: float, warpers: LogitsProcessorList, estimator: str,
                  top_k: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For next-token `scores` [positions, vocab]: the tempered log-probabilities, their entropies (by `estimator`,
    `top_k`), and the log-probabilities of the distribution sampled, after the `warpers` (top-k / top-p / min-p; None:
    greedy)."""
    tempered = torch.log_softmax(scores / (temperature if temperature > 0 else 1.0), dim=-1)
    entropies = token_entropy(tempered, estimator, top_k, vocab_size)
    if temperature <= 0:
        return tempered, entropies, None
    if not warpers:  # temperature 1, no truncation: the distribution sampled is the tempered one
        return tempered, entropies, tempered
    return tempered, entropies, torch.log_softmax(warpers(None, scores), dim=-1)


def residual(sampled: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """The distributions to draw from: where a draft was just rejected at this position (`excluded` >= 0: the draft),
    p without it."""
    rows = (excluded >= 0).nonzero().squeeze(1)
    if not len(rows):
        return sampled
    left = sampled.clone()
    left[rows, excluded[rows]] = float("-inf")
    return left


def sample_tokens(logprobs: torch.Tensor, block: int = 256) -> torch.Tensor:
    """One token per row of `logprobs` ([rows, vocab]), by inverse transform sampling in two levels: a block of the
    vocabulary by its mass, then a token within it, both cumulated in float64. `torch.multinomial` draws from the same
    distribution, but on this CPU it took 63 ms for 84 rows of SmolLM2's 49k vocabulary; this takes a few."""
    probs = logprobs.exp()
    rows, vocab = probs.shape
    blocks = (torch.nn.functional.pad(probs, (0, -vocab % block)) if vocab % block else probs).view(rows, -1, block)
    mass = blocks.sum(-1).double()  # a block's 256 terms sum accurately in float32; the blocks are cumulated in float64
    cdf = mass.cumsum(-1)
    target = torch.rand(rows, 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    residual = target - (cdf.gather(1, chosen) - mass.gather(1, chosen))
    inner = blocks[torch.arange(rows, device=probs.device), chosen.squeeze(1)].to(torch.float64).cumsum(-1)
    tokens = (chosen * block + torch.searchsorted(inner, residual, right=True).clamp_(max=block - 1)).squeeze(1)
    tokens = tokens.clamp_(max=vocab - 1)
    impossible = logprobs.gather(1, tokens[:, None]).squeeze(1) == float("-inf")  # float64 rounding at an edge
    if impossible.any():
        tokens[impossible] = torch.multinomial(probs[impossible], 1).squeeze(1)
    return tokens


def accept_drafts(tempered: torch.Tensor, sampled: torch.Tensor | None,
                  drafts: list[list[int]]) -> tuple[list[int], list[list[float]]]:
    """Speculative sampling with drafts that are point masses: per row, how many leading drafts the distributions
    accept, and every draft's logprob under them. `tempered`, `sampled`: [rows, D, vocab] log-probabilities at the
    positions that predict the D drafts (`sampled`: after top-k/p, min-p; None: greedy). Draft d is accepted with
    probability p(d) (greedy: d is the argmax); the caller draws a rejected position's token from p without d, so the
    token emitted there is distributed exactly as p: P(d) = p(d), P(x ≠ d) = (1 - p(d)) · p(x) / (1 - p(d))."""
    rows, width = tempered.shape[:2]
    draft = torch.tensor([d + [0] * (width - len(d)) for d in drafts], device=tempered.device)
    if sampled is not None:
        chosen = sampled.gather(-1, draft[..., None]).squeeze(-1)
        accept = torch.rand(chosen.shape, device=chosen.device) < chosen.exp()
    else:
        chosen = tempered.gather(-1, draft[..., None]).squeeze(-1)
        accept = tempered.argmax(-1) == draft
    lengths = torch.tensor([len(d) for d in drafts], device=tempered.device)
    accept &= torch.arange(width, device=tempered.device) < lengths[:, None]
    return accept.long().cumprod(1).sum(1).tolist(), chosen.tolist()
