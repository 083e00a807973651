"""The fill-up rule (`arpo_trl.budget.FillUps`, paper §3.1 step 4) on hand-built rollouts: how many paths forking
could still add, how many it is expected to add, and which fill-ups start, are confirmed or are dropped."""

from __future__ import annotations

import random

import pytest

from arpo_trl.budget import FILL_UP_ODDS, FillUps
from arpo_trl.paths import Rollout, ToolCallRecord

PROMPT = [5, 6, 7]


def rollout(m: int, n: int, policy: str = "entropy") -> Rollout:
    """One prompt with budget M and its N global paths, as `BranchingSampler.sample` starts it."""
    r = Rollout([[]], m, policy)
    for _ in range(n):
        r.start(0, list(PROMPT), "global", None)
    r.started.clear()
    return r


def kinds(r: Rollout) -> list[tuple[str, bool]]:
    return [(path.kind, path.committed) for path in r.groups[0]]


def test_capacity_is_what_forking_could_still_add_below_a_path():
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    path = r.groups[0][0]
    assert fills.capacity(r, path) == 7  # 2^3 - 1: a binary tree over the three tool results it may reach
    path.fork_decisions = 1
    assert fills.capacity(r, path) == 3
    assert FillUps(3, 3, 0.5).capacity(r, path) == 8  # Z = 3: 3^2 - 1
    path.fork_decisions = 3
    assert fills.capacity(r, path) == 0
    assert fills.capacity(rollout(m=4, n=1), rollout(m=4, n=1).groups[0][0]) == 4  # never more than M


def test_paths_that_cannot_fork_reserve_nothing():
    fills = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5)
    finished, fill_up = rollout(m=8, n=1), rollout(m=8, n=1)
    finished.groups[0][0].finish_reason = "eos"
    fill_up.groups[0][0].kind = "fill"
    trajectory_level = rollout(m=8, n=1, policy="none")
    for r in (finished, fill_up, trajectory_level):
        assert fills.capacity(r, r.groups[0][0]) == 0 and fills.added_paths(r, r.groups[0][0], 8) == [1.0]
    r = rollout(m=8, n=1)
    assert FillUps(3, 1, 0.5).capacity(r, r.groups[0][0]) == 0  # Z = 1 never forks


def test_added_paths_from_the_priors():
    """c = p = 1/2 (the priors), Z = 2, two decisions left: G_1 = 1/2 + 1/2·(1/2 + 1/2·s) = (3/4, 1/4);
    D_2 = 1/2·G_1 + 1/2·s·G_1² = (3/8, 13/32, 3/16, 1/32); G_2 = 1/2 + 1/2·D_2."""
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    path = r.groups[0][0]
    assert fills.added_paths(r, path, 8) == pytest.approx([11 / 16, 13 / 64, 3 / 32, 1 / 64], abs=1e-12)
    assert fills.added_paths(r, path, 1) == pytest.approx([11 / 16, 5 / 16], abs=1e-12)  # 1 or more lumped
    path.calls = [ToolCallRecord("python")]  # a decision pending at a tool result happens surely: D_2
    assert fills.added_paths(r, path, 8) == pytest.approx([3 / 8, 13 / 32, 3 / 16, 1 / 32], abs=1e-12)


@pytest.mark.parametrize("tool_calls,decisions,expected", [
    (0, 0, 0.4375),  # E_2 - 1, E_r = 1/2 + 1/2 · 3/2 · E_{r-1}: c = 1/2 (prior), growth 1 + (Z-1)·p = 3/2
    (1, 0, 0.875),  # a decision pending at a tool result happens surely: 3/2 · E_1 - 1
    (1, 1, 0.25),  # one decision left: E_1 - 1
    (2, 1, 0.5),  # the last decision pending: 3/2 - 1
    (2, 2, 0.0),  # none left
])
def test_added_paths_have_the_branching_process_mean(tool_calls, decisions, expected):
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    path = r.groups[0][0]
    path.calls, path.fork_decisions = [ToolCallRecord("python")] * tool_calls, decisions
    distribution = fills.added_paths(r, path, 64)
    assert sum(distribution) == pytest.approx(1.0, abs=1e-12)
    assert sum(j * q for j, q in enumerate(distribution)) == pytest.approx(expected, abs=1e-12)


def test_added_paths_weigh_this_rollouts_rates_against_the_priors():
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    r.segments, r.segments_calling, r.fork_probabilities = 8, 8, [1.0] * 8  # every segment called, every fork taken
    # c = (8 + 8 · 1/2) / 16 = 3/4 and p likewise: growth 7/4, E_1 = 1/4 + 3/4 · 7/4, E_2 = 1/4 + 3/4 · 7/4 · E_1
    e1 = 0.25 + 0.75 * 1.75

    def mean(distribution):
        return sum(j * q for j, q in enumerate(distribution))
    assert mean(fills.added_paths(r, r.groups[0][0], 64)) == pytest.approx(0.25 + 0.75 * 1.75 * e1 - 1, abs=1e-12)
    assert mean(FillUps(1, 3, 0.5).added_paths(r, r.groups[0][0], 64)) == pytest.approx(0.25 + 0.75 * 2.5 - 1)


def test_fill_ups_start_once_forking_cannot_fill_the_prompt():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5, speculative=False), rollout(4, 2)
    first, second = r.groups[0]
    fills.update(r, 0, None)  # each global may still fork once: 2 + 1 + 1 = 4, nothing is certain yet
    assert kinds(r) == [("global", True)] * 2 and r.stats.fill_ups == 0
    first.finish_reason = "eos"  # ended without a tool call: only the second's decision may still add a path
    fills.update(r, 0, first)
    assert kinds(r) == [("global", True)] * 2 + [("fill", True)]
    fill_up = r.groups[0][2]
    assert fill_up.prompt_ids == PROMPT and r.started == [(fill_up, first)]  # its chain continues the first's step
    assert r.stats.fill_ups == 1 and r.stats.speculative_fill_ups == 0


def test_a_lone_global_that_cannot_fork_gets_all_its_fill_ups_at_once():
    fills, r = FillUps(max_tool_calls=0, branch_factor=2, branch_threshold=0.5, speculative=False), rollout(3, 1)
    fills.update(r, 0, None)
    assert kinds(r) == [("global", True)] + [("fill", True)] * 2 and r.stats.fill_ups == 2
    assert all(path.prompt_ids == PROMPT for path in r.groups[0])


def test_speculative_fill_ups_cover_what_forking_is_not_expected_to_fill():
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m=8, n=2)
    creator = r.groups[0][0]
    fills.update(r, 0, creator)
    # nothing certain (each global could add 7), but both add none with probability (43/64)² = 0.45 ≥ FILL_UP_ODDS:
    # each of the 6 missing slots is likely enough to need its fill-up
    assert kinds(r) == [("global", True)] * 2 + [("fill", False)] * 6
    assert r.stats.speculative_fill_ups == 6 and r.stats.fill_ups == 0
    assert [creator_of for _, creator_of in r.started] == [creator] * 6
    fills.update(r, 0, creator)  # nothing changed: nothing more starts
    assert len(r.groups[0]) == 8 and r.stats.speculative_fill_ups == 6


def test_a_lone_global_speculates_too():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(m=2, n=1)
    fills.update(r, 0, None)  # forking fills the one slot a quarter of the time: 3/4 ≥ FILL_UP_ODDS
    assert kinds(r) == [("global", True), ("fill", False)] and r.groups[0][1].prompt_ids == PROMPT


def test_certain_fill_ups_confirm_the_oldest_speculative_ones():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(m=4, n=2)
    fills.update(r, 0, None)  # speculation is on by default: P(forks add ≤ 1) = 15/16, P(none) = 9/16
    assert kinds(r) == [("global", True)] * 2 + [("fill", False)] * 2 and r.stats.speculative_fill_ups == 2
    first = r.groups[0][0]
    first.finish_reason = "eos"
    fills.update(r, 0, first)  # one slot is now certain to need a fill-up: the oldest speculative one takes it
    assert kinds(r) == [("global", True)] * 2 + [("fill", True), ("fill", False)]
    assert r.stats.fill_ups == 1 and r.stats.speculative_fill_ups == 2


def test_a_fork_takes_the_slot_of_the_youngest_speculative_fill_up():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(m=4, n=2)
    fills.update(r, 0, None)
    first, second, older, younger = r.groups[0]
    branch = r.start(0, list(PROMPT), "branch", first)  # a confirmed fork: 3 committed + 2 speculative > M
    fills.make_room(r, 0)
    assert r.groups[0] == [first, second, older, branch] and r.cancelled == [younger]
    fills.make_room(r, 0)  # within the budget: nothing more to drop
    assert r.cancelled == [younger]


def test_each_rollouts_rates_become_the_next_ones_priors():
    fills = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.3)
    assert (fills.call_rate, fills.fork_rate) == (0.5, 0.3)
    r = rollout(m=4, n=2)
    fills.learn(r)  # nothing seen: the priors stay
    assert (fills.call_rate, fills.fork_rate) == (0.5, 0.3)
    r.segments, r.segments_calling, r.fork_probabilities = 4, 1, [0.2, 0.6]
    fills.learn(r)
    assert fills.call_rate == 0.25 and fills.fork_rate == pytest.approx(0.4)


@pytest.mark.parametrize("m,n", [(16, 8), (8, 3), (5, 2), (4, 4), (12, 1)])
def test_line_shares_split_the_branch_slots_evenly(m, n):
    """Each global path's line owns (M - N) // N branch slots, the odd ones drawn at random: no line's share depends
    on when it reaches a tool result. A branch takes its slot from its own line; a fill-up belongs to no line."""
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5, rng=random.Random(0)), rollout(m, n)
    shares = fills.shares.shares(r, 0)
    assert sorted(shares) == [path.id for path in r.groups[0]]
    assert sum(shares.values()) == m - n and max(shares.values()) - min(shares.values()) <= 1
    line = r.groups[0][0]
    before = fills.shares.remaining(r, 0, line.id)
    branch = r.start(0, list(PROMPT), "branch", line)
    assert branch.line == line.id and fills.shares.remaining(r, 0, line.id) == before - 1
    assert r.start(0, list(PROMPT), "fill", line).line is None and fills.shares.remaining(r, 0, None) == 0


def test_speculation_starts_only_the_fill_ups_likely_to_be_needed():
    """Once every segment calls and every decision forks (c = p = 3/4 with the priors), two globals with three
    decisions each leave the 6 missing slots unfilled rarely: only the fill-ups at least FILL_UP_ODDS likely start."""
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m=8, n=2)
    r.segments, r.segments_calling, r.fork_probabilities = 8, 8, [1.0] * 8
    total = [1.0]
    for path in r.groups[0]:
        single = fills.added_paths(r, path, 6)
        total = [sum(total[i] * single[j - i] for i in range(len(total)) if 0 <= j - i < len(single))
                 for j in range(min(7, len(total) + len(single) - 1))]
        total[-1] += 1 - sum(total)
    likely = sum(sum(total[: 6 - f + 1]) >= FILL_UP_ODDS for f in range(1, 7))
    assert 0 < likely < 6 and fills.speculative_count(r, 0, 6) == likely
    fills.update(r, 0, None)
    assert kinds(r) == [("global", True)] * 2 + [("fill", False)] * likely


def test_a_share_its_line_cannot_use_goes_to_a_line_that_can():
    """M = 4, N = 2: a slot per line. The first global ends without forking; its slot goes to the second line, which
    may still fork twice, so no fill-up is certain. Once the second line has no decision left either, the two slots
    it cannot use are certain fill-ups."""
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5, speculative=False), rollout(4, 2)
    first, second = r.groups[0]
    fills.update(r, 0, None)
    first.finish_reason = "eos"
    fills.update(r, 0, first)
    assert fills.shares.shares(r, 0) == {first.id: 0, second.id: 2} and r.stats.fill_ups == 0
    second.fork_decisions = 2
    fills.update(r, 0, second)
    assert kinds(r) == [("global", True)] * 2 + [("fill", True)] * 2 and r.stats.fill_ups == 2


def test_a_pooled_slot_goes_to_a_line_drawn_at_random():
    """Of three lines (M = 6), the first ends without forking: its slot goes to either other line, as a fair coin
    decides, whichever reaches a tool result first."""
    receivers = []
    for seed in range(200):
        fills = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5, speculative=False,
                        rng=random.Random(seed))
        r = rollout(6, 3)
        first = r.groups[0][0]
        first.finish_reason = "eos"
        fills.update(r, 0, first)
        shares = fills.shares.shares(r, 0)
        assert shares[first.id] == 0 and sum(shares.values()) == 3
        receivers.append(max(shares, key=shares.get))
    assert 70 <= receivers.count(r.groups[0][1].id) <= 130  # binomial(200, 1/2): beyond 4.2 standard deviations
