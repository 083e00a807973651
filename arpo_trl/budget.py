"""The fill-up rule (paper §3.1 step 4: when forking falls short, "add M−N−Ẑ trajectory-level samples"), scheduled
so that it does not stretch the rollout's critical path.

A prompt's missing slots are *certain* to need fill-ups once forking cannot fill them even if every live path forked
at every tool result it may still reach; those start (or are confirmed) at once. Besides, as many *speculative*
fill-ups run as forking is expected not to fill, from the rates seen so far; a fork takes a speculative fill-up's slot
back (the youngest is dropped), and they are confirmed oldest first once certain. Forks never wait for fill-ups and
confirmation never looks at a fill-up's content, so the trees are those of the certain rule, only sooner
(docs/differences.md).
"""

from __future__ import annotations

import math

from arpo_trl.paths import Rollout, Trajectory, committed_count, speculative_fills

PRIOR_WEIGHT = 8  # segments (fork decisions) the previous rollouts' rates weigh in this rollout's estimates


class FillUps:
    """Decides, for one prompt at a time, which fill-ups to start, confirm or drop (`update`, `make_room`)."""

    def __init__(self, max_tool_calls: int, branch_factor: int, branch_threshold: float, speculative: bool = True):
        self.max_tool_calls, self.branch_factor, self.speculative = max_tool_calls, branch_factor, speculative
        self.call_rate, self.fork_rate = 0.5, branch_threshold  # priors, learned from each rollout

    def capacity(self, rollout: Rollout, path: Trajectory) -> int:
        """The most paths forking can still add below a live path: Z-1 copies at each tool result it may still
        reach, and likewise below every copy, so Z^r - 1 for r unsettled fork decisions."""
        if not self.forking(rollout, path):
            return 0
        remaining = max(0, self.max_tool_calls - path.fork_decisions)
        return min(self.branch_factor ** remaining - 1, rollout.num_generations)

    def expected(self, rollout: Rollout, path: Trajectory) -> float:
        """Paths forking is expected to add below a live path, from the rates seen so far: c, the share of segments
        that end with a tool call, and p, the mean fork probability (this rollout's, shrunk towards the previous
        rollouts'). A path reaching r more decisions: E_r = (1 - c) + c·(1 + (Z-1)·p)·E_{r-1}, E_0 = 1; a pending
        decision happens surely."""
        if not self.forking(rollout, path):
            return 0.0
        c = (rollout.segments_calling + PRIOR_WEIGHT * self.call_rate) / (rollout.segments + PRIOR_WEIGHT)
        p = (sum(rollout.fork_probabilities) + PRIOR_WEIGHT * self.fork_rate) / \
            (len(rollout.fork_probabilities) + PRIOR_WEIGHT)
        growth, expected = 1 + (self.branch_factor - 1) * p, 1.0
        pending = path.tool_calls > path.fork_decisions
        for _ in range(max(0, self.max_tool_calls - path.fork_decisions - pending)):
            expected = (1 - c) + c * growth * expected
        return (growth if pending else 1.0) * expected - 1

    def forking(self, rollout: Rollout, path: Trajectory) -> bool:
        return path.active and path.kind != "fill" and rollout.policy != "none" and self.branch_factor > 1

    def update(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Commit (oldest first), or start, every fill-up the prompt is now certain to need: the slots forking cannot
        supply even if every live path forked at every tool result it may reach. Then keep as many speculative
        fill-ups running as the slots forking is expected not to fill; a fork takes its slot back (`make_room`).
        Forks never wait for fill-ups and fill-ups are committed by start order, so the trees are those of
        certain fill-ups started at the end, as the paper describes, only sooner."""
        if g in rollout.monitoring:  # AEPO: how many global samples the group gets is not decided yet
            return
        group, m = rollout.groups[g], rollout.num_generations
        committed = [path for path in group if path.committed]
        certain = m - len(committed) - sum(self.capacity(rollout, path) for path in committed)
        if certain > 0:
            speculative = speculative_fills(group)[:certain]
            for path in speculative:
                path.committed = True
            for _ in range(certain - len(speculative)):
                rollout.start(g, group[0].prompt_ids, "fill", creator)
            rollout.stats.fill_ups += certain
        self.make_room(rollout, g)
        if not self.speculative:
            return
        missing = m - committed_count(group)
        expected = sum(self.expected(rollout, path) for path in group if path.committed)
        wanted = min(missing, math.ceil(missing - expected))
        for _ in range(wanted - len(speculative_fills(group))):
            rollout.start(g, group[0].prompt_ids, "fill", creator).committed = False
            rollout.stats.speculative_fill_ups += 1

    def make_room(self, rollout: Rollout, g: int) -> None:
        """Forks took slots held by speculative fill-ups: drop the youngest."""
        group = rollout.groups[g]
        while committed_count(group) + len(fills := speculative_fills(group)) > rollout.num_generations:
            rollout.drop(fills[-1])

    def learn(self, rollout: Rollout) -> None:
        """This rollout's rates become the next one's priors (consecutive training steps behave alike)."""
        if rollout.segments:
            self.call_rate = rollout.segments_calling / rollout.segments
        if rollout.fork_probabilities:
            self.fork_rate = sum(rollout.fork_probabilities) / len(rollout.fork_probabilities)
