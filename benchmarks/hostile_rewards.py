"""Hostile model output against every reward function and parser we ship: time, console output and thread safety.

    python benchmarks/hostile_rewards.py                       # every case, then a batch of 64 hostile completions
    python benchmarks/hostile_rewards.py --only tower,nul_bytes --batch 16 --out outputs/hostile.json

Per case (one completion, ground truth "3"), every scorer runs once on the main thread: `seconds` is the wall time of
`arpo_math` alone and `all_seconds` the sum over all scorers; `output_bytes` is what they wrote to the process's
stdout and stderr (captured at the file-descriptor level, so logging's last-resort handler and C-level prints count).
`thread_safe` is whether every scorer also returned (without raising) when called from a worker thread.
The batch: `--batch` completions cycling through the hostile cases (each with its own numbers), scored by
`arpo_math_reward` in one call, on the main thread and then from a worker thread; the worst batch: `--worst-batch`
completions whose answers all run past the per-answer time limit (`slow_sum`, a sum sympy takes ~20 s over).

Prints one JSON object (also written to `--out` if given), then a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from arpo_trl.rewards import (
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    extract_answer,
    format_credit_reward,
    last_boxed,
    validate_format,
)
from arpo_trl.rewards.eval_metrics import score_completion
from arpo_trl.rollout.tool_calls import TagFormat
from arpo_trl.tools.base import Tool
from arpo_trl.tools.tags import extract_call, own_text_from_markers

TRUTH = "3"


def boxed(answer: str) -> str:
    return f"<think>t</think><answer>\\boxed{{{answer}}}</answer>"


# name -> builder(i): the i-th variant of the case (the batch gives each completion its own numbers)
CASES: dict[str, Callable[[int], str]] = {
    "control_equal": lambda i: boxed("3"),
    "control_fraction": lambda i: boxed(f"\\frac{{{6 + 2 * i}}}{{{2 + i}}}"),
    "tower": lambda i: boxed(f"9^{{9^{{9^{{{9 + i}}}}}}}"),
    "factorial": lambda i: boxed(f"(10^{{{10 + i}}})!"),
    "big_exponent": lambda i: boxed(f"{2 + i}^{{10^{{10}}}}"),
    "huge_number_100k": lambda i: boxed(str(1 + i % 9) * 100_000),
    "nested_parens_3000": lambda i: boxed("(" * 3000 + str(i) + ")" * 3000),
    "frac_chain_5000": lambda i: boxed(f"\\frac{{{1 + i}}}{{2}}+" * 5000),
    "deep_frac_300": lambda i: boxed("\\frac{1}{" * 300 + str(i) + "}" * 300),
    "many_boxed_5000": lambda i: "<think>t</think><answer>" + f"\\boxed{{{i}}} " * 5000 + "</answer>",
    "unbalanced_braces": lambda i: "<think>t</think><answer>\\boxed{" + "{" * 50_000 + str(i) + "</answer>",
    "repetition_no_answer": lambda i: "<think>" + f"I think the answer is {i}. " * 5000,
    "long_text_answer_100k": lambda i: boxed(f"the answer {i} " * 7000),
    "many_answer_tags": lambda i: "<think>t</think>" + "<answer>" * 20_000 + f"\\boxed{{{i}}}",
    "tool_tag_spam": lambda i: "<think>t</think>" + "<python>" * 20_000 + f"{i}</python> <result>\n\n</result>"
                               + "<answer>\\boxed{3}</answer>",
    "slow_sum": lambda i: boxed(f"\\sum_{{k=1}}^{{{30000 + i}}} \\frac{{1}}{{k}}"),  # 20 s in sympy, no big number
    "lone_surrogates": lambda i: boxed(f"3\ud800{i}\udfff" + b"\xff\xfe".decode("utf-8", "surrogateescape")),
    "nul_bytes": lambda i: boxed(f"3\x00{i}" + "\x00" * 10_000),
}

TAGS = TagFormat([Tool("python", str), Tool("search", str)])


def _parsers(text: str) -> None:
    validate_format(text)
    extract_answer(text)
    last_boxed(text)
    own_text_from_markers(text, ["python", "search"])
    for stop in ("</python>", "</search>"):
        extract_call(text, stop)
        TAGS.parse(text, stop)


SCORERS: dict[str, Callable[[str], object]] = {
    "arpo_math": lambda text: arpo_math_reward([text], ground_truth=[TRUTH]),
    "arpo_f1": lambda text: arpo_f1_reward([text], ground_truth=[TRUTH]),
    "format_credit": lambda text: format_credit_reward([text]),
    "accuracy": lambda text: answer_accuracy([text], ground_truth=[TRUTH]),
    "eval_math": lambda text: score_completion(text, TRUTH, "math"),
    "eval_f1": lambda text: score_completion(text, TRUTH, "f1"),
    "eval_em": lambda text: score_completion(text, TRUTH, "em"),
    "parsers": _parsers,
}


@contextlib.contextmanager
def captured_output():
    """Redirect fds 1 and 2 into a temp file; yields a list that receives the number of bytes written."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    size: list[int] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield size
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            size.append(sink.seek(0, os.SEEK_END))


def in_thread(fn: Callable[[], object]) -> tuple[bool, str | None, float]:
    """(returned without raising, the error, seconds) of `fn` run on a fresh worker thread."""
    outcome: dict = {}

    def run():
        try:
            fn()
            outcome["ok"] = True
        except BaseException as error:  # the point: does anything escape?
            outcome["ok"], outcome["error"] = False, f"{type(error).__name__}: {str(error)[:120]}"

    start = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    return outcome.get("ok", False), outcome.get("error"), time.perf_counter() - start


def measure_case(name: str) -> dict:
    text = CASES[name](0)
    seconds: dict[str, float] = {}
    with captured_output() as size:
        for scorer, fn in SCORERS.items():
            start = time.perf_counter()
            try:
                fn(text)
            except Exception:  # noqa: BLE001 - reported through thread_errors below
                pass
            seconds[scorer] = time.perf_counter() - start
    errors = {}
    with captured_output() as thread_size:
        for scorer, fn in SCORERS.items():
            ok, error, _ = in_thread(lambda fn=fn: fn(text))
            if not ok:
                errors[scorer] = error
    return {"case": name, "chars": len(text), "seconds": seconds["arpo_math"], "all_seconds": sum(seconds.values()),
            "max_scorer": max(seconds, key=seconds.get), "per_scorer_seconds": seconds, "output_bytes": size[0],
            "thread_output_bytes": thread_size[0], "thread_safe": not errors, "thread_errors": errors}


def _clear_cache() -> None:
    """Forget cached scores (the code under test caches them), so that the thread run scores everything again."""
    try:
        from arpo_trl.rewards.math_scoring import default_scorer
    except ImportError:  # the code before bounded scoring: no cache
        return
    default_scorer().clear_cache()


def measure_batch(size: int, names: list[str]) -> dict:
    hostile = [n for n in names if not n.startswith("control")] or names
    texts = [CASES[hostile[i % len(hostile)]](i // len(hostile)) for i in range(size)]
    metrics: dict[str, float] = {}  # what the reward logs through TRL's `log_metric` (bound counters)
    _clear_cache()
    with captured_output() as out:
        start = time.perf_counter()
        rewards = arpo_math_reward(texts, ground_truth=[TRUTH] * size, log_metric=metrics.__setitem__)
        main_seconds = time.perf_counter() - start
    _clear_cache()
    with captured_output() as thread_out:
        ok, error, thread_seconds = in_thread(lambda: arpo_math_reward(texts, ground_truth=[TRUTH] * size))
    return {"completions": size, "seconds": main_seconds, "output_bytes": out[0], "thread_seconds": thread_seconds,
            "thread_output_bytes": thread_out[0], "thread_safe": ok, "thread_error": error,
            "rewards": {str(v): rewards.count(v) for v in sorted(set(rewards))}, "metrics": metrics}


def table(report: dict) -> str:
    lines = ["| case | chars | arpo_math s | all scorers s | output bytes | thread-safe |",
             "|---|---:|---:|---:|---:|---|"]
    for row in report["cases"]:
        lines.append(f"| {row['case']} | {row['chars']} | {row['seconds']:.3f} | {row['all_seconds']:.3f} | "
                     f"{row['output_bytes']} | {'yes' if row['thread_safe'] else 'no'} |")
    for name in ("batch", "worst_batch"):
        batch = report.get(name)
        if batch:
            lines.append(f"| **{name.replace('_', ' ')} of {batch['completions']}** (arpo_math) | | "
                         f"{batch['seconds']:.2f} | thread: {batch['thread_seconds']:.2f} | "
                         f"{batch['output_bytes'] + batch['thread_output_bytes']} | "
                         f"{'yes' if batch['thread_safe'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="Comma-separated case names (default: all).")
    parser.add_argument("--batch", type=int, default=64, help="Completions in the batch (0: no batch).")
    parser.add_argument("--worst-batch", type=int, default=64,
                        help="Completions in a batch where every answer runs past the time limit (0: none).")
    parser.add_argument("--skip-cases", action="store_true", help="Only the batches.")
    parser.add_argument("--out", default=None, help="Also write the JSON report here.")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {list(CASES)}")
    report = {"cpus": os.cpu_count(), "cases": [] if args.skip_cases else [measure_case(name) for name in names]}
    if args.batch:
        report["batch"] = measure_batch(args.batch, names)
    if args.worst_batch:
        report["worst_batch"] = measure_batch(args.worst_batch, ["slow_sum"])
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    print(table(report))
    return report


if __name__ == "__main__":
    main()
