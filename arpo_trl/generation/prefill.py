"""The prefill of the requests that join the running batch in one step, in as few forwards as pay.

A joining request brings the KV of its cached prefix (`start` positions, maybe none) and the tokens after it. One
forward per request pays the model's fixed cost every time (worth tens of prefilled positions on a CPU, far more on a
GPU; `FORWARD_COST_TOKENS`, docs/cpu_measurements.md), and tool results come back together,
so a step often admits several requests. A group's forward lays out

    columns   [0 ............. P)[P ................... P + W)
    row i      padding | cached i  new tokens of i | padding

the cached parts right-aligned before column P (the longest cached part), the new tokens left-aligned after it. A
row's positions stay contiguous, so its KV is the slice [P - start_i, P + new_i); its real tokens never attend to
padding (masked) nor to the padded queries after them (causal), so they are what a forward of that row alone
computes, up to floating-point rounding. The padding is computed and thrown away: `group_by_length` splits the
requests into forwards where the padding would cost more than a forward's fixed cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from arpo_trl.generation.prefix_cache import KV, layer_pairs, stack_layers

MAX_FORWARD_POSITIONS = 8192  # rows × width of one grouped forward: bounds its activations (a longer request alone)
# A forward's fixed cost in prefilled positions, fitted on the 2-core development CPU with SmolLM2-135M (~90 measured;
# docs/cpu_measurements.md). On a GPU it is larger, so there the engine splits its prefills more than it would need to;
# the one-GPU default is vLLM, and the measured cost model that would fix it was deleted for want of a CPU gain.
FORWARD_COST_TOKENS = 64


@dataclass
class PrefillJob:
    """One request's prefill: its whole prefix `tokens`, and the KV of the first `start` of them (one row) or None."""

    tokens: list[int]
    cached: KV | None
    start: int

    @property
    def new(self) -> int:
        return len(self.tokens) - self.start


def group_by_length(lengths: Sequence[int], forward_cost: float,
                    max_positions: int = MAX_FORWARD_POSITIONS) -> list[list[int]]:
    """Indices of `lengths` in groups, one forward each, that minimise the positions computed,
    Σ (forward_cost + rows × longest), with rows × longest ≤ `max_positions` unless one row is longer alone.
    Sorted by length, some optimal grouping is contiguous, so a dynamic programme over that order finds one."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])  # longest first; stable, so deterministic
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for begin in range(end - 1, -1, -1):  # the group order[begin:end]; its longest is order[begin]
            positions = (end - begin) * lengths[order[begin]]
            if positions > max_positions and end - begin > 1:
                continue
            if (cost := best[begin] + forward_cost + positions) < best[end]:
                best[end], cut[end] = cost, begin
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]: end])
        end = cut[end]
    return groups[::-1]


def prefill(model, jobs: Sequence[PrefillJob], forward_cost: float) -> tuple[list[tuple[KV, torch.Tensor]], list[int]]:
    """Each job's KV (one row, its whole prefix) and next-token logits ([1, vocab], float32), in job order; and the
    positions each forward computed, padding included. `forward_cost`: a forward's fixed cost in positions."""
    results: list[tuple[KV, torch.Tensor] | None] = [None] * len(jobs)
    positions = []
    for group in group_by_length([job.new for job in jobs], forward_cost):
        group_jobs = [jobs[index] for index in group]
        for index, result in zip(group, _forward(model, group_jobs)):
            results[index] = result
        positions.append(len(group) * max(job.new for job in group_jobs))
    return results, positions


def _forward(model, jobs: list[PrefillJob]) -> list[tuple[KV, torch.Tensor]]:
    device = next(model.parameters()).device
    past, width = max(job.start for job in jobs), max(job.new for job in jobs)
    ids = torch.empty(len(jobs), width, dtype=torch.long)
    positions = torch.empty(len(jobs), width, dtype=torch.long)
    mask = torch.zeros(len(jobs), past + width, dtype=torch.long)
    for row, job in enumerate(jobs):
        ids[row, : job.new] = torch.tensor(job.tokens[job.start:])
        ids[row, job.new:] = job.tokens[-1]  # any real token: these queries are thrown away
        positions[row] = torch.arange(job.start, job.start + width)
        mask[row, past - job.start: past + job.new] = 1
    cache = DynamicCache(ddp_cache_data=layer_pairs(_padded_past(jobs, past))) if past else DynamicCache()
    last = sorted({job.new - 1 for job in jobs})  # the rows' last real positions: logits only there
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                cache=cache, use_cache=True, logits_to_keep=torch.tensor(last, device=device))
    column = {position: index for index, position in enumerate(last)}
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    return [(stack_layers([(keys[row: row + 1, :, past - job.start: past + job.new],
                            values[row: row + 1, :, past - job.start: past + job.new]) for keys, values in layers]),
             out.logits[row: row + 1, column[job.new - 1]].to(torch.float32, copy=True))  # a view would keep
            for row, job in enumerate(jobs)]  # all of the forward's logits alive while the prefix cache holds it


def _padded_past(jobs: list[PrefillJob], past: int) -> KV:
    """The rows' cached KV, right-aligned at column `past` (zeros in front: masked, but finite, so that their zero
    attention weights give exact zeros). One row with the whole past: its cached KV as is (a view of a prefix-cache
    entry, which the model's cache update does not write: it concatenates into new tensors)."""
    if len(jobs) == 1 and jobs[0].start == past:
        return jobs[0].cached
    reference = next(job.cached for job in jobs if job.cached is not None)
    padded = reference.new_empty((*reference.shape[:2], len(jobs), reference.shape[3], past, reference.shape[5]))
    for row, job in enumerate(jobs):
        padded[:, :, row, :, : past - job.start] = 0.0
        if job.start:
            padded[:, :, row, :, past - job.start:] = job.cached[:, :, 0]
    return padded
