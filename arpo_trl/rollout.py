"""ARPO's entropy-based adaptive rollout (paper §3.1; reference `vllm_rollout_with_tools.py`).

Per prompt, with a budget of M trajectories:
  1. start N global paths from the prompt;
  2. generate every active path until a tool's closing tag, EOS or its length budget;
  3. measure H, the entropy of the first k tokens of each new segment (normalised by ln|V|); a path's
     first segment sets H_initial;
  4. run the tool calls (concurrently) and append ` <result>\\n…\\n</result>` (loss mask 0; with a
     `ChatTemplateFormat`, the chat template's tool message and next assistant header instead);
  5. for each segment that followed a tool result, fork Z-1 copies of the path at that result with
     probability clip(τ + β·(H - H_initial), 0, 1), while the prompt has fewer than M paths;
  6. if none of a prompt's paths is active and it has fewer than M, add one fresh global path;
  repeat 2-6 until no path is active. Each prompt ends with exactly M trajectories.

Where we differ from the reference code, deliberately (see docs/differences.md):
  * H_initial is reset every rollout and inherited by branches (the reference keeps a per-slot dict that is
    never cleared, so from the second step on ΔH compares with a stale, unrelated value).
  * The fork is decided by the entropy measured right after a tool result and placed at that result, as
    the paper describes; the reference decides with the previous segment's entropy (one round late).
  * Tokens the environment writes (tool results, the EOS after the call limit, the tail of a closing tag
    that ended inside a token) have loss mask 0: the loss covers exactly the tokens the model sampled.
  * Result text is encoded without special tokens (the reference's `encode` would insert a BOS on Llama).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from arpo_trl.engines import GenerationEngine, Segment, normalized_entropy
from arpo_trl.tags import cut_at_stop
from arpo_trl.tool_calls import CallFormat, TagFormat, ToolCall
from arpo_trl.tools.base import Tool, ToolEnvironmentError
from arpo_trl.tools.runner import CallOutcome, run_calls


@dataclass
class Trajectory:
    """One path of a rollout tree. Its first `fork_position` completion tokens are its parent's."""

    id: int
    group: int
    prompt_ids: list[int]
    kind: str  # "global", "branch" or "fill" (a top-up global path)
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
    # Bookkeeping for the fork rule: was the last thing appended a tool result, and where did the current
    # segment start (length and call count), so that a fork can copy the path as it was at that result.
    awaiting_entropy: bool = False
    fork_candidate: bool = False
    _segment_start: tuple[int, int, int] = (0, 0, 0)

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def own_tokens(self) -> int:
        """Model-sampled tokens this path generated itself (not inherited from its parent)."""
        return sum(self.mask[self.fork_position or 0 :])

    def snapshot(self, length: int) -> tuple[list[int], list[int], list[float], list[float]]:
        return self.completion_ids[:length], self.mask[:length], self.logprobs[:length], self.entropies[:length]


@dataclass
class RolloutStats:
    forks: int = 0
    fork_deltas: list[float] = field(default_factory=list)
    fill_ups: int = 0
    rounds: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    seconds: float = 0.0  # the whole rollout
    generation_seconds: float = 0.0  # inside engine.generate
    tool_seconds: float = 0.0  # waiting for tool calls

    @property
    def overhead_seconds(self) -> float:
        """Sampler bookkeeping: neither generation nor tools (tag cutting, encoding, branching)."""
        return self.seconds - self.generation_seconds - self.tool_seconds


@dataclass
class RolloutResult:
    groups: list[list[Trajectory]]  # per prompt, exactly M trajectories in creation order
    stats: RolloutStats

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for group in self.groups for t in group]


BRANCH_POLICIES = ("entropy", "random", "none")


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


@dataclass
class _ToolRequest:
    path: Trajectory
    call: ToolCall


class BranchingSampler:
    """Builds ARPO rollout trees from token-id prompts with any `GenerationEngine` and tools, called as tags
    (`TagFormat`, the default) or through the chat template (`call_format=ChatTemplateFormat(...)`)."""

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
    ):
        tags = [tool.tag for tool in tools]
        if len(set(tags)) != len(tags):
            raise ValueError(f"Tool tags must be unique, got {tags}.")
        if initial_rollouts is None:
            initial_rollouts = default_initial_rollouts(num_generations, branch_policy)
        check_branching_args(num_generations, initial_rollouts, branch_factor, branch_threshold, entropy_window,
                             branch_policy, max_tool_calls)
        self.engine, self.tokenizer = engine, tokenizer
        self.call_format = call_format if call_format is not None else TagFormat(tools)
        self.num_generations, self.initial_rollouts = num_generations, initial_rollouts
        self.branch_factor, self.branch_threshold, self.entropy_weight = branch_factor, branch_threshold, entropy_weight
        self.entropy_window, self.branch_policy = entropy_window, branch_policy
        self.max_tool_calls, self.max_completion_length = max_tool_calls, max_completion_length
        self.tool_timeout = tool_timeout
        self.rng = random.Random(seed)
        self.max_tool_workers = max_tool_workers
        eos = getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id]
        self.eos_token_id = eos[0]

    # ---- the algorithm ------------------------------------------------------------------------------
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
        stats, self._next_id, start = RolloutStats(), 0, time.perf_counter()
        groups = [[self._new_path(g, list(p), "global") for _ in range(n)] for g, p in enumerate(prompts)]
        while active := [path for group in groups for path in group if path.active]:
            stats.rounds += 1
            generation_start = time.perf_counter()
            segments = self.engine.generate(
                [path.prompt_ids + path.completion_ids for path in active],
                [self.max_completion_length - len(path.completion_ids) for path in active],
                self.call_format.stop_strings,
            )
            stats.generation_seconds += time.perf_counter() - generation_start
            requests = [r for path, seg in zip(active, segments) if (r := self._absorb(path, seg))]
            tools_start = time.perf_counter()
            self._run_tools(requests, stats)
            stats.tool_seconds += time.perf_counter() - tools_start
            for group in groups:
                if policy != "none":
                    self._branch(group, m, policy, stats)
                if len(group) < m and not any(path.active for path in group):
                    group.append(self._new_path(group[0].group, group[0].prompt_ids, "fill"))
                    stats.fill_ups += 1
        stats.seconds = time.perf_counter() - start
        return RolloutResult(groups, stats)

    def fork_probability(self, delta_entropy: float, policy: str | None = None) -> float:
        """P(fork) = clip(τ + β·ΔH, 0, 1) for 'entropy'; τ for the 'random' ablation."""
        if (policy or self.branch_policy) == "random":
            return self.branch_threshold
        return min(1.0, max(0.0, self.branch_threshold + self.entropy_weight * delta_entropy))

    # ---- steps ----------------------------------------------------------------------------------------
    def _new_path(self, group: int, prompt_ids: list[int], kind: str) -> Trajectory:
        self._next_id += 1
        return Trajectory(id=self._next_id - 1, group=group, prompt_ids=prompt_ids, kind=kind)

    def _append(self, path: Trajectory, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None,
                entropies: Sequence[float] | None = None) -> None:
        path.completion_ids += ids
        path.mask += [mask] * len(ids)
        path.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        path.entropies += list(entropies) if entropies is not None else [math.nan] * len(ids)

    def _absorb(self, path: Trajectory, seg: Segment) -> _ToolRequest | None:
        """Append a generated segment; record its entropy; return the tool call it ends with, if any."""
        path._segment_start = (len(path.completion_ids), path.tool_calls, path.tool_failures)
        path.fork_candidate, path.awaiting_entropy = path.awaiting_entropy, False
        entropy = normalized_entropy(seg.entropies, self.entropy_window, self.engine.vocab_size)
        path.segment_entropies.append(entropy)
        if path.initial_entropy is None:
            path.initial_entropy = entropy
        stops = self.call_format.stop_strings
        cut = cut_at_stop(seg.token_ids, self._decode, self._encode, stops) if seg.finish_reason == "stop" else None
        if cut is None:
            self._append(path, seg.token_ids, 1, seg.logprobs, seg.entropies)
            path.finish_reason = "eos" if seg.finish_reason == "eos" else "length"
            return None
        kept, rewritten, stop = cut
        self._append(path, kept, 1, seg.logprobs[: len(kept)], seg.entropies[: len(kept)])
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
        return _ToolRequest(path, call)

    def _finish(self, path: Trajectory, reason: str) -> None:
        path.finish_reason = reason
        self._truncate(path)
        return None

    def _truncate(self, path: Trajectory) -> None:
        """Enforce the completion budget: cut what overshoots; a path with no room left is finished."""
        limit = self.max_completion_length
        over = len(path.completion_ids) > limit
        if over:
            path.completion_ids, path.mask, path.logprobs, path.entropies = path.snapshot(limit)
        if over or (path.active and len(path.completion_ids) >= limit):
            path.finish_reason = "length"

    def _run_tools(self, requests: list[_ToolRequest], stats: RolloutStats) -> None:
        valid = [r for r in requests if r.call.error is None]
        outcomes = run_calls([_bind(r.call.tool, r.call.content) for r in valid], self.max_tool_workers,
                             self.tool_timeout)  # one deadline for the round's concurrent calls
        by_request = {id(r): outcome for r, outcome in zip(valid, outcomes)}
        for request in requests:
            path = request.path
            text, failed = self._tool_output(request.call, by_request.get(id(request)))
            stats.tool_calls += 1
            stats.tool_failures += failed
            path.tool_failures += failed
            self._append(path, self._encode(self.call_format.render_result(text, request.call)), 0)
            path.awaiting_entropy = True
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

    def _branch(self, group: list[Trajectory], m: int, policy: str, stats: RolloutStats) -> None:
        """Fork paths whose newest segment followed a tool result, at that result (paper §3.1 step 3)."""
        for source in list(group):
            if len(group) >= m:
                return
            if not source.fork_candidate:
                continue
            source.fork_candidate = False
            delta = source.segment_entropies[-1] - source.initial_entropy
            if self.rng.random() >= self.fork_probability(delta, policy):
                continue
            for _ in range(min(self.branch_factor - 1, m - len(group))):
                group.append(self._fork(source, delta))
                stats.forks += 1
                stats.fork_deltas.append(delta)

    def _fork(self, source: Trajectory, delta: float) -> Trajectory:
        length, calls, failures = source._segment_start
        child = self._new_path(source.group, source.prompt_ids, "branch")
        child.completion_ids, child.mask, child.logprobs, child.entropies = source.snapshot(length)
        child.parent, child.fork_position, child.fork_delta = source.id, length, delta
        child.tool_calls, child.tool_failures = calls, failures
        child.initial_entropy = source.initial_entropy
        child.segment_entropies = source.segment_entropies[:-1]
        return child

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        # Tokenizers reject lone surrogates, which a tool's str may hold (JSON escapes, surrogateescape).
        return self.tokenizer.encode(text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False)


def _bind(tool: Tool, content: str):
    return lambda: tool(content)
