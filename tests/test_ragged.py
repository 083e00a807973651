"""One forward per step (arpo_trl.generation.ragged): the running rows' decode (with drafts and holes) and the joining
rows' prefill in one ragged forward compute, row by row, what a forward of each row alone computes."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from arpo_trl.engines import SamplingSettings
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.admission import empty_kv
from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.ragged import layout, ragged_forward


@pytest.fixture(scope="module")
def model64(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().double()


def _kv(model, tokens: list[int]):
    cache = DynamicCache()
    if tokens:
        model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
        return [(layer.keys, layer.values) for layer in cache.layers]
    return empty_kv(model)


@pytest.mark.parametrize("step", [1, 3])
def test_a_ragged_step_equals_each_row_alone(model64, poisoned_buffers, step):
    """Running rows of different lengths (one with a hole from a rejected draft, one slot reused after a leave) feed
    `step` tokens each; joining rows with cached prefixes of 0, 2 and 9 tokens feed 1, 4, 4 and 6 new tokens (fewer
    and more than `step`, so their cached parts end after and before the batch's next column)."""
    torch.manual_seed(0)
    texts = [torch.randint(3, 100, (n,)).tolist() for n in (5, 11, 3, 8)]
    joining = [(torch.randint(3, 100, (c,)).tolist(), torch.randint(3, 100, (n,)).tolist())
               for c, n in ((9, 1), (2, 4), (0, 4), (5, 6))]
    with torch.no_grad():
        batch = KVBatch()
        batch.add([_kv(model64, texts[0]), _kv(model64, texts[1][:-1])])
        batch.remove([0])  # row 0's slot now holds row 1; the freed row's stale values stay masked out
        batch.add([_kv(model64, texts[0]), _kv(model64, texts[2]), _kv(model64, texts[3])])
        running = [texts[1][:-1], texts[0], texts[2], texts[3]]
        # a decode step of 2 columns whose second (a rejected draft) becomes a hole in row 2
        batch.open_columns(2)
        fed = [[texts[1][-1], 7], [8, 9], [10, 11], [12, 13]]
        for row, tokens in enumerate(fed):
            kv = _kv(model64, running[row] + tokens)
            for layer, (k, v) in enumerate(kv):
                batch.keys[layer][row, :, batch.width: batch.width + 2] = k[0, :, -2:]
                batch.values[layer][row, :, batch.width: batch.width + 2] = v[0, :, -2:]
        batch.close_columns(2)
        batch.hole(2, batch.width - 1, batch.width)
        running = [r + f for r, f in zip(running, fed)]
        running[2] = running[2][:-1]
        new = [[20 + row + j for j in range(step)] for row in range(len(running))]
        joining.sort(key=lambda item: len(item[1]))
        batch.add([_kv(model64, cached) for cached, _ in joining], [step - len(n) for _, n in joining], step=step)
        batch.open_columns(step)
        ids = [t for row in new for t in row] + [t for _, n in joining for t in n]
        positions = [len(r) + j for r in running for j in range(step)]
        positions += [len(c) + j for c, n in joining for j in range(len(n))]
        steps = layout(batch, len(running), step, [len(n) for _, n in joining])
        logits = ragged_forward(model64, batch, steps, torch.tensor(ids), torch.tensor(positions),
                                torch.arange(len(ids)))
        batch.close_columns(step)
    rows = [r + n for r, n in zip(running, new)] + [c + n for c, n in joining]
    queried = [len(n) for n in new] + [len(n) for _, n in joining]
    token = 0
    for row, (tokens, count) in enumerate(zip(rows, queried)):
        with torch.no_grad():
            alone = model64(input_ids=torch.tensor([tokens]), use_cache=True)
        torch.testing.assert_close(logits[token: token + count], alone.logits[0, -count:].float(), atol=1e-9, rtol=0)
        token += count
        if row >= len(running) or row != 2:  # row 2's hole is skipped by `row()`
            kept = batch.row(row)
            for (k, v), layer in zip(kept, alone.past_key_values.layers):
                torch.testing.assert_close(k, layer.keys, atol=1e-12, rtol=0)
                torch.testing.assert_close(v, layer.values, atol=1e-12, rtol=0)


def test_a_ragged_layout_refuses_joining_rows_out_of_order(model64):
    batch = KVBatch()
    batch.add([_kv(model64, [5, 6]), _kv(model64, [7])], [-3, -1], step=1)
    batch.open_columns(1)
    with pytest.raises(ValueError, match="sorted by their new tokens"):
        layout(batch, 0, 1, [4, 2])


def test_one_forward_per_step_prefills_in_the_decode_forward(model64, tokenizer):
    """A request that joins while another decodes costs no forward of its own: the step count is that of the longer
    request's decode plus its first prefill, and the joining request's first token comes from the shared forward."""
    greedy = SamplingSettings(temperature=0, entropy_top_k=None)
    counts = {}
    for fused in (True, False):
        engine = CachedTransformersEngine(model64, tokenizer, sampling=greedy, max_draft_tokens=0,
                                          one_forward_per_step=fused)

        async def two(engine):
            first = asyncio.ensure_future(engine.agenerate([5, 6, 7, 8], 12, []))
            await asyncio.sleep(0)
            while engine.counters.decode_steps < 3:
                await asyncio.sleep(0)
            second = await engine.agenerate([9, 10, 11], 4, [])
            return await first, second

        segments = asyncio.run(two(engine))
        asyncio.run(engine.aclose())
        counts[fused] = (engine.counters.prefill_forwards, engine.counters.decode_steps, engine.counters.prefill_tokens,
                         [s.token_ids for s in segments])
    assert counts[True][3] == counts[False][3]  # the same greedy segments
    assert counts[True][2] == counts[False][2] == 7  # both prefill the two prompts' tokens, nothing else
    first, second = counts[True][3]
    assert len(first) > len(second) + 3  # the second request joined and left while the first decoded
    assert counts[False][0] == 2 and counts[False][1] == len(first) - 1  # two prefill forwards, then a decode a step
    assert counts[True][0] == 2 and counts[True][1] == len(first)  # its first prefill; the second rode in a decode
