"""What users were told to import keeps importing: the public API, every `from arpo_trl… import …` line and every
`arpo_trl.x.y` name in README.md, docs/*.md, the notebook and the recipes, and every `arpo_trl/….py` file the docs
point at (docs/architecture.md: moved modules)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "quickstart.ipynb",
             *sorted((ROOT / "recipes").rglob("*.yaml"))]
IMPORT_LINE = re.compile(r"^\s*\"?(from arpo_trl[\w.]* import [\w, ]+|import arpo_trl[\w.]*)", re.M)
DOTTED = re.compile(r"\barpo_trl(?:\.\w+)+")
FILE = re.compile(r"\barpo_trl/[\w/]+\.py\b")


def _found(pattern: re.Pattern) -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(ROOT).as_posix(), match.group(1) if pattern.groups else match.group(0))
                   for doc in DOCUMENTS for match in pattern.finditer(doc.read_text(encoding="utf-8"))})


def _resolve(dotted: str) -> object:
    """The module or attribute a dotted name points at: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for name in parts[k:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(dotted)


def test_the_public_api_imports():
    import arpo_trl

    missing = [name for name in arpo_trl.__all__ if not hasattr(arpo_trl, name)]
    assert not missing and {"ARPOTrainer", "ARPOConfig", "PythonTool"} <= set(arpo_trl.__all__), missing


@pytest.mark.parametrize(("doc", "statement"), _found(IMPORT_LINE), ids=lambda value: value)
def test_documented_import_statements_run(doc, statement):
    exec(statement, {})


@pytest.mark.parametrize(("doc", "dotted"), _found(DOTTED), ids=lambda value: value)
def test_documented_dotted_names_resolve(doc, dotted):
    _resolve(dotted.rstrip("."))


@pytest.mark.parametrize(("doc", "path"), _found(FILE), ids=lambda value: value)
def test_documented_files_exist(doc, path):
    assert (ROOT / path).is_file(), f"{doc} names {path}, which does not exist"
