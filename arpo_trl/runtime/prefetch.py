"""Fill-up prefetch: how the event scheduler shortens a rollout's critical path without the rule knowing.

The rule (`arpo.py`) starts a fill-up only once it is certain to be needed (paper §3.1 step 4), which is often late:
a prompt whose lines fork less than expected learns so only when their tool results pass without a fork, hundreds of
tokens in, and a fill-up started then ends the rollout's longest chain (on a GPU, where a decode step costs about the
same with more rows, the rollout's time). A fill-up depends on nothing the rule decides after it starts: its tokens on
its key (`("fill", g, j)`, prompt g's j-th fill-up) and prompt alone (an engine that takes a path's seed draws them
from it, `generation/sampling.py`), and it never forks. So the scheduler runs the fill-ups a prompt will likely need
ahead of the rule, each a *shadow*: the rule's own program for that path, on a scratch rollout of its own. A shadow is
handed over only when the rule itself starts that fill-up: the rule's program replays the shadow's answers (its
segments and tool outcomes, checked request by request) and goes on live from there. The trees are the rule's by
construction; a shadow the rule never starts is cancelled, and its tokens count as discarded.

How many run ahead (`FillUpPrefetch.wanted`): besides those certain, as many as forking is expected not to fill, from
the rates seen so far (c, the share of segments that end with a tool call; p, the mean fork probability), or, when
more, as many as the prompt needs with probability `HEDGE`. On an engine whose every running row costs compute
(`EngineTraits.compute_bound`: vLLM on a CPU), they wait for the prompt's first fork decision or the
end of its first path; before that, only those the rates make near-certain (`SURELY`) start. Measurements:
docs/architecture.md ("Fill-ups run ahead of the rule").
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from arpo_trl.rollout.arpo import BranchingRule
from arpo_trl.rollout.paths import Rollout, Trajectory

MODES = ("auto", "off")
PRIOR_WEIGHT = 8  # segments (fork decisions) the previous rollouts' rates weigh in this rollout's estimates
HEDGE = 0.9  # fill-ups also run ahead to cover what a prompt needs with this probability (`likely_needed`)
SURELY = 0.99  # before a prompt is heard from, the fill-ups it needs with this probability run ahead (`surely_needed`)


@dataclass
class Shadow:
    """A fill-up run ahead of the rule: its path on a scratch rollout, and the answers its requests got, in order."""

    path: Trajectory
    scratch: Rollout
    started_at: int  # tokens on the chain of the step that started it (the rollout's critical path)
    answers: list[tuple[tuple, Any, int, int]] = field(default_factory=list)  # (the request's signature, its
    # answer, the requests and tokens on its chain once answered)
    adopted: bool = False  # the rule started this fill-up: its program replays these answers
    done: bool = False  # no more answers will come
    task: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def group(self) -> int:
        return self.path.group

    @property
    def index(self) -> int:
        return self.path.key[2]


class FillUpPrefetch:
    """Which fill-ups run ahead for one rule (`BranchingRule`), by its public queries of a rollout (`live_lines`,
    `forking`, `shares`); the rates it estimates with carry from one rollout to the next."""

    def __init__(self, rule: BranchingRule, mode: str = "auto", wait_for_first_decision: bool = False):
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {MODES}, got {mode!r}.")
        self.rule = rule
        self.enabled = mode != "off"
        self.wait_for_first_decision = wait_for_first_decision
        self.call_rate = 0.5  # priors, learned from each rollout
        self.fork_rate = rule.branch_threshold
        self._ids = itertools.count(1)
        self.begin()

    def begin(self) -> None:
        """A new rollout: its own counts of segments, calls and fork probabilities."""
        self.segments = self.segments_calling = 0
        self.fork_probabilities: list[float] = []
        self._decisions_seen: dict[int, int] = {}

    # ---- what the scheduler tells it ---------------------------------------------------------------------------
    def observe(self, path: Trajectory, segment_started: bool, calling: bool) -> None:
        """A real path's program asked for a new segment or a tool call; its fork decisions so far."""
        self.segments += segment_started
        self.segments_calling += calling
        seen = self._decisions_seen.get(path.id, 0)
        self.fork_probabilities += [d.probability for d in path.decisions[seen:]]
        self._decisions_seen[path.id] = len(path.decisions)

    def learn(self) -> None:
        """This rollout's rates become the next one's priors (consecutive training steps behave alike)."""
        if self.segments:
            self.call_rate = self.segments_calling / self.segments
        if self.fork_probabilities:
            self.fork_rate = sum(self.fork_probabilities) / len(self.fork_probabilities)

    def shadow(self, rollout: Rollout, g: int, j: int) -> Shadow:
        """Prompt `g`'s j-th fill-up as the rule would start it (its key, seed and environment), on a scratch rollout
        of its own whose budget it fills alone, so that the rule's program starts nothing from it."""
        scratch = Rollout([[] for _ in rollout.groups], 1, rollout.policy, environments=rollout.environments,
                          fork=rollout.fork, seed=rollout.seed)
        path = scratch.start(g, list(rollout.groups[g][0].prompt_ids), "fill", None, index=j)
        path.id = -next(self._ids)  # never a real path's
        scratch.take_started()
        return Shadow(path, scratch, started_at=0)

    # ---- how many run ahead ------------------------------------------------------------------------------------
    def wanted(self, rollout: Rollout, g: int) -> range:
        """The fill-up indices of prompt `g` that should be running ahead of the rule now."""
        group = rollout.groups[g]
        started = sum(path.kind == "fill" for path in group)
        missing = rollout.num_generations - len(group)
        if not self.enabled or missing <= 0 or g in rollout.monitoring:  # AEPO: m is not decided yet
            return range(started, started)
        if self.wait_for_first_decision and not self._heard_from(group):  # only what the rates make near-certain
            count = min(missing, self.surely_needed(rollout, g))
        else:
            count = min(missing, max(math.ceil(missing - self.expected_slots(rollout, g)),
                                     self.likely_needed(rollout, g)))
        return range(started, started + count)

    def expected(self, rollout: Rollout, path: Trajectory) -> float:
        """Paths forking is expected to add below a live path, from the rates: a path reaching r more decisions,
        E_r = (1 − c) + c·(1 + (Z − 1)·p)·E_{r−1}, E_0 = 1; a pending decision happens surely."""
        if not self.rule.forking(rollout, path):
            return 0.0
        c, p = self.rates()
        growth, expected = 1 + (self.rule.branch_factor - 1) * p, 1.0
        pending = path.tool_calls > path.growth.fork_decisions
        for _ in range(max(0, self.rule.max_tool_calls - path.growth.fork_decisions - pending)):
            expected = (1 - c) + c * growth * expected
        return (growth if pending else 1.0) * expected - 1

    def never_forks(self, rollout: Rollout, path: Trajectory) -> float:
        """The probability that a live path forks at none of its remaining tool results: each segment ends the path
        (1 − c) or reaches a decision that does not fork (c·(1 − p))."""
        if not self.rule.forking(rollout, path):
            return 1.0
        c, p = self.rates()
        pending = path.tool_calls > path.growth.fork_decisions
        r = max(0, self.rule.max_tool_calls - path.growth.fork_decisions - pending)
        q = sum((c * (1 - p)) ** j * (1 - c) for j in range(r)) + (c * (1 - p)) ** r
        return (1 - p) * q if pending else q

    def rates(self) -> tuple[float, float]:
        """c and p: this rollout's, shrunk towards the previous rollouts'."""
        c = (self.segments_calling + PRIOR_WEIGHT * self.call_rate) / (self.segments + PRIOR_WEIGHT)
        p = (sum(self.fork_probabilities) + PRIOR_WEIGHT * self.fork_rate) / \
            (len(self.fork_probabilities) + PRIOR_WEIGHT)
        return c, p

    def expected_slots(self, rollout: Rollout, g: int) -> float:
        """Branch slots forking is expected to take in prompt `g`: per line, its paths' `expected` sum, capped by the
        remaining share times the chance that the line forks at all (a line that ends without forking leaves its
        whole share to fill-ups, which the mean alone would hide)."""
        total = 0.0
        for line, paths in self.rule.live_lines(rollout, g).items():
            forks = 1 - math.prod(self.never_forks(rollout, path) for path in paths)
            total += min(sum(self.expected(rollout, path) for path in paths),
                         self.rule.shares.remaining(rollout, g, line) * forks)
        return total

    def surely_needed(self, rollout: Rollout, g: int) -> int:
        """The fill-ups prompt `g` needs with probability at least `SURELY` by the rates: a line that forks at none of
        its tool results leaves its whole remaining share to fill-ups (a lower bound)."""
        left, tail = self._unforked_slots(rollout, g), 0.0
        for k in range(len(left) - 1, 0, -1):
            if (tail := tail + left[k]) >= SURELY:
                return k
        return 0

    def likely_needed(self, rollout: Rollout, g: int) -> int:
        """The fill-ups prompt `g` needs with probability at least `HEDGE` (the distribution of `surely_needed`,
        from its other end)."""
        total = 0.0
        for k, chance in enumerate(left := self._unforked_slots(rollout, g)):
            if (total := total + chance) >= HEDGE:
                return k
        return len(left) - 1

    def _unforked_slots(self, rollout: Rollout, g: int) -> list[float]:
        """P(the live lines that never fork leave k slots), for k = 0, 1, ...: each leaves its remaining share."""
        left = [1.0]
        for line, paths in self.rule.live_lines(rollout, g).items():
            never = math.prod(self.never_forks(rollout, path) for path in paths)
            share = self.rule.shares.remaining(rollout, g, line)
            spread = [0.0] * (len(left) + share)
            for k, chance in enumerate(left):
                spread[k] += chance * (1 - never)
                spread[k + share] += chance * never
            left = spread
        return left

    @staticmethod
    def _heard_from(group: list[Trajectory]) -> bool:
        """Whether a path of the prompt made a fork decision or ended: a line that ends without a tool call decides
        nothing, and a prompt whose paths never call a tool must not wait for its last line to end."""
        return any(path.growth.fork_decisions or not path.active for path in group)
