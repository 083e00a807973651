"""What runs the rule (`rollout/`) against an engine and the tools, and how fast: the entry point that grows a
rollout (`sampler.BranchingSampler`), the schedulers that decide when each of the rule's requests runs (`schedulers`:
events or waves) and the fill-ups run ahead of the rule (`prefetch`).

May import: rollout, generation, tools, entropy.
"""

from arpo_trl.runtime.prefetch import MODES as SPECULATION_MODES
from arpo_trl.runtime.sampler import BranchingSampler
from arpo_trl.runtime.schedulers import SCHEDULERS

__all__ = ["SCHEDULERS", "SPECULATION_MODES", "BranchingSampler"]
