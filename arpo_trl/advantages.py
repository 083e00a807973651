"""Advantage attribution over rollout trees (paper §3.2).

* soft (paper default, all reported results): plain GRPO over the M trajectories of a prompt; a shared
  prefix is trained in every copy, and since the copies share context their ratios are equal, so the
  prefix implicitly receives the mean advantage. TRL's own group advantages already do this.
* hard: a token shared by d trajectories gets the mean of their d advantages and is trained once (in the
  row of the path that generated it). Counting it once matters: d copies each weighted by the mean give
  Σ A_i, i.e. the soft gradient again (docs/reference.md#advantages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_owners(
    ids: Sequence[int], parents: Sequence[int | None], fork_positions: Sequence[int | None],
    lengths: Sequence[int], width: int,
) -> torch.Tensor:
    """(B, width) id of the path that generated each completion token (-1 past a row's length).

    A branch's first `fork_position` tokens are its parent's tokens at the same positions, recursively."""
    row_of = {node: row for row, node in enumerate(ids)}
    owners = torch.full((len(ids), width), -1, dtype=torch.long)
    for row, length in enumerate(lengths):
        node, end = ids[row], length
        while node is not None and end > 0:
            start = min(fork_positions[row_of[node]] or 0, end)
            owners[row, start:end] = node
            node, end = parents[row_of[node]], start
    return owners


def hard_advantages(advantages: torch.Tensor, owners: torch.Tensor, groups: Sequence[int],
                    scored: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, T) per-token advantages: the mean advantage over the rows of the group sharing each token.

    `scored[i]` False: every reward function returned None for row i (TRL gives it advantage 0, no signal), so it
    does not count in the mean of the tokens it shares; a token only unscored rows share gets 0."""
    out = torch.zeros(owners.shape, dtype=advantages.dtype, device=advantages.device)
    groups_t = torch.as_tensor(list(groups))
    weights = torch.ones(len(groups_t)) if scored is None else torch.as_tensor(list(scored), dtype=torch.float)
    weights = weights.to(advantages.device, advantages.dtype)
    owners = owners.to(advantages.device)
    for group in groups_t.unique():
        rows = (groups_t == group).nonzero().squeeze(-1).to(advantages.device)
        own = owners[rows]  # (G, T)
        same = (own[:, None, :] == own[None, :, :]) & (own[None, :, :] >= 0)  # (G, G, T)
        counted = same * weights[rows][None, :, None]
        total = (counted * advantages[rows][None, :, None]).sum(1)
        out[rows] = total / counted.sum(1).clamp(min=1)
    return out


def owner_mask(owners: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """(B, T) 1 where the row's own path generated the token: each shared token counted once."""
    return (owners == torch.as_tensor(list(ids))[:, None]).long()
