"""`PythonTool`: runs model-written code in a separate, resource-limited process.

Differs from the reference (`python_tool.py`: bare `python -c` with a 120 s timeout, stderr on failure,
empty output retried) in that the child gets its own session (killed as a group on timeout), rlimits on
memory, CPU time and file size, a fresh scratch directory as cwd/HOME, an environment without the
trainer's variables, no stdin, and bounded output. Errors are returned as text, never raised.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from arpo_trl.tools.base import Tool, function_schema

# Runs inside the child: limits first, then the user's code with its last bare expression printed (ToRA
# style, as the reference does via `ast`). Our own frames are cut from tracebacks.
_BOOTSTRAP = r'''
import ast, resource, signal, sys, traceback
mem, cpu, fsize = (int(x) for x in sys.argv[2:5])
if mem > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
source = open(sys.argv[1], encoding="utf-8", errors="replace").read()
try:
    tree = ast.parse(source, "<python>")
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr) and not (
        isinstance(last.value, ast.Call) and getattr(last.value.func, "id", None) == "print"
    ):
        tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [last.value], []))
        ast.fix_missing_locations(tree)
    code = compile(tree, "<python>", "exec")
    del ast, resource, signal, source, tree, last, mem, cpu, fsize
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except SyntaxError as exc:
    traceback.print_exception(type(exc), exc, None)
    sys.exit(1)
except BaseException as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
'''


class PythonTool(Tool):
    """Execute `<python>…</python>` code in a subprocess and return its output (or error) as text."""

    def __init__(
        self,
        tag: str = "python",
        timeout: float = 10.0,
        memory_limit_mb: int = 2048,
        max_output_chars: int = 4096,
        python_executable: str | None = None,
        extra_env: dict[str, str] | None = None,
    ):
        super().__init__(tag)
        if timeout <= 0:
            raise ValueError(f"PythonTool timeout must be > 0 seconds, got {timeout}.")
        if max_output_chars < 1:
            raise ValueError(f"PythonTool max_output_chars must be >= 1, got {max_output_chars}.")
        self.timeout = timeout
        self.memory_limit_mb = memory_limit_mb
        self.max_output_chars = max_output_chars
        self.python_executable = python_executable or sys.executable
        self.extra_env = dict(extra_env or {})

    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.tag, "Run Python code in a sandboxed subprocess and return what it prints (a final bare expression "
            "is printed too), or its error.", {"code": "The Python source code to run."},
        )

    def _child_env(self, scratch: str) -> dict[str, str]:
        env = {
            "PATH": os.defpath,
            "HOME": scratch,
            "TMPDIR": scratch,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        env.update(self.extra_env)
        return env

    def __call__(self, code: str) -> str:
        scratch = tempfile.mkdtemp(prefix="arpo_python_")
        try:
            return self._run(code, Path(scratch))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, code: str, scratch: Path) -> str:
        (scratch / "main.py").write_text(code, encoding="utf-8", errors="replace")
        (scratch / "_bootstrap.py").write_text(_BOOTSTRAP, encoding="utf-8")
        cap_bytes = 4 * self.max_output_chars + 1024  # file-size rlimit: what we keep plus a margin
        argv = [
            self.python_executable, "-I", str(scratch / "_bootstrap.py"), str(scratch / "main.py"),
            str(self.memory_limit_mb * 2**20), str(int(self.timeout) + 1), str(cap_bytes),
        ]
        with open(scratch / "stdout", "wb") as out, open(scratch / "stderr", "wb") as err:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch,
                env=self._child_env(str(scratch)), start_new_session=True, close_fds=True,
            )
            timed_out = self._wait(proc)
        stdout = self._read(scratch / "stdout")
        stderr = self._read(scratch / "stderr")
        if timed_out:
            partial = f"\n{stdout}" if stdout else ""
            return f"TimeoutError: execution exceeded {self.timeout:g} s and was killed.{partial}"
        if proc.returncode != 0:
            if proc.returncode < 0:
                name = signal.Signals(-proc.returncode).name
                stderr = (stderr + f"\nProcess killed by {name} (resource limit exceeded?)").strip()
            return self._truncate("\n".join(s for s in (stdout, stderr) if s))
        return stdout if stdout else "(no output)"

    def _wait(self, proc: subprocess.Popen) -> bool:
        deadline = time.monotonic() + self.timeout
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        try:  # the whole session: children the code spawned die with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return timed_out

    def _read(self, path: Path) -> str:
        data = path.read_bytes()[: 4 * self.max_output_chars + 4]
        return self._truncate(data.decode("utf-8", errors="replace").strip())

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n... [output truncated to {self.max_output_chars} chars]"
