"""The rollout tree's per-row metadata, kept in a side table of the trainer instead of the user's example dicts.

TRL merges the extra fields of a `rollout_func`'s output into each example dict of the batch, so every key we returned
there (node, parent, fork position, calls, ...) would show up in what `training_step`, `compute_loss` and callbacks
see. The rollout stores them here, row by row in the batch's order, and only the reward functions receive them, as
`arpo_*` keyword arguments (docs/rewards.md).
"""

from __future__ import annotations

REWARD_PREFIX = "arpo_"


class TreeRows:
    """Mixin placed before `GRPOTrainer` in `ARPOTrainer`'s bases: `_tree_rows` holds the last rollout's per-row
    metadata (set by the rollout, one dict per completion, in the batch's row order)."""

    _tree_rows: list[dict] | None = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # TRL 1.16: (B, funcs) rewards
        # The reward functions are the one documented reader of the tree metadata: hand it to them on copies.
        rows = self._tree_rows
        if rows is not None:
            if len(rows) != len(inputs):
                raise RuntimeError(f"ARPO: the rollout recorded {len(rows)} tree rows for a batch of {len(inputs)} "
                                   "completions; a rollout_func or _generate override changed the batch.")
            inputs = [{**example, **{REWARD_PREFIX + key: value for key, value in row.items()}}
                      for example, row in zip(inputs, rows)]
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
