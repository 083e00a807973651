"""The fill-up rule (paper §3.1 step 4: when forking falls short, "add M−N−Ẑ trajectory-level samples"), scheduled
so that it does not stretch the rollout's critical path.

A prompt's branch slots are shared among its lines (`ForkShares`); a share that its line can no longer use goes to
the lines that could fork more (`FillUps.pool`). A prompt's missing slots are *certain* to need fill-ups once forking
cannot fill them even if every live path forked at every tool result it may still reach; those start (or are
confirmed) at once. Besides, a fill-up starts early once it is likely enough to be needed (`speculative_count`, from
the rates seen so far); a fork takes a speculative fill-up's slot back (the youngest is dropped), and they are
confirmed oldest first once certain. Forks never wait for fill-ups and confirmation never looks at a fill-up's
content, so the trees are those of the certain rule, only sooner (docs/differences.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from arpo_trl.paths import Rollout, Trajectory, committed_count, speculative_fills

PRIOR_WEIGHT = 8  # segments (fork decisions) the previous rollouts' rates weigh in this rollout's estimates
FILL_UP_ODDS = 0.2  # a fill-up starts before it is certain once it is this likely to be needed (`speculative_count`)


class ForkShares:
    """Who may take a prompt's branch slots (docs/differences.md, "Fork slots"). The M - n slots that its n global
    paths leave are split into equal shares, one per line (a global path and every branch below it); the (M - n) mod n
    slots left over go to lines drawn at random. A fork takes its copies from its own line's share, so which lines get
    branches follows their fork decisions (entropy), never which path reaches a tool result first, and no path waits
    for another's decision; a share its line can no longer use goes to other lines (`FillUps.pool`). The split is made
    once a prompt's global paths are known (AEPO: after its monitoring path)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def split(self, rollout: Rollout, g: int, lines: list[int]) -> None:
        """Share the slots the prompt's global paths leave among `lines`."""
        globals_ = sum(path.kind == "global" for path in rollout.groups[g])
        base, extra = divmod(max(0, rollout.num_generations - globals_), max(1, len(lines)))
        lucky = set(self.rng.sample(lines, extra)) if lines and extra else set()
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
                 rng: random.Random | None = None):
        self.max_tool_calls, self.branch_factor, self.speculative = max_tool_calls, branch_factor, speculative
        self.call_rate, self.fork_rate = 0.5, branch_threshold  # priors, learned from each rollout
        self.shares = ForkShares(rng or random.Random(0))

    def capacity(self, rollout: Rollout, path: Trajectory) -> int:
        """The most paths forking can still add below a live path: Z-1 copies at each tool result it may still
        reach, and likewise below every copy, so Z^r - 1 for r unsettled fork decisions."""
        if not self.forking(rollout, path):
            return 0
        remaining = max(0, self.max_tool_calls - path.fork_decisions)
        return min(self.branch_factor ** remaining - 1, rollout.num_generations)

    def added_paths(self, rollout: Rollout, path: Trajectory, limit: int) -> list[float]:
        """The distribution of the paths forking adds below a live path, from the rates seen so far: c, the share of
        segments that end with a tool call, and p, the mean fork probability (this rollout's, shrunk towards the
        previous rollouts'). Entry j is P(j paths), the last one P(`limit` or more). A path with r decisions left:
        G_r = (1 - c) + c·D_r, where D_r = (1 - p)·G_{r-1} + p·s^(Z-1)·G_{r-1}^Z is the distribution at a decision
        (the path and its Z-1 copies go on with r - 1 each), G_0 = 1; a pending decision happens surely (D_r)."""
        if not self.forking(rollout, path):
            return [1.0]
        c, p = self._rates(rollout)
        pending = path.tool_calls > path.fork_decisions
        at_decision, before_decision = [1.0], [1.0]
        for _ in range(max(0, self.max_tool_calls - path.fork_decisions)):
            forked = _shifted(_power(before_decision, self.branch_factor, limit), self.branch_factor - 1, limit)
            at_decision = _mix(1 - p, before_decision, p, forked)
            before_decision = _mix(1 - c, [1.0], c, at_decision)
        return at_decision if pending else before_decision

    def _rates(self, rollout: Rollout) -> tuple[float, float]:
        """c, the share of segments that end with a tool call, and p, the mean fork probability: this rollout's,
        shrunk towards the previous rollouts'."""
        c = (rollout.segments_calling + PRIOR_WEIGHT * self.call_rate) / (rollout.segments + PRIOR_WEIGHT)
        p = (sum(rollout.fork_probabilities) + PRIOR_WEIGHT * self.fork_rate) / \
            (len(rollout.fork_probabilities) + PRIOR_WEIGHT)
        return c, p

    def forking(self, rollout: Rollout, path: Trajectory) -> bool:
        return path.active and path.kind != "fill" and rollout.policy != "none" and self.branch_factor > 1

    def forkable(self, rollout: Rollout, g: int, per_path: Callable[[Rollout, Trajectory], float]) -> float:
        """What forking can still add to prompt `g`: per line, `per_path` summed over its live paths, capped by the
        line's remaining share."""
        return sum(min(total, self.shares.remaining(rollout, g, line))
                   for line, total in self._per_line(rollout, g, per_path).items())

    def _per_line(self, rollout: Rollout, g: int, per_path: Callable[[Rollout, Trajectory], float]) -> dict:
        by_line: dict[int | None, float] = {}
        for path in rollout.groups[g]:
            if path.committed and self.forking(rollout, path):
                by_line[path.line] = by_line.get(path.line, 0) + per_path(rollout, path)
        return by_line

    def pool(self, rollout: Rollout, g: int) -> None:
        """Slots a line's share holds beyond what its live paths could still fork go, one at a time, to a line drawn
        at random among those that could fork more than their share: a line that ends without forking leaves its
        slots to the others, so fill-ups start only where forking cannot fill the prompt (paper §3.1, "while the
        prompt has fewer than M paths"), yet no slot goes to whichever path reaches a tool result first."""
        shares, capacity = self.shares.shares(rollout, g), self._per_line(rollout, g, self.capacity)
        room = {line: capacity.get(line, 0) - self.shares.remaining(rollout, g, line) for line in shares}
        for donor in sorted(line for line, spare in room.items() if spare < 0):
            while room[donor] < 0 and (takers := sorted(line for line, spare in room.items() if spare > 0)):
                taker = self.shares.rng.choice(takers)
                shares[donor], shares[taker] = shares[donor] - 1, shares[taker] + 1
                room[donor], room[taker] = room[donor] + 1, room[taker] - 1

    def speculative_count(self, rollout: Rollout, g: int, missing: int) -> int:
        """How many of the `missing` slots fill-ups should hold before they are certain: the f-th is needed when
        forking adds at most `missing` - f paths, and starts early when that is at least `FILL_UP_ODDS` likely
        (`added_paths` per live path, independent, within the prompt's open slots as `pool` shares them)."""
        total = [1.0]
        for path in rollout.groups[g]:
            if path.committed and self.forking(rollout, path):
                total = _times(total, self.added_paths(rollout, path, missing), missing)
        at_most = [sum(total[: j + 1]) for j in range(len(total))] + [1.0] * (missing + 1 - len(total))
        return sum(at_most[missing - f] >= FILL_UP_ODDS for f in range(1, missing + 1))

    def update(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Pool the shares lines can no longer use. Commit (oldest first), or start, every fill-up the prompt is now
        certain to need: the slots forking cannot supply even if every live path forked at every tool result it may
        reach. Then keep the fill-ups likely to be needed running (`speculative_count`); a fork takes a speculative
        one's slot back (`make_room`).
        Forks never wait for fill-ups and fill-ups are committed by start order, so the trees are those of
        certain fill-ups started at the end, as the paper describes, only sooner."""
        if g in rollout.monitoring:  # AEPO: how many global samples the group gets is not decided yet
            return
        group, m = rollout.groups[g], rollout.num_generations
        self.pool(rollout, g)
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
        wanted = self.speculative_count(rollout, g, m - committed_count(group))
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


def _mix(a: float, x: list[float], b: float, y: list[float]) -> list[float]:
    """a·x + b·y for two distributions over path counts."""
    return [a * (x[j] if j < len(x) else 0.0) + b * (y[j] if j < len(y) else 0.0) for j in range(max(len(x), len(y)))]


def _times(x: list[float], y: list[float], limit: int) -> list[float]:
    """The distribution of the sum of independent counts, all of `limit` or more in the last entry."""
    out = [0.0] * min(limit + 1, len(x) + len(y) - 1)
    for i, a in enumerate(x):
        for j, b in enumerate(y):
            out[min(i + j, limit)] += a * b
    return out


def _power(x: list[float], n: int, limit: int) -> list[float]:
    out = [1.0]
    for _ in range(n):
        out = _times(out, x, limit)
    return out


def _shifted(x: list[float], by: int, limit: int) -> list[float]:
    """The distribution of a count plus `by`."""
    out = [0.0] * min(limit + 1, len(x) + by)
    for j, a in enumerate(x):
        out[min(j + by, limit)] += a
    return out
