"""In-process generation with a persistent KV cache, driven per request by the events scheduler."""

from arpo_trl.generation.cached_engine import CachedTransformersEngine
from arpo_trl.generation.prefix_cache import PrefixCache

__all__ = ["CachedTransformersEngine", "PrefixCache"]
