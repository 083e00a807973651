"""ARPO's rollout rule (Dong et al. 2025, arXiv 2507.19849, §3.1 "Entropy-based Adaptive Rollout"), read top to bottom.

Per prompt, a budget of exactly M trajectories (`num_generations`):

  1. N global samples start the tree (`BranchingRule.begin`; §3.1 step 1, "N trajectory-level samples").
  2. Every path runs one program (`BranchingRule.grow`): generate until a tool's closing tag, EOS or its length
     budget. The first k tokens (`entropy_window`) of its first segment give H_initial (§3.1 step 1).
  3. At a tool call, the tool runs and its result is appended as ` <result>\\n…\\n</result>`, loss mask 0.
  4. Right after the result the path probes: it generates k tokens only and reads their entropy H_t. With
     ΔH = H_t − H_initial, both per-token entropies summed over the k tokens and divided by ln|V| (the reference
     code's normalisation), it forks with probability P = clip(τ + β·ΔH, 0, 1) (§3.1 steps 2-3,
     `BranchingRule.fork_probability`): Z − 1 copies of the path as it stood at the tool result (tokens, mask,
     calls) start beside it, and the path goes on from its probe.
  5. Forks stop once the prompt holds M paths. When forking can no longer fill M, even if every live path forked at
     every tool result it may still reach, the missing paths start as fresh global samples, "fill-ups" (§3.1 step 4:
     "add M − N − Ẑ trajectory-level samples"; `BranchingRule._fill_up`).

AEPO (Dong et al., arXiv 2510.14545, docs/aepo.md), `branch_policy="aepo"`: one monitoring path per prompt first
decides how many of the M are global samples (`global_samples`), and a line that forked at its latest tool results
forks less (`aepo_fork_probability`). `branch_policy="random"` forks with p = τ whatever the entropy; `"none"` is GRPO
(M global samples). A policy of one's own maps what a path shows at a tool result (`ForkPoint`) to P
(`fork_policy.py`); the rest of the rule is unchanged for it.

Where we differ from the reference code, deliberately (docs/differences.md says why):
  * H_initial is reset every rollout and inherited by a branch (the reference's per-slot dict is never cleared).
  * The fork is decided by the k tokens right after a tool result and placed at that result (the paper), not one
    round late with the previous segment's entropy; a segment's entropy is k × the mean over its first min(k, n)
    tokens (`segment_statistic='mean'`; `'sum'` is the reference's).
  * A fork takes its slots from its line's share of the budget (`ForkShares`), not from whoever arrives first.
  * Every random draw is keyed by the rollout's seed and the path's place in its tree (`Trajectory.key`): the fork
    draws here, the tokens in an engine that takes a path's seed. A seed reproduces the trees in whatever
    order the paths run, whenever tool results arrive.

What is not the rule lives behind the calls this file makes: `self.writer` writes into a path (tokens in, the call
cut at its tag, results appended: `path_writer.py`). Who runs the requests a program yields (`GenerateRequest`,
`CallRequest`), when, and how fast is the runtime's business (`arpo_trl.runtime`): the rule never learns it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from arpo_trl.entropy import check_entropy_args, segment_entropy
from arpo_trl.rollout.fork_policy import ForkPoint, ForkPolicy, policy_probability, resolve_branch_policy
from arpo_trl.rollout.path_writer import OPEN, PathWriter
from arpo_trl.rollout.paths import ForkDecision, Rollout, RolloutResult, Trajectory, derive_seed
from arpo_trl.rollout.tool_calls import CallFormat, TagFormat, ToolCall, bind_call
from arpo_trl.tools.base import Tool
from arpo_trl.tools.environments import fork_environment

BRANCH_POLICIES = ("entropy", "random", "aepo", "none")


# ---- what a path's program asks its runtime for (`BranchingRule.grow` yields these, and receives a `Segment` or a
# `CallOutcome` back): the rule's side of the contract with whoever runs it -----------------------------------------
@dataclass
class GenerateRequest:
    """Continue `path` (prompt + completion so far) by at most `max_new_tokens` tokens.

    A probe (the k tokens after a tool result) sets `continues_to`, its path's whole room: a runtime whose engine can
    may answer after the k tokens and decode the segment on in the same engine request, which then answers the
    path's next request (the rest of the segment) without a new one."""

    path: Trajectory
    max_new_tokens: int
    continues_to: int | None = None
    entropy_tokens: int | None = None  # leading tokens whose entropies the rule reads (None: all)


@dataclass
class CallRequest:
    """Run a parsed tool call; a malformed call (`call.error`) is answered with None, never run."""

    path: Trajectory
    call: ToolCall


PathRequest = GenerateRequest | CallRequest


def default_initial_rollouts(num_generations: int, branch_policy: str | ForkPolicy) -> int:
    """N when unset: M // 2 as the released scripts (16/8, 12/6); all M for trajectory-level sampling."""
    return num_generations if branch_policy == "none" else max(1, num_generations // 2)


class BranchingRule:
    """ARPO's rollout rule for token-id prompts and tools, called as tags (`TagFormat`, the default) or through the
    chat template (`call_format=ChatTemplateFormat(...)`): `begin` starts a rollout's global samples, `grow` is one
    path's program, `finish` puts the trees in order. `vocab_size` normalises ΔH (ln|V|); `eos_token_id` ends a
    path."""

    def __init__(
        self,
        tokenizer,
        tools: Sequence[Tool] = (),
        *,
        vocab_size: int,
        eos_token_id: int,
        num_generations: int = 16,
        initial_rollouts: int | None = None,
        branch_factor: int = 2,
        branch_threshold: float = 0.5,
        entropy_weight: float = 0.2,
        entropy_window: int = 20,
        branch_policy: str | ForkPolicy = "entropy",
        max_tool_calls: int = 3,
        max_completion_length: int = 512,
        tool_timeout: float = 30.0,
        seed: int | None = None,
        call_format: CallFormat | None = None,
        branch_penalty: float = 0.05,  # AEPO's λ
        pre_monitoring_beta: float | None = 0.5,  # AEPO's β of the pre-monitoring
        segment_statistic: str = "mean",
    ):
        tags = [tool.tag for tool in tools]
        if len(set(tags)) != len(tags):
            raise ValueError(f"Tool tags must be unique, got {tags}.")
        branch_policy = resolve_branch_policy(branch_policy, BRANCH_POLICIES)
        if initial_rollouts is None:
            initial_rollouts = default_initial_rollouts(num_generations, branch_policy)
        check_branching_args(num_generations, initial_rollouts, branch_factor, branch_threshold, entropy_window,
                             branch_policy, max_tool_calls, entropy_weight=entropy_weight)
        check_aepo_args(branch_penalty, pre_monitoring_beta)
        check_entropy_args("auto", None, segment_statistic)
        if tool_timeout <= 0:
            raise ValueError(f"tool_timeout must be > 0, got {tool_timeout}.")
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.vocab_size = vocab_size
        self.call_format = call_format if call_format is not None else TagFormat(tools)
        self.num_generations = num_generations
        self.initial_rollouts = initial_rollouts
        self.branch_factor = branch_factor
        self.branch_threshold = branch_threshold
        self.entropy_weight = entropy_weight
        self.entropy_window = entropy_window
        self.segment_statistic = segment_statistic
        self.branch_policy = branch_policy
        self.branch_penalty = branch_penalty
        self.pre_monitoring_beta = pre_monitoring_beta
        self.max_tool_calls = max_tool_calls
        self.max_completion_length = max_completion_length
        self.tool_timeout = tool_timeout
        self.reseed(random.randrange(2 ** 63) if seed is None else seed)
        self.shares = ForkShares()
        self.eos_token_id = eos_token_id
        self.writer = PathWriter(tokenizer, self.call_format, eos_token_id, max_completion_length, max_tool_calls,
                                 tool_timeout)

    # ---- the rollout -------------------------------------------------------------------------------------------
    def begin(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int | None = None,
        initial_rollouts: int | None = None,
        branch_policy: str | ForkPolicy | None = None,
        environments: Sequence | None = None,
    ) -> Rollout:
        """A new rollout of exactly `num_generations` trajectories for each prompt, its first paths started (arguments
        override the defaults, e.g. for evaluation without branching; `environments`: per prompt, the reset
        environment its paths start from). Its started paths' programs (`grow`) then run until none is left."""
        policy = resolve_branch_policy(branch_policy or self.branch_policy, BRANCH_POLICIES)
        m = num_generations or self.num_generations
        n = initial_rollouts or (m if policy == "none" else min(self.initial_rollouts, m))
        check_branching_args(m, n, self.branch_factor, self.branch_threshold, self.entropy_window, policy,
                             self.max_tool_calls, entropy_weight=self.entropy_weight)
        rollout = Rollout([[] for _ in prompts], m, policy, environments=environments, fork=fork_environment,
                          seed=derive_seed(self.seed, self.rollouts))
        self.rollouts += 1
        monitored = policy == "aepo" and self.pre_monitoring_beta is not None
        for g, prompt in enumerate(prompts):  # step 1: N global samples (AEPO: one monitoring path first)
            for _ in range(1 if monitored else n):
                rollout.start(g, list(prompt), "global", None)
            if monitored:
                rollout.monitoring.add(g)
            self._fill_up(rollout, g, None)
        return rollout

    def finish(self, rollout: Rollout) -> RolloutResult:
        """The rollout's trees, once every path has ended: each group's M paths in tree order."""
        rollout.finish()
        return RolloutResult(rollout.groups, rollout.stats)

    def grow(self, rollout: Rollout, path: Trajectory) -> Generator[PathRequest, object, None]:
        """One path's program (steps 2-4): it yields requests (generate, call a tool) to the runtime and receives
        their results (a `Segment`, a `CallOutcome`)."""
        probe = False  # the next request's entropy decides the fork at the tool result just appended
        continued = False  # the request continues a segment that a short request stopped inside
        while path.active:
            room = self.max_completion_length - len(path.completion_ids)
            cap = min(room, self.entropy_window) if probe else room
            # the rest of a segment needs no entropy (its first k gave it); a runtime may decode a probe on
            request = GenerateRequest(path, cap, continues_to=room if probe else None,
                                      entropy_tokens=0 if continued else self.entropy_window)
            segment = yield request
            if not continued:
                entropy = segment_entropy(segment.entropies, self.entropy_window, self.vocab_size,
                                          self.segment_statistic)
                if probe:  # step 4: the k tokens after the tool result decide the fork at that result, right now
                    self._decide_fork(rollout, path, entropy - path.initial_entropy)
                path.segment_entropies.append(entropy)
                if path.initial_entropy is None:  # step 2: the path's first segment
                    path.initial_entropy = entropy
            capped = request.max_new_tokens < room and len(segment.token_ids) >= request.max_new_tokens
            call = self.writer.absorb(rollout, path, segment, continued, capped)
            probe, continued = False, call is OPEN
            if isinstance(call, ToolCall):  # step 3
                outcome = yield CallRequest(path, bind_call(call, path.environment))
                self.writer.append_result(rollout, path, call, outcome)
                probe = path.active and self._at_tool_result(rollout, path)
        if path.group in rollout.monitoring:
            self._end_monitoring(rollout, path)
        self._fill_up(rollout, path.group, path)

    # ---- forks (step 4) ----------------------------------------------------------------------------------------
    def fork_probability(self, delta_entropy: float, policy: str | None = None, consecutive_forks: int = 0) -> float:
        """P(fork) = clip(τ + β·ΔH, 0, 1) for 'entropy'; τ for the 'random' ablation; for 'aepo', the same rule with
        AEPO's penalty on a path that forked at its last `consecutive_forks` tool results (`aepo_fork_probability`).
        A policy of one's own is asked with the whole `ForkPoint` instead (`_decide_fork`)."""
        if (policy := policy or self.branch_policy) == "random":
            return self.branch_threshold
        if policy == "aepo":
            return aepo_fork_probability(delta_entropy, consecutive_forks, self.branch_threshold,
                                         self.entropy_weight, self.branch_penalty)
        return min(1.0, max(0.0, self.branch_threshold + self.entropy_weight * delta_entropy))

    def _at_tool_result(self, rollout: Rollout, path: Trajectory) -> bool:
        """A tool result was appended: whether a fork is possible here, decided by the probe that follows. The
        uniform u that the probe's P is compared with is drawn now, keyed by the path (`fork_draw`), so it is
        independent of the probe and of which path got here first."""
        if not self._may_fork(rollout, path):
            self._decide_fork(rollout, path, None)
            return False
        path.growth.pending_draw = fork_draw(path)
        return True

    def _may_fork(self, rollout: Rollout, path: Trajectory) -> bool:
        return rollout.policy != "none" and self.branch_factor > 1 and path.kind != "fill" and \
            path.group not in rollout.monitoring and self.shares.free(rollout, path) > 0

    def _decide_fork(self, rollout: Rollout, path: Trajectory, delta: float | None) -> None:
        """Settle the fork at the path's latest tool result: Z − 1 copies with probability P (None: no fork was
        possible there)."""
        kept = 0
        draw, path.growth.pending_draw = path.growth.pending_draw, None
        if delta is not None and self._may_fork(rollout, path):
            probability = policy_probability(rollout.policy, ForkPoint.of(path, delta)) if callable(rollout.policy) \
                else self.fork_probability(delta, rollout.policy, path.growth.consecutive_forks)
            forked = draw < probability
            path.decisions.append(ForkDecision(len(path.completion_ids), delta, probability, draw, forked))
            if forked:
                copies = [self.branch(rollout, path, c)
                          for c in range(min(self.branch_factor - 1, self.shares.free(rollout, path)))]
                kept = len(copies)
                for child in copies:
                    child.fork_delta = delta
                    rollout.stats.forks += 1
                    rollout.stats.fork_deltas.append(delta)
        growth = path.growth
        growth.fork_decisions += 1
        growth.consecutive_forks = growth.consecutive_forks + 1 if kept else 0  # AEPO's l: forks in a row on this line
        self._fill_up(rollout, path.group, path)

    def branch(self, rollout: Rollout, source: Trajectory, copy: int) -> Trajectory:
        """Copy number `copy` of `source` as it stands at its latest tool result (its probe not yet written)."""
        child = rollout.start(source.group, source.prompt_ids, "branch", source, copy)
        child.completion_ids, child.mask, child.logprobs, child.entropies = source.snapshot(len(source.completion_ids))
        child.parent = source.id
        child.fork_position = source.growth.segment_start
        child.growth.segment_start = source.growth.segment_start
        child.growth.fork_decisions = source.growth.fork_decisions + 1
        child.growth.consecutive_forks = source.growth.consecutive_forks + 1
        child.calls = list(source.calls)
        child.initial_entropy = source.initial_entropy
        child.segment_entropies = list(source.segment_entropies)
        return child

    # ---- the budget of exactly M (step 5) ----------------------------------------------------------------------
    def _fill_up(self, rollout: Rollout, g: int, creator: Trajectory | None) -> None:
        """Start every fill-up prompt `g` is now certain to need: the slots forking cannot supply even if every live
        path forked at every tool result it may still reach (`capacity`)."""
        if g in rollout.monitoring:  # AEPO: how many global samples the group gets is not decided yet
            return
        group = rollout.groups[g]
        if len(group) >= rollout.num_generations:
            return  # the prompt's M paths are all decided
        forkable = sum(min(sum(self.capacity(rollout, path) for path in paths), self.shares.remaining(rollout, g, line))
                       for line, paths in self.live_lines(rollout, g).items())
        certain = rollout.num_generations - len(group) - forkable
        for _ in range(max(0, certain)):
            rollout.start(g, group[0].prompt_ids, "fill", creator)
        rollout.stats.fill_ups += max(0, certain)

    def capacity(self, rollout: Rollout, path: Trajectory) -> int:
        """The most paths forking can still add below a live path: Z − 1 copies at each tool result it may still
        reach, and likewise below every copy, so Z^r − 1 for r unsettled fork decisions."""
        if not self.forking(rollout, path):
            return 0
        remaining = max(0, self.max_tool_calls - path.growth.fork_decisions)
        return min(self.branch_factor ** remaining - 1, rollout.num_generations)

    def forking(self, rollout: Rollout, path: Trajectory) -> bool:
        """Whether `path` may still fork at a tool result."""
        return path.active and path.kind != "fill" and rollout.policy != "none" and self.branch_factor > 1

    def live_lines(self, rollout: Rollout, g: int) -> dict[int | None, list[Trajectory]]:
        """Prompt `g`'s paths that may still fork, by line (`ForkShares`)."""
        lines: dict[int | None, list[Trajectory]] = {}
        for path in rollout.groups[g]:
            if self.forking(rollout, path):
                lines.setdefault(path.growth.line, []).append(path)
        return lines

    def _end_monitoring(self, rollout: Rollout, monitor: Trajectory) -> None:
        """AEPO's entropy pre-monitoring: the group's first path, which does not fork, measured the question's entropy
        (its first segment) and the tool results' (all its segments); it is one of the m global samples
        (`global_samples`), and the other m − 1 start now. The rest of the budget goes to forks and fill-ups."""
        rollout.monitoring.discard(monitor.group)
        m = global_samples(rollout.num_generations, monitor.initial_entropy or 0.0, monitor.segment_entropies,
                           self.pre_monitoring_beta)
        rollout.stats.global_samples[monitor.group] = m
        lines = [rollout.start(monitor.group, monitor.prompt_ids, "global", monitor).id for _ in range(m - 1)]
        self.shares.split(rollout, monitor.group, lines)  # the monitor has ended: it owns no branch slot

    # ---- seeds and state ---------------------------------------------------------------------------------------
    def reseed(self, seed: int) -> None:
        """Start the sequence of rollouts of `seed` anew: the n-th `sample` call after this draws the same trees."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}.")
        self.seed = seed
        self.rollouts = 0

    def state_dict(self) -> dict:
        """What a resumed run needs to grow the same trees: the seed and the rollouts drawn so far."""
        return {"seed": self.seed, "rollouts": self.rollouts}

    def load_state_dict(self, state: dict) -> None:
        if not {"seed", "rollouts"} <= set(state):
            raise ValueError(f"The sampler state has no 'seed' and 'rollouts' (keys: {sorted(state)}): it was saved by "
                             "an arpo-trl before keyed draws, whose trees a resumed run cannot continue.")
        self.reseed(state["seed"])
        self.rollouts = state["rollouts"]


def fork_draw(path: Trajectory) -> float:
    """The uniform a path's next fork decision compares with its P: keyed by the path's seed and the decision's index,
    so it does not depend on which path reached its tool result first."""
    return derive_seed(path.seed, "fork", path.growth.fork_decisions) / 2 ** 63


class ForkShares:
    """Who may take a prompt's branch slots (docs/differences.md, "Fork slots"). The M − n slots its n global paths
    leave are split into equal shares, one per line (a global path and every branch below it); the (M − n) mod n left
    over go to lines drawn at random. A fork takes its copies from its own line's share, so which lines get branches
    follows their fork decisions (entropy), never which path reaches a tool result first; a share its line can no
    longer use goes to fill-ups. The split is made once a prompt's global paths are known (AEPO: after its monitoring
    path), the draw keyed by the rollout's seed and the prompt."""

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
        used = sum(path.kind == "branch" and path.growth.line == line for path in rollout.groups[g])
        return self.shares(rollout, g).get(line, 0) - used

    def free(self, rollout: Rollout, path: Trajectory) -> int:
        """Branch slots a fork of `path` may take now: its line's remaining share, within the prompt's M."""
        open_slots = rollout.num_generations - len(rollout.groups[path.group])
        return min(open_slots, self.remaining(rollout, path.group, path.growth.line))


# ---- AEPO's rules (arXiv 2510.14545, "Dynamic Entropy-Balanced Rollout"; constants and rounding of the authors'
# `AEPO/verl_aepo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py`; docs/aepo.md) -------------
def global_samples(budget: int, root_entropy: float, segment_entropies: Sequence[float], beta: float) -> int:
    """Entropy pre-monitoring: of a prompt's budget M, m = M·σ(β·(H_root − mean H_tool)) are global samples and the
    rest branches. H_root is the first segment's entropy of one monitoring trajectory and the mean runs over all its
    segments (the first included), as the authors' code measures them; m = floor(M·σ) + 1, kept in [1, M], as that
    code rounds it. A question more uncertain than its tool results gets more global samples."""
    mean_tool = sum(segment_entropies) / len(segment_entropies) if segment_entropies else root_entropy
    sigma = 0.5 * (1.0 + math.tanh(0.5 * beta * (root_entropy - mean_tool)))  # the logistic σ, without overflow
    return max(1, min(budget, int(budget * sigma) + 1))


def aepo_fork_probability(delta_entropy: float, consecutive_forks: int, threshold: float, weight: float,
                          penalty: float) -> float:
    """P(fork) at a tool result under AEPO's rule: fork when (u + β·ΔH)·(1 − λ·l) ≥ τ, u ~ U(0, 1), where l is the
    number of fork decisions in a row that forked on this path's line (the branch penalty P̂(l) = λ·l; λ = 0.05 in
    the authors' code). Solved for u: P = clip(1 − τ/(1 − λ·l) + β·ΔH, 0, 1), 0 once λ·l >= 1. With l = 0 and
    τ = 0.5 this is ARPO's clip(τ + β·ΔH, 0, 1)."""
    if threshold <= 0.0:
        return 1.0  # the code clips the score to [0, 1] before comparing: a zero threshold always forks
    factor = 1.0 - penalty * consecutive_forks
    if factor <= 0.0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - threshold / factor + weight * delta_entropy))


# ---- argument checks (shared by ARPOConfig) ----------------------------------------------------------------------
def check_branching_args(
    num_generations: int, initial_rollouts: int, branch_factor: int, branch_threshold: float,
    entropy_window: int, branch_policy: str | ForkPolicy, max_tool_calls: int, *, entropy_weight: float = 0.2,
) -> None:
    """Raise a ValueError naming the field for any invalid combination."""
    m, n = num_generations, initial_rollouts
    branch_policy = resolve_branch_policy(branch_policy, BRANCH_POLICIES)
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
    if isinstance(entropy_weight, bool) or not isinstance(entropy_weight, (int, float)) \
            or not math.isfinite(entropy_weight):
        raise ValueError(f"entropy_weight (β) must be a finite number (ΔH's weight in P = clip(τ + β·ΔH, 0, 1)), got "
                         f"{entropy_weight!r}.")
    if entropy_window < 1:
        raise ValueError(f"entropy_window (k) must be >= 1, got {entropy_window}.")
    if max_tool_calls < 0:
        raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}.")


def check_aepo_args(branch_penalty: float, pre_monitoring_beta: float | None) -> None:
    """Raise a ValueError naming the field (shared by ARPOConfig and the rule)."""
    if not (math.isfinite(branch_penalty) and branch_penalty >= 0):
        raise ValueError(f"branch_penalty (λ) must be a finite number >= 0, got {branch_penalty}.")
    if pre_monitoring_beta is not None and not (math.isfinite(pre_monitoring_beta) and pre_monitoring_beta >= 0):
        raise ValueError(f"pre_monitoring_beta must be a finite number >= 0 or None, got {pre_monitoring_beta}.")
