"""`BranchingSampler`: the one entry point that grows rollouts, for the trainer's backends, `arpo-trl evaluate` and
users. It holds the rule (`rollout.BranchingRule`: what ARPO decides), an engine (who generates) and a scheduler (when
each request runs: `schedulers.py`, which may run likely fill-ups ahead, `prefetch.py`); the rule sees neither."""

from __future__ import annotations

import time
from collections.abc import Sequence

from arpo_trl.generation.engine import EngineTraits, GenerationEngine
from arpo_trl.rollout.arpo import BranchingRule
from arpo_trl.rollout.paths import RolloutResult
from arpo_trl.runtime.schedulers import make_scheduler
from arpo_trl.tools.base import Tool


class BranchingSampler:
    """Builds ARPO rollout trees from token-id prompts with any `GenerationEngine` and tools.

    `scheduler`: 'events' (every path advances on its own; needs an engine whose traits say `event_driven`), 'waves'
    (ready requests batched into one `generate` call) or 'auto' (events where the engine can). `speculation`: 'auto'
    (the event scheduler runs likely fill-ups ahead of the rule and hands one over only when the rule starts it) or
    'off'; the trees are the same in both. `max_tool_workers`: tool calls running at once. Every other keyword is the
    rule's (`BranchingRule`: M, N, Z, τ, β, k, the branch policy, limits, seed, call format). `engine=None`: a rank
    whose rollouts the main process grows (server mode with several processes); it keeps the rule's seeds for a
    resumed run and never samples."""

    def __init__(self, engine: GenerationEngine | None, tokenizer, tools: Sequence[Tool] = (), *,
                 scheduler: str = "auto", speculation: str = "auto", max_tool_workers: int = 8, **rule_args):
        if max_tool_workers < 1:
            raise ValueError(f"max_tool_workers must be >= 1, got {max_tool_workers}.")
        if engine is None:
            vocab_size, eos, traits = len(tokenizer), [tokenizer.eos_token_id], EngineTraits()
        else:
            vocab_size, eos, traits = engine.vocab_size, engine.eos_token_ids or [tokenizer.eos_token_id], engine.traits
        self.rule = BranchingRule(tokenizer, tools, vocab_size=vocab_size, eos_token_id=eos[0], **rule_args)
        self.engine = engine
        self.scheduler = make_scheduler(scheduler, traits, speculation, max_tool_workers)

    @property
    def call_format(self):
        return self.rule.call_format

    def sample(self, prompts: Sequence[Sequence[int]], num_generations: int | None = None,
               initial_rollouts: int | None = None, branch_policy: str | None = None,
               environments: Sequence | None = None) -> RolloutResult:
        """Exactly `num_generations` trajectories for each prompt (arguments override the rule's defaults, e.g. for
        evaluation without branching; `environments`: per prompt, the reset environment its paths start from)."""
        if self.engine is None:
            raise RuntimeError("BranchingSampler has no engine: on this rank the main process grows the rollouts.")
        start = time.perf_counter()
        rollout = self.rule.begin(prompts, num_generations, initial_rollouts, branch_policy, environments)
        self.scheduler.run(self.rule, self.engine, rollout)
        result = self.rule.finish(rollout)
        result.stats.seconds = time.perf_counter() - start
        return result

    def state_dict(self) -> dict:
        """What a resumed run needs to grow the same trees (the rule's seed and rollouts drawn so far)."""
        return self.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)
