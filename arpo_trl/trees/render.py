"""Pictures of rollout trees: one group's tree as self-contained HTML (text, tool calls and results marked, ⑂ at
each fork) or as a PNG timeline, the entropy-around-tools plot, and `plot_run` for all of a run's pictures. Tool
calls and results are placed by the records' `calls`, never found in the text."""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from arpo_trl.trees.analysis import entropy_around_tools
from arpo_trl.trees.records import children, load_step, one_group, prompt_text, read_jsonl, select, tree_order


def _char_offset(record: dict, token: int) -> int:
    """Character offset of a token boundary (the last segment boundary at or before `token`)."""
    chars = 0
    for seg in record["segments"]:
        if seg["end"] > token:
            break
        chars += len(seg["text"])
    return chars


def _char_labels(record: dict) -> tuple[str, list[str]]:
    """The completion text and a label per character: model, call, result or env."""
    text = "".join(seg["text"] for seg in record["segments"])
    labels: list[str] = []
    for seg in record["segments"]:
        labels += [seg["kind"]] * len(seg["text"])
    for call in record.get("calls", []):
        if call.get("result_start") is None:
            continue
        end = _char_offset(record, call["result_start"])  # the call's text ends where its result begins
        for i in range(max(0, end - call.get("call_chars", 0)), end):
            labels[i] = "call" if labels[i] in ("model", "env") else labels[i]
    return text, labels


def fmt_value(value: float | None, spec: str = "+.3f") -> str:
    return "–" if value is None else format(value, spec)


def node_summary(r: dict) -> str:
    parts = [f"node {r['node']}", r["kind"]]
    if r.get("parent") is not None:
        parts.append(f"from {r['parent']} @{r.get('fork_position')} ΔH={fmt_value(r.get('fork_delta'))}")
    parts += [f"calls {r['tool_calls']}" + (f" ({r['tool_failures']} failed)" if r.get("tool_failures") else ""),
              f"{r.get('finish_reason')}", f"len {r['length']}", f"reward {fmt_value(r.get('reward'), '.3g')}",
              f"adv {fmt_value(r.get('advantage'), '+.3g')}"]
    return " · ".join(parts)


# ---- HTML ----------------------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
pre.text{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,monospace;font-size:12.5px;
 margin:.3em 0 .5em 0;background:#fafafa;border:1px solid #eee;padding:.4em}
.node{border-left:3px solid #4a78c2;padding-left:.8em;margin:.6em 0}
.node.branch{border-left-color:#c2781e}.node.fill{border-left-color:#6a6a6a}
.children{margin-left:1.6em}
.head{font-size:13px;font-weight:600}.root{background:#eef3fb;padding:.5em;border-radius:4px}
.call{background:#dcefd9;color:#114d0e}.result{background:#fde7c6;color:#5b3600}.env{background:#e6e6e6}
.fork{background:#c2781e;color:#fff;border-radius:3px;padding:0 .3em;font-size:11px;text-decoration:none}
.ctx{font-size:11px;color:#777;white-space:pre-wrap;font-family:ui-monospace,monospace}
.leaf{font-size:12px;color:#333;margin-bottom:.3em}.legend span{padding:0 .4em;margin-right:.5em}
"""


def _node_html(r: dict, kids: dict[int, list[dict]]) -> str:
    text, labels = _char_labels(r)
    start = _char_offset(r, r.get("fork_position") or 0)
    marks: dict[int, list[str]] = defaultdict(list)
    for child in kids.get(r["node"], []):
        at = max(_char_offset(r, child.get("fork_position") or 0), start)
        marks[at].append(f'<a class="fork" href="#node-{child["node"]}" title="branch node {child["node"]}">'
                         f'⑂ {child["node"]} ΔH={fmt_value(child.get("fork_delta"))}</a>')
    pieces, i = [], start
    while i < len(text) or i in marks:
        pieces += marks.pop(i, [])
        if i >= len(text):
            break
        j = i + 1
        while j < len(text) and labels[j] == labels[i] and j not in marks:
            j += 1
        chunk = html.escape(text[i:j])
        pieces.append(chunk if labels[i] == "model" else f'<span class="{labels[i]}">{chunk}</span>')
        i = j
    pieces += [m for at in sorted(marks) for m in marks[at]]
    leaf = (f"■ {html.escape(str(r.get('finish_reason')))} · reward {fmt_value(r.get('reward'), '.4g')} · "
            f"advantage {fmt_value(r.get('advantage'), '+.4g')} · {r.get('own_tokens', '?')} own tokens")
    context = ""
    if start:
        context = (f'<div class="ctx">continues node {r.get("parent")} after token {r.get("fork_position")}: '
                   f"…{html.escape(text[max(0, start - 80) : start])}</div>")
    children = "".join(_node_html(c, kids) for c in kids.get(r["node"], []))
    return (f'<div class="node {html.escape(r["kind"])}" id="node-{r["node"]}">'
            f'<div class="head">{html.escape(node_summary(r))}</div>{context}'
            f'<pre class="text">{"".join(pieces)}</pre><div class="leaf">{leaf}</div>'
            + (f'<div class="children">{children}</div>' if children else "") + "</div>")


def tree_html(records: Sequence[dict]) -> str:
    """A self-contained HTML page (inline CSS, no scripts) of one group's tree."""
    records = one_group(records, "tree_html")
    roots, kids = children(records)
    step, group = records[0]["step"], records[0]["group"]
    body = "".join(_node_html(r, kids) for r in roots)
    title = f"ARPO rollout tree · step {step} · group {group}"
    legend = ('<div class="legend">model text · <span class="call">tool call</span><span class="result">tool result'
              '</span><span class="env">other environment tokens</span><span class="fork">⑂ branch</span> '
              'each node shows the text it generated itself; a branch continues from its ⑂ marker</div>')
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h2>{html.escape(title)}</h2>{legend}"
            f'<div class="root"><div class="head">prompt ({len(records)} trajectories)</div>'
            f'<pre class="text">{html.escape(prompt_text(records))}</pre></div>{body}</body></html>')


def render_tree_html(records: Sequence[dict], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tree_html(records), encoding="utf-8")
    return path


# ---- PNG -----------------------------------------------------------------------------------------------
def save_figure(plt, fig, path: str | os.PathLike, dpi: float | None = None) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def render_tree_png(records: Sequence[dict], path: str | os.PathLike) -> Path:
    """Timeline of one group's tree: x = token position, a row per trajectory (tree order); a branch's row
    starts at its fork with a connector to its parent's row; model tokens coloured by entropy, tool results
    shaded, tool calls marked, finish and reward written at each row's end."""
    plt = pyplot()
    order = tree_order(one_group(records, "render_tree_png"))
    row_of = {r["node"]: i for i, (r, _) in enumerate(order)}
    width = max([r["length"] for r, _ in order] + [1])
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.42 * len(order)), dpi=100)
    mesh = None
    for y, (r, _) in enumerate(order):
        mesh = _draw_row(ax, r, y, row_of) or mesh
    ax.set_xlim(0, width * 1.22)
    ax.set_ylim(len(order) - 0.4, -0.6)
    ax.set_yticks(range(len(order)), [f"{r['node']} {r['kind']}" for r, _ in order], fontsize=8)
    ax.set_xlabel("completion token position")
    ax.set_title(f"rollout tree · step {order[0][0]['step']} · group {order[0][0]['group']}", fontsize=10)
    if mesh is not None:
        fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.03).set_label("token entropy (nats)", fontsize=8)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#f5a623", alpha=0.55, label="tool result"),
                       plt.Line2D([], [], color="#1a7f37", marker="v", ls="", label="tool call")],
              loc="lower right", fontsize=7)
    return save_figure(plt, fig, path)


def _draw_row(ax, r: dict, y: int, row_of: dict[int, int]):
    import numpy as np

    start = r.get("fork_position") or 0
    end = r["length"]
    ax.plot([start, end], [y, y], color="#999", lw=0.8, zorder=1)
    values = np.array([np.nan if h is None else h for h in r["entropies"][start:end]], dtype=float)
    mesh = None
    if values.size and not np.isnan(values).all():
        mesh = ax.pcolormesh(np.arange(start, end + 1), [y - 0.3, y + 0.3], np.ma.masked_invalid(values[None, :]),
                             cmap="viridis", shading="flat", zorder=2)
    elif end > start:
        ax.barh(y, end - start, left=start, height=0.6, color="#4a78c2", zorder=2)
    for seg in r["segments"]:
        if seg["end"] <= start:
            continue
        s = max(seg["start"], start)
        result = seg["kind"] == "result"
        if seg["kind"] != "model":
            ax.barh(y, seg["end"] - s, left=s, height=0.6, color="#f5a623" if result else "#bbb",
                    alpha=0.55 if result else 0.8, zorder=3)
        if result:
            ax.plot(s, y - 0.42, marker="v", color="#1a7f37", ms=5, zorder=4)
    parent_row = row_of.get(r.get("parent"))
    if parent_row is not None:
        ax.plot([start, start], [parent_row, y], color="#c2781e", lw=1.2, zorder=1)
        ax.plot(start, parent_row, marker="o", color="#c2781e", ms=4, zorder=5)
        ax.annotate(f"ΔH {fmt_value(r.get('fork_delta'), '+.2f')}", (start, y), xytext=(-3, 0),
                    textcoords="offset points", ha="right", va="center", fontsize=6.5, color="#c2781e")
    ends = f"{r.get('finish_reason')}  r={fmt_value(r.get('reward'), '.3g')}  A={fmt_value(r.get('advantage'), '+.2f')}"
    ax.annotate(ends, (end, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    return mesh


# ---- text ---------------------------------------------------------------------------------------------
def _snippet(text: str, width: int) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_tree(records: Sequence[dict], width: int = 60) -> str:
    """A compact text tree of one group: indentation by fork depth, one line per node and per own segment."""
    records = one_group(records, "format_tree")
    prompt = _snippet(prompt_text(records), width)
    lines = [f"step {records[0]['step']} · group {records[0]['group']} · prompt: {prompt}"]
    for r, depth in tree_order(records):
        pad = "    " * depth
        lines.append(f"{pad}{'└─ ' if depth else '● '}{node_summary(r)}")
        own = r.get("fork_position") or 0
        for seg in r["segments"]:
            if seg["end"] > own:
                tag = {"model": "model", "result": "tool "}.get(seg["kind"], "env  ")
                lines.append(f"{pad}     [{tag}] {seg['start']:>4}-{seg['end']:<4} {_snippet(seg['text'], width)}")
    return "\n".join(lines)


def plot_entropy_around_tools(records_or_stats: Sequence[dict] | dict, path: str | os.PathLike,
                              window: int = 20) -> Path:
    """Line plot of `entropy_around_tools` (records are summarised first) with the first-segment baseline."""
    stats = records_or_stats if isinstance(records_or_stats, dict) else entropy_around_tools(records_or_stats, window)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=100)
    xs = [x for x, m in zip(stats["offsets"], stats["mean"]) if m is not None]
    ys = [m for m in stats["mean"] if m is not None]
    for side in (lambda x: x < 0, lambda x: x > 0):
        pts = [(x, y) for x, y in zip(xs, ys) if side(x)]
        if pts:
            ax.plot(*zip(*pts), marker=".", color="#4a78c2")
    ax.axvspan(-0.5, 0.5, color="#f5a623", alpha=0.35, label="tool result")
    if stats.get("baseline_mean") is not None:
        ax.axhline(stats["baseline_mean"], color="#888", ls="--", lw=1,
                   label=f"first segment mean ({stats['baseline_count']} tokens)")
    twin = ax.twinx()
    twin.bar(stats["offsets"], stats["count"], color="#999", alpha=0.18, width=0.8)
    twin.set_ylabel("tokens counted", color="#777", fontsize=8)
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xlabel("model tokens before (−) / after (+) a tool result")
    ax.set_ylabel("mean token entropy (nats)")
    ax.set_title(f"Token entropy around tool results ({stats['occurrences']} results)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(plt, fig, path)


def plot_run(file: str | os.PathLike, out: str | os.PathLike, step: int | None = None, group: int | None = None,
             window: int = 20) -> list[Path]:
    """Tree PNG + HTML of each group of `step` (default: the last) and the entropy-around-tools plot (+ JSON) of
    the whole file, written into `out`; returns the paths written."""
    records = load_step(file, step)
    groups = [group] if group is not None else sorted({r["group"] for r in records})
    out, written = Path(out), []
    for g in groups:
        chosen = select(records, group=g, source=str(file))
        stem = out / f"tree_step{chosen[0]['step']}_group{g}"
        written += [render_tree_png(chosen, stem.with_suffix(".png")),
                    render_tree_html(chosen, stem.with_suffix(".html"))]
    stats = entropy_around_tools(read_jsonl(file), window)
    out.mkdir(parents=True, exist_ok=True)
    (out / "entropy_around_tools.json").write_text(json.dumps(stats, indent=1))
    written += [out / "entropy_around_tools.json", plot_entropy_around_tools(stats, out / "entropy_around_tools.png")]
    return written
