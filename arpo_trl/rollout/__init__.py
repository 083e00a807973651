"""ARPO's rollout rule (paper §3.1; docs/architecture.md), and only the rule, read top to bottom in `arpo`
(`BranchingRule`: N global samples, the k-token probe after a tool result, P = clip(τ + β·ΔH, 0, 1), exactly M with
fill-ups; AEPO's variants beside it; what a path's program asks for), and a fork policy of one's own (`fork_policy`).
Beside it: how a program writes into its path (`path_writer`), the tool-call formats (`tool_calls`), the rollout's
records and seeds (`paths`). Who runs the requests, and when, is `arpo_trl.runtime`'s business.

May import: generation (the engine contract, `generation.engine`, only), tools, entropy.
"""

from arpo_trl.rollout.arpo import BRANCH_POLICIES, BranchingRule, check_branching_args, default_initial_rollouts
from arpo_trl.rollout.fork_policy import ForkPoint, ForkPolicy
from arpo_trl.rollout.paths import RolloutResult, Trajectory

__all__ = ["BRANCH_POLICIES", "BranchingRule", "ForkPoint", "ForkPolicy", "RolloutResult", "Trajectory",
           "check_branching_args", "default_initial_rollouts"]
