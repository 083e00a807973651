"""Rollout trees: records and their JSONL file (`records`), pictures (`render`), the entropy around tool results
(`analysis`). The viewer is the `arpo-trl view` / `arpo-trl plot` command (`arpo_trl.commands.trees`).

May import: nothing outside trees.
"""

from arpo_trl.trees.analysis import entropy_around_tools
from arpo_trl.trees.records import (
    NODE_COLUMNS,
    SCHEMA_VERSION,
    TreeFileError,
    iter_jsonl,
    load_step,
    node_table,
    read_jsonl,
    segments_of,
    select,
    tree_records,
    write_jsonl,
)
from arpo_trl.trees.render import (
    format_tree,
    plot_entropy_around_tools,
    plot_run,
    render_tree_html,
    render_tree_png,
    tree_html,
)

__all__ = [
    "NODE_COLUMNS", "SCHEMA_VERSION", "TreeFileError", "entropy_around_tools", "format_tree", "iter_jsonl", "load_step",
    "node_table", "plot_entropy_around_tools", "plot_run", "read_jsonl", "render_tree_html", "render_tree_png",
    "segments_of", "select", "tree_html", "tree_records", "write_jsonl",
]
