"""Run one round's tool calls concurrently, under one deadline, on daemon threads.

Not a `ThreadPoolExecutor`: a thread cannot be killed, so a custom tool that hangs would keep an executor worker
forever (later rounds starve once all are stuck) and block interpreter exit (executor threads are joined at
exit). Here a call past the deadline is abandoned: its daemon thread no longer counts against `max_workers`,
and the process can still exit. Our own tools enforce their own limits (`PythonTool` kills its process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class CallOutcome:
    """A call's return value, or the exception it raised, or neither when it missed the deadline."""

    value: object = None
    error: BaseException | None = None
    timed_out: bool = True


def run_calls(calls: Sequence[Callable[[], object]], max_workers: int, timeout: float) -> list[CallOutcome]:
    """Run `calls` at most `max_workers` at a time; return their outcomes in order once all finish or `timeout`
    seconds pass (calls still running or not yet started then are `timed_out`)."""
    outcomes = [CallOutcome() for _ in calls]
    pending, running, finished = list(range(len(calls))), [0], [0]
    changed = threading.Condition()

    def work(index: int) -> None:
        outcome = CallOutcome(timed_out=False)
        try:
            outcome.value = calls[index]()
        except BaseException as exc:  # reported to the caller, never raised in the thread (SystemExit too)
            outcome.error = exc
        with changed:
            outcomes[index] = outcome
            running[0] -= 1
            finished[0] += 1
            changed.notify_all()

    deadline = time.monotonic() + timeout
    with changed:
        while finished[0] < len(calls):
            while pending and running[0] < max_workers:
                running[0] += 1
                threading.Thread(target=work, args=(pending.pop(0),), name="arpo-tool", daemon=True).start()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            changed.wait(remaining)
        return list(outcomes)
