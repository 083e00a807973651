"""The real quickstart, timed, over several seeds: does the reward rise, and how long does each stage take?

    python benchmarks/quickstart.py                          # seeds 1 2 3, the first from an empty cache
    python benchmarks/quickstart.py --seeds 1 --max_steps 6  # quicker look (extra flags go to the quickstart)

Each seed runs `arpo-trl quickstart --seed S` as a user would, in its own working folder. The first seed starts from
an empty `ARPO_TRL_CACHE`, so its stage times include fetching and converting SmolLM2 (install excluded). The cold
start is seeded by its own recipe and identical for every seed, so later seeds reuse the first seed's cold-start
model (their SFT stage reads 0 s) and share its cache. The criterion is issue #14's: the mean reward of the last
third of the steps is above the mean of the first third, on every seed.

Prints one JSON object, then a markdown table; writes the JSON to --out/quickstart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = re.compile(r"Quickstart stage times: (.*?); total")
SFT_DIR = Path("runs") / "quickstart-sft"


def thirds(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last third of the steps (a third is at least one step)."""
    third = max(len(rewards) // 3, 1)
    return statistics.mean(rewards[:third]), statistics.mean(rewards[-third:])


def stage_seconds(text: str) -> dict[str, float]:
    """'model fetch + conversion 31 s, cold-start SFT 95 s, ARPO 360 s' -> {name: seconds}."""
    return {name: float(seconds) for name, seconds in (part.rsplit(" ", 2)[:2] for part in text.split(", "))}


def run_seed(seed: int, folder: Path, cache: Path, extra: list[str]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ARPO_TRL_CACHE": str(cache)}
    start, load_start = time.monotonic(), os.getloadavg()[0]
    log = folder / "quickstart.log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "arpo_trl.cli", "quickstart", "--seed", str(seed), *extra],
                              cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    if code != 0:
        raise RuntimeError(f"seed {seed}: arpo-trl quickstart exited with {code}; see {log}")
    rows = [json.loads(line) for line in (folder / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row]  # the training logs (not the final summary)
    rewards = [row["reward"] for row in steps]
    first, last = thirds(rewards)
    stages = STAGES.search(log.read_text())

    def mean_of(key: str) -> float:
        return round(statistics.mean(row.get(key, 0.0) for row in steps), 3)

    return {
        "seed": seed, "wall_s": round(wall, 1), "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0],
        "stage_seconds": stage_seconds(stages.group(1)) if stages else {},
        "steps": len(rewards), "rewards": [round(r, 3) for r in rewards],
        "first_third_mean": round(first, 3), "last_third_mean": round(last, 3), "rising": last > first,
        "clipped_ratio_mean": mean_of("completions/clipped_ratio"),
        "tool_calls_per_trajectory_mean": mean_of("arpo/tool_calls_per_trajectory"),
        "forks_per_group_mean": mean_of("arpo/forks_per_group"),
        "run_folder": str(folder / "runs" / "quickstart"),
    }


def table(report: dict) -> str:
    lines = ["| seed | wall | stages (s) | steps | first third | last third | rising | clipped | tool calls/traj | "
             "forks/group |", "|---" * 10 + "|"]
    for r in report["seeds"]:
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items())
        lines.append(f"| {r['seed']} | {r['wall_s'] / 60:.1f} min | {stages} | {r['steps']} | "
                     f"{r['first_third_mean']:+.3f} | {r['last_third_mean']:+.3f} | {'yes' if r['rising'] else 'NO'} | "
                     f"{r['clipped_ratio_mean']:.2f} | {r['tool_calls_per_trajectory_mean']:.2f} | "
                     f"{r['forks_per_group_mean']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="runs/bench_quickstart", help="Working folders and the JSON report.")
    parser.add_argument("--cache", default=None, help="ARPO_TRL_CACHE for every seed (default: a new empty one).")
    args, extra = parser.parse_known_args(argv)
    out = Path(args.out).resolve()
    cache = Path(args.cache).resolve() if args.cache else Path(tempfile.mkdtemp(prefix="arpo_trl_cache_"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"commit": commit, "machine": f"{os.cpu_count()} CPUs", "cache": str(cache), "extra_flags": extra,
              "seeds": []}
    for i, seed in enumerate(args.seeds):
        folder = out / f"seed{seed}"
        shutil.rmtree(folder, ignore_errors=True)
        if i > 0:  # the cold start does not depend on the ARPO seed: reuse the first seed's
            shutil.copytree(out / f"seed{args.seeds[0]}" / SFT_DIR, folder / SFT_DIR)
        report["seeds"].append(run_seed(seed, folder, cache, extra))
        print(json.dumps(report["seeds"][-1]), file=sys.stderr, flush=True)
    report["all_rising"] = all(r["rising"] for r in report["seeds"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "quickstart.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
