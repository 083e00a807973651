"""The tree rollout (paper §3.1; docs/architecture.md): `BranchingSampler` grows each prompt's tree of M paths, deciding
where they fork (`sampler`) while a `PathWriter` writes into them (`path_writer`); the schedulers drive the paths'
programs against an engine and the tools (`schedulers`); the fork budget and fill-ups (`budget`), AEPO's fork rules
(`entropy_balance`), the tool-call formats (`tool_calls`) and the rollout's records (`paths`).

May import: generation, tools, entropy.
"""

from arpo_trl.rollout.paths import RolloutResult, Trajectory
from arpo_trl.rollout.sampler import BRANCH_POLICIES, BranchingSampler, check_branching_args, default_initial_rollouts
from arpo_trl.rollout.schedulers import SCHEDULERS

__all__ = ["BRANCH_POLICIES", "SCHEDULERS", "BranchingSampler", "RolloutResult", "Trajectory", "check_branching_args",
           "default_initial_rollouts"]
