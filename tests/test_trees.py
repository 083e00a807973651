"""Rollout-tree records, pictures, entropy-around-tools statistics and the viewer (`arpo_trl.trees`), on real
rollouts of the branching sampler driven by a scripted engine with the real PythonTool, and on hand-made records
with known numbers."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_rollout import ScriptedEngine, _prompts

from arpo_trl import trees
from arpo_trl.commands import trees as trees_command
from arpo_trl.markdown import markdown_table
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import PythonTool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def _script(text, rng):
    """Two calls whose code prints HTML-looking text, then an answer; entropy rises with each call."""
    calls = text.count("</result>")
    if calls < 2:
        return f'step {calls} <python>print("<b>&" * {calls + 1})</python>', 0.3 + 0.5 * calls, "stop"
    return "<answer>\\boxed{2}</answer>", 1.5, "eos"


@pytest.fixture(scope="module")
def result(tokenizer):
    # τ = 1, β = 0: every segment after a tool result forks while a prompt has fewer than M paths.
    engine = ScriptedEngine(tokenizer, _script)
    sampler = BranchingSampler(engine, tokenizer, [PythonTool(timeout=10)], num_generations=4, initial_rollouts=2,
                               branch_threshold=1.0, entropy_weight=0.0, max_completion_length=300, seed=0)
    out = sampler.sample(_prompts(tokenizer, 2))
    assert any(t.kind == "branch" for t in out.trajectories)
    return out


@pytest.fixture(scope="module")
def records(result, tokenizer):
    n = len(result.trajectories)
    return trees.tree_records(result, tokenizer, step=7, rewards=[float(i) for i in range(n)],
                              advantages=[0.5 - i / n for i in range(n)])


def test_records_follow_the_trajectories(result, records, tokenizer):
    assert len(records) == len(result.trajectories)
    first_of_group = set()
    for t, r in zip(result.trajectories, records):
        assert r["version"] == trees.SCHEMA_VERSION and r["step"] == 7
        assert (r["group"], r["node"], r["parent"], r["kind"], r["fork_position"]) == \
            (t.group, t.id, t.parent, t.kind, t.fork_position)
        assert (r["tool_calls"], r["tool_failures"], r["finish_reason"]) == (t.tool_calls, t.tool_failures,
                                                                             t.finish_reason)
        assert r["length"] == len(t.completion_ids) and r["own_tokens"] == t.own_tokens()
        assert r["fork_delta"] == (None if t.fork_delta is None else pytest.approx(t.fork_delta))
        if t.group not in first_of_group:
            first_of_group.add(t.group)
            assert r["prompt"] == tokenizer.decode(t.prompt_ids, skip_special_tokens=True)
        else:
            assert r["prompt"] is None
    rewards = [r["reward"] for r in records]
    assert rewards == [float(i) for i in range(len(records))]
    assert records[1]["advantage"] == pytest.approx(0.5 - 1 / len(records))


def test_segments_rejoin_to_the_completion(result, records, tokenizer):
    for t, r in zip(result.trajectories, records):
        segs = r["segments"]
        assert "".join(s["text"] for s in segs) == tokenizer.decode(t.completion_ids, skip_special_tokens=True)
        assert segs[0]["start"] == 0 and segs[-1]["end"] == len(t.completion_ids)
        for a, b in zip(segs, segs[1:]):
            assert a["end"] == b["start"] and a["kind"] != b["kind"]
        for s in segs:
            assert set(t.mask[s["start"] : s["end"]]) == {1 if s["kind"] == "model" else 0}
            assert s["text"] == tokenizer.decode(t.completion_ids[s["start"] : s["end"]], skip_special_tokens=True)
        assert [h is None for h in r["entropies"]] == [bit == 0 for bit in t.mask]
        assert [h for h in r["entropies"] if h is not None] == \
            [pytest.approx(h, abs=1e-4) for h in t.entropies if not math.isnan(h)]
        results = [s for s in segs if s["kind"] == "result"]
        assert len(results) == t.tool_calls == len(r["calls"])
        assert all(s["text"].startswith(" <result>") and "<b>&" in s["text"] for s in results)  # PythonTool ran
        assert [(s["start"], s["end"]) for s in results] == [(c["result_start"], c["result_end"]) for c in r["calls"]]
        assert [c["tool"] for c in r["calls"]] == ["python"] * t.tool_calls and not any(c["failed"] for c in r["calls"])


def test_segments_rejoin_when_a_boundary_splits_a_character(tokenizer):
    ids = tokenizer.encode("aé😀 b", add_special_tokens=False)
    decode = lambda i: tokenizer.decode(list(i), skip_special_tokens=True)  # noqa: E731
    for cut in range(1, len(ids)):
        segs = trees.segments_of(ids, [1] * cut + [0] * (len(ids) - cut), decode)
        assert "".join(s["text"] for s in segs) == decode(ids)


def test_branch_prefixes_are_the_parents(records):
    by_node = {(r["group"], r["node"]): r for r in records}
    branches = [r for r in records if r["kind"] == "branch"]
    assert branches
    for r in branches:
        parent, fork = by_node[(r["group"], r["parent"])], r["fork_position"]
        assert [s for s in r["segments"] if s["end"] <= fork] == [s for s in parent["segments"] if s["end"] <= fork]
        assert any(s["end"] == fork for s in r["segments"])  # a branch starts at a segment boundary
        assert r["entropies"][:fork] == parent["entropies"][:fork]
        assert [s for s in r["segments"] if s["end"] == fork][0]["kind"] == "result"
        assert r["calls"][:1] == parent["calls"][:1]  # the call it forked after is its parent's


def test_jsonl_round_trip_appends_steps(records, tmp_path):
    path = tmp_path / "run" / "trees.jsonl"
    later = [{**r, "step": 8} for r in records]
    trees.write_jsonl(records, path)
    trees.write_jsonl(later, path)
    assert trees.read_jsonl(path) == records + later
    assert len(path.read_text().splitlines()) == 2 * len(records)
    assert trees.select(trees.read_jsonl(path)) == later  # default: the last step
    assert {r["group"] for r in trees.select(records, 7, 1)} == {1}


def test_non_finite_values_are_written_as_null(result, tokenizer, tmp_path):
    n = len(result.trajectories)
    recs = trees.tree_records(result, tokenizer, 0, rewards=[math.nan] + [1.0] * (n - 1))
    assert recs[0]["reward"] is None and recs[0]["advantage"] is None
    trees.write_jsonl(recs, tmp_path / "t.jsonl")
    assert "NaN" not in (tmp_path / "t.jsonl").read_text()
    with pytest.raises(ValueError, match="rewards has 1 entries for"):
        trees.tree_records(result, tokenizer, 0, rewards=[1.0])
    with pytest.raises(ValueError, match="record 0 .* is not JSON"):
        trees.write_jsonl([{"node": 0, "x": math.inf}], tmp_path / "bad.jsonl")


def test_node_table(records):
    columns, rows = trees.node_table(records)
    assert columns[:4] == ["step", "group", "node", "parent"] and len(rows) == len(records)
    for row, r in zip(rows, records):
        assert row[columns.index("node")] == r["node"]
        assert row[columns.index("fork_position")] == r["fork_position"]
        assert row[columns.index("finish_reason")] == r["finish_reason"]
    json.dumps(rows)  # plain values, as wandb.Table(columns=..., data=...) takes them
    table = markdown_table(columns, rows)
    assert table.splitlines()[0].startswith("| step | group | node |") and len(table.splitlines()) == len(rows) + 2


def test_html_shows_every_node_and_escapes_text(records, tmp_path):
    group = trees.select(records, group=0)
    page = trees.render_tree_html(group, tmp_path / "tree.html").read_text(encoding="utf-8")
    for r in group:
        assert f'id="node-{r["node"]}"' in page and f"node {r['node']} ·" in page
        if r["kind"] == "branch":
            assert f'href="#node-{r["node"]}"' in page  # the fork marker in the parent's text
    assert "<python>" not in page and "<result>" not in page and "<b>" not in page
    assert '<span class="call">&lt;python&gt;print(&quot;&lt;b&gt;&amp;&quot;' in page
    assert '<span class="result"> &lt;result&gt;' in page
    assert "<script" not in page and "src=" not in page and "<link" not in page  # self-contained
    hostile = [{**r, "prompt": "</pre><script>alert(1)</script>" if r["prompt"] else None} for r in group]
    assert "<script>" not in trees.tree_html(hostile)
    with pytest.raises(ValueError, match="one group's records"):
        trees.tree_html(records)


def _pixels(path: Path, color: str, tolerance: int = 24) -> int:
    """How many pixels of the PNG are within `tolerance` (0-255, per channel) of `color` ('#rrggbb')."""
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(path)[..., :3] * 255
    target = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image - target) <= tolerance).all(-1).sum())


def _height(path: Path) -> int:
    import matplotlib.image

    return matplotlib.image.imread(path).shape[0]


def _without_results(records):
    """The same records with every environment span turned into model text: no tool results left to draw."""
    return [{**r, "segments": [{**seg, "kind": "model"} for seg in r["segments"]]} for r in records]


RESULT_SHADE, CALL_MARK, CURVE = "#f9ce86", "#1a7f37", "#4a78c2"  # result bar (α .55 on white), call marker, curve


def test_pngs_show_the_tree_and_the_curve(records, tmp_path):
    """The pictures hold what they claim: a row per trajectory, shaded tool results and call markers (compared with
    the same tree without results), and the entropy curve (absent when there is no tool result to centre on)."""
    for group in (0, 1):
        mine = trees.select(records, group=group)
        png = trees.render_tree_png(mine, tmp_path / f"tree{group}.png")
        assert png.read_bytes()[:8] == PNG_MAGIC
        bare = trees.render_tree_png(_without_results(mine), tmp_path / f"bare{group}.png")
        single = trees.render_tree_png(mine[:1], tmp_path / f"single{group}.png")
        assert _height(png) > _height(single)  # a row per trajectory
        assert _pixels(png, RESULT_SHADE) > _pixels(bare, RESULT_SHADE) + 100  # the legend's patch is in both
        assert _pixels(png, CALL_MARK) > _pixels(bare, CALL_MARK)
    plot = trees.plot_entropy_around_tools(records, tmp_path / "entropy.png", window=8)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    flat = trees.plot_entropy_around_tools(_without_results(records), tmp_path / "flat.png", window=8)
    assert _pixels(plot, CURVE) > 100 and _pixels(flat, CURVE) == 0


def _record(step, node, parent, fork, segments, entropies):
    segs = [{"start": s, "end": e, "kind": k, "text": t} for s, e, k, t in segments]
    calls = [{"tool": "python", "result_start": s["start"], "result_end": s["end"]} for s in segs
             if s["kind"] == "result"]
    return {"version": 2, "calls": calls, "step": step, "group": 0, "node": node, "parent": parent,
            "kind": "branch" if parent is not None else "global", "fork_position": fork,
            "fork_delta": 0.1 if parent is not None else None,
            "tool_calls": 1, "tool_failures": 0, "finish_reason": "eos", "length": segs[-1]["end"], "own_tokens": 0,
            "reward": 1.0, "advantage": 0.0, "prompt": "q" if parent is None else None, "segments": segs,
            "entropies": entropies}


RESULT = " <result>\nx\n</result>"
HAND = [
    # node 0: model [0,3) H 1 2 3 | result [3,5) | model [5,8) H 4 5 6 | EOS after the call limit [8,9), no result
    _record(3, 0, None, None, [(0, 3, "model", "abc"), (3, 5, "result", RESULT), (5, 8, "model", "def"),
                               (8, 9, "env", "")], [1.0, 2.0, 3.0, None, None, 4.0, 5.0, 6.0, None]),
    # node 1 branches from 0 after its result: owns [5,10): model H 7 8 | result [7,9) | model H 9
    _record(3, 1, 0, 5, [(0, 3, "model", "abc"), (3, 5, "result", RESULT), (5, 7, "model", "gh"),
                         (7, 9, "result", RESULT), (9, 10, "model", "i")],
            [1.0, 2.0, 3.0, None, None, 7.0, 8.0, None, None, 9.0]),
    # another step, no tool call: only the baseline
    _record(4, 0, None, None, [(0, 1, "model", "z")], [10.0]),
]


def test_entropy_around_tools_exact():
    stats = trees.entropy_around_tools(HAND, window=2)
    assert stats["offsets"] == [-2, -1, 0, 1, 2]
    # -2: node 0 pos 1 (2), node 1 pos 5 (7) | -1: pos 2 (3), pos 6 (8) | +1: pos 5 (4), node 1 pos 5 (7), pos 9 (9)
    # | +2: pos 6 (5), node 1 pos 6 (8); node 1's copy of node 0's tokens before the first result is not counted
    assert stats["count"] == [2, 2, 0, 3, 2]
    assert stats["mean"] == [pytest.approx(4.5), pytest.approx(5.5), None, pytest.approx(20 / 3), pytest.approx(6.5)]
    assert stats["occurrences"] == 3
    assert stats["baseline_mean"] == pytest.approx((1 + 2 + 3 + 10) / 4) and stats["baseline_count"] == 4
    one = trees.entropy_around_tools(HAND, window=1)
    assert one["count"] == [2, 0, 3] and one["mean"][2] == pytest.approx(20 / 3)
    wide = trees.entropy_around_tools(HAND, window=5)  # windows stop at the segment's ends
    assert wide["count"] == [0, 0, 1, 2, 2, 0, 3, 2, 1, 0, 0]
    json.dumps(wide)
    with pytest.raises(ValueError, match="window"):
        trees.entropy_around_tools(HAND, window=0)


def test_entropy_on_the_sampled_rollout(records):
    # Per group: 2 globals forked once each right after their first result, every path makes 2 calls. The engine's
    # entropy is 0.3 before the first result, 0.8 after it, 1.5 after the second. Owned call segments: 2 first
    # (globals) at 0.3, 4 second at 0.8; owned continuations: 4 after a first result (0.8), 4 after a second (1.5).
    for group in (0, 1):
        kinds = sorted(r["kind"] for r in records if r["group"] == group)
        assert kinds == ["branch", "branch", "global", "global"]
        assert all(r["tool_calls"] == 2 for r in records)
    stats = trees.entropy_around_tools(records, window=3)
    assert stats["count"] == [12, 12, 12, 0, 16, 16, 16]
    assert stats["mean"][:3] == [pytest.approx((2 * 0.3 + 4 * 0.8) / 6)] * 3
    assert stats["mean"][4:] == [pytest.approx((4 * 0.8 + 4 * 1.5) / 8)] * 3
    assert stats["occurrences"] == 2 * (2 * 2 + 2 * 2)  # 2 globals × 2, 2 branches × (inherited + own)
    assert stats["baseline_mean"] == pytest.approx(0.3) and stats["baseline_count"] > 0


def _write(tmp_path, records):
    path = tmp_path / "trees.jsonl"
    trees.write_jsonl(records, path)
    trees.write_jsonl([{**r, "step": 8} for r in records], path)
    return path


def test_viewer_prints_the_tree(records, tmp_path, capsys):
    path = _write(tmp_path, records)
    assert trees_command.main(["view", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 8 · group 0" in out and "step 8 · group 1" in out and "step 7" not in out
    for r in records:
        assert f"node {r['node']} · {r['kind']}" in out
    assert "└─ node" in out and "ΔH=" in out and "[tool ]" in out and "<python>print" in out
    html_out = tmp_path / "view.html"
    assert trees_command.main(["view", str(path), "--step", "7", "--group", "1", "--html", str(html_out)]) == 0
    out = capsys.readouterr().out
    assert "step 7 · group 1" in out and "group 0" not in out and html_out.read_text().startswith("<!DOCTYPE html>")


def test_plot_command_writes_pictures(records, tmp_path, capsys):
    path = _write(tmp_path, records)
    assert trees_command.main(["plot", str(path), "--out", str(tmp_path / "pics"), "--window", "4"]) == 0
    names = sorted(os.listdir(tmp_path / "pics"))
    assert names == ["entropy_around_tools.json", "entropy_around_tools.png", "tree_step8_group0.html",
                     "tree_step8_group0.png", "tree_step8_group1.html", "tree_step8_group1.png"]
    stats = json.loads((tmp_path / "pics" / "entropy_around_tools.json").read_text())
    assert stats["window"] == 4 and sum(stats["count"]) > 0


def _error(argv, capsys):
    assert trees_command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err
    return err


def test_bad_input_gives_one_clear_error(records, tmp_path, capsys):
    path = _write(tmp_path, records)
    missing = tmp_path / "nope.jsonl"
    assert f"{missing}: no such trees file" in _error(["view", str(missing)], capsys)
    assert "no step 99 (steps present: 7-8)" in _error(["view", str(path), "--step", "99"], capsys)
    assert "step 8 has no group 5 (groups: 0-1)" in _error(["view", str(path), "--group", "5"], capsys)
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    assert f"{bad}:2: not valid JSON" in _error(["view", str(bad)], capsys)
    record = json.loads(lines[1])
    del record["segments"]
    bad.write_text("\n".join([lines[0], "", json.dumps(record)]) + "\n")
    assert f"{bad}:3: missing field 'segments'" in _error(["plot", str(bad), "--out", str(tmp_path)], capsys)
    bad.write_text(json.dumps({**json.loads(lines[0]), "step": "7"}) + "\n")
    assert f"{bad}:1: field 'step' must be int" in _error(["view", str(bad)], capsys)
    bad.write_text(json.dumps({**json.loads(lines[0]), "version": 3}) + "\n")
    with pytest.raises(trees.TreeFileError, match=r"bad.jsonl:1: field 'version' is 3, this reader knows 1, 2"):
        trees.read_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no tree records" in _error(["view", str(empty)], capsys)


def test_cli_entry_point(records, tmp_path):
    path = _write(tmp_path, records)
    done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", "view", str(path), "--group", "0"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "step 8 · group 0" in done.stdout


def test_version_1_files_still_read(records, tmp_path):
    """Files written before `calls` existed: read, drawn and analysed with no tool calls, not rejected."""
    old = [{k: v for k, v in r.items() if k != "calls"} | {"version": 1, "segments": [
        {**seg, "kind": "model" if seg["kind"] == "model" else "env"} for seg in r["segments"]]}
        for r in trees.select(records, group=0)]
    path = tmp_path / "old.jsonl"
    trees.write_jsonl(old, path)
    back = trees.read_jsonl(path)
    assert [r["calls"] for r in back] == [[] for _ in old]
    assert trees.entropy_around_tools(back)["occurrences"] == 0
    assert trees.tree_html(back).startswith("<!DOCTYPE html>")
