"""The cached engine's cost model (arpo_trl.generation.calibration): fitted exactly from given step times, the
decisions it steers (prefill grouping, draft length, a second admission round), measured once per process and kind of
model, and pinned where given. No test here times anything: times are injected."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.generation import CachedTransformersEngine, calibration
from arpo_trl.generation import admission as admission_module
from arpo_trl.generation.calibration import DRAFTS, ROWS, SHAPES, fit_costs
from arpo_trl.generation.cost_model import DecodeCost, ForwardCosts
from arpo_trl.generation.cpu.costs import CPU_COSTS, CPU_DECODE_COST, FORWARD_COST_TOKENS
from arpo_trl.generation.prefill import MAX_FORWARD_POSITIONS, group_by_length
from arpo_trl.generation.speculation import Acceptance
from tests.test_cached_engine import GREEDY, _prompt

# The development CPU's steps (docs/cpu_measurements.md, ms): 1 row fed 1 / 2 tokens, 16 rows fed 1 / 2 / 5.
CPU_STEPS = {(1, 0): 101.0, (ROWS, 0): 181.0, (1, 1): 157.0, (ROWS, 1): 340.0, (ROWS, DRAFTS): 413.0}
# A GPU-like device: 20 ms a forward whatever its shape up to far more positions, 0.01 ms a position.
GPU_STEPS = {(rows, drafts): 20.0 + 0.01 * rows * (1 + drafts) for rows, drafts in SHAPES}


def test_the_fit_goes_through_the_steps_it_was_given():
    costs = fit_costs(CPU_STEPS, prefill_seconds=101.0 + 127 * 1.5, source="table")
    decode = costs.decode
    assert decode.per_row == pytest.approx(80 / 15) and decode.fixed == pytest.approx(101 - 80 / 15)
    assert decode.per_draft_position == pytest.approx(73 / 48)
    assert decode.draft_per_row == pytest.approx(103 / 15 - 73 / 48)
    assert decode.draft_fixed == pytest.approx(56 - 103 / 15)
    for (rows, drafts), ms in CPU_STEPS.items():  # four parameters, five steps: each step is reproduced
        assert decode.step(rows, drafts) == pytest.approx(ms), (rows, drafts)
    assert decode.wide_positions == ROWS * (1 + DRAFTS)  # beyond the widest step timed, a position costs a row's
    assert decode.step(64, 2) - decode.step(64, 1) == pytest.approx(64 * decode.per_row)
    assert costs.forward_cost_tokens == pytest.approx((101 - 80 / 15) / 1.5) and costs.source == "table"


def test_noise_that_would_make_a_part_negative_makes_it_zero():
    noisy = {(1, 0): 10.0, (ROWS, 0): 9.0, (1, 1): 9.5, (ROWS, 1): 8.5, (ROWS, DRAFTS): 8.0}
    costs = fit_costs(noisy, prefill_seconds=9.0)
    decode = costs.decode
    assert (decode.per_row, decode.per_draft_position, decode.draft_per_row, decode.draft_fixed) == (0, 0, 0, 0)
    assert decode.fixed == 10.0 and decode.wide_position == 0
    assert costs.forward_cost_tokens == MAX_FORWARD_POSITIONS  # a prefilled position that costs nothing
    assert fit_costs(CPU_STEPS, prefill_seconds=1e9).forward_cost_tokens == 1.0  # at least one position


def test_a_gpu_like_device_drafts_at_many_rows_and_prefills_in_one_forward():
    gpu = fit_costs(GPU_STEPS, prefill_seconds=20.0 + 0.01 * 128)
    assert gpu.forward_cost_tokens == pytest.approx(2000)
    on_gpu, on_cpu = Acceptance(8, gpu.decode), Acceptance(8, CPU_DECODE_COST)
    assert on_gpu.draft_length([8] * 64, [0.5] * 64) > 0 == on_cpu.draft_length([8] * 64, [0.5] * 64)
    assert on_gpu.draft_length([8] * 16, [0.8] * 16) == 8 > on_cpu.draft_length([8] * 16, [0.8] * 16)
    assert on_gpu.draft_length([8] * 4, [0.0] * 4) == 0  # drafts never accepted still do not pay
    lengths = [106, 1, 14, 14, 300]
    assert group_by_length(lengths, gpu.forward_cost_tokens) == [[4, 0, 2, 3, 1]]
    assert len(group_by_length(lengths, FORWARD_COST_TOKENS)) == 3


def test_the_cpu_costs_are_the_constants_the_engine_used_before():
    assert CPU_COSTS.forward_cost_tokens == FORWARD_COST_TOKENS == 64
    old = {(1, 0): 19, (1, 8): 18 + 6 + 1 * (1 + 1.5 + 3.2), (64, 2): 18 + 6 + 64 * (1 + 1.5 + 0.8) + (192 - 160)}
    for (rows, drafts), cost in old.items():
        assert CPU_COSTS.decode.step(rows, drafts) == pytest.approx(cost)


@pytest.fixture
def fake_measurement(monkeypatch):
    """`measure_costs` replaced by one that counts its calls and returns a fixed cost model."""
    calls = []
    fixed = ForwardCosts(DecodeCost(fixed=1.0, per_row=0.5), forward_cost_tokens=7.0, source="fake")
    monkeypatch.setattr(calibration, "_MEASURED", {})
    monkeypatch.setattr(calibration, "measure_costs", lambda model: calls.append(model) or fixed)
    return calls, fixed


def test_engines_of_one_process_share_one_measurement_per_kind_of_model(tiny_model_dir, tokenizer, fake_measurement):
    calls, fixed = fake_measurement
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = _prompt(tokenizer, "What is 3+4?")
    first, second = (CachedTransformersEngine(model, tokenizer, sampling=GREEDY, cost_model="measure")
                     for _ in range(2))
    assert first.costs is None
    first.generate([prompt], [3], []), second.generate([prompt], [3], [])
    assert len(calls) == 1 and first.costs is second.costs is fixed and first.speculator.acceptance.cost is fixed.decode
    assert "calibrate" in first.counters.seconds and "calibrate" in second.counters.seconds
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    CachedTransformersEngine(other, tokenizer, sampling=GREEDY, cost_model="measure").generate([prompt], [3], [])
    assert len(calls) == 2  # another dtype is another kind of model


def test_by_default_a_cpu_keeps_the_constants_and_an_accelerator_is_measured(tiny_model_dir, tokenizer,
                                                                             fake_measurement):
    calls, fixed = fake_measurement
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY)
    engine.generate([_prompt(tokenizer, "What is 3+4?")], [3], [])
    assert engine.costs is CPU_COSTS and engine.speculator.acceptance.cost is CPU_DECODE_COST and not calls

    class OnAnAccelerator(torch.nn.Module):  # only its parameters' device is read before the (fake) measurement
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))

    assert calibration.device_costs(OnAnAccelerator()) is fixed and len(calls) == 1


def test_a_given_cost_model_is_used_as_is(tiny_model_dir, tokenizer, fake_measurement, monkeypatch):
    calls, _ = fake_measurement
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    seen = []
    prefill = admission_module.prefill
    monkeypatch.setattr(admission_module, "prefill", lambda m, jobs, cost: seen.append(cost) or prefill(m, jobs, cost))
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY, cost_model=CPU_COSTS)
    assert engine.speculator.acceptance.cost is CPU_DECODE_COST
    engine.generate([_prompt(tokenizer, "What is 3+4?"), _prompt(tokenizer, "What is 12+30?")], [3, 3], [])
    assert not calls and engine.costs is CPU_COSTS and seen and set(seen) == {FORWARD_COST_TOKENS}
    assert "calibrate" not in engine.counters.seconds


def test_a_measurement_times_every_shape_and_fits_them(tiny_model_dir, monkeypatch):
    """On the tiny model, with the clock replaced: each shape's time is its position in the round (1, 2, ...)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ticks = iter(range(10_000))
    monkeypatch.setattr(calibration, "_timed", lambda forward, device: forward() is None or float(next(ticks) % 6))
    costs = calibration.measure_costs(model, repeats=2, max_seconds=1e9)
    steps = dict(zip(SHAPES, [0.0, 1.0, 2.0, 3.0, 4.0]))  # the last round's; every round's are the same
    expected = fit_costs(steps, prefill_seconds=5.0)
    assert costs.decode == expected.decode and costs.forward_cost_tokens == expected.forward_cost_tokens
    assert costs.source.startswith("measured on cpu in ")
