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

Hard mode is defined for losses that sum tokens (TRL's dapo, bnpo, dr_grpo, cispo, luspo at token level) and for those
that divide each row by its own trained-token count (grpo, sapo), which `row_normalised_hard_advantages` keeps to the
whole trajectory's count. `check_attribution` (called by `ARPOConfig`) refuses in one line each setting that weighs,
corrects or drops a row by a statistic over its trained tokens, which no per-token advantage can restore: a branch's
row trains only its own suffix, so the branch would be judged by that suffix instead of its trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


def trained_mask(owners: torch.Tensor, ids: Sequence[int], kept: Sequence[bool]) -> torch.Tensor:
    """(B, T) 1 where the row trains the token under hard attribution: each token once, in the row of the path that
    generated it or, when the loss leaves that row out (`kept` False), in the first kept row sharing it."""
    mask = owner_mask(owners, ids).bool()
    kept_t = torch.as_tensor(list(kept), dtype=torch.bool)
    mask &= kept_t[:, None]
    for row in (~kept_t).nonzero().flatten().tolist():
        sharing = (owners == ids[row]) & kept_t[:, None]  # kept rows holding tokens this row's path generated
        positions = sharing.any(0).nonzero().flatten()
        mask[sharing.int().argmax(0)[positions], positions] = True
    return mask.long()


ROW_NORMALISED_LOSSES = ("grpo", "sapo")  # TRL 1.16: a row's token sum divided by that row's own trained tokens


def row_normalised_hard_advantages(advantages: torch.Tensor, owners: torch.Tensor, groups: Sequence[int],
                                   whole: torch.Tensor, trained: torch.Tensor, kept: Sequence[bool] | None = None,
                                   scored: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, T) advantages for a loss that divides each row by its own trained tokens (`ROW_NORMALISED_LOSSES`).

    There a token of trajectory i weighs A_i / L_i, L_i its trajectory's trained tokens (`whole`, (B,)), so a shared
    token gets the mean of A_i / L_i over the rows sharing it that count, trained once. Hard attribution leaves row i
    only its `trained` tokens ((B,)), by which the loss divides instead of L_i: the advantages are multiplied by them
    (the loss is linear in a positive per-row scale of the advantages, whose signs it alone reads)."""
    whole = whole.to(advantages.device, advantages.dtype).clamp(min=1)
    per_token = hard_advantages(advantages / whole, owners, groups, kept, scored)
    return per_token * trained.to(per_token.device, per_token.dtype)[:, None]


ATTRIBUTIONS = ("soft", "hard")
VLLM_SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")

# (the fields that make the setting, refused when the predicate holds; what it does with a row's trained tokens, to be
# followed by "its trained tokens"; the way out besides advantage_attribution='soft')
HARD_REFUSALS: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str, str], ...] = (
    (("importance_sampling_level",), lambda c: c.importance_sampling_level == "sequence",
     "averages a row's log-ratio over", "use importance_sampling_level='token'"),
    (("loss_type",), lambda c: c.loss_type == "vespo",
     "weights a row by its sequence ratio over",
     "use loss_type 'dapo', 'bnpo', 'dr_grpo', 'cispo', 'luspo', 'grpo' or 'sapo'"),
    (("off_policy_mask_threshold",), lambda c: c.off_policy_mask_threshold is not None,
     "drops a row by its mean KL over", "set off_policy_mask_threshold=None"),
    (("use_vllm", "vllm_importance_sampling_mode"),
     lambda c: c.use_vllm and c.vllm_importance_sampling_correction
     and c.vllm_importance_sampling_mode in VLLM_SEQUENCE_MODES,
     "corrects a row by its sampler ratio over",
     "use vllm_importance_sampling_mode 'token_mask' or 'token_truncate'"),
    (("loss_type", "beta"), lambda c: c.loss_type in ROW_NORMALISED_LOSSES and c.beta != 0.0,
     "divides a row's KL term by the number of",
     "set beta=0.0 (the policy term is rescaled to the trajectory, the KL term cannot be) or use loss_type 'dapo', "
     "'bnpo' or 'dr_grpo'"),
)


def check_attribution(config: Any) -> None:
    """A ValueError in one line for an unknown attribution, or a TRL setting hard attribution cannot honour."""
    if config.advantage_attribution not in ATTRIBUTIONS:
        raise ValueError(f"advantage_attribution must be one of {ATTRIBUTIONS}, got {config.advantage_attribution!r}.")
    if config.advantage_attribution != "hard":
        return
    for names, refused, what, way_out in HARD_REFUSALS:
        if refused(config):
            setting = ", ".join(f"{name}={getattr(config, name)!r}" for name in names)
            raise ValueError(f"advantage_attribution='hard' trains each shared token in one row only, so a branch's "
                             f"row trains just its own suffix; {setting} {what} its trained tokens, i.e. that suffix "
                             f"instead of the whole trajectory: {way_out}, or advantage_attribution='soft'.")


# ---- hard attribution on TRL's batch -------------------------------------------------------------------------------
# Hard attribution on TRL's batch (`advantage_attribution="hard"`): a token that a prompt's tree shares is trained
# once, by its owner (`advantages.token_owners`). TRL's tool mask loses the other copies (`owned_tool_mask`), and the
# (B,) group advantages TRL computed become (B, T) per-token ones (`token_advantages`), which TRL's `_compute_loss`
# accepts; with grpo/sapo's row-normalised losses they are scaled so that a row's division by its own trained tokens
# weighs them by its whole trajectory's, as soft attribution does.
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
