"""What a decode step of the in-process engine costs, learned from its own timings: seconds ≈ fixed + per_row × rows.

The sampler asks it whether running a path it may throw away (a branch started beside its parent's probe, a
speculative fill-up) is worth it now. On a small batch a step costs about its fixed part, whatever its rows, so a
speculative row costs nearly nothing and shortens the rollout's critical path. Once the rows' part dominates, every
row lengthens every step as much as any other: the batch is throughput-bound, a discarded token costs what a kept one
does, and speculation only slows the rollout down (docs/in_process_engine.md, "Speculation by regime").
"""

from __future__ import annotations

import math

MIN_STEPS = 32  # steps timed before the fit is trusted
MIN_ROW_SPREAD = 4.0  # the rows' standard deviation over the timed steps: below it, fixed and per-row are not separable


class StepCosts:
    """A least-squares line through (rows, seconds) of the timed steps, with exponential forgetting so that it follows
    a model or machine whose speed changes; it lives as long as the engine, so one rollout's steps inform the next's.

    `cheap(rows)`: whether a batch of `rows` still costs at most `row_share` times its fixed part in rows, i.e.
    rows × per_row ≤ row_share × fixed. Until the fit is trusted, every batch counts as cheap (speculation stays on,
    as on a server)."""

    def __init__(self, row_share: float = 2.0, half_life_steps: float = 1024.0):
        if row_share < 0 or half_life_steps <= 0:
            raise ValueError(f"row_share must be >= 0 and half_life_steps > 0, got {row_share}, {half_life_steps}.")
        self.row_share = row_share
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"StepCosts.record: rows must be >= 1 and seconds finite and >= 0, got {rows}, {seconds}.")
        d = self._decay
        self._n, self._x, self._y = d * self._n + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds
        self._steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None while too few steps, or too alike in rows, were timed."""
        if self._steps < MIN_STEPS:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        variance = self._xx / self._n - mean_x * mean_x
        if variance < MIN_ROW_SPREAD ** 2:
            return None
        per_row = (self._xy / self._n - mean_x * mean_y) / variance
        return mean_y - per_row * mean_x, per_row

    def cheap(self, rows: int) -> bool:
        fitted = self.fit()
        if fitted is None:
            return True
        fixed, per_row = fitted
        return per_row <= 0 or rows * per_row <= self.row_share * max(fixed, 0.0)
