"""A training run that says how long it will take, and can be told how long it may take (`ARPOConfig.max_minutes`).

After the first step the run prints the measured step time and the expected total for `max_steps`; with a budget it
also says how many steps fit, and stops after the last step that fits, so that a user on a slower machine gets a
finished run (model saved, curves and tree pictures drawn) instead of a killed one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import TrainerCallback


def fitting_steps(budget_seconds: float, first_step_seconds: float, later_step_seconds: float) -> int:
    """Steps that fit in the budget: the first (which pays the warm-up) plus as many later ones as remain."""
    if first_step_seconds > budget_seconds:
        return 1  # a run always takes its first step: that is how the estimate is measured
    return 1 + int((budget_seconds - first_step_seconds) // max(later_step_seconds, 1e-9))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


class TimeBudget(TrainerCallback):
    """Print the expected duration after the first step; with `max_minutes`, stop before a step that would not fit.

    `agree` makes every rank take the main process's decision (the trainer passes `run_on_main_process`), so a
    multi-process run never has one rank stop while another waits in a collective.
    """

    def __init__(self, max_minutes: float | None, agree: Callable[[Callable[[], bool]], bool] | None = None,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.budget = None if max_minutes is None else 60.0 * max_minutes
        self.agree = agree or (lambda decide: decide())
        self.say = say
        self.clock = clock
        self.start = self.first_step = None
        self.steps = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        elapsed = self.clock() - self.start
        if self.steps == 1:
            self.first_step = elapsed
            if state.is_world_process_zero:
                self.say(self._forecast(state.max_steps - state.global_step + 1))
        if self.budget is not None and state.global_step < state.max_steps and self.agree(
                lambda: elapsed + self._later_step(elapsed) > self.budget):
            control.should_training_stop = True
            if state.is_world_process_zero:
                self.say(f"ARPO: stopping after step {state.global_step} of {state.max_steps}: another step "
                         f"(~{_minutes(self._later_step(elapsed))}) would pass max_minutes={self.budget / 60:g} "
                         f"({_minutes(elapsed)} used).")
        return control

    def _later_step(self, elapsed: float) -> float:
        """Seconds a step after the first takes: their mean once there are some, else the first step's."""
        return (elapsed - self.first_step) / (self.steps - 1) if self.steps > 1 else self.first_step

    def _forecast(self, steps_in_run: int) -> str:
        first = self.first_step
        message = (f"ARPO: step 1 took {_minutes(first)}; {steps_in_run} steps take about "
                   f"{_minutes(first * steps_in_run)}")
        if self.budget is None:
            return message + " (set --max_minutes to bound it)."
        fit = min(steps_in_run, fitting_steps(self.budget, first, first))
        return message + f"; max_minutes={self.budget / 60:g} fits {fit} of them."
