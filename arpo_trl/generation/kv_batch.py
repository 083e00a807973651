"""The running rows' KV cache, preallocated and written in place.

A decode step appends one key and one value per row and layer. transformers' `DynamicCache` does it by
concatenation, which copies the whole batch's cache every step: at 84 rows of ~190 positions that copy was 190 of a
470 ms SmolLM2-135M step on this CPU. Here the rows live in buffers with spare columns and rows; a step writes one
column, a row joins by writing its own positions, a row leaves by moving the last row into its slot. Only when the
spare room runs out is the batch copied, into buffers with room again (amortised over many steps).

Rows are left-padded: every row's next position is the same column (`width`), and a row's positions are the
columns just before it, except for holes: a decode step with drafts writes several columns for every row, and a
row's rejected drafts are masked out (`hole`) and squeezed out when the buffers regrow. Columns a row does not use
are masked out, so they get exactly zero attention weight, and hold finite values (of earlier rows, or zeros written
when they enter the model's view: new buffers are not zero-filled); the model sees a `Cache` whose layers return views
of the buffers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape [rows, heads, positions, head_dim]

LEFT_SLACK = 32  # padding columns added in front when a longer row joins, so that the next longer ones fit too


def _slack(needed: int, minimum: int) -> int:
    return needed + max(minimum, needed // 4)


class KVBatch:
    """The keys and values of `rows` running rows. Buffers per layer: [row capacity, heads, column capacity, head_dim];
    the columns in use are `first` .. `width` - 1, and `mask[row, column]` is 1 where the row has a position."""

    def __init__(self):
        self.rows, self.first, self.width = 0, 0, 0
        self.starts: list[int] = []  # per row, its first column
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        self.cache = Cache(layers=[])

    @property
    def row_capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def column_capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def add(self, rows: list[KV]) -> None:
        """Append rows (each one row's KV, [1, heads, positions, head_dim] per layer) at the end of the batch."""
        longest = max(kv[0][0].shape[2] for kv in rows)
        if not self.keys or self.rows + len(rows) > self.row_capacity or longest > self.width:
            self._regrow(self.rows + len(rows), longest + LEFT_SLACK if longest > self.width else longest, rows[0])
        for kv in rows:
            length, row = kv[0][0].shape[2], self.rows
            start = self.width - length
            if start < self.first:  # the view widens to the left: the running rows' new columns are padding
                self._zero(slice(0, row), start, self.first)
            self._zero(slice(row, row + 1), self.first, start)
            for layer, (k, v) in enumerate(kv):
                self.keys[layer][row, :, start: self.width] = k[0]
                self.values[layer][row, :, start: self.width] = v[0]
            self.mask[row] = 0
            self.mask[row, start: self.width] = 1
            self.starts.append(start)
            self.first = min(self.first, start)
            self.rows += 1
        self._sync_cache()

    def remove(self, rows: list[int]) -> list[int]:
        """Take rows out: the last row moves into each freed slot. Returns the new order as old row indices."""
        order = list(range(self.rows))
        for row in sorted(set(rows), reverse=True):
            last = self.rows - 1
            if row != last:
                for buffer in self.keys + self.values:
                    buffer[row, :, self.first: self.width] = buffer[last, :, self.first: self.width]
                self.mask[row] = self.mask[last]
                self.starts[row], order[row] = self.starts[last], order[last]
            self.starts.pop(), order.pop()
            self.rows -= 1
        self.first = min(self.starts, default=self.width)
        self._sync_cache()
        return order

    def row(self, row: int) -> KV:
        """A copy of one row's positions, for the prefix cache (without the holes rejected drafts left)."""
        start = self.starts[row]
        used = self.mask[row, start: self.width]
        if bool(used.all()):
            return [(k[row: row + 1, :, start: self.width].clone(), v[row: row + 1, :, start: self.width].clone())
                    for k, v in zip(self.keys, self.values)]
        columns = used.nonzero().squeeze(1) + start
        return [(k[row: row + 1, :, columns], v[row: row + 1, :, columns]) for k, v in zip(self.keys, self.values)]

    def open_columns(self, count: int = 1) -> torch.Tensor:
        """Before a decode step of `count` tokens per row (a sampled one and its drafts): make room for them, unmask
        them for every row and return the step's attention mask (a view: the columns in use and the new ones)."""
        if self.width + count > self.column_capacity:
            self._regrow(self.rows, 0, spare=count)
            self._sync_cache()
        self.mask[: self.rows, self.width: self.width + count] = 1
        return self.mask[: self.rows, self.first: self.width + count]

    def close_columns(self, count: int = 1) -> None:
        """After a decode step: the columns the layers wrote are in use (their `update` already moved their views)."""
        self.width += count

    def hole(self, row: int, begin: int, end: int) -> None:
        """Mask out columns [begin, end) of a row: rejected drafts' positions, never attended to again."""
        self.mask[row, begin: end] = 0

    def _regrow(self, rows: int, width: int, like: KV | None = None, spare: int = 1) -> None:
        """New buffers holding the rows' positions right-aligned at `max(width, longest row)`, with spare room;
        holes (rejected drafts) are squeezed out."""
        lengths = self.mask[: self.rows, self.first: self.width].sum(1).tolist() if self.mask is not None else []
        compact = any(length != self.width - start for length, start in zip(lengths, self.starts))
        used = max(lengths, default=0) if compact else self.width - self.first
        width = max(width, used)
        reference = like[0][0] if like is not None else self.keys[0]
        heads, head_dim = reference.shape[1], reference.shape[3]
        shape = (_slack(rows, 8), heads, _slack(width + spare, 64), head_dim)
        layers = len(like) if like is not None else len(self.keys)
        keys = [_new_buffer(reference, shape) for _ in range(layers)]
        values = [_new_buffer(reference, shape) for _ in range(layers)]
        mask = torch.zeros(shape[0], shape[2], dtype=torch.long, device=reference.device)
        if compact:
            for row, length in enumerate(lengths):
                columns = self.mask[row, self.first: self.width].nonzero().squeeze(1) + self.first
                for new, old in zip(keys + values, self.keys + self.values):
                    new[row, :, width - used: width - length] = 0.0
                    new[row, :, width - length: width] = old[row, :, columns]
                mask[row, width - length: width] = 1
            self.starts = [width - length for length in lengths]
        else:
            shift = width - self.width
            for new, old in zip(keys + values, self.keys + self.values):
                new[: self.rows, :, width - used: width] = old[: self.rows, :, self.first: self.width]
            if self.mask is not None:
                mask[: self.rows, width - used: width] = self.mask[: self.rows, self.first: self.width]
            self.starts = [start + shift for start in self.starts]
        self.keys, self.values, self.mask = keys, values, mask
        self.first, self.width = width - used, width

    def _zero(self, rows: slice, begin: int, end: int) -> None:
        """Zero columns [begin, end) of `rows`: masked columns inside the model's view must hold finite values."""
        if end > begin:
            for buffer in self.keys + self.values:
                buffer[rows, :, begin: end] = 0.0

    def _sync_cache(self) -> None:
        """The model's view: one layer per buffer pair, whose `update` writes the column `width`."""
        self.cache.layers = [_BufferLayer(self, layer) for layer in range(len(self.keys))]


def _new_buffer(reference: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Uninitialised: `add` and `_regrow` write or zero every column inside the view before the model reads it (the
    regrowth at 128 rows of SmolLM2-135M took 2.1 s with zero-filled buffers, 1.2 s without)."""
    return reference.new_empty(shape)


class _BufferLayer(DynamicLayer):
    """A `Cache` layer over a `KVBatch` buffer: the columns in use, and the new token's written in place."""

    def __init__(self, batch: KVBatch, layer: int):
        super().__init__()
        self.batch, self.layer, self.is_initialized = batch, layer, True
        self.keys = batch.keys[layer][: batch.rows, :, batch.first: batch.width]
        self.values = batch.values[layer][: batch.rows, :, batch.first: batch.width]
        self.device = self.keys.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, column, count = self.batch, self.batch.width, key_states.shape[2]
        if column + count > batch.column_capacity:
            raise RuntimeError("KVBatch: a decode step writes the columns KVBatch.open_columns made room for.")
        batch.keys[self.layer][: batch.rows, :, column: column + count] = key_states
        batch.values[self.layer][: batch.rows, :, column: column + count] = value_states
        self.keys = batch.keys[self.layer][: batch.rows, :, batch.first: column + count]
        self.values = batch.values[self.layer][: batch.rows, :, batch.first: column + count]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.batch.width - self.batch.first
