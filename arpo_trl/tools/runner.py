"""Run tool calls concurrently on daemon threads, each under its own deadline.

Not a `ThreadPoolExecutor`: a thread cannot be killed, so a custom tool that hangs would keep an executor worker
forever (later calls starve once all are stuck) and block interpreter exit (executor threads are joined at exit).
Here a call past its deadline is abandoned: its future is settled as timed out, its worker thread is written off and
replaced, and the process can still exit (daemon threads). Our own tools enforce their own limits (`PythonTool` kills
its process) and can be interrupted (`Tool.interrupt`). Workers are reused between calls, and one watchdog thread
keeps every deadline, so a call costs no thread start.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
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
    seconds: float = 0.0  # from the call's start to its return (its deadline, when it timed out)


class ToolRunner:
    """Runs calls at most `max_workers` at a time; each call's future settles when it returns, raises, or `timeout`
    seconds after it started (queued calls wait for a free worker first, without a deadline). `close()` lets the
    idle workers exit; a runner is meant for one rollout."""

    def __init__(self, max_workers: int, timeout: float):
        if max_workers < 1 or not timeout > 0:
            raise ValueError(f"ToolRunner needs max_workers >= 1 and timeout > 0, got {max_workers}, {timeout}.")
        self.max_workers, self.timeout = max_workers, timeout
        self._changed = threading.Condition()
        self._queue: deque[tuple[Callable[[], object], Future]] = deque()
        self._deadlines: list[tuple[float, int, Future, list[bool]]] = []  # heap; the list flags its worker lost
        self._order = itertools.count()
        self._workers = self._idle = 0
        self._closed = False
        threading.Thread(target=self._watch, name="arpo-tool-watchdog", daemon=True).start()

    def submit(self, call: Callable[[], object]) -> Future:
        """A future of the call's `CallOutcome`."""
        future: Future = Future()
        with self._changed:
            self._queue.append((call, future))
            self._add_workers()
            self._changed.notify_all()
        return future

    def cancel_pending(self) -> None:
        """Drop the calls still waiting for a worker (their futures are cancelled)."""
        with self._changed:
            queued, self._queue = list(self._queue), deque()
        for _, future in queued:
            future.cancel()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _add_workers(self) -> None:  # holds the lock
        while len(self._queue) > self._idle and self._workers < self.max_workers:
            self._workers += 1
            self._idle += 1  # counted idle until it takes a call, so that a burst does not start too many
            threading.Thread(target=self._work, name="arpo-tool", daemon=True).start()

    def _work(self) -> None:
        idle = True  # counted idle by `_add_workers` already
        while True:
            with self._changed:
                if not idle:
                    self._idle += 1
                idle = False
                while not self._queue and not self._closed:
                    self._changed.wait()
                self._idle -= 1
                if not self._queue:  # closed
                    self._workers -= 1
                    return
                call, future = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                lost = [False]
                heapq.heappush(self._deadlines, (time.monotonic() + self.timeout, next(self._order), future, lost))
                self._changed.notify_all()  # the watchdog may have to wake up earlier
            outcome, began = CallOutcome(timed_out=False), time.monotonic()
            try:
                outcome.value = call()
            except BaseException as exc:  # reported to the caller, never raised in the thread (SystemExit too)
                outcome.error = exc
            outcome.seconds = time.monotonic() - began
            with self._changed:
                if lost[0]:  # timed out meanwhile: the watchdog settled the call and replaced this worker
                    return
                future.set_result(outcome)

    def _watch(self) -> None:
        with self._changed:
            while not (self._closed and all(entry[2].done() for entry in self._deadlines)):
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].done() or self._deadlines[0][0] <= now):
                    _, _, future, lost = heapq.heappop(self._deadlines)
                    if not future.done():
                        lost[0] = True
                        future.set_result(CallOutcome(seconds=self.timeout))
                        self._workers -= 1  # written off; a queued call gets a new worker
                        self._add_workers()
                self._changed.wait(self._deadlines[0][0] - now if self._deadlines else None)


def run_calls(calls: Sequence[Callable[[], object]], max_workers: int, timeout: float) -> list[CallOutcome]:
    """Run `calls` at most `max_workers` at a time, each under `timeout` seconds; their outcomes in order."""
    runner = ToolRunner(max_workers, timeout)
    try:
        futures = [runner.submit(call) for call in calls]
        wait(futures)
        return [future.result() for future in futures]
    finally:
        runner.close()
