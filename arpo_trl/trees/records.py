"""Rollout-tree records: a JSON line per trajectory, read back checked, selected by step and group, as a node table.

    records = tree_records(result, tokenizer, step, rewards=..., advantages=...)
    write_jsonl(records, "RUN/trees.jsonl")                       # appends one step
    arpo-trl view RUN/trees.jsonl [--step N] [--group G] [--html out.html]

Record schema, version 2 (one JSON object per trajectory, in `RolloutResult.trajectories` order):

    version         2 (version 1 files, written before `calls`, are read too: they show no tool calls)
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
    calls           the sampler's record of each tool call (`arpo_trl.rollout.paths.ToolCallRecord`): {"tool",
                    "arguments", "call_chars", "ran", "result_start", "result_end", "failed", "seconds"}; token offsets
                    index the completion
    segments        [{"start", "end", "kind", "text"}]: the completion as consecutive token spans of one kind,
                    "model" (sampled, mask 1), "result" (a tool's reply, as `calls` places it) or "env" (other
                    environment tokens: a tag tail, the EOS after the call limit; mask 0). Texts re-join to the
                    decoded completion (special tokens skipped). A branch's segments up to fork_position are its
                    parent's.
    entropies       per completion token, nats (rounded to 1e-4); null on environment tokens
    decisions       the fork decisions this node made itself where a fork was possible
                    (`arpo_trl.rollout.paths.ForkDecision`): {"position", "delta", "probability", "draw", "forked"};
                    absent in files written before it

Every float that is not finite is written as null. Prefix tokens are repeated in every branch's record (each
record is a full trajectory); `entropy_around_tools` counts each token once, in the record that owns it.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "version": int, "step": int, "group": int, "node": int, "kind": str, "length": int, "segments": list,
    "entropies": list, "tool_calls": int,
}
NODE_COLUMNS = [
    "step", "group", "node", "parent", "kind", "fork_position", "fork_delta", "tool_calls", "tool_failures",
    "reward", "advantage", "finish_reason", "length", "own_tokens",
]


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


def _span_cuts(ids: Sequence[int], full: str, bounds: Sequence[int], decode) -> list[int]:
    """The character offset in `full` (the decoded completion) of each token boundary in `bounds`, monotone, so that
    the pieces re-join exactly (a boundary inside a multi-byte character moves to the character's start)."""
    cuts = []
    for b in bounds:
        prefix = decode(ids[:b])
        while prefix and not full.startswith(prefix):
            prefix = prefix[:-1]
        cuts.append(max(len(prefix), cuts[-1] if cuts else 0))
    return cuts


def _boundaries(mask: Sequence[int], calls: Sequence[dict]) -> list[tuple[int, int]]:
    """Token spans [start, end) of equal mask, also cut where a tool's result begins and ends."""
    cuts = {i for i in range(1, len(mask)) if mask[i] != mask[i - 1]}
    cuts |= {c[k] for c in calls for k in ("result_start", "result_end") if c.get(k) is not None}
    edges = [0, *sorted(c for c in cuts if 0 < c < len(mask)), len(mask)]
    return [(s, e) for s, e in zip(edges, edges[1:]) if e > s]


def _kind(start: int, mask: Sequence[int], calls: Sequence[dict]) -> str:
    if mask[start]:
        return "model"
    return "result" if any(c.get("result_start") == start for c in calls) else "env"


def segments_of(ids: Sequence[int], mask: Sequence[int], decode, calls: Sequence[dict] = ()) -> list[dict]:
    """The completion as `{"start", "end", "kind", "text"}` spans (token offsets, end exclusive): runs of equal
    mask, with each tool result of `calls` a "result" span of its own."""
    runs = _boundaries(mask, calls)
    texts = [decode(ids[s:e]) for s, e in runs]
    full = decode(ids)
    if "".join(texts) != full:  # a boundary splits a character: cut the full text instead
        cuts = _span_cuts(ids, full, [end for _, end in runs[:-1]], decode)
        chars = [0, *cuts, len(full)]
        texts = [full[chars[k] : chars[k + 1]] for k in range(len(runs))]
    return [{"start": s, "end": e, "kind": _kind(s, mask, calls), "text": text} for (s, e), text in zip(runs, texts)]


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
        calls = [asdict(call) for call in t.calls]
        records.append({
            "version": SCHEMA_VERSION, "step": int(step), "group": t.group, "node": t.id, "parent": t.parent,
            "kind": t.kind, "fork_position": t.fork_position, "fork_delta": _finite(t.fork_delta, 6),
            "tool_calls": t.tool_calls, "tool_failures": t.tool_failures, "finish_reason": t.finish_reason,
            "length": len(t.completion_ids), "own_tokens": t.own_tokens(), "reward": reward, "advantage": advantage,
            "initial_entropy": _finite(t.initial_entropy, 6),
            "segment_entropies": [_finite(h, 6) for h in t.segment_entropies],
            "prompt": decode(t.prompt_ids) if first else None,
            "calls": calls, "segments": segments_of(t.completion_ids, t.mask, decode, calls),
            "entropies": [_finite(h, 4) for h in t.entropies],
            "decisions": [{**asdict(d), "delta": _finite(d.delta, 6)} for d in t.decisions],
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
    if record["version"] not in READABLE_VERSIONS:
        raise TreeFileError(f"{where}: field 'version' is {record['version']}, this reader knows "
                            f"{', '.join(map(str, READABLE_VERSIONS))}")
    if not isinstance(record.setdefault("calls", []), list):
        raise TreeFileError(f"{where}: field 'calls' must be a list, got {record['calls']!r:.60}")
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


def load_step(path: str | os.PathLike, step: int | None = None) -> list[dict]:
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


# ---- tables and tree structure -----------------------------------------------------------------------
def node_table(records: Sequence[dict]) -> tuple[list[str], list[list]]:
    """`(columns, rows)`, one row per node: `wandb.Table(columns=columns, data=rows)` or `markdown_table`."""
    rows = []
    for r in records:
        row = [r.get(c) for c in NODE_COLUMNS]
        rows.append([round(v, 4) if isinstance(v, float) else v for v in row])
    return list(NODE_COLUMNS), rows


def one_group(records: Sequence[dict], what: str) -> list[dict]:
    keys = sorted({(r["step"], r["group"]) for r in records})
    if len(keys) != 1:
        raise ValueError(f"{what}: needs one group's records, got {len(keys)} (step, group) pairs {keys[:5]}; "
                         "pick one with select(records, step, group)")
    return list(records)


def children(records: Sequence[dict]) -> tuple[list[dict], dict[int, list[dict]]]:
    """Roots (no parent in the set) and, per node, its children by fork position."""
    nodes = {r["node"] for r in records}
    kids: dict[int, list[dict]] = defaultdict(list)
    roots = []
    for r in records:
        (kids[r["parent"]] if r.get("parent") in nodes else roots).append(r)
    for lst in kids.values():
        lst.sort(key=lambda r: (r.get("fork_position") or 0, r["node"]))
    return roots, kids


def tree_order(records: Sequence[dict]) -> list[tuple[dict, int]]:
    """(record, depth) in tree order: a node, then its branches."""
    roots, kids = children(records)
    out: list[tuple[dict, int]] = []

    def visit(r: dict, depth: int) -> None:
        out.append((r, depth))
        for child in kids.get(r["node"], []):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return out


def prompt_text(records: Sequence[dict]) -> str:
    return next((r["prompt"] for r in records if r.get("prompt")), "")
