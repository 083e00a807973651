"""Scoring and metrics of an evaluation run (`arpo-trl eval`, `arpo_trl.commands.evaluate`): pass@k, F1/EM/math/
letter scores of what the model wrote (`arpo_trl.rewards.own_text`: tool results excluded), the metric each row
asks for (`row_metric`), tool-call statistics from the sampler's records, and the per-seed and per-source tables.

A trajectory is *correct* when its score is 1: math-verify equivalence, the letter of a multiple-choice answer
('choice'), or an exact match for 'f1'/'em' (the 'f1' metric additionally reports the mean token-F1, which is what
the paper reports for knowledge QA).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from arpo_trl.markdown import markdown_table
from arpo_trl.rewards.reward_functions import (
    GROUND_TRUTH_COLUMNS,
    choice_score,
    exact_match,
    extract_answer,
    f1_score,
    is_choice,
    last_boxed,
    math_score,
    own_text,
    validate_format,
)
from arpo_trl.rollout.paths import ToolCallRecord
from arpo_trl.tools.tags import OwnText, own_text_from_ids

METRICS = ("auto", "math", "f1", "em", "choice")
# The rule by data source (the `task` column: ARPO's parquet `ability`, our loaders' task names) for rows that name
# no metric of their own.
TASK_METRICS = {"math": "math", "qa": "f1"}
_SOURCE_KEY = re.compile(r"^source\[(.*)\]/(.+)$")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of n samples, c of them correct, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score_answer(answer: str | None, ground_truth, metric: str) -> dict[str, float]:
    """`score` (the metric's value), `correct` (1.0 or 0.0) and, for 'f1'/'em', both `f1` and `em`. A list ground
    truth holds several acceptable answers: the best match counts."""
    if metric not in METRICS[1:]:
        raise ValueError(f"metric: unknown metric {metric!r}; expected one of {list(METRICS[1:])}.")
    truth = ground_truth if isinstance(ground_truth, (list, tuple)) else str(ground_truth)
    if metric in ("math", "choice"):
        value = 0.0 if answer is None else (math_score if metric == "math" else choice_score)(answer, truth)
        return {"score": value, "correct": float(value >= 1.0)}
    f1 = 0.0 if answer is None else f1_score(answer, truth)
    em = 0.0 if answer is None else exact_match(answer, truth)
    return {"score": f1 if metric == "f1" else em, "correct": em, "f1": f1, "em": em}


def score_completion(text: str, ground_truth, metric: str, require_answer_tag: bool = True,
                     calls: Sequence[dict] | None = None, own: OwnText | None = None) -> dict[str, Any]:
    """Score one completion: the answer the model wrote (`own`, default `own_text(text, calls)`: never one inside a
    tool result, none when it writes a result marker), metric values and the reference's format check."""
    own = own or own_text(text, calls)
    answer = None if own.error else extract_answer(own.text) if require_answer_tag else last_boxed(own.text)
    format_error = validate_format(text, calls=calls, own=own)
    return {"answer": answer, "metric": metric, **score_answer(answer, ground_truth, metric),
            "format_error": format_error}


def score_paths(paths: Sequence, truth, metric: str, decode: Callable[[Sequence[int]], str], tags: Sequence[str],
                require_answer_tag: bool = True, save_text: bool = True) -> list[dict[str, Any]]:
    """Score a question's sampled paths (`Trajectory`s): the model's own text is decoded outside the recorded result
    spans (`arpo_trl.tools.tags.own_text_from_ids`), in any call format."""
    completions = []
    for path in paths:
        text = decode(path.completion_ids)
        own = own_text_from_ids(path.completion_ids, path.calls, decode)
        scored = score_completion(text, truth, metric, require_answer_tag, [asdict(c) for c in path.calls], own)
        completions.append({
            **({"text": text} if save_text else {}), **scored,
            "tool_calls": path.tool_calls, "tool_failures": path.tool_failures,
            "calls_by_tool": tool_call_counts(path.calls, tags), "finish_reason": path.finish_reason,
            "tokens": path.own_tokens(),
        })
    return completions


def row_metric(row: dict, fallback: str) -> str:
    """The metric of one row: its own `metric` field; else a one-letter ground truth (or a list of them) scores as
    a letter ('choice'); else the rule by data source (`TASK_METRICS` on its `task`: math-verify for math, F1 for
    QA); else `fallback` (the dataset's). Raises ValueError for a `metric` field outside `METRICS`."""
    named = row.get("metric")
    if named:
        if named not in METRICS[1:]:
            raise ValueError(f"metric: a row asks for {named!r}; expected one of {list(METRICS[1:])}.")
        return named
    truth = ground_truth(row)
    truths = truth if isinstance(truth, (list, tuple)) else [truth]
    if truths and all(is_choice(str(t)) for t in truths):
        return "choice"
    return TASK_METRICS.get(str(row.get("task") or "").lower(), fallback)


def row_source(row: dict) -> str:
    """The group a row is reported in: its `task` (ARPO's `ability`, our loaders' task names), else 'all'."""
    return str(row.get("task") or "all")


def tool_call_counts(calls: Sequence[ToolCallRecord], tags: Sequence[str]) -> dict[str, int]:
    """Calls run per tool, as the sampler recorded them (any call format)."""
    return {tag: sum(call.ran and call.tool == tag for call in calls) for tag in tags}


# ---- metrics ----------------------------------------------------------------------------------------------------
def quality(records: list[dict], ks: Sequence[int]) -> dict[str, float]:
    """Questions, pass@k, the mean score and, over the rows scored by F1/EM, mean F1 and EM."""
    completions = [c for r in records for c in r["completions"]]
    out: dict[str, float] = {"questions": len(records), "trajectories": len(completions)}
    for k in ks:
        out[f"pass@{k}"] = _mean(pass_at_k(len(r["completions"]), r["num_correct"], k) for r in records)
    out["mean_score"] = _mean(c["score"] for c in completions)
    if any("f1" in c for c in completions):
        out["mean_f1"] = _mean(c["f1"] for c in completions if "f1" in c)
        out["mean_em"] = _mean(c["em"] for c in completions if "em" in c)
    return out


def seed_metrics(records: list[dict], ks: Sequence[int], tags: Sequence[str], wall_time: float) -> dict[str, float]:
    """Flat metrics of one seed's per-question records; with several sources (`row_source`), each source's
    `quality` too, as `source[<name>]/<metric>`."""
    completions = [c for r in records for c in r["completions"]]
    total = max(len(completions), 1)
    out = quality(records, ks)
    sources = sorted({r.get("source", "all") for r in records})
    for source in sources if len(sources) > 1 else ():
        for key, value in quality([r for r in records if r.get("source", "all") == source], ks).items():
            out[f"source[{source}]/{key}"] = value
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
    """A markdown table: a row per metric, a column per seed, then mean ± std (per-source metrics: `source_table`)."""
    columns = ["metric", *(f"seed {int(m['seed'])}" for m in per_seed), "mean ± std"]
    rows = [[key, *(_fmt(key, m.get(key, 0.0)) for m in per_seed), f"{_fmt(key, s['mean'])} ± {_fmt(key, s['std'])}"]
            for key, s in summary.items() if not _SOURCE_KEY.match(key)]
    return markdown_table(columns, rows)


def source_table(summary: dict[str, dict[str, float]], metrics: dict[str, list[str]]) -> str:
    """A markdown table: a row per source and one for all, a column per `quality` metric (mean over seeds), with the
    metrics each source was scored by (`metrics`: source → metric names)."""
    per_source: dict[str, dict[str, float]] = {}
    for key, stats in summary.items():
        if (match := _SOURCE_KEY.match(key)) is not None:
            per_source.setdefault(match.group(1), {})[match.group(2)] = stats["mean"]
    per_source["all"] = {key: stats["mean"] for key, stats in summary.items() if not _SOURCE_KEY.match(key)}
    names = [key for key in summary if not _SOURCE_KEY.match(key) and key not in ("trajectories",)
             and (key.startswith("pass@") or key in ("questions", "mean_score", "mean_f1", "mean_em"))]
    scored_by = {**metrics, "all": sorted({m for ms in metrics.values() for m in ms})}
    rows = [[source, ", ".join(scored_by.get(source, [])), *(_fmt(k, values.get(k, 0.0)) if k in values else "–"
                                                              for k in names)]
            for source, values in per_source.items()]
    return markdown_table(["source", "scored by", *names], rows)


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


def seed_interval(mine: dict[Any, Sequence[float]], base: dict[Any, Sequence[float]], statistic: str,
                  level: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """A method against a baseline across training seeds. Per seed `g`, its value is the ratio ('ratio') or difference
    ('difference') of the means of its paired units (`mine[g][i]` with `base[g][i]`: the same training step or
    held-out question). With two seeds or more, the estimate is the mean of the seeds' values and the interval is
    Student's t over them (`interval`: 't'): the seeds are the sample, since a run's training seed, not the questions
    it is scored on, decides most of its result. With one seed there is no spread to measure: its value, with the
    percentile bootstrap over its units, which holds their noise only (`interval`: 'units'). A seed whose baseline mean
    is 0 has no ratio and is left out (`undefined_seeds`). `per_seed`: each seed's value."""
    import numpy as np

    try:
        from scipy import stats
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("seed_interval needs scipy for Student's t: pip install -e '.[dev]'") from error
    if statistic not in ("ratio", "difference"):
        raise ValueError(f"statistic: expected 'ratio' or 'difference', got {statistic!r}.")
    groups = [g for g in mine if g in base and min(len(mine[g]), len(base[g])) > 0]
    if not groups:
        raise ValueError("seed_interval: no seed has units for both methods.")
    per_seed = {}
    for g in groups:
        a, b = (float(np.mean(values[: min(len(mine[g]), len(base[g]))])) for values in (mine[g], base[g]))
        per_seed[g] = (a / b if b else math.nan) if statistic == "ratio" else a - b
    values = np.array([v for v in per_seed.values() if not math.isnan(v)])
    result = {"statistic": statistic, "seeds": int(values.size), "per_seed": {str(g): v for g, v in per_seed.items()},
              "undefined_seeds": len(groups) - int(values.size), "level": level}
    if values.size >= 2:
        half = stats.t.ppf((1 + level) / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
        mean = float(values.mean())
        return result | {"estimate": mean, "low": mean - float(half), "high": mean + float(half), "interval": "t"}
    if values.size == 0:
        return result | {"estimate": math.nan, "low": math.nan, "high": math.nan, "interval": "none"}
    g = next(g for g in groups if not math.isnan(per_seed[g]))
    units = paired_bootstrap({g: mine[g]}, {g: base[g]}, statistic, resamples, seed, level)
    return result | {"estimate": units["estimate"], "low": units["low"], "high": units["high"], "interval": "units",
                     "units": units["units"]}


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
    defined = np.array([d for d in draws if not math.isnan(d)])  # a ratio is undefined where the base mean is 0
    low, high = np.quantile(defined, [(1 - level) / 2, (1 + level) / 2]) if defined.size else (math.nan, math.nan)
    return {"estimate": value(pairs), "low": float(low), "high": float(high), "groups": len(groups),
            "units": int(sum(p.shape[1] for p in pairs)), "undefined_resamples": resamples - int(defined.size)}
