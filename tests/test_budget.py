"""The fill-up rule (paper §3.1 step 4: `BranchingSampler._fill_up` and `capacity` in `arpo_trl.rollout.arpo`) and
speculation's early fill-ups (`arpo_trl.rollout.speculation`) on hand-built rollouts: how many paths forking could
still add, how many it is expected to add, and which fill-ups start, are confirmed or are dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from arpo_trl.rollout import BranchingSampler
from arpo_trl.rollout.paths import Rollout, ToolCallRecord

PROMPT = [5, 6, 7]


class FillUps:
    """The real rule and its speculation, driven one prompt at a time as the sampler drives them (`update` is the
    rule's `_fill_up`); no engine runs, so none is needed but its EOS."""

    def __init__(self, max_tool_calls: int, branch_factor: int, branch_threshold: float, speculative: bool = True,
                 after_first_decision: bool = False):
        self.rule = BranchingSampler(SimpleNamespace(eos_token_ids=[0]), None, max_tool_calls=max_tool_calls,
                                     branch_factor=branch_factor, branch_threshold=branch_threshold, seed=0)
        self.early = self.rule.speculation
        self.early.fill_ups_early = speculative
        self.early.after_first_decision = after_first_decision
        self.shares = self.rule.shares
        self.update, self.capacity = self.rule._fill_up, self.rule.capacity
        self.expected, self.make_room, self.learn = self.early.expected, self.early.forked, self.early.learn
        self._rates, self.likely_needed = self.early._rates, self.early.likely_needed


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
        assert fills.capacity(r, r.groups[0][0]) == 0 and fills.expected(r, r.groups[0][0]) == 0.0
    r = rollout(m=8, n=1)
    assert FillUps(3, 1, 0.5).capacity(r, r.groups[0][0]) == 0  # Z = 1 never forks


@pytest.mark.parametrize("tool_calls,decisions,expected", [
    (0, 0, 0.4375),  # E_2 - 1, E_r = 1/2 + 1/2 · 3/2 · E_{r-1}: c = 1/2 (prior), growth 1 + (Z-1)·p = 3/2
    (1, 0, 0.875),  # a decision pending at a tool result happens surely: 3/2 · E_1 - 1
    (1, 1, 0.25),  # one decision left: E_1 - 1
    (2, 1, 0.5),  # the last decision pending: 3/2 - 1
    (2, 2, 0.0),  # none left
])
def test_expected_paths_from_the_priors(tool_calls, decisions, expected):
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    path = r.groups[0][0]
    path.calls, path.fork_decisions = [ToolCallRecord("python")] * tool_calls, decisions
    assert fills.expected(r, path) == pytest.approx(expected, abs=1e-12)


def test_expected_paths_weigh_this_rollouts_rates_against_the_priors():
    fills, r = FillUps(max_tool_calls=2, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    r.segments, r.segments_calling, r.fork_probabilities = 8, 8, [1.0] * 8  # every segment called, every fork taken
    # c = (8 + 8 · 1/2) / 16 = 3/4 and p likewise: growth 7/4, E_1 = 1/4 + 3/4 · 7/4, E_2 = 1/4 + 3/4 · 7/4 · E_1
    e1 = 0.25 + 0.75 * 1.75
    assert fills.expected(r, r.groups[0][0]) == pytest.approx(0.25 + 0.75 * 1.75 * e1 - 1, abs=1e-12)
    assert FillUps(1, 3, 0.5).expected(r, r.groups[0][0]) == pytest.approx(0.25 + 0.75 * 2.5 - 1)  # Z = 3


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
    # nothing certain (each global could add 7), but forking is expected to add 2 · 0.578125 paths of the 6 missing:
    # ceil(6 - 1.15625) = 5; each line forks at none of its 3 decisions with probability 0.671875 and then leaves
    # its 3 slots: 0, 3 or 6 are needed with probability 0.11, 0.44, 0.45, so the hedge's 0.9 quantile is 6
    assert fills.early.expected_slots(r, 0) == pytest.approx(1.15625) and fills.likely_needed(r, 0) == 6
    fills.update(r, 0, creator)
    assert kinds(r) == [("global", True)] * 2 + [("fill", False)] * 6
    assert r.stats.speculative_fill_ups == 6 and r.stats.fill_ups == 0
    assert [creator_of for _, creator_of in r.started] == [creator] * 6
    fills.update(r, 0, creator)  # nothing changed: nothing more starts
    assert len(r.groups[0]) == 8 and r.stats.speculative_fill_ups == 6


def test_speculative_fill_ups_can_wait_for_the_prompts_first_fork_decision():
    """On an engine that drafts late paths from their siblings' text, speculation starts at the prompt's first fork
    decision or when its first path ends; certain fill-ups never wait."""
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5, after_first_decision=True), \
        rollout(m=8, n=2)
    creator = r.groups[0][0]
    fills.update(r, 0, creator)
    assert kinds(r) == [("global", True)] * 2 and r.stats.speculative_fill_ups == 0
    creator.fork_decisions = 1  # its first tool result, decided without a fork
    fills.update(r, 0, creator)
    assert kinds(r)[2:] and set(kinds(r)[2:]) == {("fill", False)} and r.stats.fill_ups == 0
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5, after_first_decision=True), \
        rollout(m=8, n=2)
    fills.update(r, 0, None)
    first = r.groups[0][0]
    first.finish_reason = "eos"  # a line that ended without a tool call: no decision will come from it
    fills.update(r, 0, first)
    assert ("fill", False) in kinds(r) and r.stats.speculative_fill_ups > 0
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5, after_first_decision=True), \
        rollout(m=8, n=2)
    fills.early.call_rate = 0.0  # learned from a rollout in which no path called a tool: no line is expected to fork
    fills.update(r, 0, None)
    assert kinds(r) == [("global", True)] * 2 + [("fill", False)] * 6  # all missing paths start with the globals
    certain, lone = FillUps(max_tool_calls=0, branch_factor=2, branch_threshold=0.5, after_first_decision=True), \
        rollout(3, 1)
    certain.update(lone, 0, None)
    assert kinds(lone) == [("global", True)] + [("fill", True)] * 2


def test_a_lone_global_speculates_too():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(m=2, n=1)
    fills.update(r, 0, None)  # the one slot is expected to be filled a quarter of the time: ceil(1 - 0.25) = 1
    assert kinds(r) == [("global", True), ("fill", False)] and r.groups[0][1].prompt_ids == PROMPT


def test_certain_fill_ups_confirm_the_oldest_speculative_ones():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(m=4, n=2)
    fills.update(r, 0, None)  # speculation is on by default: ceil(2 - 2 · 0.25) = 2
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
    assert (fills.early.call_rate, fills.early.fork_rate) == (0.5, 0.3)
    r = rollout(m=4, n=2)
    fills.learn(r)  # nothing seen: the priors stay
    assert (fills.early.call_rate, fills.early.fork_rate) == (0.5, 0.3)
    r.segments, r.segments_calling, r.fork_probabilities = 4, 1, [0.2, 0.6]
    fills.learn(r)
    assert fills.early.call_rate == 0.25 and fills.early.fork_rate == pytest.approx(0.4)


@pytest.mark.parametrize("m,n", [(16, 8), (8, 3), (5, 2), (4, 4), (12, 1)])
def test_line_shares_split_the_branch_slots_evenly(m, n):
    """Each global path's line owns (M - N) // N branch slots, the odd ones drawn at random: no line's share depends
    on when it reaches a tool result. A branch takes its slot from its own line; a fill-up belongs to no line."""
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m, n)
    shares = fills.shares.shares(r, 0)
    assert sorted(shares) == [path.id for path in r.groups[0]]
    assert sum(shares.values()) == m - n and max(shares.values()) - min(shares.values()) <= 1
    line = r.groups[0][0]
    before = fills.shares.remaining(r, 0, line.id)
    branch = r.start(0, list(PROMPT), "branch", line)
    assert branch.line == line.id and fills.shares.remaining(r, 0, line.id) == before - 1
    assert r.start(0, list(PROMPT), "fill", line).line is None and fills.shares.remaining(r, 0, None) == 0
