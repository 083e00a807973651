"""AEPO's entropy-balanced policy update (arXiv 2510.14545, §"Entropy-Balanced Policy Optimization"; the authors'
`compute_policy_loss_entropy_balanced_clipping` in `AEPO/verl_aepo_entropy/verl/trainer/ppo/core_algos.py`) on TRL's
own loss: docs/aepo.md.

TRL 1.16's `_compute_loss` gets the token log-probabilities from `_get_per_token_logps_and_entropies`, then reads
`inputs["advantages"]`, then takes PPO's -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A). `EntropyBalancedUpdate` changes
those two inputs, for the loss's own forward only, and leaves the loss code TRL's:
  * entropy-aware advantage: A·(1 + a·(H_t - mean H)/std H), H the policy's token entropy from that same forward,
    standardised over the batch's trained tokens (as the authors' code, over its micro-batch);
  * stop-gradient clipping: for a token with A > 0 and r > 1+ε_high, AEPO's clipped term is (1+ε_high)/sg(r)·r·A:
    PPO's value, but gradient (1+ε_high)·A·∇log π instead of 0. Handing TRL the log-probability
    log π_old + log c + (log π - sg(log π)), with c just inside the clip bound (within `BOUND_MARGIN`), gives
    TRL's ratio the value c and the gradient c·∇log π: the same loss value and gradient, through TRL's code.
"""

from __future__ import annotations

import math

import torch

BOUND_MARGIN = 1e-4  # log-space gap below log(1+ε_high): float32 rounding must not push the ratio past TRL's clamp


def entropy_aware_advantages(advantages: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor,
                             weight: float) -> torch.Tensor:
    """(B, T) advantages A·(1 + a·z_t), z the token entropies standardised over the tokens where `mask` is 1 (a std of
    0, or a single token, counts as 1, as the authors' code). (B,) advantages are broadcast per token."""
    advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    trained = entropies.detach()[mask.bool()]
    if trained.numel() == 0:
        return advantages.expand_as(entropies).clone()
    std = trained.std() if trained.numel() > 1 else torch.ones((), device=trained.device)
    std = torch.where(std > 0, std, torch.ones_like(std))
    z = (entropies.detach() - trained.mean()) / std
    return advantages * (1 + weight * z)


def rescaled_clip_mask(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       epsilon_high: float) -> torch.Tensor:
    """Tokens whose PPO gradient clipping zeroes and AEPO keeps: A > 0 and r > 1+ε_high (trained tokens only)."""
    advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    ratio = torch.exp(logps.detach() - old_logps)
    return (advantages > 0) & (ratio > 1 + epsilon_high) & mask.bool()


def keep_clipped_gradients(logps: torch.Tensor, old_logps: torch.Tensor, clipped: torch.Tensor,
                           epsilon_high: float) -> torch.Tensor:
    """Log-probabilities that make TRL's clipped loss AEPO's on `clipped` tokens (value c·A, gradient c·A·∇log π with
    c = (1+ε_high)·e^-BOUND_MARGIN) and leave the other tokens untouched."""
    bound = math.log1p(epsilon_high) - BOUND_MARGIN
    straight_through = old_logps + bound + (logps - logps.detach())
    return torch.where(clipped, straight_through, logps)


class EntropyBalancedUpdate:
    """Mixin placed before `GRPOTrainer` in `ARPOTrainer`'s bases; active with `entropy_balanced_clipping` or a
    non-zero `entropy_advantage_weight` (ARPOConfig), for any branch policy."""

    _loss_inputs: dict | None = None

    def _compute_loss(self, model, inputs):  # TRL 1.16: one batch's loss; AEPO changes its advantages and ratios
        args = self.args
        if not (args.entropy_balanced_clipping or args.entropy_advantage_weight):
            return super()._compute_loss(model, inputs)
        self._loss_inputs = dict(inputs)  # a copy: TRL reuses `inputs` over num_iterations
        try:
            return super()._compute_loss(model, self._loss_inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):  # TRL 1.16: (logps, entropies, aux)
        logps, entropies, *rest = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._loss_inputs = self._loss_inputs, None  # only the forward of `_compute_loss` itself
        if inputs is not None:
            logps = self._balance_entropy(inputs, logps, entropies)
        return (logps, entropies, *rest)

    def _balance_entropy(self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        """Rewrite `inputs["advantages"]` (TRL reads them after this forward) and return the log-probabilities."""
        args, mode = self.args, "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        if args.entropy_advantage_weight:
            inputs["advantages"] = entropy_aware_advantages(inputs["advantages"], entropies, mask,
                                                            args.entropy_advantage_weight)
        if not args.entropy_balanced_clipping:
            return logps
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        clipped = rescaled_clip_mask(logps, old, inputs["advantages"], mask, self.epsilon_high)
        self._trl.log_metric(mode, "aepo/rescaled_clip_ratio", (clipped.sum() / mask.sum().clamp(min=1)).item())
        return keep_clipped_gradients(logps, old, clipped, self.epsilon_high)


CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's losses with PPO's clipped ratio


def check_entropy_balanced_update(config) -> None:
    """AEPO's entropy-balanced clipping needs a clipped token-level loss and no term that reads the rescaled
    log-probabilities (`ARPOConfig` calls this)."""
    if not math.isfinite(config.entropy_advantage_weight):
        raise ValueError(f"entropy_advantage_weight must be a finite number, got {config.entropy_advantage_weight}.")
    if not config.entropy_balanced_clipping:
        return
    if config.loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(f"entropy_balanced_clipping rescales the gradient of PPO's clipped term, so loss_type "
                         f"must be one of {CLIPPED_LOSS_TYPES}; got {config.loss_type!r}.")
    if config.importance_sampling_level != "token":
        raise ValueError("entropy_balanced_clipping works on token ratios: set importance_sampling_level='token', "
                         f"got {config.importance_sampling_level!r}.")
    if config.beta != 0.0 or config.off_policy_mask_threshold is not None:
        raise ValueError("entropy_balanced_clipping needs beta=0 and off_policy_mask_threshold=None (AEPO trains "
                         "without a KL term; both would read the rescaled tokens' log-probabilities), got "
                         f"beta={config.beta}, off_policy_mask_threshold={config.off_policy_mask_threshold}.")
