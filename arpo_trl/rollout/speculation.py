"""Speculation: work the rollout rule (`arpo.py`) will likely need, started before the rule decides it, so that the
rollout's critical path is shorter. It never changes what the rule decides: forks never wait for it, the rule takes
its fill-ups oldest first only once they are certain to be needed, and a fork starts early only when its u already
makes it certain. Tested to grow the same trees in every mode (`tests/test_seeds.py`).

Modes (`BranchingSampler(speculation=...)`, `ARPOConfig.rollout_speculation`):
  * 'off': the rule alone.
  * 'auto' (default): speculative fill-ups, and a fork that u makes certain before its probe reads anything (u below
    the P of zero entropy, the lowest P a probe can give) starts its copies at the tool result, beside the probe.

Speculative fill-ups: besides the fill-ups a prompt is certain to need, as many run as forking is expected not to
fill, from the rates seen so far (c, the share of segments that end with a tool call; p, the mean fork
probability), or, when more, as many as are needed with probability `HEDGE` (a prompt whose lines fork less than
expected otherwise starts its fill-ups late, and the rollout waits for them). A fork takes a speculative fill-up's
slot back (the youngest is dropped). On an engine that drafts a late path from its siblings' text, or one where every
running row costs compute (a CPU), they wait for the prompt's first fork decision or the end of its first path, when
the estimate knows more; before that, only those the rates make near-certain (`SURELY`) start. Measurements:
docs/benchmarks.md ("Rollout wall time").
"""

from __future__ import annotations

import math

from arpo_trl.rollout.paths import Rollout, Trajectory, committed_count

MODES = ("auto", "off")
PRIOR_WEIGHT = 8  # segments (fork decisions) the previous rollouts' rates weigh in this rollout's estimates
HEDGE = 0.9  # speculative fill-ups also cover what a prompt needs with this probability (`likely_needed`)
SURELY = 0.99  # before a prompt is heard from, the fill-ups it needs with this probability start (`surely_needed`)


class Speculation:
    """Early starts for one sampler (`rule`, the `BranchingSampler` whose forks and budget it anticipates)."""

    def __init__(self, rule, mode: str = "auto", after_first_decision: bool = False):
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {MODES}, got {mode!r}.")
        self.rule = rule
        self.fill_ups_early = mode != "off"
        self.certain_forks_early = mode != "off"
        self.after_first_decision = after_first_decision
        self.call_rate = 0.5  # priors, learned from each rollout
        self.fork_rate = rule.branch_threshold
        self.copies: dict[int, list[Trajectory]] = {}  # path id -> the copies started at its pending tool result

    @classmethod
    def for_engine(cls, mode: str, rule, engine, event_driven: bool) -> Speculation:
        """Fill-ups wait for a prompt's first decision where early ones cost most: an engine that drafts a late path
        from its siblings' text (the cached engine, which writes their first segment in a few steps) or one whose rows
        each cost compute (vLLM on a CPU), under the event scheduler."""
        late = getattr(engine, "drafts_late_paths", False) or getattr(engine, "compute_bound", False)
        return cls(rule, mode, after_first_decision=late and event_driven)

    def begin(self, rollout: Rollout) -> None:
        self.copies = {}

    # ---- forks -------------------------------------------------------------------------------------------------
    def at_tool_result(self, rollout: Rollout, path: Trajectory) -> None:
        """A fork is possible at the path's tool result and its u is drawn: if u makes the fork certain, start its
        copies now, beside the probe."""
        rule = self.rule
        lowest = (0.0 if rule.entropy_weight >= 0 else rule.entropy_window) - (path.initial_entropy or 0.0)  # H ≥ 0
        certain = path.initial_entropy is not None and path.pending_draw < rule.fork_probability(
            lowest, rollout.policy, path.consecutive_forks)
        if not (certain and self.certain_forks_early):
            return
        copies = min(rule.branch_factor - 1, rule.shares.free(rollout, path))
        self.copies[path.id] = [rule.branch(rollout, path, c) for c in range(copies)]
        self.forked(rollout, path.group)

    def early_copies(self, path: Trajectory) -> list[Trajectory] | None:
        """The copies `at_tool_result` started for the path's pending decision (None: none were)."""
        return self.copies.pop(path.id, None)

    def forked(self, rollout: Rollout, g: int) -> None:
        """Forks took slots held by speculative fill-ups: drop the youngest."""
        group = rollout.groups[g]
        while committed_count(group) + len(fills := self.running_fill_ups(group)) > rollout.num_generations:
            rollout.drop(fills[-1])

    # ---- fill-ups ----------------------------------------------------------------------------------------------
    @staticmethod
    def running_fill_ups(group: list[Trajectory]) -> list[Trajectory]:
        """The prompt's speculative fill-ups, oldest first."""
        return [path for path in group if path.kind == "fill" and not path.committed]

    def take_fill_ups(self, group: list[Trajectory], needed: int) -> int:
        """The rule needs `needed` fill-ups: confirm the oldest speculative ones; how many there were."""
        taken = self.running_fill_ups(group)[:needed]
        for path in taken:
            path.committed = True
        return len(taken)

    def fill_ups(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Keep as many speculative fill-ups running as forking is expected not to fill, or, when more, as the prompt
        needs with probability `HEDGE`."""
        self.forked(rollout, g)
        if not self.fill_ups_early:
            return
        group = rollout.groups[g]
        missing = rollout.num_generations - committed_count(group)
        if self.after_first_decision and not self._heard_from(group):  # only what the rates make near-certain
            wanted = min(missing, self.surely_needed(rollout, g))
        else:
            wanted = min(missing, max(math.ceil(missing - self.expected_slots(rollout, g)),
                                      self.likely_needed(rollout, g)))
        for _ in range(wanted - len(self.running_fill_ups(group))):
            rollout.start(g, group[0].prompt_ids, "fill", creator).committed = False
            rollout.stats.speculative_fill_ups += 1

    def expected(self, rollout: Rollout, path: Trajectory) -> float:
        """Paths forking is expected to add below a live path, from the rates: a path reaching r more decisions,
        E_r = (1 − c) + c·(1 + (Z − 1)·p)·E_{r−1}, E_0 = 1; a pending decision happens surely."""
        if not self.rule.forking(rollout, path):
            return 0.0
        c, p = self._rates(rollout)
        growth, expected = 1 + (self.rule.branch_factor - 1) * p, 1.0
        pending = path.tool_calls > path.fork_decisions
        for _ in range(max(0, self.rule.max_tool_calls - path.fork_decisions - pending)):
            expected = (1 - c) + c * growth * expected
        return (growth if pending else 1.0) * expected - 1

    def never_forks(self, rollout: Rollout, path: Trajectory) -> float:
        """The probability that a live path forks at none of its remaining tool results: each segment ends the path
        (1 − c) or reaches a decision that does not fork (c·(1 − p))."""
        if not self.rule.forking(rollout, path):
            return 1.0
        c, p = self._rates(rollout)
        pending = path.tool_calls > path.fork_decisions
        r = max(0, self.rule.max_tool_calls - path.fork_decisions - pending)
        q = sum((c * (1 - p)) ** j * (1 - c) for j in range(r)) + (c * (1 - p)) ** r
        return (1 - p) * q if pending else q

    def _rates(self, rollout: Rollout) -> tuple[float, float]:
        """c and p: this rollout's, shrunk towards the previous rollouts'."""
        c = (rollout.segments_calling + PRIOR_WEIGHT * self.call_rate) / (rollout.segments + PRIOR_WEIGHT)
        p = (sum(rollout.fork_probabilities) + PRIOR_WEIGHT * self.fork_rate) / \
            (len(rollout.fork_probabilities) + PRIOR_WEIGHT)
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
        """The fill-ups prompt `g` needs with probability at least `HEDGE` (the same distribution as
        `surely_needed`, from its other end)."""
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
        return any(path.fork_decisions or (path.committed and not path.active) for path in group)

    # ---- across rollouts ---------------------------------------------------------------------------------------
    def learn(self, rollout: Rollout) -> None:
        """This rollout's rates become the next one's priors (consecutive training steps behave alike)."""
        self.copies = {}
        if rollout.segments:
            self.call_rate = rollout.segments_calling / rollout.segments
        if rollout.fork_probabilities:
            self.fork_rate = sum(rollout.fork_probabilities) / len(rollout.fork_probabilities)

    def state_dict(self) -> dict:
        return {"call_rate": self.call_rate, "fork_rate": self.fork_rate}

    def load_state_dict(self, state: dict) -> None:
        self.call_rate = state.get("call_rate", self.call_rate)
        self.fork_rate = state.get("fork_rate", self.fork_rate)
