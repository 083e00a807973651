"""One markdown table writer for every report (trees' node tables, evaluation, the metrics summary)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(value: Any) -> str:
    """A table cell: None is empty, a float has 4 significant digits, `|` is escaped."""
    text = "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
    return text.replace("|", "\\|")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table of `rows` under `columns`, every value written by `cell`."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
