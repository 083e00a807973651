"""Fill-ups hedged (issue 55): with many prompts, one prompt whose lines fork less than expected started a fill-up
hundreds of tokens into the rollout, and the rollout waited for it (the longest chain grew 11 % on the paper-like
benchmark). Speculation's `hedge=q` also starts the fill-ups needed with probability q; what is kept is unchanged."""

from __future__ import annotations

import math

import pytest
from test_budget import FillUps

from arpo_trl.rollout.paths import Rollout

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


@pytest.mark.parametrize("hedge", [0.5, 0.9, 0.99])
def test_hedged_speculation_covers_the_quantile_of_lines_that_never_fork(hedge):
    # M=16, N=8: one branch slot per line; priors c = p = 0.5 and 3 decisions to go, so a line forks at none of
    # them with probability 0.5·(1 + 0.25 + 0.0625) + 0.25³, and the fill-ups needed are Binomial(8, that)
    never = 0.5 * (1 + 0.25 + 0.0625) + 0.25**3
    plain, hedged = FillUps(3, 2, 0.5), FillUps(3, 2, 0.5, hedge=hedge)
    r_plain, r_hedged = rollout(16, 8), rollout(16, 8)
    plain.update(r_plain, 0, None)
    hedged.update(r_hedged, 0, None)
    assert hedged.likely_needed(r_hedged, 0) == binomial_quantile(8, never, hedge)
    assert speculative(r_hedged) == max(speculative(r_plain), binomial_quantile(8, never, hedge))
    assert speculative(r_plain) == math.ceil(8 - 8 * (1 - never))  # the expected count: 6
    assert r_hedged.stats.fill_ups == 0 and all(path.kind == "global" for path in r_hedged.groups[0][:8])


def test_a_fork_still_takes_a_hedged_fill_ups_slot():
    fills, r = FillUps(3, 2, 0.5, hedge=0.99), rollout(16, 8)
    fills.update(r, 0, None)
    started = speculative(r)
    parent = r.groups[0][0]
    child = r.start(0, list(PROMPT), "branch", parent)  # a confirmed fork of line 0
    child.line = parent.line
    fills.make_room(r, 0)
    assert len(r.groups[0]) <= 16 and speculative(r) == min(started, 16 - 9)


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
