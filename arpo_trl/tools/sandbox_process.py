"""One sandboxed process seen from the trainer (the parent side of `_sandbox_child.py`'s pipes): started with its
settings and a scrubbed environment, sent its code, read until it ends, its output capped and its deadline kept, its
status lines read, killed with its whole session; and the host facts a `Sandbox` needs to configure it (the
interpreter's directories, whether another uid can run it, a uid's process count)."""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from arpo_trl.tools.base import ToolEnvironmentError

CHILD = str(Path(__file__).with_name("_sandbox_child.py"))


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
class Worker:
    """One sandboxed process, started and waiting for its code: the pipes the trainer holds to it."""

    process: subprocess.Popen
    output_fd: int
    status_fd: int
    code_fd: int
    scratch: str | None


class SandboxError(ToolEnvironmentError):
    """The sandbox itself could not start (not an error of the code it runs)."""


def spawn(python_executable: str, settings: dict, scratch: str | None, env: dict[str, str]) -> Worker:
    """Start a sandboxed process (`_sandbox_child.py` with `settings`, which gain the status pipe's descriptor); it
    waits for its code on stdin."""
    code_read, code_write = os.pipe()
    output_read, output_write = os.pipe()
    status_read, status_write = os.pipe()
    try:
        process = subprocess.Popen(
            [python_executable, "-I", "-u", CHILD, json.dumps({**settings, "status_fd": status_write})],
            stdin=code_read, stdout=output_write, stderr=output_write, pass_fds=(status_write,),
            cwd=scratch or "/", env=env, start_new_session=True,
        )
    finally:
        for fd in (code_read, output_write, status_write):
            os.close(fd)
    return Worker(process, output_read, status_read, code_write, scratch)


def child_env(home: str, extra_env: dict[str, str]) -> dict[str, str]:
    """The whole environment of a sandboxed process: none of the trainer's variables, one thread per library."""
    env = {
        "PATH": os.defpath, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
    }
    env.update(extra_env)
    return env


def kill(worker: Worker) -> None:
    """End the process (its whole session) and release its pipes and scratch directory."""
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


def collect(worker: Worker, source: str, timeout: float, max_output_bytes: int) -> SandboxResult:
    """Send `source` to the waiting process and read what it prints and how it ends, within `timeout` seconds and
    `max_output_bytes` of output."""
    start = time.monotonic()
    send(worker, source, timeout)
    output, statuses = bytearray(), bytearray()
    result = SandboxResult(output="")
    deadline = start + timeout
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
        if len(output) > max_output_bytes:
            result.output_exceeded = True
            break
        if worker.status_fd not in open_fds and worker.output_fd in open_fds:
            deadline = min(deadline, time.monotonic() + 0.5)  # code done; a leftover process holds the pipe
    result.seconds = time.monotonic() - start
    result.output = output[: max_output_bytes].decode("utf-8", errors="replace")
    read_status(statuses.decode(errors="replace"), result)
    return result


def send(worker: Worker, source: str, timeout: float) -> None:
    """The code, whole, then end of file: the process reads it all before it runs anything."""
    try:
        data = source.encode("utf-8", errors="replace")
        view = memoryview(data)
        while view:  # the runner reads it all before running anything; the pipe only fills up to 64 KiB
            _, writable, _ = select.select([], [worker.code_fd], [], timeout)
            if not writable:
                break
            view = view[os.write(worker.code_fd, view[: 1 << 16]):]
    except BrokenPipeError:
        pass  # the worker died during setup; its status says why
    finally:
        os.close(worker.code_fd)
        worker.code_fd = -1


def read_status(text: str, result: SandboxResult) -> None:
    """Fill in how the run ended from the status lines of `_sandbox_child.py`; a sandbox that never became ready is a
    `SandboxError`."""
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
def python_dirs(executable: str) -> set[str]:
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
def readable_by_others(executable: str) -> bool:
    """Whether an unprivileged sandbox uid could run this interpreter without namespaces (e.g. not under /root)."""
    for directory in python_dirs(executable):
        path = Path(directory)
        if not all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents]) or not (
                path.stat().st_mode & stat.S_IROTH):
            return False
    return True


def processes_of(uid: int) -> int:
    """How many processes `uid` has now (RLIMIT_NPROC counts them all, not just the sandbox's)."""
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count or 512  # no /proc (macOS): a generous ceiling
