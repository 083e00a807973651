"""Advantage attribution over rollout trees (paper §3.2).

* soft (paper default, all reported results): plain GRPO over the M trajectories of a prompt; a shared
  prefix is trained in every copy, and since the copies share context their ratios are equal, so the
  prefix implicitly receives the mean advantage. TRL's own group advantages already do this.
* hard: a token shared by d trajectories gets the mean of their d advantages and is trained once (in the
  row of the path that generated it). Counting it once matters: d copies each weighted by the mean give
  Σ A_i, i.e. the soft gradient again (docs/reference.md#advantages).

Rows the loss leaves out (TRL's `mask_truncated_completions` drops truncated completions) leave both modes alike:
soft trains a shared token in each kept copy with that copy's advantage; hard trains it once, in a kept row, with the
mean advantage of the kept rows sharing it (so d_kept copies at that mean are soft's sum again), and not at all when
no row sharing it is kept, as in soft.
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
                    kept: Sequence[bool] | None = None, scored: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, T) per-token advantages: the mean advantage over the rows of the group sharing each token, of the rows
    that count: those the loss keeps (`kept[i]` False: TRL's `mask_truncated_completions` drops row i) and that
    have a reward (`scored[i]` False: every reward function returned None, so TRL gives it advantage 0 and no
    signal). A token that only uncounted rows share gets 0."""
    out = torch.zeros(owners.shape, dtype=advantages.dtype, device=advantages.device)
    groups_t = torch.as_tensor(list(groups))
    counts = torch.ones(len(groups_t), dtype=torch.bool)
    for flags in (kept, scored):
        if flags is not None:
            counts &= torch.as_tensor(flags, dtype=torch.bool).cpu()
    weights = counts.to(advantages.device, advantages.dtype)
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


def trained_mask(owners: torch.Tensor, ids: Sequence[int], kept: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, T) 1 where the row trains the token under hard attribution: each token once, in the row of the path that
    generated it or, when the loss leaves that row out (`kept` False), in the first kept row sharing it."""
    mask = owner_mask(owners, ids).bool()
    if kept is None:
        return mask.long()
    kept_t = torch.as_tensor(list(kept), dtype=torch.bool)
    mask &= kept_t[:, None]
    for row in (~kept_t).nonzero().flatten().tolist():
        sharing = (owners == ids[row]) & kept_t[:, None]  # kept rows holding tokens this row's path generated
        positions = sharing.any(0).nonzero().flatten()
        mask[sharing.int().argmax(0)[positions], positions] = True
    return mask.long()
