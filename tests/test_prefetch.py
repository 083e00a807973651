"""Which fill-ups run ahead of the rule (`arpo_trl.runtime.prefetch.FillUpPrefetch`), on hand-built rollouts: how many
paths forking is expected to add, the hedge, waiting for a prompt's first decision, the rates and their priors, and
the shadow a fill-up runs as. That a shadow handed over leaves the trees unchanged is
`tests/test_rollout.py::test_fill_ups_run_ahead_of_the_rule_leave_the_trees_unchanged` and `tests/test_seeds.py`."""

from __future__ import annotations

import math

import pytest

from arpo_trl.rollout import BranchingRule
from arpo_trl.rollout.paths import ForkDecision, Rollout, ToolCallRecord, derive_seed
from arpo_trl.runtime.prefetch import HEDGE, FillUpPrefetch

PROMPT = [5, 6, 7]


def prefetch(max_tool_calls: int, branch_factor: int = 2, branch_threshold: float = 0.5, **kw) -> FillUpPrefetch:
    """The real rule's prefetch; no engine runs: the rule needs none."""
    rule = BranchingRule(None, vocab_size=1000, eos_token_id=0, max_tool_calls=max_tool_calls,
                         branch_factor=branch_factor, branch_threshold=branch_threshold, seed=0)
    return FillUpPrefetch(rule, **kw)


def rollout(m: int, n: int, policy: str = "entropy") -> Rollout:
    """One prompt with budget M and its N global paths, as `BranchingRule.begin` starts it."""
    r = Rollout([[]], m, policy, seed=11)
    for _ in range(n):
        r.start(0, list(PROMPT), "global", None)
    r.started.clear()
    return r


@pytest.mark.parametrize("tool_calls,decisions,expected", [
    (0, 0, 0.4375),  # E_2 - 1, E_r = 1/2 + 1/2 · 3/2 · E_{r-1}: c = 1/2 (prior), growth 1 + (Z-1)·p = 3/2
    (1, 0, 0.875),  # a decision pending at a tool result happens surely: 3/2 · E_1 - 1
    (1, 1, 0.25),  # one decision left: E_1 - 1
    (2, 1, 0.5),  # the last decision pending: 3/2 - 1
    (2, 2, 0.0),  # none left
])
def test_expected_paths_from_the_priors(tool_calls, decisions, expected):
    ahead, r = prefetch(max_tool_calls=2), rollout(m=16, n=1)
    path = r.groups[0][0]
    path.calls, path.growth.fork_decisions = [ToolCallRecord("python")] * tool_calls, decisions
    assert ahead.expected(r, path) == pytest.approx(expected, abs=1e-12)


def test_paths_that_cannot_fork_are_expected_to_add_nothing():
    ahead = prefetch(max_tool_calls=3)
    finished, fill_up, trajectory_level = rollout(m=8, n=1), rollout(m=8, n=1), rollout(m=8, n=1, policy="none")
    finished.groups[0][0].finish_reason = "eos"
    fill_up.groups[0][0].kind = "fill"
    for r in (finished, fill_up, trajectory_level):
        assert ahead.expected(r, r.groups[0][0]) == 0.0 and ahead.never_forks(r, r.groups[0][0]) == 1.0


def test_the_rates_weigh_this_rollouts_segments_and_decisions_against_the_priors():
    ahead, r = prefetch(max_tool_calls=2), rollout(m=16, n=1)
    path = r.groups[0][0]
    path.decisions = [ForkDecision(0, 0.0, 1.0, 0.0, True)] * 8
    for _ in range(8):  # every segment called a tool, every fork decision drew P = 1
        ahead.observe(path, segment_started=True, calling=True)
    # c = (8 + 8 · 1/2) / 16 = 3/4 and p likewise: growth 7/4, E_1 = 1/4 + 3/4 · 7/4, E_2 = 1/4 + 3/4 · 7/4 · E_1
    assert ahead.rates() == pytest.approx((0.75, 0.75))
    e1 = 0.25 + 0.75 * 1.75
    assert ahead.expected(r, path) == pytest.approx(0.25 + 0.75 * 1.75 * e1 - 1, abs=1e-12)


def test_each_rollouts_rates_become_the_next_ones_priors():
    ahead = prefetch(max_tool_calls=3, branch_threshold=0.3)
    assert (ahead.call_rate, ahead.fork_rate) == (0.5, 0.3)
    ahead.learn()  # nothing seen: the priors stay
    assert (ahead.call_rate, ahead.fork_rate) == (0.5, 0.3)
    path = rollout(m=4, n=2).groups[0][0]
    path.decisions = [ForkDecision(0, 0.0, 0.2, 0.0, False), ForkDecision(9, 0.0, 0.6, 0.0, True)]
    for calling in (True, False, False, False):
        ahead.observe(path, segment_started=True, calling=calling)
    ahead.learn()
    assert ahead.call_rate == 0.25 and ahead.fork_rate == pytest.approx(0.4)
    ahead.begin()  # a new rollout: its own counts, the learned priors
    assert ahead.rates() == pytest.approx((0.25, 0.4))


def test_fill_ups_cover_what_forking_is_not_expected_to_fill_and_the_hedge():
    ahead, r = prefetch(max_tool_calls=3), rollout(m=8, n=2)
    # nothing certain (each global could add 7), but forking is expected to add 2 · 0.578125 paths of the 6 missing:
    # ceil(6 - 1.15625) = 5; each line forks at none of its 3 decisions with probability 0.671875 and then leaves
    # its 3 slots: 0, 3 or 6 are needed with probability 0.11, 0.44, 0.45, so the hedge's 0.9 quantile is 6
    assert ahead.expected_slots(r, 0) == pytest.approx(1.15625) and ahead.likely_needed(r, 0) == 6
    assert ahead.wanted(r, 0) == range(0, 6)
    r.start(0, list(PROMPT), "fill", None)  # the rule started fill-up 0: the next run ahead are 1..5
    assert ahead.wanted(r, 0) == range(1, 6)


def test_the_hedge_covers_the_quantile_of_lines_that_never_fork():
    # M=16, N=8: one branch slot per line; priors c = p = 0.5 and 3 decisions to go, so a line forks at none of
    # them with probability 0.5·(1 + 0.25 + 0.0625) + 0.25³, and the fill-ups needed are Binomial(8, that)
    never = 0.5 * (1 + 0.25 + 0.0625) + 0.25**3
    ahead, r = prefetch(max_tool_calls=3), rollout(16, 8)
    quantile = next(k for k in range(9) if sum(math.comb(8, i) * never**i * (1 - never) ** (8 - i)
                                               for i in range(k + 1)) >= HEDGE)
    assert ahead.likely_needed(r, 0) == quantile == 7
    assert len(ahead.wanted(r, 0)) == max(math.ceil(8 - 8 * (1 - never)), quantile) == 7


def test_fill_ups_can_wait_for_the_prompts_first_fork_decision():
    """On an engine whose every running row costs compute (a CPU), fill-ups run ahead
    from the prompt's first fork decision or the end of its first path; before that only the near-certain ones."""
    ahead, r = prefetch(max_tool_calls=3, wait_for_first_decision=True), rollout(m=8, n=2)
    assert ahead.wanted(r, 0) == range(0, 0)
    r.groups[0][0].growth.fork_decisions = 1  # its first tool result, decided without a fork
    assert len(ahead.wanted(r, 0)) == 6
    r = rollout(m=8, n=2)
    r.groups[0][0].finish_reason = "eos"  # a line that ended without a tool call: no decision will come from it
    assert len(ahead.wanted(r, 0)) > 0
    ahead, r = prefetch(max_tool_calls=3, wait_for_first_decision=True), rollout(m=8, n=2)
    ahead.call_rate = 0.0  # learned from a rollout in which no path called a tool: no line is expected to fork
    assert ahead.wanted(r, 0) == range(0, 6)  # all missing paths run ahead with the globals


def test_nothing_runs_ahead_when_off_full_or_monitoring():
    r = rollout(m=8, n=2)
    assert prefetch(max_tool_calls=3, mode="off").wanted(r, 0) == range(0, 0)
    assert prefetch(max_tool_calls=3).wanted(rollout(m=2, n=2), 0) == range(0, 0)  # the prompt's M are decided
    r.monitoring.add(0)  # AEPO: the number of global samples is not known yet
    assert prefetch(max_tool_calls=3).wanted(r, 0) == range(0, 0)
    with pytest.raises(ValueError, match="speculation must be one of"):
        prefetch(max_tool_calls=3, mode="always")


def test_a_shadow_is_the_fill_up_the_rule_would_start():
    """Its key and seed are those of the prompt's j-th fill-up, on a scratch rollout it fills alone, with an id no real
    path has; its environment is a fork of the prompt's."""
    ahead = prefetch(max_tool_calls=3)
    r = rollout(m=8, n=2)
    r.environments, r.fork = [{"calls": 0}], dict
    shadow = ahead.shadow(r, 0, 3)
    assert shadow.path.key == ("fill", 0, 3) and shadow.path.seed == derive_seed(r.seed, ("fill", 0, 3))
    assert shadow.path.id < 0 and shadow.path.prompt_ids == PROMPT and shadow.path.kind == "fill"
    assert shadow.scratch.groups == [[shadow.path]] and shadow.scratch.num_generations == 1
    assert shadow.path.environment == {"calls": 0} and shadow.path.environment is not r.environments[0]
    assert len(r.groups[0]) == 2 and not r.started  # the real rollout is untouched
    for j in range(3):  # the rule's own fill-ups get the keys a shadow would have
        assert r.start(0, list(PROMPT), "fill", None).key == ("fill", 0, j)
    assert r.start(0, list(PROMPT), "fill", None).seed == shadow.path.seed
