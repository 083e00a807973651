"""The running rows' KV cache, preallocated and written in place.

A decode step appends one key and one value per row and layer. transformers' `DynamicCache` does it by
concatenation, which copies the whole batch's cache every step, a large share of a step at many rows
(docs/cpu_measurements.md). Here the rows live in buffers with spare columns and rows; a step writes one column, a
row joins by writing its own positions, a row leaves by moving the last row into its slot. Only when the spare room
runs out is the batch copied, into buffers with room again (amortised over many steps).

Rows are left-padded: every row's next position is the same column (`width`), and a row's positions are the
columns just before it. Columns a row does not use are masked out, so they get exactly zero attention weight, and hold
finite values (of earlier rows, or zeros written when they enter the model's view: new buffers are not zero-filled);
the model sees a `Cache` whose layers return views of the buffers.

All layers' keys and values live in one buffer, so a row joining, leaving or copied out for the prefix cache is one
tensor operation instead of two per layer: moving and copying rows out took less time, joining and regrowing, bound by
memory, the same (docs/cpu_measurements.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from arpo_trl.generation.prefix_cache import KV, kv_length

LEFT_SLACK = 32  # padding columns added in front when a longer row joins, so that the next longer ones fit too


def _slack(needed: int, minimum: int) -> int:
    return needed + max(minimum, needed // 4)


class KVBatch:
    """The keys and values of `rows` running rows, all layers in one buffer: [2 (keys, values), layers, row capacity,
    heads, column capacity, head_dim], so that a row joining, leaving or copied out is one tensor operation. The
    columns in use are `first` .. `width` - 1, and `mask[row, column]` is 1 where the row has a position.

    Under a KV budget (`kv_budget.py`), `room(needed)` is asked before a new buffer is allocated, with the bytes it
    needs at least, and answers the bytes it may take: the spare room shrinks to fit; `allocated(old_bytes)` is told
    after (the old buffer is freed once the rows are copied)."""

    def __init__(self, room: Callable[[int], float] | None = None, allocated: Callable[[int], None] | None = None):
        self.room = room
        self.allocated = allocated
        self.rows = 0
        self.first = 0
        self.width = 0
        self.starts: list[int] = []  # per row, its first column
        self.buffer: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.cache = Cache(layers=[])

    @property
    def row_capacity(self) -> int:
        return self.buffer.shape[2] if self.buffer is not None else 0

    @property
    def column_capacity(self) -> int:
        return self.buffer.shape[4] if self.buffer is not None else 0

    @property
    def bytes(self) -> int:
        """The buffer's bytes, spare room included."""
        return self.buffer.numel() * self.buffer.element_size() if self.buffer is not None else 0

    def add(self, rows: list[KV]) -> None:
        """Append rows (each one row's `KV`, [2, layers, 1, heads, positions, head_dim]) at the end of the batch."""
        longest = max(map(kv_length, rows))
        if self.buffer is None or self.rows + len(rows) > self.row_capacity or longest > self.width:
            self._regrow(self.rows + len(rows), longest + LEFT_SLACK if longest > self.width else longest, rows[0])
        for kv in rows:
            length, row = kv_length(kv), self.rows
            start = self.width - length
            if start < self.first:  # the view widens to the left: the running rows' new columns are padding
                self._zero(slice(0, row), start, self.first)
            self._zero(slice(row, row + 1), self.first, start)
            self.buffer[:, :, row, :, start: self.width] = kv[:, :, 0]
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
                self.buffer[:, :, row, :, self.first: self.width] = self.buffer[:, :, last, :, self.first: self.width]
                self.mask[row] = self.mask[last]
                self.starts[row], order[row] = self.starts[last], order[last]
            self.starts.pop(), order.pop()
            self.rows -= 1
        self.first = min(self.starts, default=self.width)
        self._sync_cache()
        return order

    def row(self, row: int) -> KV:
        """A copy of one row's positions, for the prefix cache."""
        return self.buffer[:, :, row: row + 1, :, self.starts[row]: self.width].clone()

    def open_columns(self, count: int = 1) -> torch.Tensor:
        """Before a decode step of `count` tokens per row: make room for them, unmask
        them for every row and return the step's attention mask (a view: the columns in use and the new ones)."""
        if self.width + count > self.column_capacity:
            self._regrow(self.rows, 0, spare=count)
            self._sync_cache()
        self.mask[: self.rows, self.width: self.width + count] = 1
        return self.mask[: self.rows, self.first: self.width + count]

    def close_columns(self, count: int = 1) -> None:
        """After a decode step: the columns the layers wrote are in use (their `update` already moved their views)."""
        self.width += count

    def _regrow(self, rows: int, width: int, like: KV | None = None, spare: int = 1) -> None:
        """New buffers holding the rows' positions right-aligned at `max(width, longest row)`, with spare room."""
        used = self.width - self.first
        width = max(width, used)
        reference = like if like is not None else self.buffer
        row_capacity, column_capacity = self._capacity(reference, rows, width + spare)
        shape = (*reference.shape[:2], row_capacity, reference.shape[3], column_capacity, reference.shape[5])
        old_bytes = self.bytes
        buffer = _new_buffer(reference, shape)
        mask = torch.zeros(shape[2], shape[4], dtype=torch.long, device=reference.device)
        shift = width - self.width
        if self.buffer is not None:
            old = self.buffer[:, :, : self.rows, :, self.first: self.width]
            buffer[:, :, : self.rows, :, width - used: width] = old
            mask[: self.rows, width - used: width] = self.mask[: self.rows, self.first: self.width]
        self.starts = [start + shift for start in self.starts]
        self.buffer = buffer
        self.mask = mask
        self.first = width - used
        self.width = width
        if self.allocated is not None:
            self.allocated(old_bytes)

    def _capacity(self, reference: torch.Tensor, rows: int, columns: int) -> tuple[int, int]:
        """Rows and columns to allocate for `rows` × `columns` in use: a quarter more of each (at least 8 rows and 64
        columns), less where `room` allows less (columns' spare room kept first: every decode step takes one)."""
        row_capacity, column_capacity = _slack(rows, 8), _slack(columns, 64)
        cell = reference[:, :, :1, :, :1].numel() * reference.element_size()  # one row's position, all layers
        if self.room is None or row_capacity * column_capacity * cell <= (room := self.room(rows * columns * cell)):
            return row_capacity, column_capacity
        cells = max(int(room // cell), rows * columns)
        column_capacity = max(columns, min(column_capacity, cells // row_capacity))
        row_capacity = max(rows, min(row_capacity, cells // column_capacity))
        return row_capacity, max(columns, min(column_capacity, cells // row_capacity))

    def _zero(self, rows: slice, begin: int, end: int) -> None:
        """Zero columns [begin, end) of `rows`: masked columns inside the model's view must hold finite values."""
        if end > begin:
            self.buffer[:, :, rows, :, begin: end] = 0.0

    def _sync_cache(self) -> None:
        """The model's view: a cache layer per model layer, whose `update` writes the column `width`."""
        self.cache.layers = [_BufferLayer(self, layer) for layer in range(self.buffer.shape[1])]


def _new_buffer(reference: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Uninitialised: `add` and `_regrow` write or zero every column inside the view before the model reads it
    (zero-filling the whole buffer made a regrowth markedly slower: docs/cpu_measurements.md)."""
    return reference.new_empty(shape)


class _BufferLayer(DynamicLayer):
    """A `Cache` layer over a `KVBatch` buffer: the columns in use, and the new token's written in place."""

    def __init__(self, batch: KVBatch, layer: int):
        super().__init__()
        self.batch = batch
        self.layer = layer
        self.is_initialized = True
        self.keys = batch.buffer[0, layer, : batch.rows, :, batch.first: batch.width]
        self.values = batch.buffer[1, layer, : batch.rows, :, batch.first: batch.width]
        self.device = self.keys.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, column, count = self.batch, self.batch.width, key_states.shape[2]
        if column + count > batch.column_capacity:
            raise RuntimeError("KVBatch: a decode step writes the columns KVBatch.open_columns made room for.")
        batch.buffer[0, self.layer, : batch.rows, :, column: column + count] = key_states
        batch.buffer[1, self.layer, : batch.rows, :, column: column + count] = value_states
        self.keys = batch.buffer[0, self.layer, : batch.rows, :, batch.first: column + count]
        self.values = batch.buffer[1, self.layer, : batch.rows, :, batch.first: column + count]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.batch.width - self.batch.first
