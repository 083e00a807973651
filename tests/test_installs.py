"""What `pip install "arpo-trl[quickstart]"` brings needs no C compiler: pip's own resolution (a dry run with its
JSON report, in a new virtual environment) installs wheels only, and any source distribution it picked would have to
be pure Python. reasoning-gym, whose pycosat PyPI ships as C source only, lives in its own extra for that reason."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILED_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".pyx", ".f", ".f90", ".rs", ".cu")


def compiled_sources(archive: Path) -> list[str]:
    """The files of a source distribution that only a compiler turns into something importable."""
    names = zipfile.ZipFile(archive).namelist() if archive.suffix == ".zip" else tarfile.open(archive).getnames()
    return [name for name in names if name.lower().endswith(COMPILED_SOURCES)]


def test_compiled_sources_finds_c_in_an_sdist(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fast.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "pkg" / "setup.py").write_text("")
    with tarfile.open(tmp_path / "pkg-1.0.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "pkg", arcname="pkg-1.0")
    assert compiled_sources(tmp_path / "pkg-1.0.tar.gz") == ["pkg-1.0/fast.c"]


def resolve(requirements: list[str], folder: Path) -> list[dict]:
    """What pip would install into a new virtual environment (`pip install --dry-run --report`)."""
    subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True, timeout=300)
    pip = [str(folder / "venv" / "bin" / "python"), "-m", "pip"]
    report = folder / "report.json"
    done = subprocess.run([*pip, "install", "--dry-run", "--quiet", "--report", str(report), *requirements],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())["install"]


@pytest.mark.long
def test_the_quickstart_extra_installs_from_wheels_only(tmp_path):
    # the torch that is installed here (a user installs CPU torch first, README "Install"): its wheel is resolved
    # as it is, not a multi-GB CUDA build
    packages = resolve([f"{ROOT}[quickstart]", f"torch=={version('torch')}"], tmp_path)
    names = {item["metadata"]["name"].lower() for item in packages}
    assert {"arpo-trl", "trl", "transformers", "gguf", "bm25s", "math-verify"} <= names
    assert "reasoning-gym" not in names and "pycosat" not in names
    sources = [item for item in packages if not item["download_info"]["url"].endswith(".whl")
               and item["metadata"]["name"].lower() != "arpo-trl"]
    for item in sources:  # none today; a pure-Python sdist would be fine
        url = item["download_info"]["url"]
        archive = tmp_path / url.rsplit("/", 1)[-1]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(tmp_path), f"{item['metadata']['name']}=={item['metadata']['version']}"],
                       check=True, capture_output=True, timeout=300)
        needs = compiled_sources(archive)
        assert not needs, f"{item['metadata']['name']} needs a compiler to install: {needs[:5]}"
