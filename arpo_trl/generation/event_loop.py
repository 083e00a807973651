"""Run a coroutine to completion from synchronous code, also where an event loop already runs (Jupyter)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from arpo_trl.tools.training_thread import run_loop_in_thread

T = TypeVar("T")


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coroutine)`; where this thread already runs an event loop, which `asyncio.run` refuses, the
    coroutine runs on a new loop in a thread of its own while this one waits (`run_loop_in_thread`: a
    KeyboardInterrupt while waiting cancels it, and is raised once it has cleaned up)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    return run_loop_in_thread(coroutine)
