"""Hostile-code suite: model-written code that tries to hurt the run, through the real `PythonTool` sandbox.

Every case checks that the trainer (this process, and a canary process it owns) survives, that the result text
says what happened, and that no process or file is left behind. The full suite needs the namespace sandbox
(Linux; CI runs as root); a subset that the weaker `rlimits` fallback also promises runs in that mode too.

On Linux the namespace sandbox is required: if it does not start, the namespace tests fail with the probe's reason
instead of skipping (a sandbox broken by a code change must not leave a green suite). Where namespaces are
unavailable by design (a container that forbids them, a distribution that restricts user namespaces), set
ARPO_TRL_SANDBOX_NAMESPACES=optional to skip them; elsewhere than Linux that is the default.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import arpo_trl.tools.sandbox as sandbox_module
import arpo_trl.tools.sandbox_process as sandbox_process
from arpo_trl.tools import PythonTool
from arpo_trl.tools.sandbox import Sandbox, SandboxError, _probe_namespaces

NAMESPACES = sys.platform.startswith("linux") and _probe_namespaces(sys.executable)
NAMESPACES_ERROR = sandbox_module._namespaces_error
FAKE_SECRETS = {"HF_TOKEN": "hf_FAKEtokenFORtests123", "WANDB_API_KEY": "fakewandbkey0123456789"}


@dataclass
class Case:
    name: str
    code: str
    expect: tuple[str, ...]  # the result must contain one of these
    fallback_safe: bool = False  # also promised (and safe to try) under isolation="rlimits"
    # a case that legitimately takes longer than the shared tools' 3 s gets a tool of its own with this timeout
    timeout: float | None = None


@dataclass
class Trainer:
    """What the hostile code goes after: secrets in the environment, the answer file, a socket, an open fd."""

    answers: Path
    listener: socket.socket
    fd: int
    canary: subprocess.Popen

    def fill(self, code: str) -> str:
        return (code.replace("ANSWERS", str(self.answers)).replace("PORT", str(self.listener.getsockname()[1]))
                .replace("TRAINER_PID", str(os.getpid())).replace("CANARY_PID", str(self.canary.pid))
                .replace("TRAINER_FD", str(self.fd)))


LIMITS = dict(memory_limit_mb=1024, max_output_chars=2000, pool_size=1, disk_limit_mb=16, max_processes=16)

CASES = [
    Case("infinite_loop", "while True: pass", ("TimeoutError",), True),
    Case("sleep_forever", "import time\ntime.sleep(1000)", ("TimeoutError",), True),
    Case("fork_bomb", "import os\nwhile True:\n    os.fork()", ("BlockingIOError", "TimeoutError", "too much output")),
    Case("subprocess_bomb", "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(100)'])", ("BlockingIOError", "Resource temporarily unavailable", "TimeoutError")),
    Case("memory_bomb", "x = bytearray(8 * 2**30)", ("MemoryError",), True),
    # it writes ~1 GB before the limit stops it: seconds on a new VM, whose first touch of each page is slow
    Case("memory_growth", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**8))", ("MemoryError",), True,
         timeout=20),
    Case("huge_output_loop", "while True:\n    print('x' * 1000)", ("too much output",), True),
    Case("huge_single_line", "print('y' * 10**8)", ("too much output",), True),
    Case("huge_stderr", "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", ("too much output",), True),
    Case("write_system_dir", "open('/usr/evil.py', 'w').write('x')", ("Read-only file system", "Permission denied")),
    Case("write_root", "open('/evil', 'w').write('x')", ("Read-only file system", "Permission denied")),
    Case("write_trainer_dir", "open('ANSWERS.evil', 'w').write('x')", ("No such file or directory",)),
    Case("fill_disk", "f = open('big', 'wb')\nwhile True:\n    f.write(b'0' * 2**20)",
         ("No space left on device", "File too large")),
    Case("fill_inodes", "import os\nfor i in range(10**6):\n    open(f'f{i}', 'w').close()",
         ("No space left on device",)),
    Case("fill_shm", "f = open('/dev/shm/big', 'wb')\nwhile True:\n    f.write(b'0' * 2**20)",
         ("No space left on device", "File too large")),
    Case("env_secrets", "import os\nprint(os.environ.get('HF_TOKEN'), os.environ.get('WANDB_API_KEY'))\n"
         "print(sorted(os.environ))", ("None None",), True),
    Case("trainer_environ", "print(open('/proc/TRAINER_PID/environ', 'rb').read())",
         ("No such file or directory", "Permission denied")),
    Case("read_answers", "print(open('ANSWERS').read())", ("No such file or directory",)),
    Case("find_answers", "import os\nfound = []\nfor d, dirs, files in os.walk('/'):\n"
         "    dirs[:] = [x for x in dirs if x != 'site-packages' and os.path.join(d, x) not in ('/usr', '/proc')]\n"
         "    found += [os.path.join(d, f) for f in files if 'answers' in f]\nprint('found', found)", ("found []",)),
    Case("read_shadow", "print(open('/etc/shadow').read())", ("No such file or directory", "Permission denied")),
    Case("tcp_to_trainer",
         "import socket\ns = socket.create_connection(('127.0.0.1', PORT), timeout=2)\nprint('connected')",
         ("Network is unreachable", "Connection refused", "Cannot assign requested address")),
    Case("dns_lookup", "import socket\nprint(socket.getaddrinfo('pypi.org', 443))",
         ("gaierror", "Temporary failure in name resolution", "Name or service not known")),
    Case("udp_out", "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
         ("Network is unreachable",)),
    Case("kill_parent", "import os\nos.kill(os.getppid(), 9)\nprint('still here')", ("still here", "SIGKILL")),
    Case("kill_trainer_pid", "import os\nos.kill(TRAINER_PID, 9)", ("ProcessLookupError", "PermissionError")),
    Case("kill_canary", "import os\nos.kill(CANARY_PID, 9)", ("ProcessLookupError", "PermissionError")),
    Case("kill_everything", "import os\nos.kill(-1, 9)\nprint('survived')", ("survived", "ProcessLookupError")),
    Case("killpg_self", "import os\nos.killpg(0, 9)", ("SIGKILL",)),
    Case("signal_self", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", ("SIGTERM",), True),
    Case("alarm", "import signal, time\nsignal.alarm(1)\ntime.sleep(30)", ("SIGALRM",), True),
    Case("stop_self", "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", ("TimeoutError",), True),
    Case("abort", "import os\nos.abort()", ("SIGABRT",), True),
    Case("escaping_daemon", "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; "
         "time.sleep(100)'], start_new_session=True)\nprint('detached')", ("detached",)),
    Case("double_fork_ignoring_signals", "import os, signal, time\nif os.fork() == 0:\n    os.setsid()\n"
         "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
         "    if os.fork() == 0:\n        time.sleep(100)\n    os._exit(0)\nprint('parent done')", ("parent done",)),
    Case("deep_recursion", "def f(n):\n    return f(n + 1)\nf(0)", ("RecursionError",), True),
    Case("unbounded_recursion", "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
         ("SIGSEGV", "MemoryError", "RecursionError", "TimeoutError")),
    Case("segfault", "import ctypes\nctypes.string_at(0)", ("SIGSEGV",), True),
    Case("setuid_root", "import os\nos.setuid(0)", ("PermissionError", "Operation not permitted")),
    Case("mount", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "r = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\nprint('mount', r, ctypes.get_errno())",
         ("mount -1 1",)),
    Case("stdin_input", "input()", ("EOFError",), True),
    Case("stdin_read", "import sys\nprint(repr(sys.stdin.read()))", ("''",), True),
    Case("binary_output", "import sys\nsys.stdout.buffer.write(bytes(range(256)))\nprint()\nprint('end')",
         ("end",), True),
    Case("invalid_utf8", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\xc3(\\xa0\\xa1')\nprint('ok')",
         ("ok",), True),
    Case("surrogate_source", "print('\udcff')", ("?", "SyntaxError"), True),
    Case("os_exit", "import os\nos._exit(7)", ("exited with status 7",), True),
    Case("sys_exit_message", "import sys\nsys.exit('bye')", ("bye",), True),
    Case("non_daemon_thread", "import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()",
         ("TimeoutError",), True),
    Case("daemon_thread", "import threading, time\nthreading.Thread(target=time.sleep, args=(100,), daemon=True)"
         ".start()\nprint('main done')", ("main done",), True),
    Case("inherited_fd", "import os\nos.fstat(TRAINER_FD)", ("Bad file descriptor",), True),
    Case("list_fds", "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))", ("[0, 1, 2, 3]",)),
    Case("see_trainer_processes", "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
         ("[1, 2]",)),
]


def sandbox_processes() -> set[int]:
    """Processes of the sandbox machinery or its uids (not counting idle pool workers, filtered by the caller).

    Only this checkout's: their interpreter is this test's `sys.executable` and they are not (descendants of) another
    checkout's `_sandbox_child.py`: sandboxes of other checkouts running on the same machine with the same interpreter
    at the same time are not leftovers of these tests."""
    ours, child = os.fsencode(sys.executable) + b"\0", os.fsencode(str(Path(sandbox_module.__file__).parent))
    found, parents, foreign = set(), {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            uid = os.stat(f"/proc/{entry}").st_uid
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if not cmdline.startswith(ours):
            continue
        if b"_sandbox_child.py" in cmdline and child not in cmdline:
            foreign.add(int(entry))
        elif b"_sandbox_child.py" in cmdline or b"time.sleep(100)" in cmdline or uid >= 2_000_000_000:
            found.add(int(entry))
    return {pid for pid in found if not _descends_from(pid, foreign, parents)}


def _descends_from(pid: int, ancestors: set[int], parents: dict[int, int]) -> bool:
    seen = set()
    while pid in parents and pid not in seen:
        seen.add(pid)
        pid = parents[pid]
        if pid in ancestors:
            return True
    return False


def idle_worker_tree(tool: PythonTool) -> set[int]:
    pids = {w.process.pid for w in tool.sandbox._idle}
    children = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) in pids:
                children.add(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return pids | children


def settled(tool: PythonTool, timeout: float = 30.0) -> PythonTool:
    """`tool` once its pool has started: one call run, the pool full again, and the sandbox processes unchanged for
    half a second. A test's "before" snapshot then never catches a module fixture's workers mid-start (which test
    creates the fixture depends on the order the tests run in)."""
    assert tool("print(1)") == "1"
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = sandbox_processes()
        if len(tool.sandbox._idle) >= tool.sandbox.pool_size and now == last:
            break
        last = now
        time.sleep(0.5)
    return tool


def leftovers(tool: PythonTool, before: set[int], grace: float = 30.0, others: tuple[PythonTool, ...] = ()) -> set[int]:
    """What the calls left, apart from the pool workers that `tool` (and the `others`, still open) keep ready."""
    deadline = time.monotonic() + grace
    while True:
        left = sandbox_processes() - before - idle_worker_tree(tool)
        left -= {pid for other in others for pid in idle_worker_tree(other)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# What other programs on a shared machine keep in /dev/shm while these tests run (Python multiprocessing's
# semaphores, torch's shared tensors, OpenMP's registration): theirs, not a sandbox's leftovers.
OTHER_PROGRAMS_SHM = ("sem.mp-", "psm_", "torch_", "__KMP_REGISTERED_LIB_")


def host_temp_entries() -> set[str]:
    """Sandbox scratch dirs and anything else in /dev/shm (other processes' /tmp files would make this flaky)."""
    scratch = {e for e in os.listdir(tempfile.gettempdir()) if e.startswith("arpo_sandbox_")}
    return scratch | {e for e in os.listdir("/dev/shm") if not e.startswith(OTHER_PROGRAMS_SHM)}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    answers = tmp_path_factory.mktemp("data") / "answers.jsonl"
    answers.write_text('{"answer": "42"}\n')
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    fd = os.open(answers, os.O_RDONLY)
    os.set_inheritable(fd, True)
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    saved = {k: os.environ.get(k) for k in FAKE_SECRETS}
    os.environ.update(FAKE_SECRETS)
    yield Trainer(answers, listener, fd, canary)
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    canary.kill()
    listener.close()
    os.close(fd)


def check_survived(trainer: Trainer, output: str) -> None:
    assert trainer.canary.poll() is None, "the trainer's canary process was killed"
    assert trainer.answers.read_text() == '{"answer": "42"}\n'
    assert not Path(str(trainer.answers) + ".evil").exists()
    with pytest.raises(BlockingIOError):
        trainer.listener.accept()
    for secret in FAKE_SECRETS.values():
        assert secret not in output


def run_case(shared: PythonTool, trainer: Trainer, case: Case) -> str:
    """`case` in the `shared` tool, or in a tool of its own like it if the case has its own timeout."""
    if case.timeout is None:
        return _run_case(shared, trainer, case)
    tool = settled(PythonTool(timeout=case.timeout, isolation=shared.sandbox_options["isolation"], **LIMITS))
    try:
        return _run_case(tool, trainer, case, others=(shared,))
    finally:
        tool.close()


def _run_case(tool: PythonTool, trainer: Trainer, case: Case, others: tuple[PythonTool, ...] = ()) -> str:
    before, files = sandbox_processes() - idle_worker_tree(tool), host_temp_entries()
    output = tool(trainer.fill(case.code))
    assert any(e in output for e in case.expect), f"{case.name}: {output!r}"
    check_survived(trainer, output)
    assert not leftovers(tool, before, others=others), f"{case.name} left processes behind"
    idle_scratch = {os.path.basename(w.scratch) for w in tool.sandbox._idle if w.scratch}
    assert host_temp_entries() - idle_scratch <= files, f"{case.name} left files: {host_temp_entries() - files}"
    return output


def namespaces_required() -> bool:
    """ARPO_TRL_SANDBOX_NAMESPACES: 'required' (default on Linux) or 'optional' (default elsewhere)."""
    setting = os.environ.get("ARPO_TRL_SANDBOX_NAMESPACES") or (
        "required" if sys.platform.startswith("linux") else "optional")
    if setting not in ("required", "optional"):
        raise ValueError(f"ARPO_TRL_SANDBOX_NAMESPACES must be 'required' or 'optional', got {setting!r}.")
    return setting == "required"


@pytest.fixture(scope="module")
def namespace_tool():
    if not NAMESPACES:
        message = f"the namespace sandbox does not start here: {NAMESPACES_ERROR}"
        if namespaces_required():
            pytest.fail(f"{message}. If this machine forbids namespaces by design, set "
                        "ARPO_TRL_SANDBOX_NAMESPACES=optional (the rlimits fallback is tested either way).")
        pytest.skip(message)
    tool = PythonTool(timeout=3, isolation="namespaces", **LIMITS)
    yield settled(tool)
    tool.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_code_in_namespace_sandbox(namespace_tool, trainer, case):
    run_case(namespace_tool, trainer, case)


@pytest.fixture
def busy_namespace_tool(namespace_tool):
    """As `namespace_tool`, with a timeout that a normal call meets while CPU hogs share the machine's cores (each
    of these calls starts its own sandbox, and that start counts against the timeout)."""
    tool = PythonTool(timeout=20, isolation="namespaces", **LIMITS)
    yield settled(tool)
    tool.close()


@pytest.mark.long  # 21 s; each hostile program alone: test_hostile_code_in_namespace_sandbox
def test_hostile_code_under_concurrency(busy_namespace_tool, namespace_tool, trainer):
    """Timeouts, crashes and normal calls at once, from the sampler's tool threads: each gets its own outcome."""
    tool = busy_namespace_tool
    picks = [c for c in CASES if c.name in {"infinite_loop", "memory_bomb", "segfault", "os_exit", "env_secrets",
                                            "fork_bomb", "huge_output_loop", "deep_recursion"}]
    before = sandbox_processes() - idle_worker_tree(tool) - idle_worker_tree(namespace_tool)
    jobs = [(c, trainer.fill(c.code)) for c in picks] + [(None, f"{i} * 7") for i in range(8)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        outputs = list(pool.map(tool, [code for _, code in jobs]))
    for (case, _), output in zip(jobs, outputs):
        if case is None:
            continue
        assert any(e in output for e in case.expect), f"{case.name}: {output!r}"
    assert outputs[len(picks):] == [str(i * 7) for i in range(8)]
    check_survived(trainer, "".join(outputs))
    assert not leftovers(tool, before, others=(namespace_tool,))  # its pool may refill after an earlier test


@pytest.fixture(scope="module")
def fallback_tool():
    tool = PythonTool(timeout=3, isolation="rlimits", **LIMITS)
    yield settled(tool)
    tool.close()


FALLBACK_CASES = [c for c in CASES if c.fallback_safe]


@pytest.mark.parametrize("case", FALLBACK_CASES, ids=[c.name for c in FALLBACK_CASES])
def test_hostile_code_in_rlimits_fallback(fallback_tool, trainer, case):
    run_case(fallback_tool, trainer, case)


def test_python_runs_normally_in_the_sandbox(namespace_tool):
    code = ("import math, json, fractions, os\nopen('notes.txt', 'w').write('kept for this call')\n"
            "print(open('notes.txt').read(), os.getcwd(), os.environ['HOME'])\nmath.comb(10, 3)")
    assert namespace_tool(code) == "kept for this call /tmp /tmp\n120"
    assert namespace_tool("import os\nos.path.exists('notes.txt')") == "False", "every call gets a fresh scratch dir"
    assert namespace_tool("import numpy\nnumpy.arange(4).sum()") == "6"


def test_sandbox_settings_are_validated():
    for kwargs, field in [({"timeout": 0}, "timeout"), ({"isolation": "docker"}, "isolation"),
                          ({"memory_mb": 0}, "memory_mb"), ({"pool_size": -1}, "pool_size")]:
        with pytest.raises(ValueError, match=field):
            Sandbox(**kwargs)
    with pytest.raises(ValueError, match="max_output_chars"):
        PythonTool(max_output_chars=0)
    with pytest.raises(ValueError, match="python_executable '/no/python' is not an executable file"):
        PythonTool(python_executable="/no/python")


def test_a_sandbox_that_cannot_start_is_an_error_not_an_observation(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    sandbox = Sandbox(pool_size=0, isolation="rlimits", python_executable=str(fake))
    fake.write_text("#!/bin/sh\necho 'error disk full' >&2\nexit 1\n")  # dies before its sandbox is ready
    with pytest.raises(SandboxError, match="the sandbox could not start"):
        sandbox.run("print(1)")


def test_namespaces_required_but_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_namespaces_available", False)
    with pytest.raises(SandboxError, match="isolation='rlimits'"):
        Sandbox(isolation="namespaces")


def test_auto_falls_back_loudly_with_the_probe_reason(monkeypatch, caplog):
    """Every Sandbox that falls back says so at WARNING, with why the probe failed and what is lost."""
    monkeypatch.setattr(sandbox_module, "_namespaces_available", False)
    monkeypatch.setattr(sandbox_module, "_namespaces_error", "unshare: Operation not permitted")
    for _ in range(2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="arpo_trl.tools.sandbox"):
            assert Sandbox(isolation="auto", pool_size=0).isolation == "rlimits"
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1, "each falling-back Sandbox logs it, not only the first"
        text = warnings[0].getMessage()
        assert "FELL BACK" in text and "'rlimits'" in text and "unshare: Operation not permitted" in text
        assert "network" in text and "isolation='rlimits'" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="arpo_trl.tools.sandbox"):
        Sandbox(isolation="rlimits", pool_size=0)  # chosen explicitly: accepted, nothing to warn about
    assert not caplog.records


def test_the_probe_reports_why_namespaces_fail(tmp_path):
    """The probe's reason names the failure (here a Python whose sandbox dies at once), and auto uses namespaces
    wherever the probe succeeds."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    sandbox_process.python_dirs(str(fake))  # the Sandbox reads (and caches) its directories first
    fake.write_text("#!/bin/sh\necho 'no namespaces for you' >&2\nexit 1\n")
    reason = sandbox_module._try_namespaces(str(fake))
    if sys.platform.startswith("linux"):
        assert reason.startswith("the probe sandbox did not start") and "no namespaces for you" in reason, reason
    if NAMESPACES:
        assert sandbox_module._try_namespaces(sys.executable) is None
        with Sandbox(isolation="auto", pool_size=0) as sandbox:
            assert sandbox.isolation == "namespaces"


def test_namespace_sandbox_is_required_on_linux(monkeypatch):
    monkeypatch.delenv("ARPO_TRL_SANDBOX_NAMESPACES", raising=False)
    assert namespaces_required() == sys.platform.startswith("linux")
    monkeypatch.setenv("ARPO_TRL_SANDBOX_NAMESPACES", "optional")
    assert not namespaces_required()
    monkeypatch.setenv("ARPO_TRL_SANDBOX_NAMESPACES", "yes")
    with pytest.raises(ValueError, match="ARPO_TRL_SANDBOX_NAMESPACES"):
        namespaces_required()


def test_idle_pool_workers_exit_when_the_trainer_dies(tmp_path):
    """A trainer killed with SIGKILL leaves no sandbox processes: idle workers see EOF on their code pipe."""
    script = ("import sys, time\nfrom arpo_trl.tools import PythonTool\n"
              "tool = PythonTool(pool_size=3)\nprint(tool('1 + 1'), flush=True)\ntime.sleep(100)")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "2"
    deadline = time.monotonic() + 60  # the pool starts its workers after the first call; /proc shows them late
    while len(workers := [p for p in sandbox_processes() if _parent(p) == trainer.pid]) < 3 and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) == 3
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
