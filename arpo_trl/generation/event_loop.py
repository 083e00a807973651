"""The event loop a rollout's coroutine runs on, wherever it is called from: `run_coroutine` also in a thread that runs
a loop already (Jupyter); `run_loop_in_thread` on a thread of its own while the calling thread serves the tool calls
that must run on it.

The second case: `GRPOTrainer` calls a sync tool function on the thread that runs `train()` (the main thread,
normally), so a function may use `signal.alarm`, thread-local state or a client that is bound to its thread. ARPO's
event-driven rollout generates while tools run; when the tool set holds such functions (`Tool.thread_safe` False),
the rollout's event loop (with the engine's generation) moves to a thread of its own and the training thread serves
those calls from a queue until the rollout ends (`ToolRunner.serve`). Our own tools and async functions stay on the
tool runner's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from arpo_trl.tools.runner import ToolRunner

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


def run_loop_in_thread(coroutine: Coroutine[Any, Any, Any], runner: ToolRunner | None = None) -> Any:
    """Run `coroutine` on a new event loop in a thread of its own while this thread waits, or, given `runner`, serves
    its calls for this thread (`ToolRunner.serve`) until the coroutine ends. An exception here (Ctrl-C, or one a
    call raised on this thread) cancels the coroutine and is raised once it has cleaned up; its own error is raised
    here too."""
    loop, finished = asyncio.new_event_loop(), Future()
    main = loop.create_task(coroutine)
    enter_device = _device_of_this_thread()

    def target() -> None:
        try:
            enter_device()
            finished.set_result(loop.run_until_complete(main))
        except BaseException as exc:
            finished.set_exception(exc)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name="arpo-rollout", daemon=True)
    thread.start()
    try:
        if runner is not None:
            runner.serve([finished])
        thread.join()
    except BaseException:
        with contextlib.suppress(RuntimeError):  # the loop has closed already
            loop.call_soon_threadsafe(main.cancel)
        if runner is not None:
            runner.cancel_pending()
        thread.join()
        raise
    return finished.result()


def _device_of_this_thread() -> Callable[[], None]:
    """CUDA's current device is per thread: the rollout's thread takes this one's (a rank's own GPU), so that
    tensors the engine makes without a device index land where the model is."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return lambda: None
    device = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(device)
