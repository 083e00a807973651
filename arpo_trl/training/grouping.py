"""Keep each prompt group's rows in one micro-batch when TRL shuffles and splits the generation batch.

TRL 1.16's `_prepare_inputs` permutes the generation batch row by row and splits it into `steps_per_generation`
micro-batches of equal row counts. Packing computes a shared prefix once per micro-batch, so rows of one tree
scattered over several micro-batches would forward it several times. `regroup` re-orders TRL's shuffled rows so
that groups are contiguous, in the random order TRL's permutation put their first rows, and splits again into the
same number of micro-batches: the row counts, hence the accumulated gradient's normalisation, are unchanged. Within
a group the rows are in trie order, so a micro-batch holding part of a large tree holds neighbouring branches.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_tensor_dict

ROW_INDEX = "arpo_row_index"  # each row's index in the generation batch as `_generate_and_score_completions` made it


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
    if not batches or ROW_INDEX not in batches[0]:
        return batches
    whole = _concat(batches)
    rows = whole.pop(ROW_INDEX).tolist()
    if any(_is_rows(value) and len(value) != len(rows) for value in whole.values()):
        for batch in batches:  # something not aligned with rows (images): leave TRL's split as it is
            batch.pop(ROW_INDEX)
        return batches
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
