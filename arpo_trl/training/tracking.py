"""What a run leaves in its output folder, beside TRL's checkpoints (`ARPOConfig.log_trees`):

    trees.jsonl                 every training rollout tree (written by ARPOTrainer each step, `write_trees`;
                                `arpo_trl.trees`)
    metrics.jsonl               every logged metrics dict (reward, arpo/forks_per_group, ...), one line per log
    reward_curve.png            reward (and format credit, tool calls) per step, drawn at the end
    trees/                      the last step's tree pictures (PNG + HTML) and the entropy-around-tools plot

wandb and trackio get the same scalars through transformers' `report_to`; wandb also gets a node table and a
tree picture each step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from arpo_trl.generation.engine import GenerationCounters
from arpo_trl.markdown import markdown_table
from arpo_trl.rollout import RolloutResult
from arpo_trl.trees import node_table, plot_run, select, tree_html, write_jsonl
from arpo_trl.trees.render import pyplot, save_figure

logger = logging.getLogger(__name__)
TREES_FILE = "trees.jsonl"
METRICS_FILE = "metrics.jsonl"
SMOOTHING = 5
CURVE_KEYS = ("reward", "arpo/tool_calls_per_trajectory", "arpo/forks_per_group")


class TreePictures(TrainerCallback):
    """At the end of training, draw the last step's trees and the entropy-around-tools plot into
    `<output_dir>/trees/` (as `arpo-trl plot <output_dir>/trees.jsonl --out <output_dir>/trees` does); at its start,
    drop the records a rerun in the folder would repeat (`keep_rows`)."""

    def on_train_begin(self, args, state, control, **kwargs):
        # A rollout's records carry the step it trained (0-based): those of a resumed checkpoint's steps stay.
        if state.is_world_process_zero:
            keep_rows(os.path.join(args.output_dir, TREES_FILE), lambda record: record["step"] < state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        trees = os.path.join(args.output_dir, TREES_FILE)
        if state.is_world_process_zero and os.path.exists(trees):
            written = plot_run(trees, os.path.join(args.output_dir, "trees"))
            logger.warning("ARPO: rollout trees in %s; pictures: %s", trees, ", ".join(map(str, written)))


class RolloutLog:
    """Each rollout's tree statistics as `arpo/*` metrics (all ranks' prompts in server mode), with an in-process
    engine's work since the previous rollout."""

    def __init__(self) -> None:
        self._prefilled = 0  # the engine's prefill counter when the last rollout was logged
        self._engine_seconds: dict[str, float] = {}  # the engine's seconds per step phase, likewise

    def metrics(self, result: RolloutResult, engine, weight_sync, tools: bool = False) -> dict[str, float]:
        """`tools`: the run has tools, so TRL's `tools/*` metrics are logged too (`trl_tool_metrics`)."""
        stats, trajectories, groups = result.stats, result.trajectories, max(len(result.groups), 1)
        metrics = {
            "arpo/forks_per_group": stats.forks / groups,
            "arpo/fill_ups_per_group": stats.fill_ups / groups,
            "arpo/discarded_tokens_per_group": stats.discarded_tokens / groups,
            "arpo/waves": stats.waves,
            "arpo/critical_path_tokens": stats.critical_path_tokens,
            "arpo/latest_fill_up_start_tokens": stats.latest_fill_up_start_tokens,
            "arpo/tool_calls_per_trajectory": statistics.fmean(t.tool_calls for t in trajectories),
            "arpo/tool_calls_per_group": stats.tool_calls / groups,
            "arpo/tool_failures_per_group": stats.tool_failures / groups,
            "arpo/tokens_generated_per_group": sum(t.own_tokens() for t in trajectories) / groups,
            "arpo/rollout_seconds": stats.seconds,
            "arpo/generation_seconds": stats.generation_seconds,
            "arpo/tool_seconds": stats.tool_seconds,
            "arpo/sampler_overhead_seconds": stats.overhead_seconds,
        }
        if tools:
            metrics |= trl_tool_metrics(trajectories)
        if getattr(weight_sync, "last_seconds", None) is not None:  # set by a sync before this rollout only
            metrics["arpo/weight_sync_seconds"], weight_sync.last_seconds = weight_sync.last_seconds, None
        if stats.global_samples:  # AEPO's pre-monitoring
            metrics["arpo/global_samples_per_group"] = statistics.fmean(stats.global_samples.values())
        if stats.fork_deltas:
            metrics["arpo/fork_delta_entropy_mean"] = statistics.fmean(stats.fork_deltas)
        # in-process engines (a rank whose rollouts the main process grows has none)
        if engine is not None and isinstance(counters := engine.counters, GenerationCounters):
            metrics["arpo/prefill_tokens_per_group"] = (counters.prefill_tokens - self._prefilled) / groups
            self._prefilled = counters.prefill_tokens
            for phase, seconds in counters.seconds.items():  # the cached engine: admit, sample, decode
                metrics[f"arpo/engine_{phase}_seconds"] = seconds - self._engine_seconds.get(phase, 0.0)
            self._engine_seconds = dict(counters.seconds)
        return metrics


def trl_tool_metrics(trajectories) -> dict[str, float]:
    """TRL 1.16's tool metrics, as `GRPOTrainer._generate` computes them over its completions: `tools/call_frequency`,
    tool calls per completion, and `tools/failure_frequency`, failed calls over calls (0 without any). A trajectory's
    calls include those it shares with its parent up to its fork (its row holds them), so a call a branch inherits
    counts in each row, as it would in M independent completions (docs/coming_from_grpo.md)."""
    calls = sum(t.tool_calls for t in trajectories)
    failures = sum(t.tool_failures for t in trajectories)
    return {"tools/call_frequency": calls / max(len(trajectories), 1),
            "tools/failure_frequency": failures / calls if calls else 0.0}


def write_trees(records: list[dict], output_dir: str, report_to: list[str] | None) -> None:
    """Append a step's tree records to `<output_dir>/trees.jsonl`; wandb also gets their node table and the first
    group's tree picture."""
    write_jsonl(records, os.path.join(output_dir, TREES_FILE))
    if "wandb" in (report_to or []) and importlib.util.find_spec("wandb"):
        import wandb

        if wandb.run is not None:
            columns, rows = node_table(records)
            wandb.log({"arpo/tree_nodes": wandb.Table(columns=columns, data=rows),
                       "arpo/tree": wandb.Html(tree_html(select(records, group=0)))}, commit=False)


class MetricsFile(TrainerCallback):
    """Append each log to `<output_dir>/metrics.jsonl` (at the start, dropping the rows a rerun in the folder would
    repeat: `keep_rows`); draw `reward_curve.png` at the end of training."""

    def on_train_begin(self, args, state, control, **kwargs):
        # A log carries the step count after it (1 for the first step): those up to a resumed checkpoint's stay.
        if state.is_world_process_zero:
            keep_rows(os.path.join(args.output_dir, METRICS_FILE), lambda row: row["step"] <= state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            with open(os.path.join(args.output_dir, METRICS_FILE), "a") as file:
                file.write(json.dumps({"step": state.global_step, **logs}, default=float) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        metrics = os.path.join(args.output_dir, METRICS_FILE)
        if state.is_world_process_zero and os.path.exists(metrics):
            plot_curves(metrics, os.path.join(args.output_dir, "reward_curve.png"))


def keep_rows(path: str | os.PathLike, keep: Callable[[dict], bool]) -> None:
    """Rewrite a JSON-lines file with the rows `keep` accepts. A run started again in the same output folder appends
    to the files of the run before it: without this, a rerun's steps would follow the earlier run's in one file
    (their curves and per-step statistics mixed), and a resumed run's would repeat the steps after its checkpoint.
    A last line that is not JSON is a write cut short by a killed run, and goes; any other is an error. Blank lines are
    skipped (and go), as the readers skip them (`read_metrics`, `arpo_trl.trees.iter_jsonl`)."""
    if not os.path.exists(path):
        return
    # split at newlines only: trees.jsonl holds model text as written (UTF-8, not escaped), which may contain U+2028
    # and other characters `splitlines` would also split at
    lines = [(number, line) for number, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1)
             if line.strip()]
    kept = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == lines[-1][0]:
                break
            raise ValueError(f"{path}, line {number}: not JSON ({error}); move the file to start afresh") from error
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}, line {number}: expected an object with an integer 'step'")
        if keep(row):
            kept.append(line)
    if len(kept) < len(lines):
        Path(path).write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]


def curves(rows: list[dict], keys: tuple[str, ...] = CURVE_KEYS) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the training logs (rows with a `reward`), by key, plus every `rewards/*/mean`."""
    train = [row for row in rows if "reward" in row]
    names = list(keys) + sorted({k for row in train for k in row if k.startswith("rewards/") and k.endswith("/mean")})
    # A reward function that returned None for every row of a step logs its mean as NaN (null in the file).
    return {name: [(row["step"], float(row[name])) for row in train
                   if row.get(name) is not None and not math.isnan(float(row[name]))] for name in names}


def plot_curves(metrics_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """One panel per series of `curves`: reward per step, each reward function's mean, tool calls, forks."""
    plt = pyplot()
    series = {k: v for k, v in curves(read_metrics(metrics_path)).items() if v}
    fig, axes = plt.subplots(1, max(len(series), 1), figsize=(4 * max(len(series), 1), 3.2), squeeze=False)
    for ax, (name, points) in zip(axes[0], series.items()):
        steps, values = [p[0] for p in points], [p[1] for p in points]
        ax.plot(steps, values, marker="o", label="per step")
        if len(values) >= 2 * SMOOTHING:  # a step's few prompts make single steps noisy
            means = [sum(values[max(0, i - SMOOTHING + 1) : i + 1]) / len(values[max(0, i - SMOOTHING + 1) : i + 1])
                     for i in range(len(values))]
            ax.plot(steps, means, linestyle="--", label=f"running mean ({SMOOTHING} steps)")
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_figure(plt, fig, out, dpi=110)


def run_summary(output_dir: str | os.PathLike) -> str:
    """Markdown: reward per step (and each reward function, tool calls, forks), then the files the run left."""
    out = Path(output_dir)
    series = curves(read_metrics(out / METRICS_FILE)) if (out / METRICS_FILE).is_file() else {}
    names = [name for name, points in series.items() if points]
    lines = []
    if names:
        steps = sorted({step for name in names for step, _ in series[name]})
        values = {name: dict(series[name]) for name in names}
        rows = [[step, *(f"{values[n][step]:.3f}" if step in values[n] else "" for n in names)] for step in steps]
        lines.append(markdown_table(["step", *names], rows))
    files = [out / TREES_FILE, out / METRICS_FILE, out / "reward_curve.png", *sorted((out / "trees").glob("*"))]
    lines += ["", "Run folder:"] + [f"  {path}" for path in files if path.exists()]
    return "\n".join(lines)
