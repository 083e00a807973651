"""`KVBatch`: the cached engine's running rows, written in place. Every row must read back exactly the positions it
was given plus those its decode steps wrote, whatever joined, left or made the buffers grow in between; the model
must compute through it exactly what it computes through a concatenating `DynamicCache`."""

import random

import pytest
import torch
from transformers import DynamicCache

from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefix_cache import KV, layer_pairs, stack_layers

LAYERS, HEADS, DIM = 2, 3, 4


def row_kv(length: int) -> KV:
    return torch.randn(2, LAYERS, 1, HEADS, length, DIM)


def decode(batch: KVBatch, expected: list[KV], count: int = 1) -> None:
    """One step through the model's interface: every layer writes `count` new columns for all rows."""
    mask = batch.open_columns(count)
    assert mask.shape == (batch.rows, batch.width - batch.first + count)
    new = torch.randn(2, LAYERS, batch.rows, HEADS, count, DIM)
    for layer in range(LAYERS):
        keys, values = batch.cache.layers[layer].update(new[0, layer], new[1, layer])
        assert keys.shape[2] == values.shape[2] == mask.shape[1]
    for row in range(batch.rows):
        expected[row] = torch.cat([expected[row], new[:, :, row: row + 1, :, :]], -2)
    batch.close_columns(count)


def test_rows_read_back_exactly_through_joins_leaves_and_regrowth(poisoned_buffers):
    torch.manual_seed(0)
    rng = random.Random(0)
    batch, expected = KVBatch(), []
    for step in range(150):  # past the first column capacity: the buffers regrow
        if step % 7 == 0 or not batch.rows:  # rows join, some longer than every running one
            joining = [row_kv(rng.randint(1, 40 + step)) for _ in range(rng.randint(1, 4))]
            batch.add(joining)
            expected += joining
        if step % 5 == 4 and batch.rows > 1:
            leaving = rng.sample(range(batch.rows), rng.randint(1, batch.rows - 1))
            order = batch.remove(leaving)
            assert sorted(order) == sorted(set(range(len(expected))) - set(leaving))
            expected = [expected[row] for row in order]
        decode(batch, expected)
        for layer in batch.cache.layers:  # what the model reads: padding included, all finite
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        for row in range(batch.rows):
            mask, length = batch.mask[row, batch.first: batch.width], expected[row].shape[-2]
            assert mask.sum() == length and mask[: batch.starts[row] - batch.first].sum() == 0
            assert torch.equal(batch.row(row), expected[row])
    longest = max(expected[row].shape[-2] for row in range(batch.rows))
    assert batch.column_capacity < 2 * longest + 200  # padding dropped when the buffers regrow, not grown without bound


def test_a_decode_step_through_it_equals_one_through_a_dynamic_cache(tiny_model_dir, poisoned_buffers):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [torch.randint(0, 100, (1, length)) for length in (3, 9, 6)]
    with torch.no_grad():
        rows = []
        for ids in prompts:
            cache = DynamicCache()
            model(input_ids=ids, cache=cache, use_cache=True)
            rows.append(stack_layers([(layer.keys, layer.values) for layer in cache.layers]))
        batch = KVBatch()
        batch.add(rows[:2])
        batch.remove([0])  # the slot is reused: stale finite values there must stay masked out
        batch.add([rows[0], rows[2]])
        order = [1, 0, 2]
        tokens = torch.tensor([[5], [7], [9]])
        positions = torch.tensor([[len(prompts[i][0])] for i in order])
        mask = batch.open_columns()
        ours = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=batch.cache,
                     use_cache=True).logits
        batch.close_columns()
        width = max(len(p[0]) for p in prompts)
        padded = [[(torch.cat([k.new_zeros(1, k.shape[1], width - k.shape[2], k.shape[3]), k], 2),
                    torch.cat([v.new_zeros(1, v.shape[1], width - v.shape[2], v.shape[3]), v], 2))
                   for k, v in layer_pairs(rows[i])] for i in order]
        reference = DynamicCache(ddp_cache_data=[(torch.cat([p[layer][0] for p in padded]),
                                                  torch.cat([p[layer][1] for p in padded]))
                                                 for layer in range(len(padded[0]))])
        dense_mask = torch.tensor([[0] * (width - len(prompts[i][0])) + [1] * (len(prompts[i][0]) + 1)
                                   for i in order])
        theirs = model(input_ids=tokens, attention_mask=dense_mask, position_ids=positions, cache=reference,
                       use_cache=True).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_layers_of_different_shapes_are_refused_with_the_way_out():
    same = (torch.zeros(1, HEADS, 5, DIM), torch.zeros(1, HEADS, 5, DIM))
    other = (torch.zeros(1, HEADS + 1, 5, DIM), torch.zeros(1, HEADS + 1, 5, DIM))
    assert stack_layers([same, same]).shape == (2, 2, 1, HEADS, 5, DIM)
    with pytest.raises(ValueError, match="layers differ in shape.*in_process_engine=.waves."):
        stack_layers([same, other])
