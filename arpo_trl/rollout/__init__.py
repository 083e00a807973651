"""The tree rollout (paper §3.1; docs/architecture.md). The rule, read top to bottom: `arpo` (`BranchingSampler`:
N global samples, the k-token probe after a tool result, P = clip(τ + β·ΔH, 0, 1), exactly M with fill-ups; AEPO's
variants beside it). Around it: a `PathWriter` writes into the paths (`path_writer`), the schedulers drive their
programs against an engine and the tools (`schedulers`; likely fill-ups run ahead of the rule, `prefetch`), the
tool-call formats (`tool_calls`), the rollout's records (`paths`) and seeds (`seeds`).

May import: generation, tools, entropy.
"""

from arpo_trl.rollout.arpo import BRANCH_POLICIES, BranchingSampler, check_branching_args, default_initial_rollouts
from arpo_trl.rollout.paths import RolloutResult, Trajectory
from arpo_trl.rollout.prefetch import MODES as SPECULATION_MODES
from arpo_trl.rollout.schedulers import SCHEDULERS

__all__ = ["BRANCH_POLICIES", "SCHEDULERS", "SPECULATION_MODES", "BranchingSampler", "RolloutResult", "Trajectory",
           "check_branching_args", "default_initial_rollouts"]
