"""Fill-ups hedged (issue 55): with many prompts, one prompt whose lines fork less than expected started a fill-up
hundreds of tokens into the rollout, and the rollout waited for it (the longest chain grew 11 % on the paper-like
benchmark). Speculation also starts the fill-ups needed with probability `HEDGE`; what is kept is unchanged."""

from __future__ import annotations

import math

import pytest
from test_budget import FillUps

from arpo_trl.rollout.paths import Rollout
from arpo_trl.rollout.speculation import HEDGE

PROMPT = [5, 6, 7]


def rollout(m: int, n: int) -> Rollout:
    r = Rollout([[]], m, "entropy")
    for _ in range(n):
        r.start(0, list(PROMPT), "global", None)
    r.started.clear()
    return r


def speculative(r: Rollout) -> int:
    return sum(path.kind == "fill" and not path.committed for path in r.groups[0])


def binomial_quantile(n: int, p: float, q: float) -> int:
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if total >= q:
            return k
    return n


def test_hedged_speculation_covers_the_quantile_of_lines_that_never_fork():
    # M=16, N=8: one branch slot per line; priors c = p = 0.5 and 3 decisions to go, so a line forks at none of
    # them with probability 0.5·(1 + 0.25 + 0.0625) + 0.25³, and the fill-ups needed are Binomial(8, that)
    never = 0.5 * (1 + 0.25 + 0.0625) + 0.25**3
    fills, r = FillUps(3, 2, 0.5), rollout(16, 8)
    fills.update(r, 0, None)
    expected = math.ceil(8 - 8 * (1 - never))  # the expected count: 6
    assert fills.likely_needed(r, 0) == binomial_quantile(8, never, HEDGE) == 7
    assert speculative(r) == max(expected, binomial_quantile(8, never, HEDGE))
    assert r.stats.fill_ups == 0 and all(path.kind == "global" for path in r.groups[0][:8])


def test_a_fork_still_takes_a_hedged_fill_ups_slot():
    fills, r = FillUps(3, 2, 0.5), rollout(16, 8)
    fills.update(r, 0, None)
    assert speculative(r) == 7
    for parent in r.groups[0][:2]:  # confirmed forks of lines 0 and 1: 10 certain paths leave room for 6
        child = r.start(0, list(PROMPT), "branch", parent)
        child.line = parent.line
    fills.make_room(r, 0)
    assert len(r.groups[0]) == 16 and speculative(r) == 6


def test_the_rates_follow_the_rollout_and_the_priors():
    fills, r = FillUps(3, 2, 0.5), rollout(16, 8)
    assert fills._rates(r) == (0.5, 0.5)
    r.fork_probabilities.append(1.0)
    r.segments, r.segments_calling = 2, 2
    assert fills._rates(r) == pytest.approx(((2 + 8 * 0.5) / 10, (1.0 + 8 * 0.5) / 9))
    fills.early.call_rate = 0.0
    assert fills._rates(r)[0] == pytest.approx(2 / 10)
    other = rollout(16, 8)  # a new rollout: its own counts
    assert fills._rates(other) == (0.0, 0.5)
