"""One forward per step: the running rows' decode and the joining rows' prefill, ragged.

A step used to run two kinds of forward: the decode of the running rows (a token each, plus drafts) and, when
requests joined, a prefill of their new tokens (a tool result, a prompt), each paying the model's fixed cost (the
weights read once per forward: ~0.1 s of a SmolLM2-135M forward on a 2-core CPU). Here both ride in one forward whose
input is the step's tokens laid end to end, `input_ids` of shape [1, T]: the running rows' rectangle of `width`
tokens each (row-major), then each joining row's new tokens. Every layer's projections, MLP and RoPE run on the T
tokens as one sequence; only attention is per row, through an attention function registered with transformers
(`AttentionInterface`) that the engine selects for this forward alone:

    batch columns        first ............................... width ... width + step - 1
    running row r        [its cached positions, holes masked]  [sampled token, drafts]
    joining row j        [       its cached prefix       ][ its new tokens, ending at the same column ]

A joining row's new tokens end at the step's last column, so nobody gets holes; its cached prefix sits before them
(`KVBatch.add` with `ahead`). The cache layers write each token's key and value at its (row, column) and hand
attention the batch's views; a group of rows with the same number of queries (the running rows; the joining rows of
one length) attends in one SDPA call, a query seeing its row's positions up to its own column. Every row computes what
a forward of that row alone computes, up to floating-point rounding (tested in float64 against separate forwards).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from arpo_trl.generation.kv_batch import KVBatch

ATTENTION = "arpo_ragged_rows"


@dataclass
class _Group:
    """Rows `rows` (a slice of the batch) with `width` queries each, tokens `tokens` (a slice of the step's T), and
    their attention mask [rows, 1, width, view columns]: the row's positions up to each query's column."""

    rows: slice
    tokens: slice
    width: int
    mask: torch.Tensor


@dataclass
class RaggedLayout:
    """Where the step's tokens go: `groups` in token order, and the joining rows' (row, column) of each new token."""

    groups: list[_Group]
    running: int  # rows 0 .. running - 1 decode `step` tokens each, written at columns width .. width + step - 1
    step: int
    join_rows: torch.Tensor  # [joining tokens]
    join_columns: torch.Tensor  # [joining tokens], absolute columns of the buffers


def layout(batch: KVBatch, running: int, step: int, joining: list[int]) -> RaggedLayout:
    """The layout of a step after `batch.open_columns(step)`: rows 0 .. `running` - 1 decode `step` tokens each; rows
    `running` .. hold the joining rows, with `joining[j]` new tokens each, sorted by count (groups are slices)."""
    if joining != sorted(joining) or len(joining) != batch.rows - running:
        raise ValueError("ragged layout: the joining rows follow the running ones, sorted by their new tokens.")
    end = batch.width + step  # the step's last column + 1
    view_mask = batch.mask[: batch.rows, batch.first: end].bool()
    columns = torch.arange(end - batch.first, device=view_mask.device)
    groups, token, row = [], 0, 0

    def group(rows: int, width: int) -> None:
        nonlocal token, row
        queries = columns[end - width - batch.first:]  # the group's query columns: its rows' last `width`
        causal = columns[None, None, None, :] <= queries[None, None, :, None]
        mask = view_mask[row: row + rows, None, None, :] & causal
        groups.append(_Group(slice(row, row + rows), slice(token, token + rows * width), width, mask))
        token, row = token + rows * width, row + rows

    if running:
        group(running, step)
    join_rows, join_columns = [], []
    for count in sorted(set(joining)):
        rows = joining.count(count)
        for offset in range(rows):
            join_rows += [row + offset] * count
            join_columns += range(end - count, end)
        group(rows, count)
    device = view_mask.device
    return RaggedLayout(groups, running, step, torch.tensor(join_rows, dtype=torch.long, device=device),
                        torch.tensor(join_columns, dtype=torch.long, device=device))


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ragged_layout=None,
                     **kwargs):
    """Attention of the step's T queries ([1, heads, T, dim]) to their own rows' keys ([rows, kv heads, columns,
    dim]), a group of rows per SDPA call."""
    if ragged_layout is None:
        raise RuntimeError(f"attention '{ATTENTION}' runs only in a ragged step (ragged_layout missing).")
    heads, dim = query.shape[1], query.shape[3]
    outputs = []
    for group in ragged_layout.groups:
        rows = group.rows.stop - group.rows.start
        queries = query[0][:, group.tokens].view(heads, rows, group.width, dim).transpose(0, 1)
        out, _ = sdpa_attention_forward(module, queries, key[group.rows], value[group.rows], group.mask,
                                        scaling=scaling, dropout=0.0)
        outputs.append(out.reshape(rows * group.width, heads, dim))  # [rows, width, heads, dim] → tokens
    return torch.cat(outputs)[None], None


AttentionInterface.register(ATTENTION, ragged_attention)


class _RaggedLayer(DynamicLayer):
    """A `Cache` layer over a `KVBatch` buffer for one ragged step: writes each token's key and value at its row and
    column, and returns the views of the step's columns."""

    def __init__(self, batch: KVBatch, layer: int, layout: RaggedLayout):
        super().__init__()
        self.batch, self.layer, self.layout, self.is_initialized = batch, layer, layout, True
        self.device = batch.keys[layer].device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, layout, column = self.batch, self.layout, self.batch.width
        decoded = layout.running * layout.step
        end = column + layout.step
        views = []
        for buffer, states in ((batch.keys[self.layer], key_states), (batch.values[self.layer], value_states)):
            heads, dim = states.shape[1], states.shape[3]
            if decoded:
                buffer[: layout.running, :, column: end] = (
                    states[0, :, :decoded].view(heads, layout.running, layout.step, dim).transpose(0, 1))
            if len(layout.join_rows):
                buffer[layout.join_rows, :, layout.join_columns] = states[0, :, decoded:].transpose(0, 1)
            views.append(buffer[: batch.rows, :, batch.first: end])
        self.keys, self.values = views
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.batch.width + self.layout.step - self.batch.first


@contextlib.contextmanager
def _attention(model):
    config = model.config
    previous, config._attn_implementation = config._attn_implementation, ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def ragged_forward(model, batch: KVBatch, layout: RaggedLayout, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   logits_at: torch.Tensor) -> torch.Tensor:
    """Run the step's tokens ([T] ids and positions, in the layout's order) through the model, writing their keys and
    values into `batch`; returns the logits (float32) at the token indices `logits_at`."""
    cache = Cache(layers=[_RaggedLayer(batch, layer, layout) for layer in range(len(batch.keys))])
    with _attention(model):
        out = model(input_ids=input_ids[None], position_ids=position_ids[None], cache=cache, use_cache=True,
                    logits_to_keep=logits_at, ragged_layout=layout)
    return out.logits[0].float()
