"""arpo-trl: ARPO (Agentic Reinforced Policy Optimization, Dong et al. 2025, arXiv 2507.19849) on TRL."""

import importlib
import sys

from arpo_trl.config import ARPOConfig
from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.rewards import arpo_f1_reward, arpo_math_reward
from arpo_trl.rollout import BranchingSampler, RolloutResult, Trajectory
from arpo_trl.server.client import VLLMClient, VLLMServerError
from arpo_trl.server.engine import VLLMServerEngine
from arpo_trl.tools import BM25Backend, PythonTool, SearchBackend, SearchTool, Tool
from arpo_trl.trainer import ARPOTrainer
from arpo_trl.training.advantages import hard_advantages, owner_mask, token_owners

__version__ = "0.1.0"

__all__ = [
    "ARPOConfig", "ARPOTrainer", "BM25Backend", "BranchingSampler", "GenerationEngine", "PythonTool",
    "RolloutResult", "SearchBackend", "SearchTool", "Segment", "Tool", "TransformersEngine", "Trajectory",
    "VLLMClient", "VLLMServerEngine", "VLLMServerError",
    "arpo_f1_reward", "arpo_math_reward", "hard_advantages", "owner_mask", "token_owners",
]

# Module paths of arpo-trl 0.1 that the docs named, kept for users (docs/architecture.md, moved modules): each is the
# moved module itself, so that imports, attribute access and monkeypatching reach the same object. Nothing inside the
# package imports them (tests/test_architecture.py).
_MOVED = {"tool_calls": "rollout.tool_calls", "scoring": "rewards.math_scoring", "eval_metrics": "rewards.eval_metrics",
          "models": "data.models"}
for _old, _new in _MOVED.items():
    globals()[_old] = sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"{__name__}.{_new}")
