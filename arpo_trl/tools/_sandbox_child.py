"""The sandboxed side of `arpo_trl.tools.sandbox`: run as ``python -I _sandbox_child.py '<json settings>'``.

Stdlib only (it must not import arpo_trl or anything the sandbox cannot see). Protocol:
  fd 0  the code, written once by the trainer, then EOF (read after setup, so a worker can wait in a pool);
  fd 1  everything the code prints (stdout and stderr, merged);
  status_fd (a setting)
        status lines for the trainer: ``ready`` or ``error <message>`` from the sandbox after setup, then
        ``exit <code>`` or ``signal <number>`` from the supervising process when the code has finished.

This process is the *supervisor*: it enters fresh mount/network/PID/IPC/UTS namespaces (and a user namespace
when not root) and forks the *runner*, which is PID 1 of the new PID namespace — when it exits, the kernel kills
every process the code started, whatever session or process group they moved to. The runner builds a new root
filesystem (read-only binds of the system and Python directories, a size-limited tmpfs as /tmp), pivots into it,
drops every privilege, waits for the code, applies the rlimits and executes it.
"""

import ast
import ctypes
import gc
import json
import os
import platform
import resource
import signal
import sys
import traceback

SETTINGS = json.loads(sys.argv[1])
STATUS_FD = SETTINGS["status_fd"]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group")
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


def status(line: str) -> None:
    os.write(STATUS_FD, (line + "\n").encode())


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def encode(text):
    return text.encode() if isinstance(text, str) else text


def mount(source, target, fstype, flags, data=None) -> None:
    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {source} on {target}")


def enter_namespaces() -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:  # unprivileged: a user namespace grants the capabilities for the rest, mapped to ourselves
        flags |= CLONE_NEWUSER
    check(libc.unshare(flags), "unshare")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def bind_readonly(source_fd: int, target: str) -> None:
    mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND | MS_REC)
    locked = os.statvfs(target).f_flag & (MS_NOEXEC | MS_NODEV | MS_NOSUID)  # a user namespace must keep these
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def build_root(new_root: str) -> None:
    """Mount a tmpfs at `new_root` holding read-only binds of what Python needs, a fresh /dev, /proc and /tmp."""
    sources = {}  # opened before the tmpfs may hide them (the Python prefix can live under /tmp)
    for path in list(SYSTEM_DIRS) + SETTINGS["binds"] + [f"/etc/{name}" for name in ETC_FILES]:
        if os.path.islink(path) and path in SYSTEM_DIRS:
            sources[path] = os.readlink(path)
        elif os.path.exists(path) and path not in sources:
            sources[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
    devices = {name: os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC) for name in DEVICES}
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    disk = f"size={SETTINGS['disk_bytes']},nr_inodes=4096,mode=1777"
    os.makedirs(new_root + "/tmp")  # first: a Python prefix under /tmp (a venv in a temp clone) is bound inside it
    mount("tmpfs", new_root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, disk)
    for path, source in sources.items():
        target = new_root + path
        if isinstance(source, str):
            os.symlink(source, target)
            continue
        is_dir = os.path.isdir(f"/proc/self/fd/{source}")
        os.makedirs(target if is_dir else os.path.dirname(target), exist_ok=True)
        if not is_dir:
            open(target, "w").close()
        bind_readonly(source, target)
        os.close(source)
    os.makedirs(new_root + "/dev/shm")
    for name, source in devices.items():
        open(f"{new_root}/dev/{name}", "w").close()
        mount(f"/proc/self/fd/{source}", f"{new_root}/dev/{name}", None, MS_BIND)
        os.close(source)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new_root}/dev/{name}")
    mount("tmpfs", f"{new_root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, disk)
    os.makedirs(new_root + "/proc")
    try:  # our own PID namespace's /proc: shows only the sandbox's processes
        mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # some container runtimes forbid a new proc mount; the sandbox then has an empty /proc


def pivot_into(new_root: str) -> None:
    calls = SYSCALLS[platform.machine()]
    os.chdir(new_root)
    check(libc.syscall(calls["pivot_root"], b".", b"."), "pivot_root")  # old root stacked on top of the new one
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4m,mode=755")


def drop_privileges() -> None:
    uid = SETTINGS["uid"]
    if os.getuid() == 0 and uid is not None:  # real root: become a dedicated unprivileged user
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    calls = SYSCALLS.get(platform.machine())
    if calls:  # in a user namespace we still hold every capability inside it: give them all up
        check(libc.syscall(calls["capset"], header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def set_limits() -> None:
    cpu = SETTINGS["cpu_seconds"]
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_FSIZE: (SETTINGS["file_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (SETTINGS["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NPROC: (SETTINGS["nproc"],) * 2,
    }
    if SETTINGS["memory_bytes"] > 0:
        limits[resource.RLIMIT_AS] = (SETTINGS["memory_bytes"],) * 2
    for kind, value in limits.items():
        resource.setrlimit(kind, value)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit raises OSError instead


def read_code() -> str:
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # the code's stdin is empty
    os.close(null)
    return b"".join(chunks).decode("utf-8", errors="replace")


def execute(source: str) -> int:
    """Run the code as __main__, printing a final bare expression (ToRA style, as the reference does via `ast`);
    return its exit status."""
    try:
        tree = ast.parse(source, "<python>")
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and not (
            isinstance(last.value, ast.Call) and getattr(last.value.func, "id", None) == "print"
        ):
            tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], []))
            ast.fix_missing_locations(tree)
        code = compile(tree, "<python>", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: source with NUL bytes
        traceback.print_exception(type(exc), exc, None)
        return 1
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # our own frame cut
        return 1
    return 0


def finish(status: int) -> None:
    """Exit as Python would (non-daemon threads joined, atexit handlers run, output flushed), then skip the
    interpreter's teardown: in a forked child it touches every inherited object, copying shared pages (~25 ms)."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


def runner() -> None:
    """PID 1 of the new namespace: build the sandbox, wait for the code, run it in a child, report how it ended."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the supervisor killed → we and our namespace die
    try:
        if SETTINGS["namespaces"]:
            build_root("/tmp")
            pivot_into("/tmp")
            os.chdir("/tmp")
        else:
            os.chdir(SETTINGS["scratch"])
        drop_privileges()
        for module in SETTINGS["preimport"]:
            __import__(module)
    except BaseException as exc:
        status(f"error {type(exc).__name__}: {exc}")
        os._exit(125)
    status("ready")
    source = read_code()
    if not source:  # the trainer closed the pool
        os._exit(0)
    # The code runs in a child, not as PID 1, so that signals behave as usual (init ignores default-action ones).
    gc.freeze()  # the child's collections then skip our objects: fewer shared pages copied
    pid = os.fork()
    if pid == 0:
        os.close(STATUS_FD)  # the code cannot forge its outcome
        set_limits()
        finish(execute(source))
    for fd in (0, 1, 2):
        os.close(fd)
    report(pid)


def report(pid: int) -> None:
    _, wait_status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wait_status):
        status(f"signal {os.WTERMSIG(wait_status)}")
    else:
        status(f"exit {os.WEXITSTATUS(wait_status)}")
    os._exit(0)


def supervise() -> None:
    """Outside the new PID namespace (its first child becomes PID 1); reports only if the runner itself died."""
    try:
        if SETTINGS["namespaces"]:
            enter_namespaces()
    except OSError as exc:
        status(f"error {exc}")
        os._exit(125)
    pid = os.fork()
    if pid == 0:
        runner()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # only the runner holds the code and output pipes
        os.dup2(null, fd)
    _, wait_status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wait_status):
        status(f"signal {os.WTERMSIG(wait_status)}")
    os._exit(0)


if __name__ == "__main__":
    supervise()
