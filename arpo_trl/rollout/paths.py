"""The records of a rollout: its paths (`Trajectory`, apart from what the rule tracks while growing one: `Growth`),
statistics, result, the state its path programs share while it runs (`Rollout`), and the seeds every draw is keyed by
(`derive_seed`)."""

from __future__ import annotations

import hashlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from arpo_trl.tools.failures import ToolTally


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a path, as the sampler saw it: every reader (trees, pictures, evaluation, rewards) takes the
    calls from here instead of re-parsing the text, so that any call format (`tags`, `chat_template`) reads alike.
    Token offsets index the completion."""

    tool: str  # the tool's tag ("python", "search"); "" when the call names no tool we have
    arguments: str = ""  # what the tool ran on: the tag's content, or the JSON call's arguments as the tool's input
    call_chars: int = 0  # characters of the call as the model wrote it (open to close marker), before `result_start`
    ran: bool = True  # False: not run (past max_tool_calls, empty, or still open at the end); the path ended there
    result_start: int | None = None  # the environment's reply is completion tokens [result_start, result_end)
    result_end: int | None = None
    failed: bool = False  # the reply is an error: the tool raised or timed out, or the call was malformed
    seconds: float = 0.0  # the tool's running time

    @property
    def answered(self) -> bool:
        return self.result_start is not None


@dataclass(frozen=True)
class ForkDecision:
    """A fork decision a path made at one of its tool results (paper §3.1 step 3): the fork was possible, and the
    path forked iff `draw` < `probability` (or the fork was certain at the result: `draw` below every P the probe
    could have given)."""

    position: int  # completion tokens up to the end of the tool result: where the copies start
    delta: float  # ΔH, normalised by ln|V|
    probability: float  # P = clip(τ + β·ΔH, 0, 1) (τ for 'random'; with AEPO's penalty for 'aepo')
    draw: float  # the uniform it was compared with (`arpo.fork_draw`)
    forked: bool


@dataclass
class Growth:
    """What the rule tracks of a path while it grows it; none of it is the trajectory's record."""

    segment_start: int = 0  # where the segment being generated began (after the last environment tokens)
    fork_decisions: int = 0  # tool results whose fork decision is settled (inherited by branches)
    consecutive_forks: int = 0  # AEPO's l: the latest fork decisions on this path's line that forked, in a row
    pending_draw: float | None = None  # the uniform its pending fork decision compares with P (drawn at the result)
    line: int | None = None  # the id of the global path this one descends from (itself if global; None: fill-up),
    # whose share of the branch slots its forks take (`ForkShares`)


@dataclass
class Trajectory:
    """One path of a rollout tree: what it is (its tokens, mask, logprobs, calls, parent and fork point, its place in
    the tree), and, apart, what the rule tracks while growing it (`growth`). Its first `fork_position` completion tokens
    are its parent's."""

    id: int
    group: int
    prompt_ids: list[int]
    kind: str  # "global", "branch" or "fill" (a global path started to complete the budget)
    parent: int | None = None
    fork_position: int | None = None
    fork_delta: float | None = None  # ΔH that triggered this branch
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = sampled by the model, 0 = written by the environment
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # per token, nats; NaN for environment tokens
    calls: list[ToolCallRecord] = field(default_factory=list)
    initial_entropy: float | None = None
    segment_entropies: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # None while active
    environment: Any = None  # environment_factory: this path's own environment (docs/environments.md)
    # Where the path sits in its tree, whatever the order paths were started in: ('global', g, i), the i-th global
    # path of group g; ('fill', g, j), its j-th fill-up; (parent's key, d, c), copy c of a fork at the parent's d-th
    # fork decision. With the rollout's seed it gives the path's `seed`, which keys its token draws and fork draws.
    key: tuple = ()
    seed: int = 0
    decisions: list[ForkDecision] = field(default_factory=list)  # the fork decisions it made itself (not inherited)
    growth: Growth = field(default_factory=Growth)

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    @property
    def tool_calls(self) -> int:
        """Calls run (or running) on this path, inherited ones included."""
        return sum(call.ran for call in self.calls)

    @property
    def tool_failures(self) -> int:
        return sum(call.failed for call in self.calls)

    def own_tokens(self) -> int:
        """Model-sampled tokens this path generated itself (not inherited from its parent)."""
        return sum(self.mask[self.fork_position or 0 :])

    def snapshot(self, length: int) -> tuple[list[int], list[int], list[float], list[float]]:
        return self.completion_ids[:length], self.mask[:length], self.logprobs[:length], self.entropies[:length]

    def cut(self, length: int) -> None:
        """Keep the first `length` completion tokens; a tool result the cut runs through ends there."""
        self.completion_ids, self.mask, self.logprobs, self.entropies = self.snapshot(length)
        self.calls = [call if call.result_end is None or call.result_end <= length
                      else replace(call, result_end=max(length, call.result_start)) for call in self.calls]


@dataclass
class RolloutStats:
    forks: int = 0
    fork_deltas: list[float] = field(default_factory=list)
    fill_ups: int = 0
    speculative_fill_ups: int = 0  # run ahead of the rule (`prefetch.py`), whether the rule then started them or not
    discarded_tokens: int = 0  # generated by fill-ups run ahead that the rule never started
    discarded_tool_calls: int = 0
    adopted_fill_ups: int = 0  # fill-ups the rule started that had run ahead: their programs replayed the shadows'
    waves: int = 0  # batch engines: engine calls; event-driven: most requests in sequence along one chain
    global_samples: dict[int, int] = field(default_factory=dict)  # AEPO pre-monitoring: group -> its m
    critical_path_tokens: int = 0  # longest chain of sequentially generated tokens the rollout waited for
    critical_path_kind: str | None = None  # event-driven: the kind of the path that ends the longest chain
    latest_fill_up_start_tokens: int = 0  # event-driven: tokens on the chain before the latest kept fill-up started
    requests: int = 0
    continued_probes: int = 0  # event-driven: probes whose engine request decoded the segment on
    tool_calls: int = 0
    tool_failures: int = 0
    seconds: float = 0.0  # the whole rollout
    generation_seconds: float = 0.0  # while generation was in progress
    tool_seconds: float = 0.0  # waiting for tool calls alone (no generation in progress)
    overhead_seconds: float = 0.0  # in the sampler's own code: tag cutting, encoding, branching, scheduling
    tools: dict[str, ToolTally] = field(default_factory=dict)  # per tool name, the calls that ran

    def count_call(self, call: Any, outcome: Any, text: str, failed: bool) -> None:
        """Count an answered call (a `ToolCall`, its `CallOutcome` or None if it never ran, the result text)."""
        self.tool_calls += 1
        self.tool_failures += failed
        if outcome is None or call.tool is None:
            return
        tally = self.tools.setdefault(call.tool.tag, ToolTally())
        tally.calls += 1
        if failed and not tally.failures:
            tally.first_error, tally.first_arguments = text, call.content
            if outcome.error is not None:
                tally.traceback = "".join(traceback.format_exception(outcome.error))
        tally.failures += failed


@dataclass
class RolloutResult:
    groups: list[list[Trajectory]]  # per prompt, exactly M trajectories in tree order (`tree_order`)
    stats: RolloutStats

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group]


@dataclass
class Rollout:
    """The state of one rollout, shared by its path programs: the groups they grow and the budget, shares and seed the
    rule keeps them to. `started` lists the paths the rule started that nobody runs yet (`take_started`)."""

    groups: list[list[Trajectory]]
    num_generations: int
    policy: Any  # a built-in branch policy's name, or a fork policy of one's own (`fork_policy.py`)
    stats: RolloutStats = field(default_factory=RolloutStats)
    started: list[tuple[Trajectory, Trajectory | None]] = field(default_factory=list)  # (new path, its creator)
    next_id: int = 0
    monitoring: set[int] = field(default_factory=set)  # AEPO: groups whose monitoring path has not decided m yet
    environments: list | None = None  # environment_factory: per group, the reset environment its paths start from
    fork: Callable[[Any], Any] | None = None  # copies an environment in its current state (`fork_environment`)
    fork_shares: dict[int, dict[int, int]] = field(default_factory=dict)  # group -> line -> branch slots it owns
    seed: int = 0  # this rollout's: every path's seed derives from it and the path's key

    def start(self, g: int, prompt_ids: list[int], kind: str, creator: Trajectory | None,
              copy: int = 0, index: int | None = None) -> Trajectory:
        """A new path of group `g`; `creator` is the path whose step started it (None at the start), a branch's
        parent; `copy`: which of its fork's copies a branch is; `index`: which of the group's global paths or
        fill-ups this is (default: the next)."""
        path = Trajectory(id=self.next_id, group=g, prompt_ids=prompt_ids, kind=kind)
        if kind == "branch":
            path.key = (creator.key, creator.growth.fork_decisions, copy)
        else:
            path.key = (kind, g, sum(p.kind == kind for p in self.groups[g]) if index is None else index)
        path.seed = derive_seed(self.seed, path.key)
        if self.environments is not None:  # a branch continues from its parent's environment as it is at the fork
            path.environment = self.fork(creator.environment if kind == "branch" else self.environments[g])
        path.growth.line = path.id if kind == "global" else creator.growth.line if kind == "branch" else None
        self.next_id += 1
        self.groups[g].append(path)
        self.started.append((path, creator))
        return path

    def take_started(self) -> list[tuple[Trajectory, Trajectory | None]]:
        """The paths started since the last call, each with its creator, for whoever runs their programs."""
        started, self.started = self.started, []
        return started

    def finish(self) -> None:
        """Put every group (exactly M paths) in tree order (`tree_order`) and number its paths in that order across
        groups: the result does not depend on which path started first."""
        renumbered: dict[int, int] = {}
        for group in self.groups:
            group.sort(key=lambda path: tree_order(path.key))
            renumbered.update((path.id, len(renumbered)) for path in group)
        for group in self.groups:
            for path in group:
                path.id, path.parent = renumbered[path.id], renumbered.get(path.parent)
                path.growth.line = renumbered.get(path.growth.line)


def tree_order(key: tuple) -> tuple[int, ...]:
    """A path's place in a depth-first walk of its group (`Trajectory.key`): the global paths in order, each followed
    by the branches below it (by fork decision, then copy), then the fill-ups."""
    if key[0] == "global":
        return (0, key[2])
    if key[0] == "fill":
        return (1, key[2])
    parent, decision, copy = key
    return (*tree_order(parent), decision, copy)


# ---- seeds: every random draw of a rollout (a path's seed, its fork draws, a line's share of the odd branch slots)
# derives from the rollout's seed and a key naming what it is for (docs/differences.md, "Seeds") -------------------
def derive_seed(*parts) -> int:
    """A 63-bit seed from `parts` (ints, strings and tuples of them): the same in every process, run and machine
    (Python's `hash` of a string is not)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
