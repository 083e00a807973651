"""AEPO's entropy-balanced rollout rules (Dong et al., "Agentic Entropy-Balanced Policy Optimization", arXiv
2510.14545, §"Dynamic Entropy-Balanced Rollout"), with the constants and rounding of the authors' released code
(`AEPO/verl_aepo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py`). docs/aepo.md gives each
formula with its source. Entropies here are segment entropies as ARPO measures them (`entropy.segment_entropy`:
over the first k tokens, over ln|V|; the papers' code sums them, `segment_entropy='sum'`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def global_samples(budget: int, root_entropy: float, segment_entropies: Sequence[float], beta: float) -> int:
    """Entropy pre-monitoring: of a prompt's budget M, m = M·σ(β·(H_root − mean H_tool)) are global samples and the
    rest branches. H_root is the first segment's entropy of one monitoring trajectory and the mean runs over all its
    segments (the first included), as the authors' code measures them; m = floor(M·σ) + 1, kept in [1, M], as that
    code rounds it. A question more uncertain than its tool results gets more global samples."""
    mean_tool = sum(segment_entropies) / len(segment_entropies) if segment_entropies else root_entropy
    sigma = 0.5 * (1.0 + math.tanh(0.5 * beta * (root_entropy - mean_tool)))  # the logistic σ, without overflow
    return max(1, min(budget, int(budget * sigma) + 1))


def aepo_fork_probability(delta_entropy: float, consecutive_forks: int, threshold: float, weight: float,
                          penalty: float) -> float:
    """P(fork) at a tool result under AEPO's rule: fork when (u + β·ΔH)·(1 − λ·l) ≥ τ, u ~ U(0, 1), where l is the
    number of fork decisions in a row that forked on this path's line (the branch penalty P̂(l) = λ·l; λ = 0.05 in
    the authors' code). Solved for u: P = clip(1 − τ/(1 − λ·l) + β·ΔH, 0, 1), 0 once λ·l >= 1. With l = 0 and
    τ = 0.5 this is ARPO's clip(τ + β·ΔH, 0, 1)."""
    if threshold <= 0.0:
        return 1.0  # the code clips the score to [0, 1] before comparing: a zero threshold always forks
    factor = 1.0 - penalty * consecutive_forks
    if factor <= 0.0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - threshold / factor + weight * delta_entropy))


def check_aepo_args(branch_penalty: float, pre_monitoring_beta: float | None) -> None:
    """Raise a ValueError naming the field (shared by ARPOConfig and the sampler)."""
    if not (math.isfinite(branch_penalty) and branch_penalty >= 0):
        raise ValueError(f"branch_penalty (λ) must be a finite number >= 0, got {branch_penalty}.")
    if pre_monitoring_beta is not None and not (math.isfinite(pre_monitoring_beta) and pre_monitoring_beta >= 0):
        raise ValueError(f"pre_monitoring_beta must be a finite number >= 0 or None, got {pre_monitoring_beta}.")
