"""Math-equivalence scoring of model answers with a bounded cost, from any thread (see docs/rewards.md).

A policy writes whatever pays, and math-verify (sympy underneath) can spend unbounded time on what it writes:
`9^{9^{9^{9}}}` or `(10^{10})!` are a few characters each. math-verify's own timeouts use SIGALRM, which works on the
main thread only (elsewhere it raises) and cannot stop C code, and on a timeout it logs the answer. `MathScorer`
instead:

1. caps the input before any symbolic parsing: an answer longer than `max_chars` (or than twice its longest ground
   truth, if that is more) or nested deeper than `max_depth` is not parsed; it scores 1 only if it equals a ground
   truth character for character, whitespace aside ("capped"). A parsed answer that holds a number of more than
   10^5 digits (`9^{9^{9^{9}}}`, `(10^{10})!`: math-verify keeps them unevaluated until it compares) scores 0
   without being compared ("capped" too);
2. runs math-verify in worker processes forked from a zygote that imported it once (`_math_worker.py`): an answer
   still running after `timeout` seconds has its worker killed (a fresh one is forked in milliseconds) and scores 0
   ("timeout");
3. bounds a whole call by `batch_timeout`: answers still unscored then score 0 (timeouts too).

Nothing of an answer is printed or logged. Equal answers score as math-verify scores them in-process; identical
(answer, ground truths) pairs are scored once and cached.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

logger = logging.getLogger(__name__)

WORKER_SCRIPT = str(Path(__file__).with_name("_math_worker.py"))
_TIMEOUT, _ERROR, _CAPPED = object(), object(), object()
_SURROGATES = re.compile("[\ud800-\udfff]")
_OPEN, _CLOSE = frozenset("({["), frozenset(")}]")


@dataclass
class ScoreReport:
    """Scores (1.0 or 0.0) of one call, and how many answers hit each bound."""

    scores: list[float] = field(default_factory=list)
    timeouts: int = 0  # past `timeout` (worker killed) or left when `batch_timeout` ran out
    capped: int = 0  # over `max_chars` / `max_depth`: compared as text, not parsed
    errors: int = 0  # math-verify raised, or its worker died (e.g. the memory limit)


def nesting_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
    return deepest


def _squash(text: str) -> str:
    return "".join(text.split())


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the math scoring zygote exited")
        data += chunk
    return data


class _Worker:
    def __init__(self, pid: int, conn: Connection):
        self.pid = pid
        self.conn = conn


class _Zygote:
    """The process that imported math-verify once and forks scoring workers on request (`_math_worker.py`)."""

    def __init__(self, start_timeout: float):
        mine, theirs = socket.socketpair()
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-I", WORKER_SCRIPT, str(theirs.fileno())], pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
        )
        theirs.close()
        self.control = mine
        self.control.settimeout(start_timeout)  # the first answer waits for the import of math-verify
        self.lock = threading.Lock()

    def spawn(self) -> _Worker:
        mine, theirs = socket.socketpair()
        try:
            with self.lock:
                socket.send_fds(self.control, [b"s"], [theirs.fileno()])
                pid = struct.unpack("<q", _recv_exact(self.control, 8))[0]
        except OSError as error:
            mine.close()
            raise RuntimeError(f"The math scoring worker ({WORKER_SCRIPT}) could not start: {self._why(error)}") \
                from error
        finally:
            theirs.close()
        return _Worker(pid, Connection(mine.detach()))

    def kill(self, worker: _Worker) -> None:
        worker.conn.close()
        try:
            with self.lock:
                self.control.sendall(b"k" + struct.pack("<q", worker.pid))
                _recv_exact(self.control, 2)
        except OSError:  # the zygote is gone; so are its workers (they see the end of their socket)
            pass

    def _why(self, error: Exception) -> str:
        if self.process.poll() is None:
            return f"{type(error).__name__}: {error}"
        self._stderr.seek(0)
        tail = self._stderr.read()[-600:].decode("utf-8", "replace").strip()
        return f"it exited with code {self.process.returncode}: {tail or 'no output'}"

    def close(self) -> None:
        self.control.close()  # the zygote kills its workers and exits on end of file
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


class MathScorer:
    """Scores answers against ground truths with math-verify, bounded in time per answer and per call, silent, and
    callable from any thread (see the module docstring). Processes start on first use and end with `close()` (or
    at exit)."""

    def __init__(self, timeout: float = 2.0, batch_timeout: float = 8.0, max_chars: int = 1000, max_depth: int = 40,
                 workers: int | None = None, cache_size: int = 4096, start_timeout: float = 120.0):
        self.configure(timeout=timeout, batch_timeout=batch_timeout, max_chars=max_chars, max_depth=max_depth,
                       workers=workers or min(4, max(2, os.cpu_count() or 1)))
        self.cache_size = cache_size
        self.start_timeout = start_timeout
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._zygote: _Zygote | None = None
        self._pid = os.getpid()
        atexit.register(self.close)

    def configure(self, **limits) -> None:
        """Change `timeout`, `batch_timeout`, `max_chars`, `max_depth` or `workers` (checked: positive numbers)."""
        for name, value in limits.items():
            if name not in ("timeout", "batch_timeout", "max_chars", "max_depth", "workers"):
                raise TypeError(f"MathScorer has no limit {name!r}.")
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"math scoring {name} must be a positive number, got {value!r}.")
            setattr(self, name, value)

    # ---- scoring ------------------------------------------------------------------------------------------------
    def score(self, predictions: Sequence[str], truths: Sequence[Sequence[str]]) -> ScoreReport:
        """One score per prediction: 1.0 if math-verify finds it equivalent to one of its ground truths, else 0.0."""
        report = ScoreReport(scores=[0.0] * len(predictions))
        todo: dict[tuple, list[int]] = {}
        for i, (prediction, golds) in enumerate(zip(predictions, truths)):
            key = (_SURROGATES.sub("\ufffd", str(prediction)), tuple(_SURROGATES.sub("\ufffd", str(t)) for t in golds))
            if self._capped(*key):
                report.capped += 1
                report.scores[i] = float(any(_squash(key[0]) == _squash(t) for t in key[1]))
            elif (cached := self._cached(key)) is not None:
                report.capped += cached is _CAPPED
                report.scores[i] = 0.0 if cached is _CAPPED else cached
            else:
                todo.setdefault(key, []).append(i)
        for key, value in self._run(list(todo)).items():
            if value is _TIMEOUT:
                report.timeouts += len(todo[key])
            elif value is _ERROR:
                report.errors += len(todo[key])
            elif value is _CAPPED:
                self._store(key, value)
                report.capped += len(todo[key])
            else:
                self._store(key, value)
                for i in todo[key]:
                    report.scores[i] = value
        return report

    def _capped(self, prediction: str, truths: tuple[str, ...]) -> bool:
        longest = max((len(t) for t in truths), default=0)
        if len(prediction) > max(self.max_chars, 2 * longest):
            return True
        return nesting_depth(prediction) > max(self.max_depth, 2 * max((nesting_depth(t) for t in truths), default=0))

    def _cached(self, key: tuple) -> float | object | None:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return None

    def _store(self, key: tuple, value: float | object) -> None:
        with self._lock:
            self._cache[key] = value
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _run(self, keys: list[tuple]) -> dict[tuple, object]:
        """Score `keys` on up to `workers` processes; a worker past `timeout` is killed and replaced."""
        results: dict[tuple, object] = {}
        if not keys:
            return results
        pending, busy = collections.deque(keys), {}
        free = self._lease(min(len(keys), int(self.workers)))
        deadline = time.monotonic() + self.batch_timeout
        try:
            while pending or busy:
                while free and pending and time.monotonic() < deadline:
                    worker, key = free.pop(), pending.popleft()
                    try:
                        worker.conn.send((key[0], list(key[1])))
                        busy[worker.conn] = (worker, key, time.monotonic())
                    except OSError:  # died while idle
                        results[key] = _ERROR
                        free.append(self._replace(worker))
                if not busy:
                    break
                wake = min(min(started for _, _, started in busy.values()) + self.timeout, deadline)
                for conn in wait(list(busy), timeout=max(wake - time.monotonic(), 0)):
                    worker, key, _ = busy.pop(conn)
                    try:
                        value = conn.recv()
                        capped = not isinstance(value, float) and value[0] == "capped"
                        results[key] = value if isinstance(value, float) else _CAPPED if capped else _ERROR
                        free.append(worker)
                    except (EOFError, OSError):  # killed by its memory limit
                        results[key] = _ERROR
                        free.append(self._replace(worker))
                now = time.monotonic()
                for conn, (worker, key, started) in list(busy.items()):
                    if now >= min(started + self.timeout, deadline):
                        del busy[conn]
                        results[key] = _TIMEOUT
                        self._zygote_process().kill(worker)
                        if pending and now < deadline:
                            free.append(self._zygote_process().spawn())
        finally:
            for worker, _, _ in busy.values():  # interrupted (KeyboardInterrupt): never reuse a busy worker
                self._zygote_process().kill(worker)
            self._release(free)
        for key in pending:
            results[key] = _TIMEOUT
        return results

    # ---- processes ----------------------------------------------------------------------------------------------
    def _zygote_process(self) -> _Zygote:
        with self._lock:
            if self._pid != os.getpid():  # a forked copy of this object: never touch the parent's processes
                self._zygote = None
                self._idle = []
                self._pid = os.getpid()
            if self._zygote is None or self._zygote.process.poll() is not None:
                self._zygote = _Zygote(self.start_timeout)
                self._idle = []
            return self._zygote

    def _lease(self, count: int) -> list[_Worker]:
        zygote = self._zygote_process()
        with self._lock:
            taken, self._idle = self._idle[:count], self._idle[count:]
        return taken + [zygote.spawn() for _ in range(count - len(taken))]

    def _release(self, workers: list[_Worker]) -> None:
        with self._lock:
            keep = max(int(self.workers) - len(self._idle), 0)
            self._idle += workers[:keep]
        for worker in workers[keep:]:
            worker.conn.close()  # it exits on end of file; the zygote reaps it

    def _replace(self, worker: _Worker) -> _Worker:
        zygote = self._zygote_process()
        zygote.kill(worker)
        return zygote.spawn()

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        """End the worker processes (a later call starts new ones)."""
        with self._lock:
            zygote, idle = self._zygote, self._idle
            self._zygote = None
            self._idle = []
        if zygote is not None and self._pid == os.getpid():
            for worker in idle:
                worker.conn.close()
            zygote.close()


_default: MathScorer | None = None
_default_lock = threading.Lock()


def default_scorer() -> MathScorer:
    """The process-wide scorer behind `arpo_math_reward`, `answer_accuracy` and `arpo-trl eval`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathScorer()
        return _default


def configure_math_scoring(**limits) -> None:
    """Set the default scorer's limits: `timeout` (seconds per answer), `batch_timeout` (seconds per reward call),
    `max_chars`, `max_depth`, `workers`."""
    default_scorer().configure(**limits)
