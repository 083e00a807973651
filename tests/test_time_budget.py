"""`ARPOConfig.max_minutes`: the forecast printed after step 1 and the stop before a step that would not fit, with a
scripted clock (exact), and the config's check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from arpo_trl.config import ARPOConfig
from arpo_trl.training.time_budget import TimeBudget, fitting_steps


def test_fitting_steps_counts_the_first_step_and_the_later_ones():
    assert fitting_steps(600, 60, 30) == 1 + 18
    assert fitting_steps(600, 60, 60) == 10
    assert fitting_steps(59, 60, 30) == 1  # the first step is always taken: it is the measurement
    assert fitting_steps(89.9, 60, 30) == 1 and fitting_steps(90, 60, 30) == 2


def _run(step_seconds: list[float], max_steps: int, max_minutes: float | None):
    """Drive the callback as the Trainer does; each step takes `step_seconds[i]` on the scripted clock."""
    now, said = [0.0], []
    budget = TimeBudget(max_minutes, say=said.append, clock=lambda: now[0])
    state = SimpleNamespace(global_step=0, max_steps=max_steps, is_world_process_zero=True)
    budget.on_train_begin(None, state, TrainerControl())
    for seconds in step_seconds:
        now[0] += seconds
        state.global_step += 1
        control = budget.on_step_end(None, state, TrainerControl())
        if control.should_training_stop:
            break
    return state.global_step, said


def test_forecast_after_the_first_step_without_a_budget():
    steps, said = _run([120, 60, 60, 60], max_steps=4, max_minutes=None)
    assert steps == 4
    assert said == ["ARPO: step 1 took 2.0 min; 4 steps take about 8.0 min (set --max_minutes to bound it)."]


def test_budget_stops_before_the_step_that_would_pass_it():
    # 10 min: step 1 = 3 min, later steps 2 min each -> after step 4 (9 min used) another step would pass 10 min.
    steps, said = _run([180, 120, 120, 120, 120, 120], max_steps=6, max_minutes=10)
    assert steps == 4
    assert said[0] == "ARPO: step 1 took 3.0 min; 6 steps take about 18.0 min; max_minutes=10 fits 3 of them."
    assert said[1] == ("ARPO: stopping after step 4 of 6: another step (~2.0 min) would pass max_minutes=10 "
                       "(9.0 min used).")


def test_budget_that_fits_every_step_changes_nothing():
    steps, said = _run([30, 30, 30], max_steps=3, max_minutes=5)
    assert steps == 3 and len(said) == 1 and "fits 3 of them" in said[0]


def test_every_rank_takes_the_agreed_decision():
    """A rank whose own clock would go on still stops when the main process (`agree`) says so."""
    now = [0.0]
    budget = TimeBudget(1, say=lambda _: None, clock=lambda: now[0], agree=lambda decide: True)
    state = SimpleNamespace(global_step=0, max_steps=5, is_world_process_zero=False)
    budget.on_train_begin(None, state, TrainerControl())
    now[0], state.global_step = 1.0, 1
    assert budget.on_step_end(None, state, TrainerControl()).should_training_stop


@pytest.mark.parametrize("value", [0, -1.5])
def test_max_minutes_must_be_positive(value, tmp_path):
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        ARPOConfig(str(tmp_path), max_minutes=value, num_generations=4, per_device_train_batch_size=4,
                   use_cpu=True, bf16=False)
