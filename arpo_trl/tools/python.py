"""`PythonTool`: runs model-written code in a `Sandbox` and returns what happened as text.

Differs from the reference (`python_tool.py`: a bare `python -c` in the trainer's environment with a 120 s timeout,
stderr on failure, empty output retried): the code runs in an OS-level sandbox (`arpo_trl/tools/sandbox.py`:
namespaces, rlimits, scrubbed environment, no network, its own filesystem view), every outcome — timeout, a
resource limit, a signal, a non-zero exit — is described in the result text, and nothing is ever raised into
the rollout.
"""

from __future__ import annotations

import threading
from typing import Any

from arpo_trl.tools.base import Tool, function_schema
from arpo_trl.tools.sandbox import Sandbox, SandboxResult

_SIGNAL_HINTS = {
    "SIGXCPU": "CPU time limit exceeded",
    "SIGKILL": "killed, e.g. for exceeding the memory limit",
    "SIGSEGV": "segmentation fault, e.g. recursion too deep",
    "SIGXFSZ": "file size limit exceeded",
}


class PythonTool(Tool):
    """Execute `<python>…</python>` code in a sandboxed process and return its output (or what went wrong)."""

    def __init__(
        self,
        tag: str = "python",
        timeout: float = 10.0,
        memory_limit_mb: int = 2048,
        max_output_chars: int = 4096,
        python_executable: str | None = None,
        extra_env: dict[str, str] | None = None,
        isolation: str = "auto",
        pool_size: int = 2,
        disk_limit_mb: int = 64,
        max_processes: int = 32,
        preimport: tuple[str, ...] = (),
        binds: tuple[str, ...] = (),
    ):
        super().__init__(tag)
        if max_output_chars < 1:
            raise ValueError(f"PythonTool max_output_chars must be >= 1, got {max_output_chars}.")
        self.timeout = timeout
        self.max_output_chars = max_output_chars
        self.sandbox_options = dict(
            timeout=timeout, memory_mb=memory_limit_mb, max_output_bytes=4 * max_output_chars + 1024,
            disk_mb=disk_limit_mb, max_processes=max_processes, isolation=isolation, pool_size=pool_size,
            preimport=tuple(preimport), binds=tuple(binds), python_executable=python_executable, extra_env=extra_env,
        )
        Sandbox.validate(**self.sandbox_options)
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    @property
    def sandbox(self) -> Sandbox:
        """Started on first use (it probes the OS and pre-starts `pool_size` processes)."""
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(**self.sandbox_options)
            return self._sandbox

    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.tag, "Run Python code in a sandboxed subprocess and return what it prints (a final bare expression "
            "is printed too), or its error.", {"code": "The Python source code to run."},
        )

    def __call__(self, code: str) -> str:
        return self.describe(self.sandbox.run(code))

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()

    def interrupt(self) -> None:
        """Kill the processes of the calls in progress (each call then returns at once)."""
        if self._sandbox is not None:
            self._sandbox.kill_running()

    def describe(self, result: SandboxResult) -> str:
        output = result.output.strip()
        if result.timed_out:
            return self._truncate(f"TimeoutError: execution exceeded {self.timeout:g} s and was killed."
                                  + (f"\n{output}" if output else ""))
        if result.output_exceeded:
            return self._truncate(output) + "\n... [the process was killed: too much output]"
        if result.signal is not None:
            hint = _SIGNAL_HINTS.get(result.signal, "terminated by a signal")
            return self._truncate("\n".join(filter(None, [output, f"Process killed by {result.signal} ({hint})."])))
        if result.exit_code:
            return self._truncate(output) if output else f"Process exited with status {result.exit_code}."
        return self._truncate(output) if output else "(no output)"

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n... [output truncated to {self.max_output_chars} chars]"

    def __getstate__(self) -> dict:  # copies (e.g. a deepcopied config) start their own sandbox
        state = dict(self.__dict__)
        state["_sandbox"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
