"""Schedulers: drive the sampler's per-path programs (`BranchingSampler.grow`) against an engine and the tools.

A program yields requests and receives their results; the algorithm lives there once, and a scheduler only decides
when each request runs (the requests: `requests`):

* `EventScheduler` (`events`; engines with `agenerate`, e.g. a vLLM server): every path advances on its own. Its next
  request goes out as soon as its own tool result or fork decision is ready, tools run as their calls arrive, and the
  server's continuous batching does the batching. No round waits for its slowest path.
* `WaveScheduler` (`waves`; batch engines, e.g. transformers in process): the tool calls of a moment run together, then
  the requests that are ready together are generated as one batch (a wave), in path order; every result goes back to its
  program in path order. Deterministic for a seed.

Both measure the rollout's critical path: the longest chain of sequentially generated tokens it waited for (for
waves, the sum of each wave's longest segment; for events, the longest chain of requests, where a branch's chain
continues its parent's at the fork and a fill-up's the chain of the step that started it).
"""

from __future__ import annotations

from arpo_trl.rollout.events import EventScheduler
from arpo_trl.rollout.waves import WaveScheduler


def make_scheduler(name: str, engine) -> WaveScheduler | EventScheduler:
    """'events' needs an engine with `agenerate`; 'waves' drives any engine; 'auto' picks events where it can."""
    asynchronous = callable(getattr(engine, "agenerate", None))
    if name == "waves" or (name == "auto" and not asynchronous):
        return WaveScheduler()
    if name in ("events", "auto"):
        if not asynchronous:
            raise ValueError(f"scheduler='events' needs an engine with an `agenerate` method (e.g. VLLMServerEngine); "
                             f"{type(engine).__name__} only generates in batches: use scheduler='waves' or 'auto'.")
        return EventScheduler()
    raise ValueError(f"scheduler must be one of ('auto', 'events', 'waves'), got {name!r}.")
