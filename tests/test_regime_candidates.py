"""The screening numbers of benchmarks/regime_candidates.py, computed from given evaluation records."""

import importlib.util
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
