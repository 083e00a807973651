"""ARPO's entropy-based adaptive rollout (paper §3.1; reference `vllm_rollout_with_tools.py`), event-driven.

Per prompt, with a budget of M trajectories, N global paths start the tree, and every path runs one program
(`BranchingSampler.grow`):
  1. generate until a tool's closing tag, EOS or its length budget; the first k tokens of the path's first
     segment give H_initial (`arpo_trl.entropy.segment_entropy`, normalised by ln|V|);
  2. run the tool and append ` <result>\\n…\\n</result>` (loss mask 0; with a `ChatTemplateFormat`, the chat
     template's tool message and next assistant header instead);
  3. probe: generate the next k tokens only, and measure their entropy H;
  4. right then, while the prompt has fewer than M paths, fork Z-1 copies of the path at the tool result with
     probability clip(τ + β·(H - H_initial), 0, 1); the copies start from the result beside the path, which goes
     on after its probe (the uniform draw is made at the result: a fork it makes certain starts confirmed);
  5. back to 1, until EOS, the call limit or the budget.
When forking can no longer fill a prompt's M slots (even if every live path forked at every tool result it may
still reach), all the missing trajectories start at once as fresh global samples ("fill-ups", paper §3.1 step 4:
"add M-N-Ẑ trajectory-level samples"; `arpo_trl.rollout.budget`, which also starts likely ones early). Each prompt ends
with exactly M trajectories; the records are in `arpo_trl.rollout.paths`. AEPO's rollout (`branch_policy="aepo"`):
`arpo_trl.rollout.entropy_balance`, docs/aepo.md.

A scheduler (`arpo_trl.rollout.schedulers`) drives the programs: against a server every path advances on its own; with a
batch engine the requests ready together form one batch (a wave), in path order. Every random draw is keyed by the
path's place in its tree (`Trajectory.key`) and the rollout's seed: its fork draws here, its tokens in an engine with
that takes a path's seed (`GenerationEngine.request_options`), so a seed reproduces the trees under either scheduler,
whenever tool results arrive.

Where we differ from the reference code, deliberately (docs/differences.md, which says why):
  * H_initial is reset every rollout and inherited by branches (the reference's per-slot dict is never cleared).
  * The fork is decided by the k tokens right after a tool result and placed at that result (paper), not one round
    late with the previous segment's entropy; entropy is exact where logits exist and a segment's is a mean.
  * A fork takes its slots from its line's share of the budget, not whoever arrives first (`budget.ForkShares`).
  * Fill-ups start all at once, as soon as they are certain to be needed, and do not fork. Tokens the environment
    writes (results, the EOS after the call limit) have loss mask 0; results are encoded without special tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Generator, Sequence

from arpo_trl.entropy import check_entropy_args, segment_entropy
from arpo_trl.generation.engine import GenerationEngine
from arpo_trl.generation.sampling import derive_seed
from arpo_trl.rollout.budget import FillUps
from arpo_trl.rollout.entropy_balance import aepo_fork_probability, check_aepo_args, global_samples
from arpo_trl.rollout.path_writer import OPEN, PathWriter
from arpo_trl.rollout.paths import ForkDecision, Rollout, RolloutResult, Trajectory
from arpo_trl.rollout.schedulers import CallRequest, CommitRequest, GenerateRequest, PathRequest, make_scheduler
from arpo_trl.rollout.tool_calls import CallFormat, TagFormat, ToolCall, bind_call
from arpo_trl.tools.base import Tool
from arpo_trl.tools.environments import fork_environment

BRANCH_POLICIES = ("entropy", "random", "aepo", "none")


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
        tool_timeout: float = 30.0, max_tool_workers: int = 8,
        seed: int | None = None,
        call_format: CallFormat | None = None,
        scheduler: str = "auto",
        speculative_fill_ups: bool = True,
        speculative_branches: bool = False, fill_up_hedge: float | None = 0.9,  # `budget.FillUps.hedge`
        branch_penalty: float = 0.05,  # AEPO (`arpo_trl.rollout.entropy_balance`)
        pre_monitoring_beta: float | None = 0.5,  # AEPO
        segment_statistic: str = "mean",  # `arpo_trl.entropy.segment_entropy`
    ):
        tags = [tool.tag for tool in tools]
        if len(set(tags)) != len(tags):
            raise ValueError(f"Tool tags must be unique, got {tags}.")
        if initial_rollouts is None:
            initial_rollouts = default_initial_rollouts(num_generations, branch_policy)
        check_branching_args(num_generations, initial_rollouts, branch_factor, branch_threshold, entropy_window,
                             branch_policy, max_tool_calls)
        check_aepo_args(branch_penalty, pre_monitoring_beta)
        check_entropy_args("auto", None, segment_statistic)
        if tool_timeout <= 0 or max_tool_workers < 1 or not (fill_up_hedge is None or 0 < fill_up_hedge < 1):
            raise ValueError(f"tool_timeout must be > 0, max_tool_workers >= 1 and fill_up_hedge in (0, 1) or None, "
                             f"got {tool_timeout}, {max_tool_workers}, {fill_up_hedge}.")
        self.engine, self.tokenizer, self.tools = engine, tokenizer, list(tools)
        self.call_format = call_format if call_format is not None else TagFormat(tools)
        self.num_generations, self.initial_rollouts = num_generations, initial_rollouts
        self.branch_factor, self.branch_threshold, self.entropy_weight = branch_factor, branch_threshold, entropy_weight
        self.entropy_window, self.segment_statistic = entropy_window, segment_statistic
        self.branch_policy = branch_policy
        self.branch_penalty, self.pre_monitoring_beta = branch_penalty, pre_monitoring_beta
        self.max_tool_calls, self.max_completion_length = max_tool_calls, max_completion_length
        self.tool_timeout, self.max_tool_workers = tool_timeout, max_tool_workers
        self.reseed(random.randrange(2 ** 63) if seed is None else seed)
        self.speculative_branches, self.scheduler = speculative_branches, make_scheduler(scheduler, engine)
        wait_for_a_decision = getattr(engine, "drafts_late_paths", False) or getattr(engine, "compute_bound", False)
        self.fill_ups = FillUps(max_tool_calls, branch_factor, branch_threshold, speculative_fill_ups,
                                wait_for_a_decision and self.scheduler.event_driven, fill_up_hedge)
        eos = getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id]
        self.eos_token_id = eos[0]
        self.writer = PathWriter(tokenizer, self.call_format, self.eos_token_id, max_completion_length, max_tool_calls,
                                 tool_timeout)

    # ---- the algorithm ------------------------------------------------------------------------------------
    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        num_generations: int | None = None,
        initial_rollouts: int | None = None,
        branch_policy: str | None = None,
        environments: Sequence | None = None,
    ) -> RolloutResult:
        """Exactly `num_generations` trajectories for each prompt (arguments override the defaults, e.g. for
        evaluation without branching; `environments`: per prompt, the reset environment its paths start from)."""
        policy = branch_policy or self.branch_policy
        m = num_generations or self.num_generations
        n = initial_rollouts or (m if policy == "none" else min(self.initial_rollouts, m))
        check_branching_args(m, n, self.branch_factor, self.branch_threshold, self.entropy_window, policy,
                             self.max_tool_calls)
        start = time.perf_counter()
        rollout = Rollout([[] for _ in prompts], m, policy, environments=environments, fork=fork_environment,
                          seed=derive_seed(self.seed, self.rollouts))
        self.rollouts += 1
        monitored = policy == "aepo" and self.pre_monitoring_beta is not None
        for g, prompt in enumerate(prompts):
            for _ in range(1 if monitored else n):  # AEPO: one monitoring path first decides m (`_end_monitoring`)
                rollout.start(g, list(prompt), "global", None)
            if monitored:
                rollout.monitoring.add(g)
            self.fill_ups.update(rollout, g, None)
        self.scheduler.run(self, rollout)
        rollout.finish()
        self.fill_ups.learn(rollout)
        rollout.stats.seconds = time.perf_counter() - start
        return RolloutResult(rollout.groups, rollout.stats)

    def grow(self, rollout: Rollout, path: Trajectory) -> Generator[PathRequest, object, None]:
        """One path's program (paper §3.1): it yields requests (generate, call a tool, wait for its fork to be
        confirmed) and receives their results (a `Segment`, a `CallOutcome`, None); the paths it starts or drops are
        queued in `rollout.started` / `rollout.cancelled`."""
        probe = False  # the next request's entropy decides the fork at the tool result just appended
        short = path.kind == "branch" and not path.committed  # a speculative branch: as short as its parent's probe
        continued = False  # the request continues a segment that a short request stopped inside
        while path.active:
            room = self.max_completion_length - len(path.completion_ids)
            cap = min(room, self.entropy_window) if probe or short else room
            # an engine may decode a probe on; the rest of a segment needs no entropy (its first k gave it)
            request = GenerateRequest(path, cap, continues_to=room if probe else None,
                                      entropy_tokens=0 if continued else self.entropy_window)
            segment = yield request
            if not continued:
                entropy = segment_entropy(segment.entropies, self.entropy_window, self.engine.vocab_size,
                                          self.segment_statistic)
                if probe:  # the k tokens after the tool result decide the fork at that result, right now
                    self._decide_fork(rollout, path, entropy - path.initial_entropy)
                path.segment_entropies.append(entropy)
                if path.initial_entropy is None:
                    path.initial_entropy = entropy
            capped = request.max_new_tokens < room and len(segment.token_ids) >= request.max_new_tokens
            call = self.writer.absorb(rollout, path, segment, continued, capped)
            probe, short, continued = False, False, call is OPEN
            while not path.committed and path.kind == "branch":  # until the parent's decision (or dropped)
                yield CommitRequest(path)
            if isinstance(call, ToolCall):
                outcome = yield CallRequest(path, bind_call(call, path.environment))
                self.writer.append_result(rollout, path, call, outcome)
                probe = path.active and self._at_tool_result(rollout, path)
        if path.group in rollout.monitoring:
            self._end_monitoring(rollout, path)
        self.fill_ups.update(rollout, path.group, path)

    def reseed(self, seed: int) -> None:
        """Start the sequence of rollouts of `seed` anew: the n-th `sample` call after this draws the same trees."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}.")
        self.seed, self.rollouts = seed, 0

    def state_dict(self) -> dict:
        """What a resumed run needs to grow the same trees: the seed, the rollouts drawn so far and the speculation's
        rates."""
        return {"seed": self.seed, "rollouts": self.rollouts,
                "call_rate": self.fill_ups.call_rate, "fork_rate": self.fill_ups.fork_rate}

    def load_state_dict(self, state: dict) -> None:
        if not {"seed", "rollouts"} <= set(state):
            raise ValueError(f"The sampler state has no 'seed' and 'rollouts' (keys: {sorted(state)}): it was saved by "
                             "an arpo-trl before keyed draws, whose trees a resumed run cannot continue.")
        self.reseed(state["seed"])
        self.rollouts = state["rollouts"]
        self.fill_ups.call_rate = state.get("call_rate", self.fill_ups.call_rate)
        self.fill_ups.fork_rate = state.get("fork_rate", self.fill_ups.fork_rate)

    def fork_probability(self, delta_entropy: float, policy: str | None = None, consecutive_forks: int = 0) -> float:
        """P(fork) = clip(τ + β·ΔH, 0, 1) for 'entropy'; τ for the 'random' ablation; for 'aepo', the same rule with
        AEPO's penalty on a path that forked at its last `consecutive_forks` tool results (`aepo_fork_probability`)."""
        if (policy := policy or self.branch_policy) == "random":
            return self.branch_threshold
        if policy == "aepo":
            return aepo_fork_probability(delta_entropy, consecutive_forks, self.branch_threshold,
                                         self.entropy_weight, self.branch_penalty)
        return min(1.0, max(0.0, self.branch_threshold + self.entropy_weight * delta_entropy))

    # ---- tree steps -----------------------------------------------------------------------------------------
    def _at_tool_result(self, rollout: Rollout, path: Trajectory) -> bool:
        """A tool result was appended. If a fork is possible here, start its Z-1 copies now, unconfirmed, beside the
        path's probe, whose entropy decides whether they are kept (`_decide_fork`): the copies' tokens do not depend
        on the decision, so the trees are those of forking after the probe, without the wait. Also for the 'random'
        ablation, so that it differs from ARPO in the decision only. Else settle the decision at once.
        The u that the probe's P is compared with is drawn here, independent of the probe: a certain fork (u below the
        P of the lowest entropy the probe can read) has its copies confirmed at once, without waiting for the probe.
        Without `speculative_branches` an uncertain fork's copies start once the probe keeps them: none discarded."""
        if not self._may_fork(rollout, path):
            self._decide_fork(rollout, path, None)
            return False
        draw = rollout.fork_draws[path.id] = fork_draw(path)
        lowest = (0.0 if self.entropy_weight >= 0 else self.entropy_window) - (path.initial_entropy or 0.0)  # H ≥ 0
        certain = path.initial_entropy is not None and draw < self.fork_probability(lowest, rollout.policy,
                                                                                   path.consecutive_forks)
        if not (certain or self.speculative_branches):
            return True  # the copies start once the probe keeps them (`_decide_fork`)
        copies = min(self.branch_factor - 1, self.fill_ups.shares.free(rollout, path))
        rollout.pending_branches[path.id] = [self._branch(rollout, path, c, certain) for c in range(copies)]
        self.fill_ups.make_room(rollout, path.group)
        return True

    def _branch(self, rollout: Rollout, source: Trajectory, copy: int, certain: bool = False) -> Trajectory:
        """Copy number `copy` of `source` as it is now, at a tool result; unconfirmed unless its fork is `certain`."""
        child = rollout.start(source.group, source.prompt_ids, "branch", source, copy)
        child.completion_ids, child.mask, child.logprobs, child.entropies = source.snapshot(len(source.completion_ids))
        child.parent, child.fork_position, child.segment_start = source.id, source.segment_start, source.segment_start
        child.fork_decisions, child.committed = source.fork_decisions + 1, certain
        child.consecutive_forks = source.consecutive_forks + 1
        child.calls = list(source.calls)
        child.initial_entropy, child.segment_entropies = source.initial_entropy, list(source.segment_entropies)
        return child

    def _may_fork(self, rollout: Rollout, path: Trajectory) -> bool:
        return rollout.policy != "none" and self.branch_factor > 1 and path.kind != "fill" and \
            path.group not in rollout.monitoring and self.fill_ups.shares.free(rollout, path) > 0

    def _end_monitoring(self, rollout: Rollout, monitor: Trajectory) -> None:
        """AEPO's entropy pre-monitoring: the group's first path, which does not fork, measured the question's entropy
        (its first segment) and the tool results' (all its segments); it is one of the m global samples
        (`global_samples`), and the other m-1 start now. The rest of the budget goes to forks and fill-ups."""
        rollout.monitoring.discard(monitor.group)
        m = global_samples(rollout.num_generations, monitor.initial_entropy or 0.0, monitor.segment_entropies,
                           self.pre_monitoring_beta)
        rollout.stats.global_samples[monitor.group] = m
        lines = [rollout.start(monitor.group, monitor.prompt_ids, "global", monitor).id for _ in range(m - 1)]
        self.fill_ups.shares.split(rollout, monitor.group, lines)  # the monitor has ended: it owns no branch slot

    def _decide_fork(self, rollout: Rollout, path: Trajectory, delta: float | None) -> None:
        """Settle the fork at the path's latest tool result: Z-1 copies with probability P (paper §3.1 step 3)."""
        copies, kept = rollout.pending_branches.pop(path.id, None), 0
        draw, held = rollout.fork_draws.pop(path.id, None), bool(copies) and copies[0].committed  # a certain fork
        if delta is not None and (held or self._may_fork(rollout, path)):  # None: no fork was possible at the result
            probability = self.fork_probability(delta, rollout.policy, path.consecutive_forks)
            rollout.fork_probabilities.append(probability)
            path.decisions.append(ForkDecision(len(path.completion_ids), delta, probability, draw,
                                               held or draw < probability))
            if held or draw < probability:  # held: certain at the tool result, whatever (even < 0) the probe read
                kept = len(copies) if held else self.fill_ups.shares.free(rollout, path)
                if copies is None:  # from the same state at the tool result: the probe is not absorbed
                    copies = [self._branch(rollout, path, c) for c in range(min(self.branch_factor - 1, kept))]
                for child in copies[:kept]:
                    if not child.committed:
                        rollout.committed.append(child)
                    child.committed, child.fork_delta = True, delta
                    rollout.stats.forks += 1
                    rollout.stats.fork_deltas.append(delta)
                self.fill_ups.make_room(rollout, path.group)
        path.fork_decisions += 1
        path.consecutive_forks = path.consecutive_forks + 1 if kept else 0  # AEPO's l: forks in a row on this line
        for child in (copies or [])[kept:]:
            rollout.drop(child)
        self.fill_ups.update(rollout, path.group, path)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, as the sampler reads it (special tokens skipped)."""
        return self.writer.decode(ids)


def fork_draw(path: Trajectory) -> float:
    """The uniform a path's next fork decision compares with its P: keyed by the path's seed and the decision's index,
    so it does not depend on which path reached its tool result first."""
    return derive_seed(path.seed, "fork", path.fork_decisions) / 2 ** 63
