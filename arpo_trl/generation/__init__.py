"""Every engine the rollout can run on, and their contract (`engine`: `GenerationEngine`, `EngineTraits`, `Segment`,
`SamplingSettings`): in process, the waves engine (`transformers_engine`) and the cached engine, event-driven with a
persistent prefix KV cache (`cached_engine`, with `admission`, `prefill`, `kv_batch`, `kv_budget`, `prefix_cache`,
`sampling`, `support`); which one a trainer gets, and what a backend sees of its trainer (`backend`); the model an
engine generates with (`model_context`); ranks in lockstep (`distributed`); the rollout's event loop (`event_loop`);
what exists only for CPU speed (`cpu/`).
The vLLM engines implement the same contract in `server/engine.py` and `colocate/engine.py`.

May import: entropy, tools, preflight (what the vLLM backends measure of the prompts).
"""

from arpo_trl.generation.cached_engine import CachedTransformersEngine
from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefix_cache import PrefixCache
from arpo_trl.generation.support import cached_engine_blocker

__all__ = ["CachedTransformersEngine", "KVBatch", "PrefixCache", "cached_engine_blocker"]
