"""Rollout-tree records: a JSON line per trajectory, a node table, pictures of a group's tree, the entropy
around tool results (the paper's Fig. 1 for any model) and a terminal viewer.

    records = tree_records(result, tokenizer, step, rewards=..., advantages=...)
    write_jsonl(records, "RUN/trees.jsonl")                       # appends one step
    python -m arpo_trl.trees view RUN/trees.jsonl [--step N] [--group G] [--html out.html]
    python -m arpo_trl.trees plot RUN/trees.jsonl --out DIR

Record schema, version 1 (one JSON object per trajectory, in `RolloutResult.trajectories` order):

    version         1
    step            training step the rollout belongs to
    group           prompt index within the rollout
    node            trajectory id (unique within one step's rollout)
    parent          node this one branched from, or null
    kind            "global", "branch" or "fill" (a top-up global path)
    fork_position   completion tokens copied from the parent (a branch starts right after a tool result), or null
    fork_delta      ΔH = (H_segment - H_initial), normalised by ln|V|, that triggered the branch, or null
    tool_calls, tool_failures, finish_reason ("eos", "length", "call_limit", "empty_call")
    length          completion tokens (model + environment)
    own_tokens      model-sampled tokens this node generated itself (after fork_position)
    reward, advantage   floats or null
    initial_entropy, segment_entropies   normalised entropy of the first k tokens of each segment (sampler's H)
    prompt          the decoded prompt on the group's first record, null on the others
    segments        [{"start", "end", "kind", "text"}]: the completion as consecutive token spans of one kind,
                    "model" (sampled, mask 1) or "env" (written by the environment: tool results, a tag tail,
                    the EOS after the call limit; mask 0). Texts re-join to the decoded completion
                    (special tokens skipped). A branch's segments up to fork_position are its parent's.
    entropies       per completion token, nats (rounded to 1e-4); null on environment tokens

Every float that is not finite is written as null. Prefix tokens are repeated in every branch's record (each
record is a full trajectory); `entropy_around_tools` counts each token once, in the record that owns it.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "version": int, "step": int, "group": int, "node": int, "kind": str, "length": int, "segments": list,
    "entropies": list, "tool_calls": int,
}
NODE_COLUMNS = [
    "step", "group", "node", "parent", "kind", "fork_position", "fork_delta", "tool_calls", "tool_failures",
    "reward", "advantage", "finish_reason", "length", "own_tokens",
]
# A tool call: `<tag>content</tag>` right before an inserted ` <result>` block (format_result).
_CALL_RE = re.compile(r"<([A-Za-z0-9_-]+)>(?:(?!<\1>).)*?</\1>(?=\s*<result>)", re.DOTALL)


class TreeFileError(ValueError):
    """Bad trees input: names the file, line and field."""


# ---- records -------------------------------------------------------------------------------------------
def _finite(value: Any, digits: int | None = None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return round(value, digits) if digits is not None else value


def _per_trajectory(values: Any, n: int, name: str) -> list[float | None]:
    if values is None:
        return [None] * n
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != n:
        raise ValueError(f"tree_records: {name} has {len(values)} entries for {n} trajectories.")
    return [_finite(v) for v in values]


def _span_cuts(ids: Sequence[int], bounds: Sequence[int], decode) -> tuple[str, list[int]]:
    """The decoded completion and the character offset of each token boundary in `bounds`, monotone, so that
    the pieces re-join exactly (a boundary inside a multi-byte character moves to the character's start)."""
    full = decode(ids)
    cuts = []
    for b in bounds:
        prefix = decode(ids[:b])
        while prefix and not full.startswith(prefix):
            prefix = prefix[:-1]
        cuts.append(max(len(prefix), cuts[-1] if cuts else 0))
    return full, cuts


def segments_of(ids: Sequence[int], mask: Sequence[int], decode) -> list[dict]:
    """Consecutive runs of equal mask as `{"start", "end", "kind", "text"}` (token offsets, end exclusive)."""
    runs: list[list[int]] = []
    for i, bit in enumerate(mask):
        if runs and mask[runs[-1][0]] == bit:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    texts = [decode(ids[s:e]) for s, e in runs]
    full = decode(ids)
    if "".join(texts) != full:  # a boundary splits a character: cut the full text instead
        full, cuts = _span_cuts(ids, [end for _, end in runs[:-1]], decode)
        chars = [0, *cuts, len(full)]
        texts = [full[chars[k] : chars[k + 1]] for k in range(len(runs))]
    return [{"start": s, "end": e, "kind": "model" if mask[s] else "env", "text": text}
            for (s, e), text in zip(runs, texts)]


def tree_records(
    result, tokenizer, step: int, rewards: Sequence[float] | None = None,
    advantages: Sequence[float] | None = None,
) -> list[dict]:
    """One JSON-serialisable record per trajectory of `result` (a `RolloutResult`), schema in the module doc.
    `rewards` / `advantages`: one value per trajectory in `result.trajectories` order (lists or 1-D tensors)."""
    trajectories = result.trajectories
    rewards = _per_trajectory(rewards, len(trajectories), "rewards")
    advantages = _per_trajectory(advantages, len(trajectories), "advantages")

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    seen_groups: set[int] = set()
    records = []
    for t, reward, advantage in zip(trajectories, rewards, advantages):
        first = t.group not in seen_groups
        seen_groups.add(t.group)
        records.append({
            "version": SCHEMA_VERSION, "step": int(step), "group": t.group, "node": t.id, "parent": t.parent,
            "kind": t.kind, "fork_position": t.fork_position, "fork_delta": _finite(t.fork_delta, 6),
            "tool_calls": t.tool_calls, "tool_failures": t.tool_failures, "finish_reason": t.finish_reason,
            "length": len(t.completion_ids), "own_tokens": t.own_tokens(), "reward": reward, "advantage": advantage,
            "initial_entropy": _finite(t.initial_entropy, 6),
            "segment_entropies": [_finite(h, 6) for h in t.segment_entropies],
            "prompt": decode(t.prompt_ids) if first else None,
            "segments": segments_of(t.completion_ids, t.mask, decode),
            "entropies": [_finite(h, 4) for h in t.entropies],
        })
    return records


# ---- JSONL ---------------------------------------------------------------------------------------------
def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> None:
    """Append the records (one step's, usually) to `path`, one JSON object per line; creates parent folders."""
    lines = []
    for i, record in enumerate(records):
        try:
            lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as error:
            raise ValueError(f"write_jsonl: record {i} (node {record.get('node')}) is not JSON: {error}") from error
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise TreeFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name, kind in REQUIRED_FIELDS.items():
        if name not in record:
            raise TreeFileError(f"{where}: missing field {name!r}")
        if not isinstance(record[name], kind) or isinstance(record[name], bool):
            raise TreeFileError(f"{where}: field {name!r} must be {kind.__name__}, got {record[name]!r:.60}")
    if record["version"] != SCHEMA_VERSION:
        raise TreeFileError(f"{where}: field 'version' is {record['version']}, this reader knows {SCHEMA_VERSION}")
    for k, seg in enumerate(record["segments"]):
        if not isinstance(seg, dict) or any(key not in seg for key in ("start", "end", "kind", "text")):
            raise TreeFileError(f"{where}: field 'segments'[{k}] needs start, end, kind and text")


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a trees file, checked; blank lines are skipped. Raises `TreeFileError` naming file:line."""
    if not os.path.isfile(path):
        raise TreeFileError(f"{path}: no such trees file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TreeFileError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            _check_record(record, where)
            yield record


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def select(records: Sequence[dict], step: int | None = None, group: int | None = None,
           source: str = "records") -> list[dict]:
    """Records of one step (default: the last) and, if given, one group; a clear error if either is absent."""
    if not records:
        raise TreeFileError(f"{source}: no tree records")
    steps = sorted({r["step"] for r in records})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise TreeFileError(f"{source}: no step {step} (steps present: {_ranges(steps)})")
    chosen = [r for r in records if r["step"] == step]
    if group is not None:
        groups = sorted({r["group"] for r in chosen})
        if group not in groups:
            raise TreeFileError(f"{source}: step {step} has no group {group} (groups: {_ranges(groups)})")
        chosen = [r for r in chosen if r["group"] == group]
    return chosen


def _ranges(values: Sequence[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(v) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


# ---- tables --------------------------------------------------------------------------------------------
def node_table(records: Sequence[dict]) -> tuple[list[str], list[list]]:
    """`(columns, rows)`, one row per node: `wandb.Table(columns=columns, data=rows)` or `markdown(...)`."""
    rows = []
    for r in records:
        row = [r.get(c) for c in NODE_COLUMNS]
        rows.append([round(v, 4) if isinstance(v, float) else v for v in row])
    return list(NODE_COLUMNS), rows


def markdown(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- tree structure ------------------------------------------------------------------------------------
def _one_group(records: Sequence[dict], what: str) -> list[dict]:
    keys = sorted({(r["step"], r["group"]) for r in records})
    if len(keys) != 1:
        raise ValueError(f"{what}: needs one group's records, got {len(keys)} (step, group) pairs {keys[:5]}; "
                         "pick one with select(records, step, group)")
    return list(records)


def _children(records: Sequence[dict]) -> tuple[list[dict], dict[int, list[dict]]]:
    """Roots (no parent in the set) and, per node, its children by fork position."""
    nodes = {r["node"] for r in records}
    kids: dict[int, list[dict]] = defaultdict(list)
    roots = []
    for r in records:
        (kids[r["parent"]] if r.get("parent") in nodes else roots).append(r)
    for lst in kids.values():
        lst.sort(key=lambda r: (r.get("fork_position") or 0, r["node"]))
    return roots, kids


def _dfs(records: Sequence[dict]) -> list[tuple[dict, int]]:
    """(record, depth) in tree order: a node, then its branches."""
    roots, kids = _children(records)
    out: list[tuple[dict, int]] = []

    def visit(r: dict, depth: int) -> None:
        out.append((r, depth))
        for child in kids.get(r["node"], []):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return out


def _prompt(records: Sequence[dict]) -> str:
    return next((r["prompt"] for r in records if r.get("prompt")), "")


def _is_result(seg: dict) -> bool:
    return seg["kind"] == "env" and "<result>" in seg["text"]


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
        label = "model" if seg["kind"] == "model" else ("result" if _is_result(seg) else "env")
        labels += [label] * len(seg["text"])
    for match in _CALL_RE.finditer(text):
        for i in range(match.start(), match.end()):
            labels[i] = "call" if labels[i] == "model" else labels[i]
    return text, labels


def _fmt(value: float | None, spec: str = "+.3f") -> str:
    return "–" if value is None else format(value, spec)


def _node_summary(r: dict) -> str:
    parts = [f"node {r['node']}", r["kind"]]
    if r.get("parent") is not None:
        parts.append(f"from {r['parent']} @{r.get('fork_position')} ΔH={_fmt(r.get('fork_delta'))}")
    parts += [f"calls {r['tool_calls']}" + (f" ({r['tool_failures']} failed)" if r.get("tool_failures") else ""),
              f"{r.get('finish_reason')}", f"len {r['length']}", f"reward {_fmt(r.get('reward'), '.3g')}",
              f"adv {_fmt(r.get('advantage'), '+.3g')}"]
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
                         f'⑂ {child["node"]} ΔH={_fmt(child.get("fork_delta"))}</a>')
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
    leaf = (f"■ {html.escape(str(r.get('finish_reason')))} · reward {_fmt(r.get('reward'), '.4g')} · "
            f"advantage {_fmt(r.get('advantage'), '+.4g')} · {r.get('own_tokens', '?')} own tokens")
    context = ""
    if start:
        context = (f'<div class="ctx">continues node {r.get("parent")} after token {r.get("fork_position")}: '
                   f"…{html.escape(text[max(0, start - 80) : start])}</div>")
    children = "".join(_node_html(c, kids) for c in kids.get(r["node"], []))
    return (f'<div class="node {html.escape(r["kind"])}" id="node-{r["node"]}">'
            f'<div class="head">{html.escape(_node_summary(r))}</div>{context}'
            f'<pre class="text">{"".join(pieces)}</pre><div class="leaf">{leaf}</div>'
            + (f'<div class="children">{children}</div>' if children else "") + "</div>")


def tree_html(records: Sequence[dict]) -> str:
    """A self-contained HTML page (inline CSS, no scripts) of one group's tree."""
    records = _one_group(records, "tree_html")
    roots, kids = _children(records)
    step, group = records[0]["step"], records[0]["group"]
    body = "".join(_node_html(r, kids) for r in roots)
    title = f"ARPO rollout tree · step {step} · group {group}"
    legend = ('<div class="legend">model text · <span class="call">tool call</span><span class="result">tool result'
              '</span><span class="env">other environment tokens</span><span class="fork">⑂ branch</span> '
              'each node shows the text it generated itself; a branch continues from its ⑂ marker</div>')
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h2>{html.escape(title)}</h2>{legend}"
            f'<div class="root"><div class="head">prompt ({len(records)} trajectories)</div>'
            f'<pre class="text">{html.escape(_prompt(records))}</pre></div>{body}</body></html>')


def render_tree_html(records: Sequence[dict], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tree_html(records), encoding="utf-8")
    return path


# ---- PNG -----------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def render_tree_png(records: Sequence[dict], path: str | os.PathLike) -> Path:
    """Timeline of one group's tree: x = token position, a row per trajectory (tree order); a branch's row
    starts at its fork with a connector to its parent's row; model tokens coloured by entropy, tool results
    shaded, tool calls marked, finish and reward written at each row's end."""
    plt = _pyplot()
    order = _dfs(_one_group(records, "render_tree_png"))
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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
        if seg["kind"] == "env":
            ax.barh(y, seg["end"] - s, left=s, height=0.6, color="#f5a623" if _is_result(seg) else "#bbb",
                    alpha=0.55 if _is_result(seg) else 0.8, zorder=3)
        if _is_result(seg):
            ax.plot(s, y - 0.42, marker="v", color="#1a7f37", ms=5, zorder=4)
    parent_row = row_of.get(r.get("parent"))
    if parent_row is not None:
        ax.plot([start, start], [parent_row, y], color="#c2781e", lw=1.2, zorder=1)
        ax.plot(start, parent_row, marker="o", color="#c2781e", ms=4, zorder=5)
        ax.annotate(f"ΔH {_fmt(r.get('fork_delta'), '+.2f')}", (start, y), xytext=(-3, 0),
                    textcoords="offset points", ha="right", va="center", fontsize=6.5, color="#c2781e")
    ax.annotate(f"{r.get('finish_reason')}  r={_fmt(r.get('reward'), '.3g')}  A={_fmt(r.get('advantage'), '+.2f')}",
                (end, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    return mesh


# ---- entropy around tool results -----------------------------------------------------------------------
def entropy_around_tools(records: Sequence[dict], window: int = 20) -> dict:
    """Mean per-token entropy (nats) at each offset from a tool result, over all records (any steps/groups).

    Offset k >= 1 is the k-th model-sampled token after a result; k <= -1 the |k|-th model token before it (the
    call's own tokens first). A window stops at the neighbouring result, or at any other environment span, and at
    the completion's ends; offset 0 is the result itself and holds no tokens. A token is counted only in the record
    that generated it (positions >= fork_position), so prefixes shared by branches count once. `baseline_*` is
    the same mean over the first model segment of each non-branch record (before any tool call); `occurrences`
    counts (record, result) pairs that contributed a token."""
    if window < 1:
        raise ValueError(f"entropy_around_tools: window must be >= 1, got {window}.")
    sums, counts = [0.0] * (2 * window + 1), [0] * (2 * window + 1)
    occurrences, base_sum, base_count = 0, 0.0, 0
    for r in records:
        segs, h = r["segments"], r["entropies"]
        if not r.get("fork_position") and segs and segs[0]["kind"] == "model":
            vals = [v for v in h[segs[0]["start"] : segs[0]["end"]] if v is not None]
            base_sum, base_count = base_sum + sum(vals), base_count + len(vals)
        occurrences += _accumulate_around(r, window, sums, counts)
    return {
        "window": window, "offsets": list(range(-window, window + 1)),
        "mean": [s / c if c else None for s, c in zip(sums, counts)], "count": counts,
        "occurrences": occurrences,
        "baseline_mean": base_sum / base_count if base_count else None, "baseline_count": base_count,
    }


def _accumulate_around(r: dict, window: int, sums: list[float], counts: list[int]) -> int:
    """Add one record's own tokens around each of its tool results; returns how many results contributed."""
    segs, h, own = r["segments"], r["entropies"], r.get("fork_position") or 0
    occurrences = 0
    for k, seg in enumerate(segs):
        if not _is_result(seg):
            continue
        sides = []
        if k + 1 < len(segs) and segs[k + 1]["kind"] == "model":  # offsets +1, +2, … after the result
            nxt = segs[k + 1]
            sides.append((1, range(nxt["start"], min(nxt["end"], nxt["start"] + window))))
        if k and segs[k - 1]["kind"] == "model":  # offsets -1, -2, … back from the call's last token
            prev = segs[k - 1]
            sides.append((-1, range(prev["end"] - 1, max(prev["start"], prev["end"] - window) - 1, -1)))
        used = False
        for sign, positions in sides:
            for distance, pos in enumerate(positions, 1):
                if pos >= own and pos < len(h) and h[pos] is not None:
                    sums[window + sign * distance] += h[pos]
                    counts[window + sign * distance] += 1
                    used = True
        occurrences += used
    return occurrences


def plot_entropy_around_tools(records_or_stats: Sequence[dict] | dict, path: str | os.PathLike,
                              window: int = 20) -> Path:
    """Line plot of `entropy_around_tools` (records are summarised first) with the first-segment baseline."""
    stats = records_or_stats if isinstance(records_or_stats, dict) else entropy_around_tools(records_or_stats, window)
    plt = _pyplot()
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- terminal viewer -----------------------------------------------------------------------------------
def _snippet(text: str, width: int) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_tree(records: Sequence[dict], width: int = 60) -> str:
    """A compact text tree of one group: indentation by fork depth, one line per node and per own segment."""
    records = _one_group(records, "format_tree")
    lines = [f"step {records[0]['step']} · group {records[0]['group']} · prompt: {_snippet(_prompt(records), width)}"]
    for r, depth in _dfs(records):
        pad = "    " * depth
        lines.append(f"{pad}{'└─ ' if depth else '● '}{_node_summary(r)}")
        own = r.get("fork_position") or 0
        for seg in r["segments"]:
            if seg["end"] > own:
                tag = "model" if seg["kind"] == "model" else ("tool " if _is_result(seg) else "env  ")
                lines.append(f"{pad}     [{tag}] {seg['start']:>4}-{seg['end']:<4} {_snippet(seg['text'], width)}")
    return "\n".join(lines)


def _load(path: str, step: int | None) -> list[dict]:
    """Records of one step of a trees file (the last by default), streamed."""
    kept, steps = [], set()
    for record in iter_jsonl(path):
        steps.add(record["step"])
        if (step is None and record["step"] >= max(steps)) or record["step"] == step:
            if step is None and kept and kept[0]["step"] != record["step"]:
                kept = []
            kept.append(record)
    if not kept:
        if not steps:
            raise TreeFileError(f"{path}: no tree records")
        raise TreeFileError(f"{path}: no step {step} (steps present: {_ranges(sorted(steps))})")
    return kept


def _view(args: argparse.Namespace) -> None:
    records = _load(args.file, args.step)
    groups = [args.group] if args.group is not None else sorted({r["group"] for r in records})
    for g in groups:
        chosen = select(records, group=g, source=args.file)
        print(format_tree(chosen, args.width))
        print()
    if args.html:
        print(f"wrote {render_tree_html(select(records, group=groups[0], source=args.file), args.html)}")


def plot_run(file: str | os.PathLike, out: str | os.PathLike, step: int | None = None, group: int | None = None,
             window: int = 20) -> list[Path]:
    """Tree PNG + HTML of each group of `step` (default: the last) and the entropy-around-tools plot (+ JSON) of
    the whole file, written into `out`; returns the paths written."""
    records = _load(str(file), step)
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


def _plot(args: argparse.Namespace) -> None:
    for path in plot_run(args.file, args.out, args.step, args.group, args.window):
        print(f"wrote {path}")


def main(argv: Sequence[str] | None = None, prog: str = "python -m arpo_trl.trees") -> int:
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


if __name__ == "__main__":
    sys.exit(main())
