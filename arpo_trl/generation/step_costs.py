"""What a decode step of the in-process engine costs, learned from its own timings: seconds ≈ fixed + per_row × rows.

The sampler asks it whether running a path it may throw away (a branch started beside its parent's probe, a
speculative fill-up) is worth it now. On a small batch a step costs about its fixed part, whatever its rows, so a
speculative row costs nearly nothing and shortens the rollout's critical path. Once the rows' part dominates, every
row lengthens every step as much as any other: the batch is throughput-bound, a discarded token costs what a kept one
does, and speculation only slows the rollout down (docs/in_process_engine.md, "Speculation by regime").
"""

from __future__ import annotations

import math

MIN_BUCKET_STEPS = 8  # steps timed at a batch size class before its mean is trusted
MIN_ROW_SPREAD = 4.0  # rows between the smallest and the largest class: below it, fixed and per-row are not separable


class StepCosts:
    """The chord through the step costs seen at the smallest and at the largest batches: timed steps are averaged per
    class of batch sizes (1, 2-3, 4-7, 8-15, ... rows; exponentially forgotten, so that the line follows a model or
    machine whose speed changes), and the line runs through the mean (rows, seconds) of the smallest and the largest
    class with enough steps. A least-squares line would follow the many large-batch steps, whose cost also grows with
    their context, and overstate the fixed part; the chord is the average cost of a row over the sizes seen. It
    lives as long as the engine, so one rollout's steps inform the next's.

    `cheap(rows)`: whether a batch of `rows` still costs at most `row_share` times its fixed part in rows, i.e.
    rows × per_row ≤ row_share × fixed. Until the line is known, every batch counts as cheap (speculation stays on,
    as on a server)."""

    def __init__(self, row_share: float = 2.0, half_life_steps: float = 1024.0):
        if row_share < 0 or half_life_steps <= 0:
            raise ValueError(f"row_share must be >= 0 and half_life_steps > 0, got {row_share}, {half_life_steps}.")
        self.row_share = row_share
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._classes: dict[int, list[float]] = {}  # rows.bit_length() -> [weight, Σ rows, Σ seconds, steps]

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"StepCosts.record: rows must be >= 1 and seconds finite and >= 0, got {rows}, {seconds}.")
        for sums in self._classes.values():
            sums[0] *= self._decay
            sums[1] *= self._decay
            sums[2] *= self._decay
        sums = self._classes.setdefault(rows.bit_length(), [0.0, 0.0, 0.0, 0])
        sums[0], sums[1], sums[2], sums[3] = sums[0] + 1, sums[1] + rows, sums[2] + seconds, sums[3] + 1

    @property
    def timed_steps(self) -> int:
        return int(sum(sums[3] for sums in self._classes.values()))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None while no two batch size classes far enough apart have enough
        timed steps."""
        known = [sums for _, sums in sorted(self._classes.items()) if sums[3] >= MIN_BUCKET_STEPS]
        if len(known) < 2:
            return None
        (w0, x0, y0, _), (w1, x1, y1, _) = known[0], known[-1]
        (x0, y0), (x1, y1) = (x0 / w0, y0 / w0), (x1 / w1, y1 / w1)
        if x1 - x0 < MIN_ROW_SPREAD:
            return None
        per_row = (y1 - y0) / (x1 - x0)
        return y0 - per_row * x0, per_row
    def cheap(self, rows: int) -> bool:
        fitted = self.fit()
        if fitted is None:
            return True
        fixed, per_row = fitted
        return per_row <= 0 or rows * per_row <= self.row_share * max(fixed, 0.0)
