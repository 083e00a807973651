"""Run tool calls concurrently on daemon threads, each under its own deadline.

Not a `ThreadPoolExecutor`: a thread cannot be killed, so a custom tool that hangs would keep an executor worker
forever (later calls starve once all are stuck) and block interpreter exit (executor threads are joined at exit).
Here a call past its deadline is abandoned: its future is settled as timed out, its worker thread is written off and
replaced, and the process can still exit (daemon threads). Our own tools enforce their own limits (`PythonTool` kills
its process) and can be interrupted (`Tool.interrupt`). Workers are reused between calls, and one watchdog thread
keeps every deadline, so a call costs no thread start.

Calls submitted with `here=True` run instead on the thread that owns the runner, one at a time, while it waits in
`serve`: a plain sync function runs where `GRPOTrainer` runs it, on the training thread (`Tool.thread_safe`,
docs/coming_from_grpo.md). Such a call keeps its deadline (its future settles as timed out), but Python cannot stop it:
it runs to its end there, and the next calls for that thread wait until it returns.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class CallOutcome:
    """A call's return value, or the exception it raised, or neither when it missed its deadline."""

    value: object = None
    error: BaseException | None = None
    timed_out: bool = True
    seconds: float = 0.0  # from the call's start to its return (its deadline, when it timed out)


@dataclass(eq=False)
class _Slot:
    """Where a running call runs; `lost`: it timed out and its result is to be dropped."""

    worker: bool = True
    lost: bool = False
    began: float = field(default_factory=time.monotonic)


class ToolRunner:
    """Runs calls at most `max_workers` at a time; each call's future settles when it returns, raises, or `timeout`
    seconds after it started (queued calls wait for a free worker first, without a deadline). `close()` lets the
    idle workers exit; a runner is meant for one rollout, and `serve` is called on the thread that made it."""

    def __init__(self, max_workers: int, timeout: float):
        if max_workers < 1 or not timeout > 0:
            raise ValueError(f"ToolRunner needs max_workers >= 1 and timeout > 0, got {max_workers}, {timeout}.")
        self.max_workers = max_workers
        self.timeout = timeout
        self._changed = threading.Condition()
        self._queue: deque[tuple[Callable[[], object], Future]] = deque()
        self._here: deque[tuple[Callable[[], object], Future]] = deque()  # calls for the owner's thread (`serve`)
        self._deadlines: list[tuple[float, int, Future, _Slot]] = []  # heap
        self._order = itertools.count()
        self._workers = self._idle = 0
        self._closed = False
        threading.Thread(target=self._watch, name="arpo-tool-watchdog", daemon=True).start()

    def submit(self, call: Callable[[], object], here: bool = False) -> Future:
        """A future of the call's `CallOutcome`; `here`: the call runs on the owner's thread, in `serve`."""
        future: Future = Future()
        with self._changed:
            (self._here if here else self._queue).append((call, future))
            self._add_workers()
            self._changed.notify_all()
        return future

    def serve(self, until: Sequence[Future]) -> None:
        """On the owner's thread: run the calls submitted with `here=True`, one at a time as they come, until every
        future of `until` is done. A KeyboardInterrupt or SystemExit, from a call or while waiting, is raised here
        (a call's future gets it as its error first); the calls' other exceptions are their outcomes."""
        for future in until:
            future.add_done_callback(self._wake)
        while True:
            with self._changed:
                while not self._here and not all(future.done() for future in until):
                    self._changed.wait()
                if not self._here:
                    return
                call, future = self._here.popleft()
                slot = self._start(future, worker=False)
            if slot is not None:
                self._finish(call, future, slot)

    def cancel_pending(self) -> None:
        """Drop the calls still waiting for a worker or for the owner's thread (their futures are cancelled)."""
        with self._changed:
            queued = list(self._queue) + list(self._here)
            self._queue = deque()
            self._here = deque()
        for _, future in queued:
            future.cancel()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _wake(self, _future: Future | None = None) -> None:
        with self._changed:
            self._changed.notify_all()

    def _add_workers(self) -> None:  # holds the lock
        while len(self._queue) > self._idle and self._workers < self.max_workers:
            self._workers += 1
            self._idle += 1  # counted idle until it takes a call, so that a burst does not start too many
            threading.Thread(target=self._work, name="arpo-tool", daemon=True).start()

    def _start(self, future: Future, worker: bool) -> _Slot | None:  # holds the lock
        """Start the call's deadline; None when its future was cancelled meanwhile."""
        if not future.set_running_or_notify_cancel():
            return None
        slot = _Slot(worker)
        heapq.heappush(self._deadlines, (slot.began + self.timeout, next(self._order), future, slot))
        self._changed.notify_all()  # the watchdog may have to wake up earlier
        return slot

    def _finish(self, call: Callable[[], object], future: Future, slot: _Slot) -> bool:
        """Run the call and settle its future; False when it had timed out (its result is dropped). On a worker,
        every exception is the outcome (SystemExit too); on the owner's thread, Ctrl-C and exits also go on."""
        outcome = CallOutcome(timed_out=False)
        try:
            outcome.value = call()
        except BaseException as exc:
            outcome.error = exc
        outcome.seconds = time.monotonic() - slot.began
        with self._changed:
            if not slot.lost:  # else the watchdog settled it (and replaced a worker)
                future.set_result(outcome)
        if not slot.worker and isinstance(outcome.error, (KeyboardInterrupt, SystemExit)):
            raise outcome.error
        return not slot.lost

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
                slot = self._start(future, worker=True)
            if slot is not None and not self._finish(call, future, slot):
                return  # written off when it timed out

    def _watch(self) -> None:
        with self._changed:
            while not (self._closed and all(entry[2].done() for entry in self._deadlines)):
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].done() or self._deadlines[0][0] <= now):
                    _, _, future, slot = heapq.heappop(self._deadlines)
                    if not future.done():
                        slot.lost = True
                        future.set_result(CallOutcome(seconds=self.timeout))
                        if slot.worker:
                            self._workers -= 1  # written off; a queued call gets a new worker
                            self._add_workers()
                self._changed.wait(self._deadlines[0][0] - now if self._deadlines else None)

