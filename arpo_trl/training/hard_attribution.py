"""Hard attribution on TRL's batch (`advantage_attribution="hard"`): a token that a prompt's tree shares is trained
once, by its owner (`advantages.token_owners`). TRL's tool mask loses the other copies (`owned_tool_mask`), and the
(B,) group advantages TRL computed become (B, T) per-token ones (`token_advantages`), which TRL's `_compute_loss`
accepts; with grpo/sapo's row-normalised losses they are scaled so that a row's division by its own trained tokens
weighs them by its whole trajectory's, as soft attribution does."""

from __future__ import annotations

import torch

from arpo_trl.training.advantages import (
    ROW_NORMALISED_LOSSES,
    hard_advantages,
    row_normalised_hard_advantages,
    token_owners,
    trained_mask,
)


def owners(fields: list[dict], width: int) -> torch.Tensor:
    """Each row's token owners, from the rows' tree fields (`node`, `parent`, `fork_position`, `length`)."""
    return token_owners([f["node"] for f in fields], [f["parent"] for f in fields],
                        [f["fork_position"] for f in fields], [f["length"] for f in fields], width)


def owned_tool_mask(fields: list[dict], tool_mask: list[list[int]], kept: list[bool]) -> list[list[int]]:
    """TRL's tool mask with each shared token left to its owner only (`kept`: the rows the loss keeps)."""
    keep = trained_mask(owners(fields, max(map(len, tool_mask))), [f["node"] for f in fields], kept).tolist()
    return [[bit * k for bit, k in zip(row, keep[i])] for i, row in enumerate(tool_mask)]


def token_advantages(trl, accelerator, loss_type: str, output: dict, fields: list[dict],
                     trajectory_mask: list[list[int]]) -> torch.Tensor:
    """(B, T) per-token advantages from the (B,) group advantages TRL just computed in `output` (`trl`: the
    trainer's `TRLState`; `trajectory_mask`: each row's own trained tokens, before ownership was applied)."""
    rows, width = trl.completion_shape(output)
    index, processes = accelerator.process_index, accelerator.num_processes
    scored = [not flag for flag in trl.unscored(rows * processes)[index * rows : (index + 1) * rows]]
    tree = (owners(fields, width), [f["group"] for f in fields])
    advantages, kept = trl.advantages(output), trl.rows_in_loss(output)
    if loss_type not in ROW_NORMALISED_LOSSES:
        return hard_advantages(advantages, *tree, kept=kept, scored=scored)
    padded = torch.zeros(rows, width, dtype=torch.long)
    for row, bits in zip(padded, trajectory_mask):
        row[:len(bits)] = torch.as_tensor(bits)
    whole = trl.loss_mask(output, padded).sum(-1)  # what soft attribution divides each row by
    trained = trl.loss_mask(output).sum(-1)  # what the loss divides each row by
    return row_normalised_hard_advantages(advantages, *tree, whole, trained, kept, scored)
