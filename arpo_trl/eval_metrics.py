"""Scoring and metrics of an evaluation run (`arpo-trl eval`, `arpo_trl.commands.evaluate`): pass@k, F1/EM/math
scores of a completion, tool-call statistics from the sampler's records, and the per-seed table.

A trajectory is *correct* when its score is 1: math-verify equivalence, or an exact match for 'f1'/'em' (the
'f1' metric additionally reports the mean token-F1, which is what the paper reports for knowledge QA).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from arpo_trl.markdown import markdown_table
from arpo_trl.paths import ToolCallRecord
from arpo_trl.rewards import (
    GROUND_TRUTH_COLUMNS,
    extract_answer,
    f1_score,
    last_boxed,
    math_score,
    normalize_answer,
    validate_format,
)

METRICS = ("auto", "math", "f1", "em")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of n samples, c of them correct, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def exact_match(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """SQuAD exact match (after `normalize_answer`), max over the ground truths."""
    truths = [ground_truths] if isinstance(ground_truths, str) else list(ground_truths)
    return float(any(normalize_answer(prediction) == normalize_answer(str(t)) for t in truths))


def score_answer(answer: str | None, ground_truth, metric: str) -> dict[str, float]:
    """`score` (the metric's value), `correct` (1.0 or 0.0) and, for 'f1'/'em', both `f1` and `em`."""
    if metric not in METRICS[1:]:
        raise ValueError(f"metric: unknown metric {metric!r}; expected one of {list(METRICS[1:])}.")
    truth = ground_truth if isinstance(ground_truth, (list, tuple)) else str(ground_truth)
    if metric == "math":
        value = 0.0 if answer is None else math_score(answer, truth)
        return {"score": value, "correct": float(value >= 1.0)}
    f1 = 0.0 if answer is None else f1_score(answer, truth)
    em = 0.0 if answer is None else exact_match(answer, truth)
    return {"score": f1 if metric == "f1" else em, "correct": em, "f1": f1, "em": em}


def score_completion(text: str, ground_truth, metric: str, require_answer_tag: bool = True,
                     calls: Sequence[dict] | None = None) -> dict[str, Any]:
    """Score one completion: extracted answer, metric values and the reference's format check."""
    answer = extract_answer(text) if require_answer_tag else last_boxed(text)
    format_error = validate_format(text, calls=calls)
    return {"answer": answer, **score_answer(answer, ground_truth, metric), "format_error": format_error}


def tool_call_counts(calls: Sequence[ToolCallRecord], tags: Sequence[str]) -> dict[str, int]:
    """Calls run per tool, as the sampler recorded them (any call format)."""
    return {tag: sum(call.ran and call.tool == tag for call in calls) for tag in tags}


# ---- metrics ----------------------------------------------------------------------------------------------------
def seed_metrics(records: list[dict], ks: Sequence[int], metric: str, tags: Sequence[str],
                 wall_time: float) -> dict[str, float]:
    """Flat metrics of one seed's per-question records."""
    completions = [c for r in records for c in r["completions"]]
    total = max(len(completions), 1)
    out: dict[str, float] = {"questions": len(records), "trajectories": len(completions)}
    for k in ks:
        out[f"pass@{k}"] = _mean(pass_at_k(len(r["completions"]), r["num_correct"], k) for r in records)
    out["mean_score"] = _mean(c["score"] for c in completions)
    if metric in ("f1", "em"):
        out["mean_f1"] = _mean(c["f1"] for c in completions)
        out["mean_em"] = _mean(c["em"] for c in completions)
    out["answered_rate"] = sum(c["answer"] is not None for c in completions) / total
    out["format_valid_rate"] = sum(c["format_error"] is None for c in completions) / total
    calls = sum(c["tool_calls"] for c in completions)
    failures = sum(c["tool_failures"] for c in completions)
    out["tool_calls_per_trajectory"] = calls / total
    out["tool_failures_per_trajectory"] = failures / total
    out["tool_failure_rate"] = failures / calls if calls else 0.0
    for tag in tags:
        out[f"tool_use_rate/{tag}"] = sum(c["calls_by_tool"][tag] > 0 for c in completions) / total
    for reason in sorted({c["finish_reason"] for c in completions}):
        out[f"finish_reason/{reason}"] = sum(c["finish_reason"] == reason for c in completions) / total
    tokens = sum(c["tokens"] for c in completions)
    out["tokens_generated"] = tokens
    out["tokens_per_trajectory"] = tokens / total
    out["wall_time_s"] = wall_time
    return out


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def summarize(per_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and sample std (0 for one seed) of every metric over seeds; a finish reason a seed never saw counts 0."""
    keys = list(dict.fromkeys(key for metrics in per_seed for key in metrics if key != "seed"))
    summary = {}
    for key in keys:
        values = [float(metrics.get(key, 0.0)) for metrics in per_seed]
        summary[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return summary


def seed_table(per_seed: list[dict[str, float]], summary: dict[str, dict[str, float]]) -> str:
    """A markdown table: a row per metric, a column per seed, then mean ± std."""
    columns = ["metric", *(f"seed {int(m['seed'])}" for m in per_seed), "mean ± std"]
    rows = [[key, *(_fmt(key, m.get(key, 0.0)) for m in per_seed), f"{_fmt(key, s['mean'])} ± {_fmt(key, s['std'])}"]
            for key, s in summary.items()]
    return markdown_table(columns, rows)


def _fmt(key: str, value: float) -> str:
    if key in ("questions", "trajectories", "tokens_generated"):
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    return f"{value:.2f}" if key == "wall_time_s" or key.endswith("per_trajectory") else f"{value:.3f}"


def question_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") or "" for m in prompt if m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1].get("content"))


def ground_truth(row: dict):
    return next((row[c] for c in GROUND_TRUTH_COLUMNS if c in row and row[c] is not None), "")


def paired_bootstrap(mine: dict[Any, Sequence[float]], base: dict[Any, Sequence[float]], statistic: str,
                     resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """A method against a baseline with a two-level paired percentile bootstrap: `mine[g][i]` and `base[g][i]` are
    paired units (the same training step, or the same held-out question) of group `g` (a training seed). Each
    resample draws groups with replacement, then units within each drawn group; the statistic is the ratio
    ('ratio') or difference ('difference') of the two means. Returns the estimate on the data and its interval."""
    import numpy as np

    if statistic not in ("ratio", "difference"):
        raise ValueError(f"statistic: expected 'ratio' or 'difference', got {statistic!r}.")
    groups = [g for g in mine if g in base and min(len(mine[g]), len(base[g])) > 0]
    if not groups:
        raise ValueError("paired_bootstrap: no group has units for both methods.")
    pairs = [np.array([mine[g][: len(base[g])], base[g][: len(mine[g])]], dtype=float) for g in groups]

    def value(sample: list) -> float:
        a, b = (float(np.concatenate([s[k] for s in sample]).mean()) for k in (0, 1))
        return (a / b if b else math.nan) if statistic == "ratio" else a - b

    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        chosen = [pairs[i] for i in rng.integers(len(pairs), size=len(pairs))]
        draws.append(value([p[:, rng.integers(p.shape[1], size=p.shape[1])] for p in chosen]))
    low, high = np.nanquantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return {"estimate": value(pairs), "low": float(low), "high": float(high), "groups": len(groups),
            "units": int(sum(p.shape[1] for p in pairs))}
