"""Batched prefill (arpo_trl.generation.prefill): the requests that join in one step share forwards, grouped to compute
the fewest positions, and each row's KV and logits are what a forward of that row alone computes."""

import asyncio
import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.prefill import FORWARD_COST_TOKENS, PrefillJob, group_by_length, prefill
from arpo_trl.generation.prefix_cache import kv_length, stack_layers


def _cost(groups, lengths, forward_cost):
    return sum(forward_cost + len(group) * max(lengths[i] for i in group) for group in groups)


def _partitions(items):
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for partition in _partitions(rest):
        for index in range(len(partition)):
            yield partition[:index] + [[head] + partition[index]] + partition[index + 1:]
        yield [[head]] + partition


@pytest.mark.parametrize("seed", range(30))
def test_grouping_is_optimal_and_covers_every_request_once(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 13, 14, 15, 40, 47, 106, 300]) for _ in range(rng.randint(1, 7))]
    forward_cost, max_positions = rng.choice([0, 16, 64, 1000]), rng.choice([10_000, 200])
    groups = group_by_length(lengths, forward_cost, max_positions)
    assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= max_positions
    allowed = [p for p in _partitions(list(range(len(lengths))))
               if all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_positions for g in p)]
    assert _cost(groups, lengths, forward_cost) == min(_cost(p, lengths, forward_cost) for p in allowed)


def test_the_fixed_cost_decides_between_padding_and_forwards():
    assert group_by_length([14, 13, 15, 14], forward_cost=64) == [[2, 0, 3, 1]]  # one forward, 4 padded positions
    assert group_by_length([106, 1], forward_cost=64) == [[0], [1]]  # 105 padded positions cost more than a forward
    assert group_by_length([106, 1], forward_cost=200) == [[0, 1]]
    assert group_by_length([], forward_cost=64) == []


@pytest.fixture(scope="module")
def model64(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().double()


def _alone(model, tokens):
    """KV and next-token logits of one row, computed by one forward over all its tokens."""
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return stack_layers([(layer.keys, layer.values) for layer in cache.layers]), out.logits[:, -1].float()


@torch.no_grad()
def test_every_row_gets_what_a_forward_of_it_alone_computes(model64):
    """Cached parts of different lengths (none, short, long) and new parts of different lengths share one forward:
    padding before the cached parts and after the new ones changes nothing but rounding (float64 here)."""
    rng = random.Random(0)
    vocab = model64.config.vocab_size
    shapes = [(0, 9), (5, 1), (17, 4), (3, 12), (0, 1), (30, 7)]  # (cached positions, new tokens)
    jobs, expected = [], []
    for start, new in shapes:
        tokens = [rng.randrange(vocab) for _ in range(start + new)]
        jobs.append(PrefillJob(tokens, _alone(model64, tokens[:start])[0] if start else None, start))
        expected.append(_alone(model64, tokens))
    results, positions = prefill(model64, jobs, FORWARD_COST_TOKENS)
    assert sum(positions) >= sum(new for _, new in shapes)
    for (kv, logits), (want_kv, want_logits), (start, new) in zip(results, expected, shapes):
        assert logits.shape == want_logits.shape and logits.dtype == torch.float32
        torch.testing.assert_close(logits, want_logits, atol=1e-6, rtol=0)
        assert kv.shape == want_kv.shape and (kv.shape[2], kv_length(kv)) == (1, start + new)  # one row, all positions
        torch.testing.assert_close(kv, want_kv, atol=1e-10, rtol=0)
    assert len(positions) == len(group_by_length([new for _, new in shapes], FORWARD_COST_TOKENS))


def test_requests_joining_in_one_step_share_forwards_and_never_prefill_a_shared_prefix(model64, tokenizer):
    """Tool results that come back together join in one forward; requests whose prefix another one of the same step
    extends wait for it and prefill only their own tokens; copies of one prefix take one result."""
    engine = CachedTransformersEngine(model64, tokenizer, sampling=SamplingSettings(temperature=0, entropy_top_k=None))
    system = tokenizer.encode("You solve problems with python. " * 12, add_special_tokens=False)
    questions = [system + tokenizer.encode(f"What is {a}+{a}?", add_special_tokens=False) for a in range(4)]

    async def rollout():
        first = await asyncio.gather(*(engine.agenerate(q, 6, []) for q in questions + questions))
        counters = (engine.counters.prefill_forwards, engine.counters.prefill_tokens)
        results = [tokenizer.encode(f" <result>\n{r}\n</result>", add_special_tokens=False) for r in range(4)]
        contexts = [q + s.token_ids + r for q, s, r in zip(questions, first, results)]
        await asyncio.gather(*(engine.agenerate(c, 4, []) for c in contexts))
        await engine.aclose()
        return first, counters

    first, (forwards, prefilled) = asyncio.run(rollout())
    assert forwards == 2  # the first question, then the three that share its system prompt, in one forward
    assert prefilled <= len(questions[0]) + 3 * max(len(q) - len(system) + 1 for q in questions)
    assert [s.token_ids for s in first[:4]] == [s.token_ids for s in first[4:]]  # the copies: the same greedy tokens
    assert engine.counters.prefill_forwards == 3  # the four continuations: one forward
    assert engine.counters.requests == 12
