"""Model output is hostile input: every reward function and parser we ship, on degenerate, huge, deep, unbalanced and
malformed completions, from the main thread and from a worker thread, bounded in time and silent (docs/rewards.md).

The cases are the benchmark's (`benchmarks/hostile_rewards.py`); the time bounds here are generous (a shared 2-core
machine), the benchmark has the figures."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from arpo_trl.rewards import answer_accuracy, arpo_math_reward, completion_text, math_scores
from arpo_trl.rewards import reward_functions as rewards_module
from arpo_trl.rewards.eval_metrics import score_completion
from arpo_trl.rewards.math_scoring import MathScorer, default_scorer
from arpo_trl.rollout.tool_calls import ChatTemplateFormat
from arpo_trl.tools import Tool

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "hostile_rewards.py"
_spec = importlib.util.spec_from_file_location("bench_hostile_rewards", BENCH)
hostile = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hostile
_spec.loader.exec_module(hostile)

CASE_BOUND_S = 12.0  # per scorer and case; the per-answer limit is 2 s (three math scorers at most hit it)
OUTPUT_BOUND = 0  # bytes on stdout/stderr: nothing (pytest's logging capture takes the one-time warning)


def run_in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - the test reports it
            box["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "scorer hung in a worker thread"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("case", list(hostile.CASES))
def test_every_scorer_is_bounded_silent_and_thread_safe(case):
    text, other = hostile.CASES[case](0), hostile.CASES[case](1)  # the thread gets another variant (no cache hit)
    for name, scorer in hostile.SCORERS.items():
        with hostile.captured_output() as size:
            start = time.perf_counter()
            main_result = scorer(text)
            seconds = time.perf_counter() - start
        assert seconds < CASE_BOUND_S, (case, name, seconds)
        assert size[0] <= OUTPUT_BOUND, (case, name, size[0])
        with hostile.captured_output() as size:
            thread_result = run_in_thread(lambda scorer=scorer: scorer(other))
        assert size[0] <= OUTPUT_BOUND, (case, name, "thread", size[0])
        assert type(thread_result) is type(main_result)


def test_a_batch_of_64_hostile_completions_is_bounded(caplog):
    report = hostile.measure_batch(64, list(hostile.CASES))
    assert report["seconds"] < 30 and report["thread_seconds"] < 30, report  # benchmark: ~4 s on 2 cores
    assert report["output_bytes"] == 0 and report["thread_output_bytes"] == 0
    assert report["thread_safe"], report["thread_error"]
    metrics = report["metrics"]
    assert metrics["rewards/arpo_math_reward/capped"] >= 30  # towers, factorials, 100k characters, deep nesting
    assert sum(report["rewards"].values()) == 64


def test_worst_batch_is_cut_at_the_batch_time_limit():
    scorer = MathScorer(timeout=0.5, batch_timeout=2.0)
    slow = [f"\\sum_{{k=1}}^{{{30000 + i}}} \\frac{{1}}{{k}}" for i in range(16)]
    try:
        start = time.perf_counter()
        report = run_in_thread(lambda: scorer.score(slow, [["3"]] * 16))
        seconds = time.perf_counter() - start
        assert report.scores == [0.0] * 16 and report.timeouts == 16
        assert seconds < 2.0 + 3.0  # batch limit + start of the zygote (~1 s) on a loaded machine
        assert scorer.score(["\\frac{6}{2}"], [["3"]]).scores == [1.0]  # killed workers were replaced
    finally:
        scorer.close()


# math-verify in-process, as rewards.math_score was before bounded scoring (main thread only).
def _in_process(prediction: str, truth: str) -> float:
    from math_verify import parse, verify

    predicted = parse(f"${prediction}$")
    gold = parse(f"${truth}$") or parse(truth)
    return 1.0 if gold and predicted and verify(gold, predicted) else 0.0


CHEAP = [("3", "3"), ("\\frac{1}{2}", "0.5"), ("3\\sqrt{3}-6", "3\\sqrt{3} - 6"), ("7", "8"), ("2^{2^{3}}", "256"),
         ("\\sum_{i=1}^{10} i", "55"), ("(x+1)^2", "x^2+2x+1"), ("\\{1, 2\\}", "\\{2, 1\\}"), ("10\\%", "0.1"),
         ("[0, 1)", "[0,1)"), ("\\pi", "3.14159"), ("x=3", "3"), ("1,000", "1000"), ("-\\infty", "-\\infty"),
         ("\\text{No}", "No"), ("\\dfrac{10!}{2}", "1814400"), ("2^{100}", "1267650600228229401496703205376"),
         ("(10^{3})!", "(1000)!"), ("e^{i\\pi}", "-1"), ("\\sqrt{2}^2", "2")]


def test_cheap_answers_score_exactly_as_math_verify_in_process():
    expected = [_in_process(p, t) for p, t in CHEAP]
    report = math_scores([p for p, _ in CHEAP], [t for _, t in CHEAP])
    assert report.scores == expected
    assert report.timeouts == report.capped == report.errors == 0
    assert sum(expected) >= 12  # the table holds both equal and different answers


def test_caps_compare_long_answers_as_text():
    long_truth = "1" + "0" * 1200  # a 1,201-character ground truth: answers up to twice as long are parsed
    report = math_scores([long_truth, "3" + " " * 1500, "4" + " " * 1500, "(" * 50 + "3" + ")" * 50],
                         [long_truth, "3", "3", "3"])
    assert report.scores == [1.0, 1.0, 0.0, 0.0], report
    assert report.capped == 3  # 1,501 characters (equal as text, or not) and the 50-deep nesting


def test_timeouts_are_logged_as_trl_metrics_and_warned_once(caplog, monkeypatch):
    monkeypatch.setattr(rewards_module, "_warned", threading.Event())  # as in a new process, whatever ran before
    metrics = []
    slow = "<think>t</think><answer>\\boxed{\\sum_{k=1}^{40001} \\frac{1}{k}}</answer>"
    good = "<think>t</think><answer>\\boxed{3}</answer>"
    with caplog.at_level(logging.WARNING):
        rewards = arpo_math_reward([slow, good], ground_truth=["3", "3"],
                                   log_metric=lambda name, value: metrics.append((name, value)))
        answer_accuracy([slow.replace("40001", "40002")], ground_truth=["3"], log_metric=lambda *a: None)
    assert rewards == [0.0, 1.0]
    assert ("rewards/arpo_math_reward/timeouts", 1.0) in metrics
    assert ("rewards/arpo_math_reward/capped", 0.0) in metrics
    warnings = [r.getMessage() for r in caplog.records if "math scoring bound" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("arpo_math_reward: 1 answer(s)"), warnings
    assert "40001" not in warnings[0]  # the answer itself is not repeated into the log


def test_a_dead_worker_is_replaced():
    scorer = default_scorer()
    assert scorer.score(["3"], [["3"]]).scores == [1.0]
    for worker in list(scorer._idle):  # kill the idle workers behind the scorer's back
        os.kill(worker.pid, signal.SIGKILL)
    assert scorer.score(["\\frac{9}{3}", "4"], [["3"], ["3"]]).scores == [1.0, 0.0]


def test_completion_text_of_hostile_messages():
    messages = [{"role": "assistant", "content": "a\x00\ud800"}, {"role": "assistant", "content": ["x"]}, "junk",
                {"role": "assistant", "content": None}]
    assert completion_text(messages) == "a\x00\ud800['x']"


def test_evaluation_scores_are_bounded():
    text = hostile.CASES["many_answer_tags"](0)
    start = time.perf_counter()
    for metric in ("math", "f1", "em"):
        assert score_completion(text, "3", metric)["correct"] == 0.0
    assert time.perf_counter() - start < 5


HOSTILE_CALLS = {
    "deep_json": "[" * 100_000 + "]" * 100_000,
    "huge_int": '{"name": "python", "arguments": {"input": ' + "9" * 100_000 + "}}",
    "huge_name": '{"name": "' + "x" * 100_000 + '", "arguments": {}}',
    "nul_and_surrogates": '{"name": "python\\u0000\\ud800", "arguments": {"input": "\x00\ud800"}}',
    "unbalanced": '{"name": "python", "arguments": {"input": "' + "{" * 50_000,
    "many_markers": "<tool_call>" * 20_000 + '{"name": "python", "arguments": {"input": "1"}}',
}


@pytest.mark.parametrize("name", list(HOSTILE_CALLS))
def test_chat_template_call_parsing_is_bounded(hermes, name):
    fmt = ChatTemplateFormat(hermes, [Tool("python", str)])
    text = f"<tool_call>{HOSTILE_CALLS[name]}</tool_call>"
    start = time.perf_counter()
    call = fmt.parse(text, "</tool_call>")
    thread_call = run_in_thread(lambda: fmt.parse(text, "</tool_call>"))
    assert time.perf_counter() - start < 5
    assert (call is None) == (thread_call is None)
    if call is not None and call.error is not None:
        assert len(call.error) < 600  # the error becomes the tool result the model reads: bounded


def test_benchmark_report_shape(tmp_path, capsys):
    out = tmp_path / "hostile.json"
    report = hostile.main(["--only", "control_equal,tower", "--batch", "4", "--worst-batch", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [c["case"] for c in report["cases"]] == ["control_equal", "tower"]
    assert report["batch"]["completions"] == 4 and "worst_batch" not in report
    assert "| **batch of 4** (arpo_math) |" in capsys.readouterr().out
