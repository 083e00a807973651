"""One decode forward over two lanes of rows that feed different numbers of tokens per row.

A path that starts late (a fill-up, a fork's copy after its probe, a continuation after siblings called the same
tool) finds its siblings' text ahead of it, and drafts from that text are nearly always accepted (on the multi-call
model, 93-95 % of such a path's tokens equal what the n-gram lookup proposes). But a decode step feeds every row of
the batch the same number of tokens, and in a rollout's bulk (~100 rows) drafts for all rows cost far more than they
save, so such a path decoded one token per step and ended the rollout's longest chain.

So the running rows are split into two lanes, each its own `KVBatch`: the main lane, where rows decode side by side,
and the sprint lane, where the late rows that hold a likely draft run. Each lane has its own number of tokens per row
(its drafts, chosen at its rows' own rates), and both lanes run in one forward, so the weights are read once per step:
the input is the lanes' tokens end to end, `input_ids` of shape [1, T] (row-major per lane). Every layer's projections,
MLP and RoPE run on the T tokens as one sequence; only attention is per lane, through an attention function
registered with transformers (`AttentionInterface`) that the engine selects for this forward alone. A lane's rows
attend to their own buffer's columns with the lane's mask; each row computes what a forward of that row alone
computes, up to floating-point rounding (tested in float64).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefix_cache import KV, kv_length
from arpo_trl.generation.speculation import sprints

ATTENTION = "arpo_lanes"


@dataclass
class LaneStep:
    """One lane's part of a step: `width` tokens per row of `batch`, tokens `tokens` of the step's T, written at
    columns `start` .. `start + width - 1`; `mask` [rows, 1, width, view columns] lets each query see its row's
    positions up to its own column."""

    batch: KVBatch
    width: int
    tokens: slice
    start: int
    mask: torch.Tensor

    @classmethod
    def open(cls, batch: KVBatch, width: int, first_token: int) -> LaneStep:
        """Make room for the lane's step (`KVBatch.open_columns`) and lay it out from token `first_token` on."""
        view = batch.open_columns(width).bool()
        start = batch.width
        columns = torch.arange(view.shape[1], device=view.device)
        queries = columns[view.shape[1] - width:]
        mask = view[:, None, None, :] & (columns[None, None, None, :] <= queries[None, None, :, None])
        return cls(batch, width, slice(first_token, first_token + batch.rows * width), start, mask)

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, end = self.batch, self.start + self.width
        return (batch.buffer[0, layer, : batch.rows, :, batch.first: end],
                batch.buffer[1, layer, : batch.rows, :, batch.first: end])


def lanes_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, lane_steps=None, **kwargs):
    """Attention of the step's T queries ([1, heads, T, dim]) to their own lane's rows, one SDPA call per lane."""
    if lane_steps is None:
        raise RuntimeError(f"attention '{ATTENTION}' runs only in a step over lanes (lane_steps missing).")
    heads, dim = query.shape[1], query.shape[3]
    outputs = []
    for lane in lane_steps:
        rows = lane.batch.rows
        queries = query[0][:, lane.tokens].view(heads, rows, lane.width, dim).transpose(0, 1)
        keys, values = lane.keys_values(module.layer_idx)
        out, _ = sdpa_attention_forward(module, queries, keys, values, lane.mask, scaling=scaling, dropout=0.0,
                                        is_causal=False)
        outputs.append(out.reshape(rows * lane.width, heads, dim))  # [rows, width, heads, dim] → tokens
    return torch.cat(outputs)[None], None


AttentionInterface.register(ATTENTION, lanes_attention)


class _LanesLayer(DynamicLayer):
    """A `Cache` layer for one step over lanes: writes each lane's keys and values at its rows and new columns;
    attention reads the lanes' buffers itself (`lanes_attention`)."""

    def __init__(self, lanes: list[LaneStep], layer: int):
        super().__init__()
        self.lanes, self.layer, self.is_initialized = lanes, layer, True
        self.device = lanes[0].batch.buffer.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        heads, dim = key_states.shape[1], key_states.shape[3]
        for lane in self.lanes:
            rows, end = lane.batch.rows, lane.start + lane.width
            for kind, states in enumerate((key_states, value_states)):
                lane.batch.buffer[kind, self.layer, :rows, :, lane.start: end] = (
                    states[0, :, lane.tokens].view(heads, rows, lane.width, dim).transpose(0, 1))
        return key_states, value_states

    def get_seq_length(self) -> int:
        lane = self.lanes[0]
        return lane.start - lane.batch.first


@contextlib.contextmanager
def _attention(model):
    config = model.config
    previous, config._attn_implementation = config._attn_implementation, ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def lanes_forward(model, lanes: list[LaneStep], input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Run the step's tokens ([T] ids and positions, in the lanes' order) through the model, writing their keys and
    values into the lanes' batches (then `KVBatch.close_columns`); returns the logits (float32) at all T tokens."""
    cache = Cache(layers=[_LanesLayer(lanes, layer) for layer in range(lanes[0].batch.buffer.shape[1])])
    with _attention(model):
        out = model(input_ids=input_ids[None], position_ids=position_ids[None], cache=cache, use_cache=True,
                    lane_steps=lanes)
    for lane in lanes:
        lane.batch.close_columns(lane.width)
    return out.logits[0].float()


class TwoLanes:
    """The cached engine's running rows in two lanes: `_rows` holds the main lane's rows (`_batch`) then the sprint
    lane's (`_sprint`), and the per-row state (`_positions`, `_logits`, `_excluded`, `_tokens`) follows that order.
    Mixed into `CachedTransformersEngine`, whose sampling (`_distributions`, `_penalized`), drafts (`_drafts`,
    `_verify`) and answers (`_release`) it uses.

    Rows join a lane for one request (a segment): the sprint lane when they hold a likely draft (`sprints`). A step
    runs both lanes in one forward (`lanes_forward`), each at its own draft width; with one lane, the model's own
    attention path, as before the lanes."""

    def _join(self, joining: list[tuple[Any, KV, torch.Tensor]]) -> None:
        """Add the admitted rows to their lane's batch (written into its preallocated buffers): the sprint lane for
        a row that holds a likely draft (`speculation.sprints`), the main lane otherwise."""
        if self.speculating:
            for request, _, _ in joining:
                self.drafts.add(request.text, request.cached - 1)
                request.alpha = self.acceptance.rate
        sprinting = self._sprinting(joining)
        self.counters.sprint_rows += sum(sprinting)
        lanes = [[row for row, sprint in zip(joining, sprinting) if not sprint],
                 [row for row, sprint in zip(joining, sprinting) if sprint]]
        split = self._main_rows()
        parts: list[tuple] = []
        for lane, rows in enumerate(lanes):
            if rows:
                batch = self._lane(lane) or KVBatch()
                batch.add([kv for _, kv, _ in rows])
                self._batch, self._sprint = (batch, self._sprint) if lane == 0 else (self._batch, batch)
            positions = torch.tensor([kv_length(kv) for _, kv, _ in rows], dtype=torch.long)
            logits = torch.cat([logits for _, _, logits in rows]) if rows else None
            parts.append(([request for request, _, _ in rows], positions, logits))
        (main, main_positions, main_logits), (sprint, sprint_positions, sprint_logits) = parts

        def merged(old: torch.Tensor | None, main_part, sprint_part) -> torch.Tensor:
            pieces = [old[:split] if old is not None else None, main_part,
                      old[split:] if old is not None else None, sprint_part]
            return torch.cat([piece.to(joining[0][2].device) for piece in pieces if piece is not None])

        self._positions = merged(self._positions, main_positions, sprint_positions)
        self._logits = merged(self._logits, main_logits, sprint_logits)
        self._excluded = merged(self._excluded, torch.full_like(main_positions, -1),
                                torch.full_like(sprint_positions, -1))
        self._rows = self._rows[:split] + main + self._rows[split:] + sprint

    def _sprinting(self, joining: list[tuple[Any, KV, torch.Tensor]]) -> list[bool]:
        """Per joining row, whether it runs in the sprint lane: it holds a draft its first distribution likely
        accepts."""
        if not self.sprint_lane:
            return [False] * len(joining)
        _, _, sampled = self._distributions(self._penalized(torch.cat([logits for _, _, logits in joining])))
        return [sprints(self.drafts, request.text, None if sampled is None else sampled[index])
                for index, (request, _, _) in enumerate(joining)]

    def _main_rows(self) -> int:
        return self._batch.rows if self._batch is not None else 0

    def _lane(self, lane: int) -> KVBatch | None:
        return self._batch if lane == 0 else self._sprint

    def _lanes(self) -> list[tuple[KVBatch, int]]:
        """The lanes that hold rows, with the index of their first row in `_rows`."""
        return [(batch, offset) for batch, offset in ((self._batch, 0), (self._sprint, self._main_rows()))
                if batch is not None]

    def _row_kv(self, row: int) -> KV:
        split = self._main_rows()
        return self._batch.row(row) if row < split else self._sprint.row(row - split)

    def _remove_rows(self, finished: list[int]) -> None:
        """Take rows out of their lanes (a lane that empties lets its buffers go), and the per-row state with them."""
        split, order = self._main_rows(), []
        for lane, (batch, offset) in enumerate(((self._batch, 0), (self._sprint, split))):
            if batch is None:
                continue
            rows = [row - offset for row in finished if offset <= row < offset + batch.rows]
            order += [offset + row for row in (batch.remove(rows) if rows else range(batch.rows))]
            if not batch.rows:  # the lane is empty: its buffers go
                self._batch, self._sprint = (None, self._sprint) if lane == 0 else (self._batch, None)
        if not order:
            self._rows, self._positions = [], None
            self._logits = self._excluded = self._tokens = None
            return
        self._rows, index = [self._rows[row] for row in order], torch.tensor(order, device=self._positions.device)
        self._positions, self._tokens = self._positions[index], self._tokens[index]
        self._logits, self._excluded = self._logits[index], self._excluded[index]

    def _decode_step(self, model) -> None:
        """Run the sampled tokens of all rows, and their drafts if any pay (chosen per lane), in one forward; each
        layer writes its new columns in place. Drafts are then verified (`_verify`)."""
        lanes = self._lanes()
        drafts = [self._drafts(offset, batch.rows) for batch, offset in lanes]
        widths = [1 + max(map(len, lane)) for lane in drafts]
        tokens = [self._lane_tokens(offset, batch.rows, lane, width)
                  for (batch, offset), lane, width in zip(lanes, drafts, widths)]
        if len(lanes) == 1:
            (batch, offset), width = lanes[0], widths[0]
            mask = batch.open_columns(width)
            starts = [batch.width]  # after open_columns, which may regrow the buffers
            positions = self._positions[:, None] + torch.arange(width, device=self._positions.device)
            out = model(input_ids=tokens[0], attention_mask=mask, position_ids=positions, cache=batch.cache,
                        use_cache=True)
            batch.close_columns(width)
            logits = [out.logits.float()]
        else:
            steps, first = [], 0
            for (batch, _), width in zip(lanes, widths):
                steps.append(LaneStep.open(batch, width, first))
                first += batch.rows * width
            starts = [step.start for step in steps]
            positions = torch.cat([(self._positions[offset: offset + batch.rows, None]
                                    + torch.arange(width, device=self._positions.device)).flatten()
                                   for (batch, offset), width in zip(lanes, widths)])
            flat = lanes_forward(model, steps, torch.cat([lane.flatten() for lane in tokens]), positions)
            logits = [flat[step.tokens].view(step.batch.rows, step.width, -1) for step in steps]
        self.counters.decode_tokens += sum(batch.rows * width for (batch, _), width in zip(lanes, widths))
        kept, next_logits, finished = [], [], []
        for (batch, offset), lane_logits, lane_drafts, start in zip(lanes, logits, drafts, starts):
            lane_kept, lane_next, lane_finished = self._verify(lane_logits, lane_drafts, start, batch, offset)
            kept += lane_kept
            next_logits.append(lane_next)
            finished += lane_finished
        self._positions = self._positions + 1 + torch.tensor(kept, device=self._positions.device)
        self._logits = torch.cat(next_logits)
        self._release(finished)

    def _lane_tokens(self, offset: int, rows: int, drafts: list[list[int]], width: int) -> torch.Tensor:
        """[rows, width]: each row's sampled token, then its drafts; padding columns become holes."""
        tokens = self._tokens[offset: offset + rows, None]
        if width == 1:
            return tokens
        padded = [draft + [0] * (width - 1 - len(draft)) for draft in drafts]
        return torch.cat([tokens, torch.tensor(padded, device=tokens.device)], dim=1)
