"""The fill-up rule (paper §3.1 step 4: `BranchingRule._fill_up` and `capacity` in `arpo_trl.rollout.arpo`) on
hand-built rollouts: how many paths forking could still add, and which fill-ups start."""

from __future__ import annotations

import pytest

from arpo_trl.rollout import BranchingRule
from arpo_trl.rollout.paths import Rollout

PROMPT = [5, 6, 7]


class FillUps:
    """The real rule, driven one prompt at a time as its runtime drives it (`update` is the rule's `_fill_up`); no
    engine runs: the rule needs none."""

    def __init__(self, max_tool_calls: int, branch_factor: int, branch_threshold: float):
        self.rule = BranchingRule(None, vocab_size=1000, eos_token_id=0, max_tool_calls=max_tool_calls,
                                  branch_factor=branch_factor, branch_threshold=branch_threshold, seed=0)
        self.shares = self.rule.shares
        self.update, self.capacity = self.rule._fill_up, self.rule.capacity


def rollout(m: int, n: int, policy: str = "entropy") -> Rollout:
    """One prompt with budget M and its N global paths, as `BranchingRule.begin` starts it."""
    r = Rollout([[]], m, policy)
    for _ in range(n):
        r.start(0, list(PROMPT), "global", None)
    r.started.clear()
    return r


def kinds(r: Rollout) -> list[str]:
    return [path.kind for path in r.groups[0]]


def test_capacity_is_what_forking_could_still_add_below_a_path():
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m=16, n=1)
    path = r.groups[0][0]
    assert fills.capacity(r, path) == 7  # 2^3 - 1: a binary tree over the three tool results it may reach
    path.growth.fork_decisions = 1
    assert fills.capacity(r, path) == 3
    assert FillUps(3, 3, 0.5).capacity(r, path) == 8  # Z = 3: 3^2 - 1
    path.growth.fork_decisions = 3
    assert fills.capacity(r, path) == 0
    assert fills.capacity(rollout(m=4, n=1), rollout(m=4, n=1).groups[0][0]) == 4  # never more than M


def test_paths_that_cannot_fork_reserve_nothing():
    fills = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5)
    finished, fill_up = rollout(m=8, n=1), rollout(m=8, n=1)
    finished.groups[0][0].finish_reason = "eos"
    fill_up.groups[0][0].kind = "fill"
    trajectory_level = rollout(m=8, n=1, policy="none")
    for r in (finished, fill_up, trajectory_level):
        assert fills.capacity(r, r.groups[0][0]) == 0
    r = rollout(m=8, n=1)
    assert FillUps(3, 1, 0.5).capacity(r, r.groups[0][0]) == 0  # Z = 1 never forks


def test_fill_ups_start_once_forking_cannot_fill_the_prompt():
    fills, r = FillUps(max_tool_calls=1, branch_factor=2, branch_threshold=0.5), rollout(4, 2)
    first, second = r.groups[0]
    fills.update(r, 0, None)  # each global may still fork once: 2 + 1 + 1 = 4, nothing is certain yet
    assert kinds(r) == ["global"] * 2 and r.stats.fill_ups == 0
    first.finish_reason = "eos"  # ended without a tool call: only the second's decision may still add a path
    fills.update(r, 0, first)
    assert kinds(r) == ["global"] * 2 + ["fill"]
    fill_up = r.groups[0][2]
    assert fill_up.prompt_ids == PROMPT and r.started == [(fill_up, first)]  # its chain continues the first's step
    assert r.stats.fill_ups == 1
    fills.update(r, 0, first)  # nothing changed: nothing more starts
    assert len(r.groups[0]) == 3 and r.stats.fill_ups == 1


def test_a_lone_global_that_cannot_fork_gets_all_its_fill_ups_at_once():
    fills, r = FillUps(max_tool_calls=0, branch_factor=2, branch_threshold=0.5), rollout(3, 1)
    fills.update(r, 0, None)
    assert kinds(r) == ["global"] + ["fill"] * 2 and r.stats.fill_ups == 2
    assert all(path.prompt_ids == PROMPT for path in r.groups[0])


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
    assert branch.growth.line == line.id and fills.shares.remaining(r, 0, line.id) == before - 1
    assert r.start(0, list(PROMPT), "fill", line).growth.line is None and fills.shares.remaining(r, 0, None) == 0


def test_the_odd_slots_go_to_lines_drawn_by_the_rollouts_seed_and_the_prompt():
    """`ForkShares.split`: the (M − N) mod N odd slots go to the lines `random.Random(derive_seed(rollout seed,
    'shares', g)).sample` picks, the same for a seed and prompt whatever happened before."""
    import random

    from arpo_trl.rollout.paths import derive_seed

    fills = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5)
    picked = set()
    for seed in range(6):
        r = Rollout([[], []], 8, "entropy", seed=seed)
        for g in (0, 1):
            for _ in range(3):
                r.start(g, list(PROMPT), "global", None)
        for g in (0, 1):
            lines = [path.id for path in r.groups[g]]
            lucky = set(random.Random(derive_seed(seed, "shares", g)).sample(lines, 2))
            assert fills.shares.shares(r, g) == {line: 1 + (line in lucky) for line in lines}
            picked.add(frozenset(line - lines[0] for line in lucky))
    assert len(picked) > 1  # the draw depends on the seed and prompt


def test_a_line_without_a_share_and_a_full_prompt_leave_no_slot():
    fills, r = FillUps(max_tool_calls=3, branch_factor=2, branch_threshold=0.5), rollout(m=4, n=2)
    first, second = r.groups[0]
    fills.shares.split(r, 0, [second.id])  # as after AEPO's monitoring path: the first line owns no slot
    assert fills.shares.remaining(r, 0, first.id) == 0 and fills.shares.remaining(r, 0, second.id) == 2
    r.start(0, list(PROMPT), "fill", None)
    r.start(0, list(PROMPT), "fill", None)  # the prompt's M = 4 paths are decided
    assert fills.shares.free(r, second) == 0
