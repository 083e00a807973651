"""The in-process engines' KV budget (arpo_trl.generation.kv_budget): requests wait for room instead of being admitted
all at once; the KV held stays under the budget; a request too large alone fails naming the setting."""

import asyncio
import math

import pytest
import torch
from test_cached_engine import GREEDY, _as_tuples, _prompt
from transformers import DynamicCache

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.kv_budget import (
    DEFAULT_MEMORY_FRACTION,
    KVBudget,
    KVBudgetSetting,
    kv_bytes_per_token,
    wave_batches,
)
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool

UNBOUNDED = KVBudgetSetting(unbounded=True)


def _most_rows(engine):
    """Records the most rows that ran in one step (`engine.most_rows`)."""
    engine.most_rows, step = 0, engine._step

    def counted(model):
        step(model)
        engine.most_rows = max(engine.most_rows, len(engine.running))

    engine._step = counted
    return engine


def test_bytes_per_token_are_the_kv_a_forward_writes(tool_model64):
    cache = DynamicCache()
    tool_model64(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    written = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                  for layer in cache.layers)
    assert kv_bytes_per_token(tool_model64) == written // 3


def test_the_setting_reads_trls_knobs_with_transformers_meanings(tool_model64, monkeypatch):
    per_token = kv_bytes_per_token(tool_model64)
    setting = KVBudgetSetting.from_config({"num_blocks": 4, "page_size": 16, "max_requests_per_batch": 3})
    budget = setting.resolve(tool_model64)
    assert (budget.bytes, budget.max_rows) == (64 * per_token, 3) and "num_blocks" in budget.source
    assert KVBudgetSetting.from_config('{"num_blocks": 2}').tokens == 2 * 256  # transformers' default page_size
    free = 10 * 2 ** 30
    monkeypatch.setattr("arpo_trl.generation.kv_budget.free_memory", lambda device: (free, "available RAM"))
    assert KVBudgetSetting.from_config(None).resolve(tool_model64).bytes == int(free * DEFAULT_MEMORY_FRACTION)
    measured = KVBudgetSetting.from_config({"max_memory_percent": 0.25}).resolve(tool_model64)
    assert measured.bytes == free // 4 and "0.25 of the available RAM" in measured.source
    assert math.isinf(UNBOUNDED.resolve(tool_model64).bytes)
    with pytest.raises(ValueError, match="max_memory_percent"):
        KVBudgetSetting(memory_fraction=1.5)


def test_the_default_budget_is_a_share_of_the_available_ram(tool_model64):
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable"))
    budget = KVBudgetSetting().resolve(tool_model64)
    assert budget.bytes == pytest.approx(available * DEFAULT_MEMORY_FRACTION, rel=0.2)
    assert "available RAM" in budget.source and "max_memory_percent" in budget.source


@pytest.mark.parametrize("scheduler", ["waves", "events"])
def test_a_rollout_under_a_small_budget_waits_for_room_and_stays_under_it(tool_model64, tokenizer, scheduler,
                                                                          poisoned_buffers):
    """Unbounded, a rollout admits every request at once; under a budget of about three rows the requests wait, the
    KV held (rows' buffers as allocated and prefix cache) never exceeds it, and the greedy trees are the same."""
    def grow(engine):
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=6,
                                   max_completion_length=80, branch_policy="random", seed=3, scheduler=scheduler)
        prompts = [_prompt(tokenizer, f"What is {a}+{b}?") for a, b in ((12, 30), (7, 5), (40, 2))]
        return sampler.sample(prompts)

    free = _most_rows(CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY, kv_budget=UNBOUNDED))
    expected = grow(free)
    tokens = 2 * 3 * (len(_prompt(tokenizer, "What is 12+30?")) + 80 + 41)  # a batch of ~3 rows at its worst
    bounded = _most_rows(CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY,
                                                  kv_budget=KVBudgetSetting(tokens=tokens)))
    result = grow(bounded)
    budget_bytes = tokens * kv_bytes_per_token(tool_model64)
    assert free.most_rows >= 9 and free.counters.kv_peak_bytes > 2 * budget_bytes  # the 9 globals at once
    assert bounded.counters.kv_waits > 0 and bounded.most_rows <= 6  # continuations need less room
    assert bounded.counters.kv_peak_copy_bytes <= budget_bytes  # with a regrowing batch's old buffer
    assert 0 < bounded.counters.kv_peak_bytes <= budget_bytes
    assert any(t.kind == "branch" for t in expected.trajectories)
    if scheduler == "waves":
        assert _as_tuples(result) == _as_tuples(expected)
    else:  # requests reach the sampler's RNG in another order, so forks may fall elsewhere; the globals may not
        for got, want in zip(result.groups, expected.groups):
            assert len(got) == len(want) == 6
            assert {tuple(t.completion_ids) for t in got if t.kind == "global"} == \
                   {tuple(t.completion_ids) for t in want if t.kind == "global"}


def test_the_row_limit_holds_and_the_segments_are_the_same(tool_model64, tokenizer):
    prefixes = [_prompt(tokenizer, f"What is {a}+{a}?") for a in range(10)]
    budgets, stop = [5 + a for a in range(10)], ["</python>"]
    want = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY, kv_budget=UNBOUNDED).generate(
        prefixes, budgets, stop)
    engine = _most_rows(CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY,
                                                 kv_budget=KVBudgetSetting.from_config({"max_requests_per_batch": 2})))
    got = engine.generate(prefixes, budgets, stop)
    assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in want]
    assert engine.most_rows == 2 and engine.counters.kv_waits > 0


def test_a_request_too_large_alone_fails_naming_the_setting_and_the_others_complete(tool_model64, tokenizer):
    engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY,
                                      kv_budget=KVBudgetSetting(tokens=200))  # one small row at a time

    async def rollout():
        results = await asyncio.gather(engine.agenerate([5, 6, 7], 8, []), engine.agenerate([5, 6, 7, 8], 90, []),
                                       engine.agenerate([9, 10], 8, []), return_exceptions=True)
        await engine.aclose()
        return results

    small, large, other = asyncio.run(rollout())
    assert isinstance(large, ValueError) and "transformers_continuous_batching_config" in str(large)
    assert "num_blocks" in str(large) and "max_memory_percent" in str(large)
    # They complete: the random model may end either one early (greedy EOS depends on the CPU's rounding).
    assert all(s.finish_reason in ("eos", "length") and 0 < len(s.token_ids) <= 8 for s in (small, other))
    assert all(s.finish_reason == "eos" or len(s.token_ids) == 8 for s in (small, other))


def test_the_waves_engine_splits_a_wave_under_the_budget(tool_model64, tokenizer):
    prefixes = [_prompt(tokenizer, f"What is {a}+{a}?") for a in range(8)]
    budgets, stop = [12] * 8, ["</python>"]
    want = TransformersEngine(tool_model64, tokenizer, sampling=GREEDY, kv_budget=UNBOUNDED).generate(
        prefixes, budgets, stop)
    tokens = 3 * (max(map(len, prefixes)) + 12)
    engine = TransformersEngine(tool_model64, tokenizer, sampling=GREEDY, kv_budget=KVBudgetSetting(tokens=tokens))
    calls, generate_batch = [], engine._generate_batch
    engine._generate_batch = lambda model, rows, *args: calls.append(len(rows)) or generate_batch(model, rows, *args)
    got = engine.generate(prefixes, budgets, stop)
    assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in want]
    assert calls == [3, 3, 2]
    assert 0 < engine.counters.kv_peak_bytes <= tokens * kv_bytes_per_token(tool_model64)
    with pytest.raises(ValueError, match="transformers_continuous_batching_config"):
        engine.generate([prefixes[0]], [tokens], stop)


def test_wave_batches_are_consecutive_and_fit():
    budget = KVBudget(bytes=100, bytes_per_token=1, source="test")
    assert wave_batches(budget, [10, 10, 10, 40], [10, 10, 10, 10]) == [slice(0, 3), slice(3, 4)]  # 4 × 50 > 100
    assert wave_batches(budget, [10] * 5, [10] * 5, max_rows=2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert wave_batches(budget, [], []) == []
    with pytest.raises(ValueError, match="needs"):
        wave_batches(budget, [90], [20])
