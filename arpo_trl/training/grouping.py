"""Keep each prompt group's rows in one micro-batch when TRL shuffles and splits the generation batch, where that
changes nothing the optimizer sees.

TRL 1.16's `_prepare_inputs` permutes the generation batch row by row and splits it into `steps_per_generation`
micro-batches of equal row counts. Packing computes a shared prefix once per micro-batch, so rows of one tree
scattered over several micro-batches would forward it several times. `regroup` re-orders TRL's shuffled rows so
that groups are contiguous, in the random order TRL's permutation put their first rows, and splits again into the
same number of micro-batches. Within a group the rows are in trie order, so a micro-batch holding part of a large
tree holds neighbouring branches.

The invariant: every optimizer step sees the same rows with the same loss weights as under `GRPOTrainer`. So rows move
only among the micro-batches of one optimizer step (`optimizer_step_window`), and only when the accumulated gradient
is a sum of per-row terms over equal row counts (`regroup_blocker`): not with bnpo's per-micro-batch token count, an
entropy bonus, `top_entropy_quantile`'s per-micro-batch threshold or AEPO's per-micro-batch entropy statistics.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_tensor_dict

ROW_INDEX = "arpo_row_index"  # each row's index in the generation batch as `_generate_and_score_completions` made it
# TRL 1.16 losses whose micro-batch loss is a sum of per-row terms over a normaliser fixed by the row count
# (grpo, sapo, luspo: mean over rows; dr_grpo: rows × max_completion_length) or by the whole generation batch
# (dapo, cispo, vespo: num_items_in_batch): with equal row counts, any partition of a step's rows gives its gradient.
ROW_SUM_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")


def regroup_blocker(args) -> str | None:
    """Why moving rows between the micro-batches of one optimizer step would change its gradient, or None."""
    if args.loss_type not in ROW_SUM_LOSSES:
        return f"loss_type={args.loss_type!r} normalises each micro-batch by its own token count"
    if args.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 thresholds entropies per micro-batch"
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        return "the entropy bonus averages over each micro-batch's tokens"
    if args.entropy_advantage_weight:
        return "entropy_advantage_weight standardises entropies over each micro-batch's tokens"
    return None


def optimizer_step_window(steps_per_generation: int, gradient_accumulation_steps: int) -> int | None:
    """How many consecutive micro-batches of TRL's buffer always fall into one optimizer step, or None when the
    steps cut the buffer unevenly. TRL trains buffer entry `step % steps_per_generation` at micro-step `step`, and
    an optimizer step takes `gradient_accumulation_steps` micro-steps."""
    if steps_per_generation % gradient_accumulation_steps == 0:
        return gradient_accumulation_steps
    if gradient_accumulation_steps % steps_per_generation == 0:
        return steps_per_generation
    return None


def without_row_index(batches: list[dict]) -> list[dict]:
    for batch in batches:
        batch.pop(ROW_INDEX, None)
    return batches


def _is_rows(value) -> bool:
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.ndim > 0)


def _concat(batches: list[dict]) -> dict:
    whole = {}
    for key, first in batches[0].items():
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            whole[key] = torch.cat([batch[key] for batch in batches])
        elif isinstance(first, list):
            whole[key] = [item for batch in batches for item in batch[key]]
        else:  # None, or a scalar of the whole generation batch (num_items_in_batch)
            whole[key] = first
    return whole


def regroup(batches: list[dict], group_size: int) -> list[dict]:
    """`batches` (TRL's shuffled micro-batches, each carrying `ROW_INDEX`) with every group's rows contiguous, and
    without `ROW_INDEX`: `training_step` and `compute_loss` receive the keys GRPOTrainer gives them."""
    whole = _concat(batches)
    rows = whole.pop(ROW_INDEX).tolist()
    if any(_is_rows(value) and len(value) != len(rows) for value in whole.values()):
        return without_row_index(batches)  # something not aligned with rows (images): TRL's split as it is
    first_seen: dict[int, int] = {}
    for row in rows:
        first_seen.setdefault(row // group_size, len(first_seen))
    # Within a group, rows in trie order (by their completion tokens): when a micro-batch holds part of a group,
    # the rows it holds share the longest prefixes.
    tokens = whole["completion_ids"].tolist() if "completion_ids" in whole else [[] for _ in rows]
    order = sorted(range(len(rows)), key=lambda i: (first_seen[rows[i] // group_size], tokens[i], rows[i]))
    index = torch.tensor(order)

    def permute(value):
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return value[index.to(value.device)]
        return [value[i] for i in order] if isinstance(value, list) else value

    return split_tensor_dict({key: permute(value) for key, value in whole.items()}, len(batches))
