"""Which task and cold start leave RL room to learn? Issue 56's three screening numbers for each candidate regime.

    python benchmarks/regime_candidates.py                           # every candidate, screening sizes
    python benchmarks/regime_candidates.py --reuse                   # keep what is finished in --out
    python benchmarks/regime_candidates.py --candidates sft24 sft4 --questions 16 --samples 8

For each candidate (`CANDIDATES`: a cold-start model, trained first with `arpo-trl sft` when missing, and the
evaluation settings) two `arpo-trl eval` runs on the same held-out `arithmetic_chain` questions
(`recipes/eval_multi_call.yaml`, dataset seed 1234, temperature 1.0):

    with_tool     --questions × --samples trajectories, tools as in training (3 Python calls)
    without_tool  --questions × --no-tool-samples trajectories, max_tool_calls 0: a call ends the trajectory, so
                  no tool result is ever seen and only an answer written without the tool can score

and three numbers (issue 56's targets in brackets):

    pass@1              mean over questions of the share of correct samples, with the tool      [0.15-0.6]
    distinct_per_group  mean over questions of how many of the --samples completions differ (text) [>= 0.8·M]
    tool_need_share     share of questions no without-tool sample answers                          [most]

The task needs the tool by construction (a 3-digit number times a 2-digit one, then ± a 3-digit one: a 135M model
cannot carry that in its head); `without_tool` measures it. Writes `<out>/<candidate>/…` and
`benchmarks/results/regime_candidates.json` (commit, machine load, sizes, seeds, seconds) and prints JSON and a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SFT_RECIPE = "recipes/multi_call_sft.yaml"
EVAL_RECIPE = "recipes/eval_multi_call.yaml"
_CHAT = yaml.safe_load((ROOT / "recipes/arpo_vs_grpo_chat.yaml").read_text())  # the chat runs' prompt and budget
CHAT_EVAL = ["--tool_call_format", "chat_template", "--system_prompt", _CHAT["system_prompt"],
             "--max_completion_length", str(_CHAT["max_completion_length"])]
# name -> (cold-start model folder, (its SFT recipe, arguments) to make it when missing (None: none), eval arguments)
CANDIDATES = {
    "sft24": ("runs/multi-call-sft", (SFT_RECIPE, []), []),  # the peaked cold start: recipes/multi_call_sft.yaml
    "sft4": ("runs/regime/sft4", (SFT_RECIPE, ["--max_steps", "4", "--warmup_steps", "1"]), []),
    "sft8": ("runs/regime/sft8", (SFT_RECIPE, ["--max_steps", "8", "--warmup_steps", "1"]), []),
    "sft10": ("runs/regime/sft10", ("recipes/headroom_sft.yaml", []), []),  # the headroom cold start
    "sft12": ("runs/regime/sft12", (SFT_RECIPE, ["--max_steps", "12", "--warmup_steps", "1"]), []),
    "sft16": ("runs/regime/sft16", (SFT_RECIPE, ["--max_steps", "16", "--warmup_steps", "1"]), []),
    "chat_sft10": ("runs/headroom-sft-chat", ("recipes/headroom_chat_sft.yaml", []), CHAT_EVAL),  # TRL's peer's
    "base_prompt": ("smollm2", None, ["--system_prompt", "python"]),  # no cold start, the long prompt's example
}
# Seconds per trajectory and per SFT step on the 2-core development CPU with nothing else running (sft12: 12 steps in
# 139 s; sft24's 16 x 8 evaluation in about 2 min). A second torch process on the same 2 cores slows both by far more
# than 2x (oversubscribed threads): run the screening alone.
SECONDS_PER_TRAJECTORY, SECONDS_PER_SFT_STEP = 2.0, 12.0


def distinct_per_group(records: list[dict]) -> float:
    """Mean over questions of the number of distinct completion texts among its samples."""
    return statistics.fmean(len({c["text"] for c in r["completions"]}) for r in records)


def pass_at_1(records: list[dict]) -> float:
    return statistics.fmean(r["num_correct"] / len(r["completions"]) for r in records)


def tool_need_share(without_tool: list[dict]) -> float:
    """Share of questions that no sample answers without a tool result."""
    return statistics.fmean(r["num_correct"] == 0 for r in without_tool)


def summary(with_tool: list[dict], without_tool: list[dict]) -> dict:
    calls = [c["tool_calls"] for r in with_tool for c in r["completions"]]
    return {"pass@1": pass_at_1(with_tool), "distinct_per_group": distinct_per_group(with_tool),
            "samples_per_group": len(with_tool[0]["completions"]), "pass@1_without_tool": pass_at_1(without_tool),
            "tool_need_share": tool_need_share(without_tool), "calls_per_trajectory": statistics.fmean(calls)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--questions", type=int, default=16, help="held-out questions")
    parser.add_argument("--samples", type=int, default=8, help="M: samples per question with the tool")
    parser.add_argument("--no-tool-samples", type=int, default=4, help="samples per question without the tool")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the evaluations")
    parser.add_argument("--out", default="runs/regime")
    parser.add_argument("--results", default=str(ROOT / "benchmarks/results/regime_candidates.json"))
    parser.add_argument("--reuse", action="store_true", help="keep cold starts and evaluations finished in --out")
    return parser.parse_args(argv)


def run(*argv: str) -> float:
    """`arpo-trl …` in a fresh process from the repository root; its wall seconds. A failure stops the screening."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"regime_candidates: {' '.join(argv[:3])} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return time.perf_counter() - start


def cold_start(name: str, reuse: bool) -> tuple[str, float]:
    model, sft, _ = CANDIDATES[name]
    if sft is None or (reuse and (ROOT / model / "config.json").is_file()):
        return model, 0.0
    recipe, overrides = sft
    return model, run("sft", "--config", recipe, *overrides, "--output_dir", model)


def evaluate(args: argparse.Namespace, name: str, model: str, tools: bool) -> tuple[list[dict], float]:
    out = Path(args.out) / name / ("with_tool" if tools else "without_tool")
    results = ROOT / out / "eval_results.json"
    seconds = 0.0
    if not (args.reuse and results.is_file()):
        samples = args.samples if tools else args.no_tool_samples
        seconds = run("eval", "--config", EVAL_RECIPE, "--model_name_or_path", model, *CANDIDATES[name][2],
                      "--num_samples", str(args.questions), "--n_samples", str(samples), "--seeds", str(args.seed),
                      "--batch_size", str(args.questions), "--max_tool_calls", "3" if tools else "0",
                      "--output_dir", str(out))
    return json.loads(results.read_text())["records"], seconds


def expected_seconds(args: argparse.Namespace) -> float:
    trajectories = args.questions * (args.samples + args.no_tool_samples) * len(args.candidates)
    steps = sum(_sft_steps(*CANDIDATES[c][1]) for c in args.candidates if CANDIDATES[c][1]
                and not (args.reuse and (ROOT / CANDIDATES[c][0] / "config.json").is_file()))
    return trajectories * SECONDS_PER_TRAJECTORY + steps * SECONDS_PER_SFT_STEP


def _sft_steps(recipe: str, overrides: list[str]) -> int:
    if "--max_steps" in overrides:
        return int(overrides[overrides.index("--max_steps") + 1])
    return int(yaml.safe_load((ROOT / recipe).read_text())["max_steps"])


def table(rows: dict) -> str:
    lines = ["| candidate | pass@1 (with tool) | distinct / M | pass@1 without tool | tool-need share | calls/traj. |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['pass@1']:.3f} | {r['distinct_per_group']:.2f} / {r['samples_per_group']} | "
                     f"{r['pass@1_without_tool']:.3f} | {r['tool_need_share']:.2f} | "
                     f"{r['calls_per_trajectory']:.2f} |")
    return "\n".join(lines)


def merge_previous(report: dict, path: Path) -> None:
    """With --reuse: candidates the previous results file holds at the same sizes and seeds are kept beside this run's;
    a candidate this run only reused keeps the commit it was measured at, and a stage it reused (0 s here) the seconds
    it took when it ran (None when no earlier file recorded them)."""
    previous = json.loads(path.read_text()) if path.is_file() else {}
    if previous.get("sizes") != report["sizes"] or previous.get("seeds") != report["seeds"]:
        previous = {}
    for name, now in report["candidates"].items():
        earlier = previous.get("candidates", {}).get(name, {})
        if not any(now["seconds"].values()):
            now["commit"] = earlier.get("commit", previous.get("commit"))
        now["seconds"] = {stage: seconds or earlier.get("seconds", {}).get(stage) or None
                          for stage, seconds in now["seconds"].items()}
    for name, earlier in previous.get("candidates", {}).items():
        if "pass@1" in earlier and name not in report["candidates"]:
            report["candidates"][name] = {"commit": previous.get("commit"), **earlier}


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"regime_candidates: expected ~{expected_seconds(args) / 60:.0f} min on a quiet 2-core CPU "
          f"({len(args.candidates)} candidates × {args.questions} questions × ({args.samples} + "
          f"{args.no_tool_samples}) samples)", file=sys.stderr, flush=True)
    report = {"commit": git_commit(), "load_start": os.getloadavg(), "sizes": {
        "questions": args.questions, "samples": args.samples, "no_tool_samples": args.no_tool_samples},
        "seeds": {"eval_sampling": args.seed, "eval_dataset": 1234, "sft_transcripts": 1, "sft": 42},
        "candidates": {}}
    for name in args.candidates:
        model, sft_seconds = cold_start(name, args.reuse)
        with_tool, tool_seconds = evaluate(args, name, model, tools=True)
        without_tool, no_tool_seconds = evaluate(args, name, model, tools=False)
        report["candidates"][name] = {"model": model, **summary(with_tool, without_tool), "seconds": {
            "sft": sft_seconds, "eval_with_tool": tool_seconds, "eval_without_tool": no_tool_seconds}}
        print(f"regime_candidates: {name}: {json.dumps(report['candidates'][name])}", file=sys.stderr, flush=True)
    report["load_end"] = os.getloadavg()
    if args.reuse:
        merge_previous(report, Path(args.results))
    Path(args.results).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    print(table(report["candidates"]))


if __name__ == "__main__":
    main()
