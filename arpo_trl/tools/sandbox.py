"""`Sandbox`: run untrusted Python in a process that cannot reach the trainer, its files, its secrets or the network.

Isolation comes from the OS, not from filtering the code (the child side is `_sandbox_child.py`, one process seen
from the trainer `sandbox_process.py`):

* ``isolation="namespaces"`` (Linux, root or unprivileged user namespaces): fresh mount, network, PID, IPC and UTS
  namespaces. The code sees a new root filesystem — read-only system and Python directories, a size-limited
  tmpfs as /tmp (its cwd and HOME) — no network interface, and only its own processes; all of them die when the
  call ends. It runs as a dedicated unprivileged uid (when the trainer is root) or with every capability dropped
  (user namespace), with ``no_new_privs``.
* ``isolation="rlimits"`` (the fallback, e.g. macOS or containers that forbid namespaces): a scratch directory on
  disk, a scrubbed environment and the rlimits only. Weaker, and documented as such: the code can read what the
  trainer's user can read and open sockets, and a process that calls ``setsid`` can outlive the call.
* ``isolation="auto"``: namespaces when a probe sandbox starts, otherwise the fallback, with a warning (and the
  probe's failure) logged by every Sandbox that falls back: a broken namespace setup must not pass unnoticed.

Both modes: its own session (killed as a group), CPU-time, address-space, file-size, process-count and open-file
rlimits, a wall-clock timeout, an environment holding none of the trainer's variables, no inherited file
descriptors, stdin empty, output capped (the process is killed once it prints more).

Each call uses a fresh process. ``pool_size`` processes are started ahead of time and wait, already sandboxed,
for their code — a call then costs milliseconds instead of an interpreter start, with the same isolation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from arpo_trl.tools.sandbox_process import (
    SandboxError,
    SandboxResult,
    Worker,
    child_env,
    collect,
    kill,
    processes_of,
    python_dirs,
    readable_by_others,
    spawn,
)

__all__ = ["ISOLATIONS", "Sandbox", "SandboxError", "SandboxResult"]

logger = logging.getLogger(__name__)

ISOLATIONS = ("auto", "namespaces", "rlimits")
_SANDBOX_UID_BASE = 2_000_000_000  # far above real users; one uid per concurrent sandbox slot (root trainer only)
_SLOTS = 256
_namespaces_available: bool | None = None
_namespaces_error: str | None = None  # why the probe failed, for the fallback warning and the tests
_probe_lock = threading.Lock()


class Sandbox:
    """Runs Python source in isolated, resource-limited, single-use processes; see the module docstring."""

    def __init__(
        self,
        timeout: float = 10.0,
        cpu_seconds: int | None = None,
        memory_mb: int = 2048,
        max_output_bytes: int = 1 << 16,
        disk_mb: int = 64,
        max_processes: int = 32,
        max_open_files: int = 256,
        isolation: str = "auto",
        pool_size: int = 2,
        preimport: tuple[str, ...] = (),
        binds: tuple[str, ...] = (),
        python_executable: str | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        self.validate(timeout, memory_mb, max_output_bytes, disk_mb, max_processes, max_open_files, isolation,
                      pool_size, python_executable)
        self.timeout = timeout
        self.cpu_seconds = cpu_seconds or int(timeout) + 1
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.disk_mb = disk_mb
        self.max_processes = max_processes
        self.max_open_files = max_open_files
        self.pool_size = pool_size
        self.preimport = tuple(preimport)
        self.binds = tuple(str(Path(b).resolve()) for b in binds)
        self.python_executable = python_executable or sys.executable
        self.extra_env = dict(extra_env or {})
        try:
            self._python_dirs = python_dirs(self.python_executable)
        except (OSError, subprocess.CalledProcessError, ValueError) as exc:
            raise SandboxError(f"cannot run the sandbox's Python {self.python_executable!r}: {exc}") from exc
        self.isolation = self._resolve_isolation(isolation)
        self._idle: list[Worker] = []
        self._running: dict[int, Worker] = {}  # id(worker) -> worker, calls in progress
        self._lock = threading.Lock()
        self._next_slot = 0
        self._closed = False
        atexit.register(self.close)
        self._refill()  # cheap: the processes start in the background

    @staticmethod
    def validate(timeout: float = 10.0, memory_mb: int = 2048, max_output_bytes: int = 1 << 16, disk_mb: int = 64,
                 max_processes: int = 32, max_open_files: int = 256, isolation: str = "auto", pool_size: int = 2,
                 python_executable: str | None = None, **_: object) -> None:
        """Raise ValueError naming the first bad setting."""
        if python_executable is not None and not (os.path.isfile(python_executable)
                                                  and os.access(python_executable, os.X_OK)):
            raise ValueError(f"Sandbox python_executable {python_executable!r} is not an executable file.")
        if not timeout > 0:
            raise ValueError(f"Sandbox timeout must be > 0 seconds, got {timeout}.")
        if isolation not in ISOLATIONS:
            raise ValueError(f"Sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}.")
        for name, value in (("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes), ("disk_mb", disk_mb),
                            ("max_processes", max_processes), ("max_open_files", max_open_files)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Sandbox {name} must be an integer >= 1, got {value!r}.")
        if not isinstance(pool_size, int) or pool_size < 0:
            raise ValueError(f"Sandbox pool_size must be an integer >= 0, got {pool_size!r}.")

    # -- public API --------------------------------------------------------------------------------------------

    def run(self, source: str) -> SandboxResult:
        """Run `source` in a fresh sandboxed process and return what it printed and how it ended."""
        if self._closed:
            raise SandboxError("this Sandbox was closed.")
        worker = self._take()
        with self._lock:
            self._running[id(worker)] = worker
        try:
            return collect(worker, source, self.timeout, self.max_output_bytes)
        finally:
            with self._lock:
                self._running.pop(id(worker), None)
            kill(worker)
            self._refill()

    def kill_running(self) -> None:
        """Kill the processes of the calls in progress; their `run` returns at once (as a crash or timeout)."""
        with self._lock:
            running = list(self._running.values())
        for worker in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.process.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the idle pooled processes (also done at interpreter exit)."""
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            kill(worker)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ---------------------------------------------------------------------------------------------

    def _resolve_isolation(self, isolation: str) -> str:
        if isolation == "rlimits":
            return isolation
        if not _probe_namespaces(self.python_executable):
            if isolation == "namespaces":
                raise SandboxError("isolation='namespaces' needs Linux mount/PID/network namespaces (root, or "
                                   "unprivileged user namespaces enabled); they are not available here. Use "
                                   "isolation='rlimits' to accept the weaker fallback.")
            logger.warning(
                "Sandbox: isolation='auto' FELL BACK to the weaker 'rlimits' isolation: Linux namespaces do not work "
                "here (%s). Model-written Python can now read every file this user can read, open network "
                "connections and leave daemons behind. Fix namespaces (root, or unprivileged user namespaces), or "
                "pass isolation='rlimits' (CLI: python_isolation) to accept the fallback explicitly.",
                _namespaces_error)
            return "rlimits"
        return "namespaces"

    def _settings(self, scratch: str | None, uid: int | None) -> dict:
        return {
            "namespaces": self.isolation == "namespaces", "scratch": scratch, "uid": uid,
            "binds": sorted(self._python_dirs | set(self.binds)),
            "cpu_seconds": self.cpu_seconds, "memory_bytes": self.memory_mb << 20,
            "file_bytes": self.disk_mb << 20,
            "disk_bytes": self.disk_mb << 20, "max_open_files": self.max_open_files,
            "nproc": self.max_processes + (0 if uid is not None else processes_of(os.getuid())),
            "preimport": list(self.preimport),
        }

    def _spawn(self) -> Worker:
        uid = None
        if os.getuid() == 0 and (self.isolation == "namespaces" or readable_by_others(self.python_executable)):
            with self._lock:
                uid, self._next_slot = _SANDBOX_UID_BASE + self._next_slot, (self._next_slot + 1) % _SLOTS
        scratch = None
        if self.isolation == "rlimits":
            scratch = tempfile.mkdtemp(prefix="arpo_sandbox_")
            if uid is not None:
                os.chown(scratch, uid, uid)
        return spawn(self.python_executable, self._settings(scratch, uid), scratch,
                     child_env(scratch or "/tmp", self.extra_env))

    def _take(self) -> Worker:
        with self._lock:
            if self._idle:  # the oldest: the newest was started a moment ago and may not be ready yet
                return self._idle.pop(0)
        return self._spawn()

    def _refill(self) -> None:
        while not self._closed:
            with self._lock:
                if len(self._idle) >= self.pool_size:
                    return
            worker = self._spawn()
            with self._lock:
                self._idle.append(worker)


def _probe_namespaces(python_executable: str) -> bool:
    """Whether a namespace sandbox starts here (probed once per process; the reason for a failure is kept)."""
    global _namespaces_available, _namespaces_error
    with _probe_lock:
        if _namespaces_available is None:
            _namespaces_error = _try_namespaces(python_executable)
            _namespaces_available = _namespaces_error is None
        return _namespaces_available


def _try_namespaces(python_executable: str) -> str | None:
    """None when a namespace sandbox runs `print('ok')`, else why not."""
    if not sys.platform.startswith("linux"):
        return f"not Linux (sys.platform={sys.platform!r})"
    probe = Sandbox.__new__(Sandbox)
    Sandbox.__init__(probe, timeout=20, pool_size=0, isolation="rlimits", python_executable=python_executable)
    probe.isolation = "namespaces"
    try:
        result = probe.run("print('ok')")
    except SandboxError as exc:
        return f"the probe sandbox did not start: {exc}"
    finally:
        probe.close()
    if result.output.strip() != "ok":
        return f"the probe sandbox printed {result.output[-500:]!r} instead of 'ok'"
    return None
