"""How the cached engine draws tokens: the distributions at a position (repetition penalty, temperature, top-k/p,
min-p; their entropies) and inverse transform sampling with a uniform keyed by the path and the token's position.

Keyed draws make a path's tokens a function of its seed and its text, not of when its requests ran or beside whom:
the token at sequence position t of a path with seed s is F⁻¹(u(s, t)), F the cumulative distribution at t. A seed
therefore reproduces a rollout under any schedule (events, waves, fill-ups run ahead or not), as vLLM's per-request
seeds do for a request; only floating-point rounding that differs with the batch can still move a token, when u falls
within rounding of a boundary of F (docs/differences.md, "Seeds").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014), elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """u(seed, position) in [0, 1) for each pair, float64: a counter-based stream, so a token's draw depends on its
    path's seed and its position only, never on how many draws came before it."""
    seed = np.asarray(seeds, dtype=np.uint64) & _MASK64
    position = np.asarray(positions, dtype=np.uint64)
    bits = _splitmix64(seed ^ _splitmix64(position))
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def sample_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """One token per row of `logprobs` ([rows, vocab]), the inverse of its cumulative distribution at the row's
    uniform (`uniforms`: [rows], float64), in two levels: a block of the vocabulary by its mass, then a token within it,
    both cumulated in float64. `torch.multinomial` draws from the same distribution, but cannot take the row's own
    uniform, and was an order of magnitude slower on the development CPU (docs/cpu_measurements.md)."""
    probs = logprobs.exp()
    rows, vocab = probs.shape
    blocks = (torch.nn.functional.pad(probs, (0, -vocab % block)) if vocab % block else probs).view(rows, -1, block)
    mass = blocks.sum(-1).double()  # a block's 256 terms sum accurately in float32; the blocks are cumulated in float64
    cdf = mass.cumsum(-1)
    target = uniforms.to(device=probs.device, dtype=torch.float64).view(rows, 1) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    residual = target - (cdf.gather(1, chosen) - mass.gather(1, chosen))
    inner = blocks[torch.arange(rows, device=probs.device), chosen.squeeze(1)].to(torch.float64).cumsum(-1)
    tokens = (chosen * block + torch.searchsorted(inner, residual, right=True).clamp_(max=block - 1)).squeeze(1)
    tokens = tokens.clamp_(max=vocab - 1)
    impossible = logprobs.gather(1, tokens[:, None]).squeeze(1) == float("-inf")  # float64 rounding at an edge
    if impossible.any():  # the most likely token: deterministic, and the edge has probability ~2^-53
        tokens[impossible] = logprobs[impossible].argmax(-1)
    return tokens
