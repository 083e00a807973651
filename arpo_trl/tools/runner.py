"""Run tool calls concurrently on daemon threads, each under its own deadline.

Not a `ThreadPoolExecutor`: a thread cannot be killed, so a custom tool that hangs would keep an executor worker
forever (later calls starve once all are stuck) and block interpreter exit (executor threads are joined at exit).
Here a call past its deadline is abandoned: its future is settled as timed out, its daemon thread no longer counts
against `max_workers`, and the process can still exit. Our own tools enforce their own limits (`PythonTool` kills its
process) and can be interrupted (`Tool.interrupt`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass


@dataclass
class CallOutcome:
    """A call's return value, or the exception it raised, or neither when it missed its deadline."""

    value: object = None
    error: BaseException | None = None
    timed_out: bool = True


class ToolRunner:
    """Runs calls at most `max_workers` at a time; each call's future settles when it returns, raises, or `timeout`
    seconds after it started (queued calls wait for a free worker first, without a deadline)."""

    def __init__(self, max_workers: int, timeout: float):
        if max_workers < 1 or not timeout > 0:
            raise ValueError(f"ToolRunner needs max_workers >= 1 and timeout > 0, got {max_workers}, {timeout}.")
        self.max_workers, self.timeout = max_workers, timeout
        self._lock = threading.Lock()
        self._queue: deque[tuple[Callable[[], object], Future]] = deque()
        self._running = 0

    def submit(self, call: Callable[[], object]) -> Future:
        """A future of the call's `CallOutcome`."""
        future: Future = Future()
        with self._lock:
            self._queue.append((call, future))
            self._start_ready()
        return future

    def cancel_pending(self) -> None:
        """Drop the calls still waiting for a worker (their futures are cancelled)."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for _, future in queued:
            future.cancel()

    def _start_ready(self) -> None:  # holds self._lock
        while self._queue and self._running < self.max_workers:
            call, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._running += 1
            timer = threading.Timer(self.timeout, self._settle, (future, CallOutcome()))
            timer.daemon = True
            threading.Thread(target=self._work, args=(call, future, timer), name="arpo-tool", daemon=True).start()
            timer.start()

    def _work(self, call: Callable[[], object], future: Future, timer: threading.Timer) -> None:
        outcome = CallOutcome(timed_out=False)
        try:
            outcome.value = call()
        except BaseException as exc:  # reported to the caller, never raised in the thread (SystemExit too)
            outcome.error = exc
        timer.cancel()
        self._settle(future, outcome)

    def _settle(self, future: Future, outcome: CallOutcome) -> None:
        with self._lock:
            if future.done():  # the call returned after its deadline: already settled as timed out
                return
            self._running -= 1
            future.set_result(outcome)
            self._start_ready()


def run_calls(calls: Sequence[Callable[[], object]], max_workers: int, timeout: float) -> list[CallOutcome]:
    """Run `calls` at most `max_workers` at a time, each under `timeout` seconds; their outcomes in order."""
    runner = ToolRunner(max_workers, timeout)
    futures = [runner.submit(call) for call in calls]
    wait(futures)
    return [future.result() for future in futures]
