"""The cached engine's two lanes (arpo_trl.generation.lanes): rows that feed different numbers of tokens share one
forward, and every row gets what a forward of it alone computes; late rows with a likely draft run in the sprint
lane, and greedy decoding is unchanged by it."""

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.lanes import LaneStep, lanes_forward
from arpo_trl.generation.prefix_cache import stack_layers
from arpo_trl.generation.speculation import SPRINT_CHANCE, SPRINT_DRAFT, DraftIndex, sprints
from tests.test_cached_engine import GREEDY, _prompt


@pytest.fixture(scope="module")
def model64(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().double()


def _alone(model, tokens: list[int]):
    """KV and last-position logits of one row, from one forward over all its tokens."""
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return stack_layers([(layer.keys, layer.values) for layer in cache.layers]), out.logits[0].float()


@torch.no_grad()
def test_two_lanes_in_one_forward_give_every_row_what_a_forward_of_it_alone_computes(model64, poisoned_buffers):
    """A main lane of 3 rows and a sprint lane of 2, of different lengths, run two steps: 1 and 3 tokens per row,
    then 2 and 4 after one sprint row's last 2 tokens were rejected (a hole). Each token's logits equal those of a
    forward of its row's kept tokens alone (float64), and the rows read back exactly those tokens' KV."""
    rng = random.Random(0)
    vocab = model64.config.vocab_size
    kept = [[rng.randrange(vocab) for _ in range(length)] for length in (5, 11, 8, 3, 14)]
    main, sprint = KVBatch(), KVBatch()
    main.add([_alone(model64, tokens)[0] for tokens in kept[:3]])
    sprint.add([_alone(model64, tokens)[0] for tokens in kept[3:]])
    lanes = [(main, [0, 1, 2]), (sprint, [3, 4])]
    for widths, rejected in (((1, 3), {3: 2}), ((2, 4), {})):
        steps, ids, positions, fed, first = [], [], [], {}, 0
        for (batch, rows), width in zip(lanes, widths):
            steps.append(LaneStep.open(batch, width, first))
            first += batch.rows * width
            for row in rows:
                fed[row] = [rng.randrange(vocab) for _ in range(width)]
                ids += fed[row]
                positions += range(len(kept[row]), len(kept[row]) + width)
        logits = lanes_forward(model64, steps, torch.tensor(ids), torch.tensor(positions))
        assert logits.shape == (len(ids), vocab)
        token = 0
        for (batch, rows), step in zip(lanes, steps):
            for local, row in enumerate(rows):
                for count in range(1, step.width + 1):
                    want = _alone(model64, kept[row] + fed[row][:count])[1][-1]
                    torch.testing.assert_close(logits[token], want, atol=1e-6, rtol=0)
                    token += 1
                keep = step.width - rejected.get(row, 0)
                if keep < step.width:
                    batch.hole(local, step.start + keep, step.start + step.width)
                kept[row] += fed[row][:keep]
    for batch, rows in lanes:
        for local, row in enumerate(rows):
            torch.testing.assert_close(batch.row(local), _alone(model64, kept[row])[0], atol=1e-10, rtol=0)


def test_a_joining_row_sprints_when_it_holds_a_likely_draft():
    index = DraftIndex()
    text = list(range(100, 100 + 2 * SPRINT_DRAFT))
    index.add(text)
    late = text[:3]  # its siblings wrote on after these tokens
    assert len(index.draft(late, SPRINT_DRAFT)) == SPRINT_DRAFT
    likely, unlikely = torch.full((300,), -20.0), torch.full((300,), -20.0)
    likely[text[3]], unlikely[text[3]] = 0.0, torch.tensor(SPRINT_CHANCE / 2).log()
    assert sprints(index, late, likely) and not sprints(index, late, unlikely)
    assert sprints(index, late, None)  # greedy: the verification judges the draft
    assert not sprints(index, text[-SPRINT_DRAFT + 1:][:3] + [999], likely)  # no draft for it
    assert not sprints(index, text[: 2 * SPRINT_DRAFT - SPRINT_DRAFT + 1], likely)  # less than SPRINT_DRAFT left


@pytest.mark.parametrize("sprint_lane", [True, False])
def test_late_rows_sprint_beside_the_main_lane_and_greedy_tokens_stay_those_of_plain_decoding(
        model64, tokenizer, sprint_lane, monkeypatch):
    """Greedy: a short prompt and two long ones decode side by side; when the short one is done, it decodes again
    while the long ones still run. The repeat finds text ahead of it, joins the sprint lane (unless the lane is off)
    and drafts there while the main lane decodes a token per row, in the same forwards; every row's tokens equal
    plain decoding's."""
    from arpo_trl.generation import lanes

    forwards = []
    monkeypatch.setattr(lanes, "lanes_forward",
                        lambda *args: forwards.append(len(args[1])) or lanes_forward(*args))
    prompts = [_prompt(tokenizer, text) for text in ("What is 12+30?", "Compute 3*4 with python", "hi")]
    budgets = [12, 80, 80]  # the long ones write 38 and more tokens
    plain = CachedTransformersEngine(model64, tokenizer, sampling=GREEDY, max_draft_tokens=0)
    expected = [segment.token_ids for segment in plain.generate(prompts, budgets, [])]
    engine = CachedTransformersEngine(model64, tokenizer, sampling=GREEDY, sprint_lane=sprint_lane)

    async def rollout():
        long = [asyncio.ensure_future(engine.agenerate(p, b, [])) for p, b in zip(prompts[1:], budgets[1:])]
        first = await engine.agenerate(prompts[0], budgets[0], [])
        assert not any(task.done() for task in long)
        again = await engine.agenerate(prompts[0], budgets[0], [])
        return [first, again, *await asyncio.gather(*long)]

    async def run():
        try:
            return await rollout()
        finally:
            await engine.aclose()

    first, again, *long = [segment.token_ids for segment in asyncio.run(run())]
    assert first == again == expected[0] and long == expected[1:]
    assert engine.counters.sprint_rows == int(sprint_lane)
    assert bool(forwards) == sprint_lane and set(forwards) <= {2}  # both lanes in one forward
