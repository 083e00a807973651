"""ARPO's entropy-based adaptive rollout (paper §3.1; reference `vllm_rollout_with_tools.py`), event-driven.

Per prompt, with a budget of M trajectories, N global paths start the tree, and every path runs one program
(`BranchingSampler._grow`):
  1. generate until a tool's closing tag, EOS or its length budget; the first k tokens of the path's first
     segment give H_initial (entropy normalised by ln|V|);
  2. run the tool and append ` <result>\\n…\\n</result>` (loss mask 0; with a `ChatTemplateFormat`, the chat
     template's tool message and next assistant header instead);
  3. probe: generate the next k tokens only, and measure their entropy H;
  4. right then, while the prompt has fewer than M paths, fork Z-1 copies of the path at the tool result with
     probability clip(τ + β·(H - H_initial), 0, 1); the copies start from the result beside the path, which goes
     on after its probe;
  5. back to 1, until EOS, the call limit or the budget.
When forking can no longer fill a prompt's M slots (even if every live path forked at every tool result it may
still reach), all the missing trajectories start at once as fresh global samples ("fill-ups", paper §3.1 step 4:
"add M-N-Ẑ trajectory-level samples"). Each prompt ends with exactly M trajectories.

A scheduler (`arpo_trl.scheduling`) drives the programs: against a server every path advances on its own; with a
batch engine the requests that are ready together form one batch (a wave), in path order, so a seed reproduces the
trees.

Where we differ from the reference code, deliberately (see docs/differences.md):
  * H_initial is reset every rollout and inherited by branches (the reference keeps a per-slot dict that is
    never cleared, so from the second step on ΔH compares with a stale, unrelated value).
  * The fork is decided by the k tokens right after a tool result and placed at that result, as the paper
    describes; the reference decides with the previous segment's entropy, one round late.
  * Fill-ups start all at once, as soon as they are certain to be needed, and do not fork; the reference adds one
    per round once every path of the prompt has ended, and lets it fork.
  * Tokens the environment writes (tool results, the EOS after the call limit, the tail of a closing tag
    that ended inside a token) have loss mask 0: the loss covers exactly the tokens the model sampled.
  * Result text is encoded without special tokens (the reference's `encode` would insert a BOS on Llama).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from arpo_trl.engines import GenerationEngine, Segment, normalized_entropy
from arpo_trl.scheduling import CallRequest, GenerateRequest, make_scheduler
from arpo_trl.tags import cut_at_stop
from arpo_trl.tool_calls import CallFormat, TagFormat, ToolCall
from arpo_trl.tools.base import Tool, ToolEnvironmentError
from arpo_trl.tools.runner import CallOutcome


@dataclass
class Trajectory:
    """One path of a rollout tree. Its first `fork_position` completion tokens are its parent's."""

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
    tool_calls: int = 0
    tool_failures: int = 0
    initial_entropy: float | None = None
    segment_entropies: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # None while active
    segment_start: int = 0  # where the segment being generated began (after the last environment tokens)
    fork_decisions: int = 0  # tool results whose fork decision is settled (inherited by branches)

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def own_tokens(self) -> int:
        """Model-sampled tokens this path generated itself (not inherited from its parent)."""
        return sum(self.mask[self.fork_position or 0 :])

    def snapshot(self, length: int) -> tuple[list[int], list[int], list[float], list[float]]:
        return self.completion_ids[:length], self.mask[:length], self.logprobs[:length], self.entropies[:length]

    def cut(self, length: int) -> None:
        self.completion_ids, self.mask, self.logprobs, self.entropies = self.snapshot(length)


@dataclass
class RolloutStats:
    forks: int = 0
    fork_deltas: list[float] = field(default_factory=list)
    fill_ups: int = 0
    waves: int = 0  # batch engines: engine calls; event-driven: most requests in sequence along one chain
    critical_path_tokens: int = 0  # longest chain of sequentially generated tokens the rollout waited for
    requests: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    seconds: float = 0.0  # the whole rollout
    generation_seconds: float = 0.0  # while generation was in progress
    tool_seconds: float = 0.0  # waiting for tool calls alone (no generation in progress)
    overhead_seconds: float = 0.0  # in the sampler's own code: tag cutting, encoding, branching, scheduling


@dataclass
class RolloutResult:
    groups: list[list[Trajectory]]  # per prompt, exactly M trajectories in creation order
    stats: RolloutStats

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group]


@dataclass
class Rollout:
    """The state of one `sample` call, shared by the path programs and the scheduler."""

    groups: list[list[Trajectory]]
    num_generations: int
    policy: str
    stats: RolloutStats = field(default_factory=RolloutStats)
    started: list[tuple[Trajectory, Trajectory | None]] = field(default_factory=list)  # (new path, its creator)
    next_id: int = 0


BRANCH_POLICIES = ("entropy", "random", "none")
SCHEDULERS = ("auto", "events", "waves")
_OPEN = object()  # `_absorb`: the probe stopped at k tokens inside a segment, which goes on


def default_initial_rollouts(num_generations: int, branch_policy: str) -> int:
    """N when unset: M // 2 as the released scripts (16/8, 12/6); all M for trajectory-level sampling."""
    return num_generations if branch_policy == "none" else max(1, num_generations // 2)


def check_branching_args(
    num_generations: int, initial_rollouts: int, branch_factor: int, branch_threshold: float,
    entropy_window: int, branch_policy: str, max_tool_calls: int,
) -> None:
    """Raise a ValueError naming the field for any invalid combination (shared by ARPOConfig)."""
    m, n = num_generations, initial_rollouts
    if branch_policy not in BRANCH_POLICIES:
        raise ValueError(f"branch_policy must be one of {BRANCH_POLICIES}, got {branch_policy!r}.")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"initial_rollouts (N) must be an integer >= 1, got {n!r}.")
    if n > m:
        raise ValueError(f"initial_rollouts (N={n}) must not exceed num_generations (M={m}).")
    if branch_policy == "none" and n != m:
        raise ValueError(
            f"branch_policy='none' samples whole trajectories only, so initial_rollouts must equal "
            f"num_generations (M={m}); got initial_rollouts={n}."
        )
    if branch_factor < 1:
        raise ValueError(f"branch_factor (Z) must be >= 1, got {branch_factor}.")
    if not 0.0 <= branch_threshold <= 1.0:
        raise ValueError(f"branch_threshold (τ) must be in [0, 1], got {branch_threshold}.")
    if entropy_window < 1:
        raise ValueError(f"entropy_window (k) must be >= 1, got {entropy_window}.")
    if max_tool_calls < 0:
        raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}.")


class BranchingSampler:
    """Builds ARPO rollout trees from token-id prompts with any `GenerationEngine` and tools, called as tags
    (`TagFormat`, the default) or through the chat template (`call_format=ChatTemplateFormat(...)`).

    `scheduler`: 'events' (every path advances on its own; needs an engine with `agenerate`, such as
    `VLLMServerEngine`), 'waves' (ready requests batched into one `generate` call; deterministic for a seed), or
    'auto' (events when the engine can, else waves).
    """

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer,
        tools: Sequence[Tool] = (),
        *,
        num_generations: int = 16,
        initial_rollouts: int | None = None,
        branch_factor: int = 2,
        branch_threshold: float = 0.5,
        entropy_weight: float = 0.2,
        entropy_window: int = 20,
        branch_policy: str = "entropy",
        max_tool_calls: int = 3,
        max_completion_length: int = 512,
        tool_timeout: float = 30.0,
        max_tool_workers: int = 8,
        seed: int | None = None,
        call_format: CallFormat | None = None,
        scheduler: str = "auto",
    ):
        tags = [tool.tag for tool in tools]
        if len(set(tags)) != len(tags):
            raise ValueError(f"Tool tags must be unique, got {tags}.")
        if initial_rollouts is None:
            initial_rollouts = default_initial_rollouts(num_generations, branch_policy)
        check_branching_args(num_generations, initial_rollouts, branch_factor, branch_threshold, entropy_window,
                             branch_policy, max_tool_calls)
        if tool_timeout <= 0 or max_tool_workers < 1:
            raise ValueError(f"tool_timeout must be > 0 and max_tool_workers >= 1, got {tool_timeout}, "
                             f"{max_tool_workers}.")
        self.engine, self.tokenizer, self.tools = engine, tokenizer, list(tools)
        self.call_format = call_format if call_format is not None else TagFormat(tools)
        self.num_generations, self.initial_rollouts = num_generations, initial_rollouts
        self.branch_factor, self.branch_threshold, self.entropy_weight = branch_factor, branch_threshold, entropy_weight
        self.entropy_window, self.branch_policy = entropy_window, branch_policy
        self.max_tool_calls, self.max_completion_length = max_tool_calls, max_completion_length
        self.tool_timeout, self.max_tool_workers = tool_timeout, max_tool_workers
        self.rng = random.Random(seed)
        self.scheduler = make_scheduler(scheduler, engine)
        eos = getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id]
        self.eos_token_id = eos[0]
        self._max_token_chars: int | None = None

    # ---- the algorithm ------------------------------------------------------------------------------------
    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int | None = None,
        initial_rollouts: int | None = None,
        branch_policy: str | None = None,
    ) -> RolloutResult:
        """Exactly `num_generations` trajectories for each prompt (arguments override the defaults, e.g. for
        evaluation without branching)."""
        policy = branch_policy or self.branch_policy
        m = num_generations or self.num_generations
        n = initial_rollouts or (m if policy == "none" else min(self.initial_rollouts, m))
        check_branching_args(m, n, self.branch_factor, self.branch_threshold, self.entropy_window, policy,
                             self.max_tool_calls)
        start = time.perf_counter()
        rollout = Rollout([[] for _ in prompts], m, policy)
        for g, prompt in enumerate(prompts):
            for _ in range(n):
                self._start(rollout, g, list(prompt), "global", None)
            self._fill_up(rollout, g, None)
        self.scheduler.run(self, rollout)
        rollout.stats.seconds = time.perf_counter() - start
        return RolloutResult(rollout.groups, rollout.stats)

    def grow(self, rollout: Rollout, path: Trajectory) -> Generator[GenerateRequest | CallRequest, object, None]:
        """One path's program (paper §3.1): it yields requests (generate, call a tool) and receives their results
        (a `Segment`, a `CallOutcome`); forks and fill-ups it starts are queued in `rollout.started`."""
        probe = continued = False
        while path.active:
            room = self.max_completion_length - len(path.completion_ids)
            segment = yield GenerateRequest(path, min(room, self.entropy_window) if probe else room)
            if not continued:
                entropy = normalized_entropy(segment.entropies, self.entropy_window, self.engine.vocab_size)
                if probe:  # the k tokens after the tool result decide the fork at that result, right now
                    self._decide_fork(rollout, path, entropy - path.initial_entropy)
                path.segment_entropies.append(entropy)
                if path.initial_entropy is None:
                    path.initial_entropy = entropy
            call = self._absorb(path, segment, continued, probe and room > self.entropy_window)
            probe, continued = False, call is _OPEN
            if isinstance(call, ToolCall):
                outcome = yield CallRequest(path, call)
                self._append_result(rollout.stats, path, call, outcome)
                probe = path.active and self._at_tool_result(rollout, path)
        self._fill_up(rollout, path.group, path)

    def fork_probability(self, delta_entropy: float, policy: str | None = None) -> float:
        """P(fork) = clip(τ + β·ΔH, 0, 1) for 'entropy'; τ for the 'random' ablation."""
        if (policy or self.branch_policy) == "random":
            return self.branch_threshold
        return min(1.0, max(0.0, self.branch_threshold + self.entropy_weight * delta_entropy))

    # ---- tree steps -----------------------------------------------------------------------------------------
    def _at_tool_result(self, rollout: Rollout, path: Trajectory) -> bool:
        """A tool result was appended: probe first if a fork is possible here (also for the 'random' ablation, so
        that it differs from ARPO in the decision only), else settle the decision at once."""
        if self._may_fork(rollout, path):
            return True
        self._decide_fork(rollout, path, None)
        return False

    def _may_fork(self, rollout: Rollout, path: Trajectory) -> bool:
        group = rollout.groups[path.group]
        return rollout.policy != "none" and self.branch_factor > 1 and path.kind != "fill" and \
            len(group) < rollout.num_generations

    def _decide_fork(self, rollout: Rollout, path: Trajectory, delta: float | None) -> None:
        """Settle the fork at the path's latest tool result: Z-1 copies with probability P (paper §3.1 step 3)."""
        path.fork_decisions += 1
        if delta is not None and self._may_fork(rollout, path):  # None: no fork was possible at the result
            if self.rng.random() < self.fork_probability(delta, rollout.policy):
                group, stats = rollout.groups[path.group], rollout.stats
                for _ in range(min(self.branch_factor - 1, rollout.num_generations - len(group))):
                    child = self._start(rollout, path.group, path.prompt_ids, "branch", path)
                    child.completion_ids, child.mask, child.logprobs, child.entropies = path.snapshot(
                        path.segment_start)
                    child.parent, child.fork_position, child.fork_delta = path.id, path.segment_start, delta
                    child.segment_start, child.fork_decisions = path.segment_start, path.fork_decisions
                    child.tool_calls, child.tool_failures = path.tool_calls, path.tool_failures
                    child.initial_entropy, child.segment_entropies = path.initial_entropy, list(path.segment_entropies)
                    stats.forks += 1
                    stats.fork_deltas.append(delta)
        self._fill_up(rollout, path.group, path)

    def fork_capacity(self, rollout: Rollout, path: Trajectory) -> int:
        """The most paths forking can still add below a live path: Z-1 copies at each tool result it may still
        reach, and likewise below every copy, so Z^r - 1 for r unsettled fork decisions."""
        if not path.active or path.kind == "fill" or rollout.policy == "none" or self.branch_factor == 1:
            return 0
        remaining = max(0, self.max_tool_calls - path.fork_decisions)
        return min(self.branch_factor ** remaining - 1, rollout.num_generations)

    def _fill_up(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Start every global path the prompt is now certain to need: those forking cannot supply."""
        group = rollout.groups[g]
        capacity = sum(self.fork_capacity(rollout, path) for path in group)
        for _ in range(rollout.num_generations - len(group) - capacity):
            self._start(rollout, g, group[0].prompt_ids, "fill", creator)
            rollout.stats.fill_ups += 1

    def _start(self, rollout: Rollout, g: int, prompt_ids: list[int], kind: str, creator: Trajectory | None):
        path = Trajectory(id=rollout.next_id, group=g, prompt_ids=prompt_ids, kind=kind)
        rollout.next_id += 1
        rollout.groups[g].append(path)
        rollout.started.append((path, creator))
        return path

    # ---- path steps ------------------------------------------------------------------------------------------
    def _append(self, path: Trajectory, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None,
                entropies: Sequence[float] | None = None) -> None:
        path.completion_ids += ids
        path.mask += [mask] * len(ids)
        path.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        path.entropies += list(entropies) if entropies is not None else [math.nan] * len(ids)

    def _absorb(self, path: Trajectory, seg: Segment, continued: bool, may_continue: bool):
        """Append generated tokens to the open segment; return the tool call it ends with, `_OPEN` if a probe
        stopped inside it, or None once the path is finished. A continued segment is searched as a whole: a tag
        may straddle the probe and its continuation, which the engine (seeing only new text) cannot stop at."""
        start = path.segment_start
        self._append(path, seg.token_ids, 1, seg.logprobs, seg.entropies)
        stops = self.call_format.stop_strings
        found = seg.finish_reason == "stop" or continued
        cut = cut_at_stop(path.completion_ids[start:], self._decode, self._encode, stops) if found else None
        if cut is None:
            if may_continue and seg.finish_reason == "length" and len(path.completion_ids) < self.max_completion_length:
                return _OPEN
            path.finish_reason = "eos" if seg.finish_reason == "eos" else "length"
            return self._finish(path, path.finish_reason)
        kept, rewritten, stop = cut
        path.cut(start + len(kept))  # what the engine generated past the tag is dropped
        self._append(path, rewritten, 0)
        call = self.call_format.parse(self._decode(kept + rewritten), stop)
        if path.tool_calls >= self.max_tool_calls:
            self._append(path, [self.eos_token_id], 0)  # reference: EOS after the call limit (VRT L350)
            return self._finish(path, "call_limit")
        if call is None:
            return self._finish(path, "empty_call")  # reference: an empty call silently ends the path
        if len(path.completion_ids) >= self.max_completion_length:
            return self._finish(path, "length")
        path.tool_calls += 1
        return call

    def _finish(self, path: Trajectory, reason: str) -> None:
        path.finish_reason = reason
        self._truncate(path)
        return None

    def _truncate(self, path: Trajectory) -> None:
        """Enforce the completion budget: cut what overshoots; a path with no room left is finished."""
        limit = self.max_completion_length
        over = len(path.completion_ids) > limit
        if over:
            path.cut(limit)
        if over or (path.active and len(path.completion_ids) >= limit):
            path.finish_reason = "length"

    def _append_result(self, stats: RolloutStats, path: Trajectory, call: ToolCall, outcome: CallOutcome | None):
        text, failed = self._tool_output(call, outcome)
        stats.tool_calls += 1
        stats.tool_failures += failed
        path.tool_failures += failed
        room = self.max_completion_length - len(path.completion_ids)
        text = text[: (room + 16) * self._longest_token()]  # a huge output: encode no more than can fit
        self._append(path, self._encode(self.call_format.render_result(text, call)), 0)
        path.segment_start = len(path.completion_ids)
        self._truncate(path)

    def _tool_output(self, call: ToolCall, outcome: CallOutcome | None) -> tuple[str, bool]:
        """The result text of a call and whether it failed; a malformed call's error is its result."""
        if outcome is None:
            return call.error, True
        tag, text = call.tool.tag, outcome.value
        if outcome.timed_out:
            return f"Error: Tool({tag}) timed out after {self.tool_timeout:g} s.", True
        if isinstance(outcome.error, ToolEnvironmentError):
            raise RuntimeError(f"Tool({tag}) cannot run: {outcome.error}") from outcome.error
        if outcome.error is not None:  # a tool's failure is the model's observation, never the trainer's crash
            exc = outcome.error
            return f"Error: Tool({tag}) execution failed with message: {type(exc).__name__}: {exc}", True
        if not isinstance(text, str):
            return f"Error: Tool({tag}) returned {type(text).__name__}, not str.", True
        return text, False

    def _longest_token(self) -> int:
        """Characters in the vocabulary's longest token (an upper bound on characters per token)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max(map(len, vocab), default=64) + 4
        return self._max_token_chars

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        # Tokenizers reject lone surrogates, which a tool's str may hold (JSON escapes, surrogateescape).
        return self.tokenizer.encode(text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False)
