"""StepCosts (arpo_trl.generation.step_costs): the decode step's cost line, learned from timings, and the regime
it tells the sampler (speculate while the batch is cheap)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.engines import SamplingSettings
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.step_costs import MIN_BUCKET_STEPS, StepCosts
from arpo_trl.rollout import BranchingSampler
from arpo_trl.tools import Tool


def _timed(costs: StepCosts, fixed: float, per_row: float, rows: range) -> None:
    for n in rows:
        costs.record(n, fixed + per_row * n)


def test_the_chord_spans_the_smallest_and_largest_batches_not_the_most_frequent():
    """Steps at a few rows, then many at 100-160 rows whose cost also grows with context (a convex bend): a
    least-squares line would follow the many large steps and put the fixed cost near 0.2 s; the chord keeps it
    near the small batches' 0.1 s."""
    costs = StepCosts()
    _timed(costs, 0.1, 0.005, [1, 2, 3] * 10)
    for rows in list(range(100, 160)) * 5:
        costs.record(rows, 0.1 + 0.005 * rows + 0.002 * (rows - 100))
    fixed, per_row = costs.fit()
    assert fixed == pytest.approx(0.1, abs=0.06) and 0.005 < per_row < 0.008


def test_the_fit_recovers_fixed_and_per_row_costs_and_the_knee():
    costs = StepCosts(row_share=2.0)
    _timed(costs, 0.036, 0.0035, range(1, 130))
    fixed, per_row = costs.fit()
    assert fixed == pytest.approx(0.036, rel=1e-6) and per_row == pytest.approx(0.0035, rel=1e-6)
    assert costs.cheap(20) and not costs.cheap(21)  # 20 × 3.5 ms ≤ 2 × 36 ms < 21 × 3.5 ms
    assert StepCosts(row_share=0.0).cheap(1)  # untrained: cheap


def test_no_fit_before_enough_steps_or_without_a_spread_of_rows():
    few = StepCosts()
    _timed(few, 0.0, 1.0, [2] * MIN_BUCKET_STEPS + [40] * (MIN_BUCKET_STEPS - 1))
    assert few.fit() is None and few.cheap(10_000)
    _timed(few, 0.0, 1.0, [40])
    assert few.fit() == pytest.approx((0.0, 1.0))
    alike = StepCosts()
    _timed(alike, 0.0, 1.0, [16, 17, 18] * 100)  # fixed and per-row cost cannot be told apart
    assert alike.fit() is None and alike.cheap(10_000)


def test_rows_that_cost_nothing_are_always_cheap_and_a_batch_with_no_fixed_cost_never():
    free = StepCosts()
    _timed(free, 0.05, 0.0, range(1, 100))
    assert free.cheap(10_000)
    busy = StepCosts()
    _timed(busy, 0.0, 0.01, range(1, 100))
    assert not busy.cheap(1)


def test_the_fit_follows_a_machine_that_speeds_up():
    costs = StepCosts(half_life_steps=64)
    _timed(costs, 0.04, 0.004, list(range(1, 100)) * 3)
    _timed(costs, 0.04, 0.001, list(range(1, 100)) * 6)
    assert costs.fit()[1] == pytest.approx(0.001, rel=0.05)


@pytest.mark.parametrize("rows, seconds", [(0, 0.1), (3, -1.0), (3, float("nan")), (3, float("inf"))])
def test_a_bad_timing_is_refused(rows, seconds):
    with pytest.raises(ValueError, match="rows must be >= 1"):
        StepCosts().record(rows, seconds)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="row_share"):
        StepCosts(row_share=-1)


def _prompt(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def test_a_busy_engine_forks_after_the_probe_and_discards_nothing(tool_model_dir, tokenizer):
    """The cached engine learns its step costs as it runs; told that rows are dear (as a full batch on this CPU),
    the event-driven sampler starts a fork's copies only once the probe keeps them, and no fill-up early: trees of
    exactly M, forks at tool results, not one token generated in vain."""
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    engine = CachedTransformersEngine(model, tokenizer, sampling=SamplingSettings(entropy_top_k=None))
    sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=6,
                               initial_rollouts=2, max_completion_length=80, branch_threshold=0.9, seed=0,
                               scheduler="events")
    prompts = [_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")]
    torch.manual_seed(0)
    sampler.sample(prompts)
    assert engine.step_costs.timed_steps > 0  # the engine timed its own steps
    engine.step_costs = StepCosts()
    _timed(engine.step_costs, 0.0, 0.01, range(1, 100))  # rows' cost only: every batch is throughput-bound
    assert not engine.speculation_pays(1)
    forks = 0
    for seed in range(3):
        torch.manual_seed(seed)
        result = sampler.sample(prompts)
        assert [len(g) for g in result.groups] == [6, 6]
        assert result.stats.discarded_tokens == result.stats.speculative_fill_ups == 0
        by_id = {t.id: t for t in result.trajectories}
        for t in result.trajectories:
            if t.kind == "branch":
                forks += 1
                assert t.completion_ids[: t.fork_position] == by_id[t.parent].completion_ids[: t.fork_position]
                assert tokenizer.decode(t.completion_ids[: t.fork_position]).endswith("</result>")
    assert forks > 0
