"""Run a coroutine to completion from synchronous code, also where an event loop already runs (Jupyter)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coroutine)`; where this thread already runs an event loop, which `asyncio.run` refuses, the
    coroutine runs on a new loop in a thread of its own while this one waits. A KeyboardInterrupt while waiting
    cancels it, and is raised once it has cleaned up."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    loop, outcome = asyncio.new_event_loop(), {}
    main = loop.create_task(coroutine)

    def target() -> None:
        try:
            outcome["value"] = loop.run_until_complete(main)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name="arpo-generation", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:  # Ctrl-C here: cancel the coroutine and wait until it cleaned up
        loop.call_soon_threadsafe(main.cancel)
        thread.join()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
