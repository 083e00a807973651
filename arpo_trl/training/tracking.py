"""What a run leaves in its output folder, beside TRL's checkpoints (`ARPOConfig.log_trees`):

    trees.jsonl                 every training rollout tree (written by ARPOTrainer each step; `arpo_trl.trees`)
    metrics.jsonl               every logged metrics dict (reward, arpo/forks_per_group, ...), one line per log
    reward_curve.png            reward (and format credit, tool calls) per step, drawn at the end
    trees/                      the last step's tree pictures (PNG + HTML) and the entropy-around-tools plot

wandb and trackio get the same scalars through transformers' `report_to`; wandb also gets a node table and a
tree picture each step.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from transformers import TrainerCallback

from arpo_trl.markdown import markdown_table
from arpo_trl.trees import plot_run

logger = logging.getLogger(__name__)
TREES_FILE = "trees.jsonl"
METRICS_FILE = "metrics.jsonl"
SMOOTHING = 5
CURVE_KEYS = ("reward", "arpo/tool_calls_per_trajectory", "arpo/forks_per_group")


class TreePictures(TrainerCallback):
    """At the end of training, draw the last step's trees and the entropy-around-tools plot into
    `<output_dir>/trees/` (as `arpo-trl plot <output_dir>/trees.jsonl --out <output_dir>/trees` does)."""

    def on_train_end(self, args, state, control, **kwargs):
        trees = os.path.join(args.output_dir, TREES_FILE)
        if state.is_world_process_zero and os.path.exists(trees):
            written = plot_run(trees, os.path.join(args.output_dir, "trees"))
            logger.warning("ARPO: rollout trees in %s; pictures: %s", trees, ", ".join(map(str, written)))


class MetricsFile(TrainerCallback):
    """Append each log to `<output_dir>/metrics.jsonl`; draw `reward_curve.png` at the end of training."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            with open(os.path.join(args.output_dir, METRICS_FILE), "a") as file:
                file.write(json.dumps({"step": state.global_step, **logs}, default=float) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        metrics = os.path.join(args.output_dir, METRICS_FILE)
        if state.is_world_process_zero and os.path.exists(metrics):
            plot_curves(metrics, os.path.join(args.output_dir, "reward_curve.png"))


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def curves(rows: list[dict], keys: tuple[str, ...] = CURVE_KEYS) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the training logs (rows with a `reward`), by key, plus every `rewards/*/mean`."""
    train = [row for row in rows if "reward" in row]
    names = list(keys) + sorted({k for row in train for k in row if k.startswith("rewards/") and k.endswith("/mean")})
    # A reward function that returned None for every row of a step logs its mean as NaN (null in the file).
    return {name: [(row["step"], float(row[name])) for row in train
                   if row.get(name) is not None and not math.isnan(float(row[name]))] for name in names}


def plot_curves(metrics_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """One panel per series of `curves`: reward per step, each reward function's mean, tool calls, forks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


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
