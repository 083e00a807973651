"""arpo-trl: ARPO (Agentic Reinforced Policy Optimization, Dong et al. 2025, arXiv 2507.19849) on TRL.

The public names below are importable from `arpo_trl` itself, each loaded on first use: `import arpo_trl` (and so
`arpo-trl --help`) does not pay for torch, transformers and TRL until a name that needs them is asked for.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "arpo_trl.config": ["ARPOConfig"],
    "arpo_trl.generation.engine": ["EngineTraits", "GenerationEngine", "Segment"],
    "arpo_trl.generation.transformers_engine": ["TransformersEngine"],
    "arpo_trl.rewards": ["arpo_f1_reward", "arpo_math_reward"],
    "arpo_trl.rollout": ["BranchingRule", "ForkPoint", "RolloutResult", "Trajectory"],
    "arpo_trl.runtime": ["BranchingSampler"],
    "arpo_trl.server.client": ["VLLMClient", "VLLMServerError"],
    "arpo_trl.server.engine": ["VLLMServerEngine"],
    "arpo_trl.tools": ["BM25Backend", "PythonTool", "SearchBackend", "SearchTool", "Tool"],
    "arpo_trl.trainer": ["ARPOTrainer"],
    "arpo_trl.training.advantages": ["hard_advantages", "owner_mask", "token_owners"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
__all__ = sorted(_MODULE_OF)

def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
