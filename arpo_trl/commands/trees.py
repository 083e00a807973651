"""`arpo-trl view|plot`: look at a run's rollout trees (trees.jsonl) in the terminal, as HTML, or as pictures.

    arpo-trl view RUN/trees.jsonl [--step N] [--group G] [--html out.html]
    arpo-trl plot RUN/trees.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from arpo_trl.trees import TreeFileError, format_tree, load_step, plot_run, render_tree_html, select


def _view(args: argparse.Namespace) -> None:
    records = load_step(args.file, args.step)
    groups = [args.group] if args.group is not None else sorted({r["group"] for r in records})
    for g in groups:
        chosen = select(records, group=g, source=args.file)
        print(format_tree(chosen, args.width))
        print()
    if args.html:
        print(f"wrote {render_tree_html(select(records, group=groups[0], source=args.file), args.html)}")


def _plot(args: argparse.Namespace) -> None:
    for path in plot_run(args.file, args.out, args.step, args.group, args.window):
        print(f"wrote {path}")


def main(argv: Sequence[str] | None = None, prog: str = "arpo-trl") -> int:
    """`view FILE [--step N] [--group G] [--html OUT]` | `plot FILE --out DIR [--step N] [--group G]`.
    Returns the exit code: 0, or 2 after one `error:` line on stderr for bad input."""
    parser = argparse.ArgumentParser(prog=prog, description="Look at ARPO rollout trees (trees.jsonl).")
    sub = parser.add_subparsers(dest="command", required=True)
    view = sub.add_parser("view", help="print a step's trees as text (default: the last step, every group)")
    plot = sub.add_parser("plot", help="tree PNG/HTML of a step's groups and the entropy-around-tools plot")
    for p in (view, plot):
        p.add_argument("file", help="trees.jsonl written by write_jsonl")
        p.add_argument("--step", type=int, default=None, help="training step (default: the last)")
        p.add_argument("--group", type=int, default=None, help="prompt group (default: all)")
    view.add_argument("--html", default=None, help="also write the (first) group's tree as HTML here")
    view.add_argument("--width", type=int, default=60, help="characters shown per segment")
    plot.add_argument("--out", required=True, help="output folder")
    plot.add_argument("--window", type=int, default=20, help="tokens either side of a tool result")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        {"view": _view, "plot": _plot}[args.command](args)
    except (TreeFileError, ValueError, OSError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0
