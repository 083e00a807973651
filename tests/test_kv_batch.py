"""`KVBatch`: the cached engine's running rows, written in place. Every row must read back exactly the positions it
was given plus those its decode steps wrote, whatever joined, left or made the buffers grow in between; the model
must compute through it exactly what it computes through a concatenating `DynamicCache`."""

import random

import torch
from transformers import DynamicCache

from arpo_trl.generation.kv_batch import KVBatch

LAYERS, HEADS, DIM = 2, 3, 4


def row_kv(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(1, HEADS, length, DIM), torch.randn(1, HEADS, length, DIM)) for _ in range(LAYERS)]


def decode(batch: KVBatch, expected: list[list[tuple[torch.Tensor, torch.Tensor]]], count: int = 1,
           kept: list[int] | None = None) -> None:
    """One step through the model's interface: every layer writes `count` new columns for all rows (a sampled token
    and its drafts); row i keeps the first `kept[i]` of them, the rest become holes (rejected drafts)."""
    mask = batch.open_columns(count)
    start = batch.width  # after open_columns, which may regrow the buffers
    assert mask.shape == (batch.rows, batch.width - batch.first + count)
    kept = kept or [count] * batch.rows
    for layer in range(LAYERS):
        k, v = torch.randn(batch.rows, HEADS, count, DIM), torch.randn(batch.rows, HEADS, count, DIM)
        keys, values = batch.cache.layers[layer].update(k, v)
        assert keys.shape[2] == mask.shape[1]
        for row in range(batch.rows):
            old_k, old_v = expected[row][layer]
            expected[row][layer] = (torch.cat([old_k, k[row: row + 1, :, : kept[row]]], 2),
                                    torch.cat([old_v, v[row: row + 1, :, : kept[row]]], 2))
    batch.close_columns(count)
    for row, keep in enumerate(kept):
        batch.hole(row, start + keep, start + count)


def test_rows_read_back_exactly_through_joins_leaves_and_regrowth(poisoned_buffers):
    torch.manual_seed(0)
    rng = random.Random(0)
    batch, expected = KVBatch(), []
    for step in range(150):  # past the first column capacity: the buffers regrow and compact
        if step % 7 == 0 or not batch.rows:  # rows join, some longer than every running one
            joining = [row_kv(rng.randint(1, 40 + step)) for _ in range(rng.randint(1, 4))]
            batch.add(joining)
            expected += [list(kv) for kv in joining]
        if step % 5 == 4 and batch.rows > 1:
            leaving = rng.sample(range(batch.rows), rng.randint(1, batch.rows - 1))
            order = batch.remove(leaving)
            assert sorted(order) == sorted(set(range(len(expected))) - set(leaving))
            expected = [expected[row] for row in order]
        count = rng.choice([1, 1, 3, 6])  # some steps feed drafts, and rows keep some of them
        decode(batch, expected, count, [rng.randint(1, count) for _ in range(batch.rows)])
        for layer in batch.cache.layers:  # what the model reads: padding and holes included, all finite
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        for row in range(batch.rows):
            kv, mask = batch.row(row), batch.mask[row, batch.first: batch.width]
            length = expected[row][0][0].shape[2]
            assert mask.sum() == length and mask[: batch.starts[row] - batch.first].sum() == 0
            for (k, v), (want_k, want_v) in zip(kv, expected[row]):
                assert torch.equal(k, want_k) and torch.equal(v, want_v)
    longest = max(expected[row][0][0].shape[2] for row in range(batch.rows))
    assert batch.column_capacity < 2 * longest + 200  # holes squeezed out, not grown without bound


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
            rows.append([(layer.keys, layer.values) for layer in cache.layers])
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
                   for k, v in rows[i]] for i in order]
        reference = DynamicCache(ddp_cache_data=[(torch.cat([p[layer][0] for p in padded]),
                                                  torch.cat([p[layer][1] for p in padded]))
                                                 for layer in range(len(padded[0]))])
        dense_mask = torch.tensor([[0] * (width - len(prompts[i][0])) + [1] * (len(prompts[i][0]) + 1)
                                   for i in order])
        theirs = model(input_ids=tokens, attention_mask=dense_mask, position_ids=positions, cache=reference,
                       use_cache=True).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
