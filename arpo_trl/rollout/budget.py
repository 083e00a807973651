"""The fill-up rule (paper §3.1 step 4: when forking falls short, "add M−N−Ẑ trajectory-level samples"), scheduled
so that it does not stretch the rollout's critical path.

A prompt's missing slots are *certain* to need fill-ups once forking cannot fill them even if every live path forked
at every tool result it may still reach; those start (or are confirmed) at once. Besides, as many *speculative*
fill-ups run as forking is expected not to fill, from the rates seen so far, or, with `hedge`, as many as are needed
with that probability when that is more; a fork takes a speculative fill-up's slot back (the youngest is dropped),
and they are confirmed oldest first once certain. On an engine that drafts a late
path from its siblings' text, or one where every running row costs compute (a CPU: a dropped fill-up is time lost),
they start at the prompt's first fork decision or the end of its first path (`after_first_decision`), when the
estimate knows more (and, drafted, their first segment costs a few steps); before that, only those the rates make
near-certain start (all of them for a model that calls no tool). Forks never wait for fill-ups and
confirmation never looks at a fill-up's content, so the trees are those of the certain rule, only sooner
(docs/differences.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from arpo_trl.generation.sampling import derive_seed
from arpo_trl.rollout.paths import Rollout, Trajectory, committed_count, speculative_fills

PRIOR_WEIGHT = 8  # segments (fork decisions) the previous rollouts' rates weigh in this rollout's estimates
SURELY = 0.99  # before a prompt is heard from, the fill-ups it needs with this probability start (`surely_needed`)


class ForkShares:
    """Who may take a prompt's branch slots (docs/differences.md, "Fork slots"). The M - n slots that its n global
    paths leave are split into equal shares, one per line (a global path and every branch below it); the (M - n) mod n
    slots left over go to lines drawn at random. A fork takes its copies from its own line's share, so which lines get
    branches follows their fork decisions (entropy), never which path reaches a tool result first, and no path waits
    for another's decision; a share its line can no longer use goes to fill-ups (`FillUps.update`). The split is made
    once a prompt's global paths are known (AEPO: after its monitoring path), the draw keyed by the rollout's seed and
    the prompt."""

    def split(self, rollout: Rollout, g: int, lines: list[int]) -> None:
        """Share the slots the prompt's global paths leave among `lines` (in the order the paths were started)."""
        globals_ = sum(path.kind == "global" for path in rollout.groups[g])
        base, extra = divmod(max(0, rollout.num_generations - globals_), max(1, len(lines)))
        draw = random.Random(derive_seed(rollout.seed, "shares", g))
        lucky = set(draw.sample(lines, extra)) if lines and extra else set()
        rollout.fork_shares[g] = {line: base + (line in lucky) for line in lines}

    def shares(self, rollout: Rollout, g: int) -> dict[int, int]:
        """The prompt's shares, split among all its global paths at first use (AEPO splits when monitoring ends)."""
        if g not in rollout.fork_shares:
            self.split(rollout, g, [path.id for path in rollout.groups[g] if path.kind == "global"])
        return rollout.fork_shares[g]

    def remaining(self, rollout: Rollout, g: int, line: int | None) -> int:
        """Branch slots `line` may still take."""
        if line is None:
            return 0
        used = sum(path.committed for path in rollout.groups[g] if path.kind == "branch" and path.line == line)
        return self.shares(rollout, g).get(line, 0) - used

    def free(self, rollout: Rollout, path: Trajectory) -> int:
        """Branch slots a fork of `path` may take now: its line's remaining share, within the prompt's M."""
        open_slots = rollout.num_generations - committed_count(rollout.groups[path.group])
        return min(open_slots, self.remaining(rollout, path.group, path.line))


class FillUps:
    """Decides, for one prompt at a time, which fill-ups to start, confirm or drop (`update`, `make_room`)."""

    def __init__(self, max_tool_calls: int, branch_factor: int, branch_threshold: float, speculative: bool = True,
                 after_first_decision: bool = False, hedge: float | None = None):
        self.max_tool_calls, self.branch_factor, self.speculative = max_tool_calls, branch_factor, speculative
        # speculation also covers the fill-ups needed with this probability (`likely_needed`), not only the mean's:
        # with many prompts, one prompt whose lines fork less than expected starts a fill-up late, and the rollout
        # waits for it (docs/differences.md, "Fill-ups hedged")
        self.hedge = hedge
        self._rates_seen: tuple | None = None  # (what the rates depend on..., c, p)
        self._lines: tuple | None = None  # (rollout, g, `live_lines`, each path's terms) while `update` runs
        # speculative fill-ups wait for the prompt's first fork decision: for an engine that drafts a late path from
        # its siblings' text (the cached engine), which writes their first segment in a few steps, and for one whose
        # rows each cost compute (vLLM on a CPU), where the fill-ups that forks would drop cost time
        self.after_first_decision = after_first_decision
        self.surely = SURELY  # while waiting: start the fill-ups needed with this probability (`surely_needed`)
        self.call_rate, self.fork_rate = 0.5, branch_threshold  # priors, learned from each rollout
        self.shares = ForkShares()

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
        if self._lines is not None and (known := self._lines[3].get(("expected", path.id))) is not None:
            return known
        c, p = self._rates(rollout)
        growth, expected = 1 + (self.branch_factor - 1) * p, 1.0
        pending = path.tool_calls > path.fork_decisions
        for _ in range(max(0, self.max_tool_calls - path.fork_decisions - pending)):
            expected = (1 - c) + c * growth * expected
        return self._remember("expected", path, (growth if pending else 1.0) * expected - 1)

    def never_forks(self, rollout: Rollout, path: Trajectory) -> float:
        """The probability that a live path forks at none of its remaining tool results (same rates as `expected`):
        each segment ends the path (1 - c) or reaches a decision that does not fork (c·(1 - p))."""
        if not self.forking(rollout, path):
            return 1.0
        if self._lines is not None and (known := self._lines[3].get(("never", path.id))) is not None:
            return known
        c, p = self._rates(rollout)
        pending = path.tool_calls > path.fork_decisions
        r = max(0, self.max_tool_calls - path.fork_decisions - pending)
        q = sum((c * (1 - p)) ** j * (1 - c) for j in range(r)) + (c * (1 - p)) ** r
        return self._remember("never", path, (1 - p) * q if pending else q)

    def _remember(self, kind: str, path: Trajectory, value: float) -> float:
        if self._lines is not None:  # inside `update`: each path's terms are asked for by several sums
            self._lines[3][kind, path.id] = value
        return value

    def _rates(self, rollout: Rollout) -> tuple[float, float]:
        """c, the share of segments that end with a tool call, and p, the mean fork probability: this rollout's,
        shrunk towards the previous rollouts'."""
        key = (rollout, rollout.segments, rollout.segments_calling, len(rollout.fork_probabilities),
               self.call_rate, self.fork_rate)
        seen = self._rates_seen
        if seen is None or seen[0] is not rollout or seen[1:-2] != key[1:]:  # asked per live path on every update: O(1)
            c = (rollout.segments_calling + PRIOR_WEIGHT * self.call_rate) / (rollout.segments + PRIOR_WEIGHT)
            p = (sum(rollout.fork_probabilities) + PRIOR_WEIGHT * self.fork_rate) / \
                (len(rollout.fork_probabilities) + PRIOR_WEIGHT)
            self._rates_seen = (*key, c, p)
        return self._rates_seen[-2], self._rates_seen[-1]

    def forking(self, rollout: Rollout, path: Trajectory) -> bool:
        return path.active and path.kind != "fill" and rollout.policy != "none" and self.branch_factor > 1

    def live_lines(self, rollout: Rollout, g: int) -> dict[int | None, list[Trajectory]]:
        """Prompt `g`'s committed paths that may still fork, by line."""
        if self._lines is not None and self._lines[0] is rollout and self._lines[1] == g:
            return self._lines[2]
        lines: dict[int | None, list[Trajectory]] = {}
        for path in rollout.groups[g]:
            if path.committed and self.forking(rollout, path):
                lines.setdefault(path.line, []).append(path)
        return lines

    def forkable(self, rollout: Rollout, g: int, per_path: Callable[[Rollout, Trajectory], float]) -> float:
        """What forking can still add to prompt `g`: per line, `per_path` summed over its live paths, capped by the
        line's remaining share."""
        return sum(min(sum(per_path(rollout, path) for path in paths), self.shares.remaining(rollout, g, line))
                   for line, paths in self.live_lines(rollout, g).items())

    def expected_slots(self, rollout: Rollout, g: int) -> float:
        """Branch slots forking is expected to take in prompt `g`: per line, its paths' `expected` sum, capped by the
        remaining share times the chance that the line forks at all (a line that ends without forking leaves its
        whole share to fill-ups, which the mean alone would hide)."""
        total = 0.0
        for line, paths in self.live_lines(rollout, g).items():
            forks = 1 - math.prod(self.never_forks(rollout, path) for path in paths)
            total += min(sum(self.expected(rollout, path) for path in paths),
                         self.shares.remaining(rollout, g, line) * forks)
        return total

    def update(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Commit (oldest first), or start, every fill-up the prompt is now certain to need: the slots forking cannot
        supply even if every live path forked at every tool result it may reach. Then keep as many speculative
        fill-ups running as the slots forking is expected not to fill; a fork takes its slot back (`make_room`).
        Forks never wait for fill-ups and fill-ups are committed by start order, so the trees are those of
        certain fill-ups started at the end, as the paper describes, only sooner."""
        if g in rollout.monitoring:  # AEPO: how many global samples the group gets is not decided yet
            return
        group = rollout.groups[g]
        if committed_count(group) >= rollout.num_generations and not speculative_fills(group):
            return  # the prompt's M paths are all decided: nothing to start, confirm or drop
        # the lines and their paths' terms stay as they are while this runs (fill-ups never fork), and each is asked
        # for by several sums (certain, expected and hedged fill-ups): computed once
        self._lines = None
        self._lines = (rollout, g, self.live_lines(rollout, g), {})
        try:
            self._update(rollout, g, creator)
        finally:
            self._lines = None

    def _update(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        group, m = rollout.groups[g], rollout.num_generations
        committed = [path for path in group if path.committed]
        certain = m - len(committed) - self.forkable(rollout, g, self.capacity)
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
        if self.after_first_decision and not self._heard_from(group):  # only what the rates make near-certain
            wanted = min(missing, self.surely_needed(rollout, g))
        else:
            wanted = min(missing, math.ceil(missing - self.expected_slots(rollout, g)))
            if self.hedge is not None:
                wanted = min(missing, max(wanted, self.likely_needed(rollout, g)))
        for _ in range(wanted - len(speculative_fills(group))):
            rollout.start(g, group[0].prompt_ids, "fill", creator).committed = False
            rollout.stats.speculative_fill_ups += 1

    def surely_needed(self, rollout: Rollout, g: int) -> int:
        """The fill-ups prompt `g` needs with probability at least `surely` by the rates: a line that forks at none of
        its tool results leaves its whole remaining share to fill-ups (a lower bound: a line that forks may still
        leave some). With rates learned from a model that calls no tool, that is every missing slot."""
        left, tail = self._unforked_slots(rollout, g), 0.0
        for k in range(len(left) - 1, 0, -1):
            if (tail := tail + left[k]) >= self.surely:
                return k
        return 0

    def likely_needed(self, rollout: Rollout, g: int) -> int:
        """The fill-ups prompt `g` needs with probability at least `hedge` by the rates (the same distribution as
        `surely_needed`, from its other end): the slots left by the lines that fork at none of their tool results."""
        total = 0.0
        for k, chance in enumerate(left := self._unforked_slots(rollout, g)):
            if (total := total + chance) >= self.hedge:
                return k
        return len(left) - 1

    def _unforked_slots(self, rollout: Rollout, g: int) -> list[float]:
        """P(the live lines that never fork leave k slots), for k = 0, 1, ...: each leaves its remaining share."""
        left = [1.0]
        for line, paths in self.live_lines(rollout, g).items():
            never, share = math.prod(self.never_forks(rollout, path) for path in paths), \
                self.shares.remaining(rollout, g, line)
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

    def make_room(self, rollout: Rollout, g: int) -> None:
        """Forks took slots held by speculative fill-ups: drop the youngest."""
        group = rollout.groups[g]
        while committed_count(group) + len(fills := speculative_fills(group)) > rollout.num_generations:
            rollout.drop(fills[-1])

    def learn(self, rollout: Rollout) -> None:
        """This rollout's rates become the next one's priors (consecutive training steps behave alike)."""
        self._rates_seen = None  # holds the rollout: let it go with its paths
        if rollout.segments:
            self.call_rate = rollout.segments_calling / rollout.segments
        if rollout.fork_probabilities:
            self.fork_rate = sum(rollout.fork_probabilities) / len(rollout.fork_probabilities)
