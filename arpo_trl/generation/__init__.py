"""In-process generation with a persistent KV cache, driven per request by the events scheduler (or in waves)."""

from arpo_trl.generation.cached_engine import CachedTransformersEngine
from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefix_cache import PrefixCache
from arpo_trl.generation.support import cached_engine_blocker

__all__ = ["CachedTransformersEngine", "KVBatch", "PrefixCache", "cached_engine_blocker"]
