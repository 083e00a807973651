"""`Sandbox`: run untrusted Python in a process that cannot reach the trainer, its files, its secrets or the network.

Isolation comes from the OS, not from filtering the code (the child side is `_sandbox_child.py`):

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
import functools
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from arpo_trl.tools.base import ToolEnvironmentError

logger = logging.getLogger(__name__)

ISOLATIONS = ("auto", "namespaces", "rlimits")
_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_SANDBOX_UID_BASE = 2_000_000_000  # far above real users; one uid per concurrent sandbox slot (root trainer only)
_SLOTS = 256
_namespaces_available: bool | None = None
_namespaces_error: str | None = None  # why the probe failed, for the fallback warning and the tests
_probe_lock = threading.Lock()


@dataclass
class SandboxResult:
    """What one run did: its merged stdout/stderr and how it ended."""

    output: str
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool = False
    output_exceeded: bool = False
    seconds: float = 0.0


@dataclass
class _Worker:
    process: subprocess.Popen
    output_fd: int
    status_fd: int
    code_fd: int
    scratch: str | None


class SandboxError(ToolEnvironmentError):
    """The sandbox itself could not start (not an error of the code it runs)."""


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
        self.memory_mb, self.max_output_bytes, self.disk_mb = memory_mb, max_output_bytes, disk_mb
        self.max_processes, self.max_open_files = max_processes, max_open_files
        self.pool_size, self.preimport = pool_size, tuple(preimport)
        self.binds = tuple(str(Path(b).resolve()) for b in binds)
        self.python_executable = python_executable or sys.executable
        self.extra_env = dict(extra_env or {})
        try:
            self._python_dirs = _python_dirs(self.python_executable)
        except (OSError, subprocess.CalledProcessError, ValueError) as exc:
            raise SandboxError(f"cannot run the sandbox's Python {self.python_executable!r}: {exc}") from exc
        self.isolation = self._resolve_isolation(isolation)
        self._idle: list[_Worker] = []
        self._running: dict[int, _Worker] = {}  # id(worker) -> worker, calls in progress
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
            return self._collect(worker, source)
        finally:
            with self._lock:
                self._running.pop(id(worker), None)
            self._kill(worker)
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
            self._kill(worker)

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

    def _settings(self, scratch: str | None, uid: int | None, status_fd: int) -> dict:
        return {
            "namespaces": self.isolation == "namespaces", "scratch": scratch, "uid": uid, "status_fd": status_fd,
            "binds": sorted(self._python_dirs | set(self.binds)),
            "cpu_seconds": self.cpu_seconds, "memory_bytes": self.memory_mb << 20,
            "file_bytes": self.disk_mb << 20,
            "disk_bytes": self.disk_mb << 20, "max_open_files": self.max_open_files,
            "nproc": self.max_processes + (0 if uid is not None else _processes_of(os.getuid())),
            "preimport": list(self.preimport),
        }

    def _spawn(self) -> _Worker:
        uid = None
        if os.getuid() == 0 and (self.isolation == "namespaces" or _readable_by_others(self.python_executable)):
            with self._lock:
                uid, self._next_slot = _SANDBOX_UID_BASE + self._next_slot, (self._next_slot + 1) % _SLOTS
        scratch = None
        if self.isolation == "rlimits":
            scratch = tempfile.mkdtemp(prefix="arpo_sandbox_")
            if uid is not None:
                os.chown(scratch, uid, uid)
        code_read, code_write = os.pipe()
        output_read, output_write = os.pipe()
        status_read, status_write = os.pipe()
        try:
            process = subprocess.Popen(
                [self.python_executable, "-I", "-u", _CHILD, json.dumps(self._settings(scratch, uid, status_write))],
                stdin=code_read, stdout=output_write, stderr=output_write, pass_fds=(status_write,),
                cwd=scratch or "/", env=self._child_env(scratch or "/tmp"), start_new_session=True,
            )
        finally:
            for fd in (code_read, output_write, status_write):
                os.close(fd)
        return _Worker(process, output_read, status_read, code_write, scratch)

    def _child_env(self, home: str) -> dict[str, str]:
        env = {
            "PATH": os.defpath, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
        }
        env.update(self.extra_env)
        return env

    def _take(self) -> _Worker:
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

    def _kill(self, worker: _Worker) -> None:
        try:  # the whole session; in namespace mode the runner's PID namespace dies with it
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        worker.process.wait()
        for fd in (worker.output_fd, worker.status_fd, worker.code_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if worker.scratch:
            shutil.rmtree(worker.scratch, ignore_errors=True)

    # -- one call ----------------------------------------------------------------------------------------------

    def _collect(self, worker: _Worker, source: str) -> SandboxResult:
        start = time.monotonic()
        self._send(worker, source)
        output, statuses = bytearray(), bytearray()
        result = SandboxResult(output="")
        deadline = start + self.timeout
        open_fds = [worker.output_fd, worker.status_fd]
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out = True
                break
            ready, _, _ = select.select(open_fds, [], [], remaining)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.remove(fd)
                    continue
                (output if fd == worker.output_fd else statuses).extend(chunk)
            if len(output) > self.max_output_bytes:
                result.output_exceeded = True
                break
            if worker.status_fd not in open_fds and worker.output_fd in open_fds:
                deadline = min(deadline, time.monotonic() + 0.5)  # code done; a leftover process holds the pipe
        result.seconds = time.monotonic() - start
        result.output = output[: self.max_output_bytes].decode("utf-8", errors="replace")
        self._read_status(statuses.decode(errors="replace"), result)
        return result

    def _send(self, worker: _Worker, source: str) -> None:
        try:
            data = source.encode("utf-8", errors="replace")
            view = memoryview(data)
            while view:  # the runner reads it all before running anything; the pipe only fills up to 64 KiB
                _, writable, _ = select.select([], [worker.code_fd], [], self.timeout)
                if not writable:
                    break
                view = view[os.write(worker.code_fd, view[: 1 << 16]):]
        except BrokenPipeError:
            pass  # the worker died during setup; its status says why
        finally:
            os.close(worker.code_fd)
            worker.code_fd = -1

    def _read_status(self, text: str, result: SandboxResult) -> None:
        if not text.startswith(("ready", "error")) and not result.timed_out:
            raise SandboxError(f"the sandbox could not start: its process ended before it was ready; it printed "
                               f"{result.output[-500:]!r}")
        for line in text.splitlines():
            kind, _, value = line.partition(" ")
            if kind == "error":
                raise SandboxError(f"the sandbox could not start: {value}")
            if result.exit_code is not None or result.signal is not None:
                break  # the runner's report comes first; the supervisor's only if the runner itself died
            if kind == "exit":
                result.exit_code = int(value)
            elif kind == "signal":
                result.signal = signal.Signals(int(value)).name


@functools.cache
def _python_dirs(executable: str) -> set[str]:
    """Directories the sandboxed interpreter must see: its prefixes and, for a virtual env, the base install."""
    probe = subprocess.run([executable, "-I", "-c", "import sys, sysconfig, json; print(json.dumps("
                            "[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix] + "
                            "list(sysconfig.get_paths().values())))"],
                           capture_output=True, text=True, check=True)
    dirs = {os.path.realpath(p) for p in json.loads(probe.stdout) if p}
    dirs |= {p for p in json.loads(probe.stdout) if p}
    dirs.add(os.path.dirname(os.path.realpath(executable)))
    system = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/")
    dirs = {d for d in dirs if os.path.isdir(d) and not (d + "/").startswith(system)}
    return {d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs)}


@functools.cache
def _readable_by_others(executable: str) -> bool:
    """Whether an unprivileged sandbox uid could run this interpreter without namespaces (e.g. not under /root)."""
    for directory in _python_dirs(executable):
        path = Path(directory)
        if not all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents]) or not (
                path.stat().st_mode & stat.S_IROTH):
            return False
    return True


def _processes_of(uid: int) -> int:
    """How many processes `uid` has now (RLIMIT_NPROC counts them all, not just the sandbox's)."""
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count or 512  # no /proc (macOS): a generous ceiling


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
