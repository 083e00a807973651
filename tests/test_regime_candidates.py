"""The screening numbers of benchmarks/regime_candidates.py, computed from given evaluation records."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "regime_candidates", Path(__file__).resolve().parent.parent / "benchmarks" / "regime_candidates.py")
regime = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(regime)


def record(texts, correct, calls=1):
    completions = [{"text": t, "correct": c, "tool_calls": calls} for t, c in zip(texts, correct)]
    return {"completions": completions, "num_correct": sum(correct)}


def test_distinct_per_group_counts_different_texts_per_question():
    records = [record(["a", "a", "b", "c"], [1, 1, 0, 0]), record(["x"] * 4, [0] * 4)]
    assert regime.distinct_per_group(records) == pytest.approx((3 + 1) / 2)


def test_pass_at_1_is_the_mean_share_of_correct_samples():
    records = [record("abcd", [1, 1, 0, 0]), record("abcd", [1, 1, 1, 1]), record("abcd", [0] * 4)]
    assert regime.pass_at_1(records) == pytest.approx((0.5 + 1 + 0) / 3)


def test_tool_need_share_counts_questions_no_sample_answers_without_the_tool():
    without = [record("ab", [0, 0]), record("ab", [0, 1]), record("ab", [0, 0]), record("ab", [1, 1])]
    assert regime.tool_need_share(without) == pytest.approx(0.5)


def test_summary_and_table():
    with_tool = [record("abcd", [1, 0, 0, 0], calls=2), record("aabb", [1, 1, 0, 0], calls=3)]
    without = [record("ab", [0, 0], calls=0), record("ab", [0, 1], calls=0)]
    row = regime.summary(with_tool, without)
    assert row == {"pass@1": 0.375, "distinct_per_group": 3.0, "samples_per_group": 4, "pass@1_without_tool": 0.25,
                   "tool_need_share": 0.5, "calls_per_trajectory": 2.5}
    assert "| c | 0.375 | 3.00 / 4 | 0.250 | 0.50 | 2.50 |" in regime.table({"c": row})


def test_a_reuse_run_keeps_earlier_candidates_and_the_seconds_of_stages_it_reused(tmp_path):
    sizes, seeds = {"questions": 16}, {"eval_sampling": 0}
    earlier = {"commit": "abc", "sizes": sizes, "seeds": seeds, "candidates": {
        "sft8": {"pass@1": 0.1, "seconds": {"sft": 470.0, "eval_with_tool": 120.0}},
        "sft12": {"pass@1": 0.6, "commit": "old", "seconds": {"sft": 300.0, "eval_with_tool": 90.0}},
        "sft4": {"model": "unfinished", "seconds": {"sft": 540.0}}}}  # no numbers: not carried over
    path = tmp_path / "results.json"
    path.write_text(json.dumps(earlier))
    report = {"sizes": sizes, "seeds": seeds, "candidates": {
        "sft12": {"pass@1": 0.6, "seconds": {"sft": 0.0, "eval_with_tool": 95.0}},  # evaluated again, SFT reused
        "sft24": {"pass@1": 0.9, "seconds": {"sft": 0.0, "eval_with_tool": 0.0}}}}  # all reused, no record
    regime.merge_previous(report, path)
    assert set(report["candidates"]) == {"sft8", "sft12", "sft24"}
    assert report["candidates"]["sft12"]["seconds"] == {"sft": 300.0, "eval_with_tool": 95.0}
    assert "commit" not in report["candidates"]["sft12"]  # measured now: the report's commit
    assert report["candidates"]["sft24"] == {"pass@1": 0.9, "commit": "abc", "seconds": {"sft": None,
                                                                                        "eval_with_tool": None}}
    assert report["candidates"]["sft8"]["commit"] == "abc"
    other_sizes = {"sizes": {"questions": 200}, "seeds": seeds, "candidates": {}}
    regime.merge_previous(other_sizes, path)
    assert other_sizes["candidates"] == {}
