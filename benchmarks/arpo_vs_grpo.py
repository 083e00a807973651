"""Is ARPO worth it? ARPO against GRPO and TRL's own tool-calling GRPOTrainer on a multi-call task, with intervals.

    python benchmarks/arpo_vs_grpo.py --reuse    # the reported run (README): prints its expected time, then resumes
    python benchmarks/arpo_vs_grpo.py --seeds 0 --steps 2 --eval-questions 8 --eval-samples 2   # a quick look
    python benchmarks/arpo_vs_grpo.py --cold-start peaked --methods arpo grpo --stacks base packed packed_cached \
        --settings 16:8 4:2 --steps 2 --eval-questions 0 --out runs/stacks    # the stacks (docs/tree_packing.md)

The task (`arithmetic_chain`, `arpo_trl.data.arithmetic_chains`) needs one Python call per step, 2-3 per trajectory;
SmolLM2-135M is cold-started on the same transcripts in two call formats (`COLD_STARTS`: `headroom`, 10 SFT steps,
leaves RL room to learn; `peaked`, 24 steps, is the earlier regime), trained first when missing. Methods, all with
the same model, data, reward, M, token and call budgets, LoRA and seed:

    arpo       ARPOTrainer, tag calls (<python>), entropy branching: N global paths, then forks up to M
    grpo       ARPOTrainer, tag calls, branch_policy=none: M global paths (GRPO with our tool loop)
    arpo_chat  ARPOTrainer, tool_call_format=chat_template (the model's own tool calls), entropy branching
    grpo_chat  ARPOTrainer, tool_call_format=chat_template, branch_policy=none: M global paths (GRPO with our tool
               loop in TRL's call format: against trl_grpo it measures the tool loop, against arpo_chat branching)
    trl_grpo   TRL's GRPOTrainer(tools=[python]) on the chat-template model (benchmarks/trl_peer.py), at --peer-seeds
    aepo       ARPOTrainer, tag calls, AEPO (docs/aepo.md): branch_policy=aepo (entropy pre-monitoring sets the global
               samples, branch penalty) with stop-gradient clipping and the entropy-aware advantage (a = 0.2)
    random     ARPOTrainer, tag calls, random branching (not in the default run)
    arpo_*     ARPO with one setting changed (`ABLATIONS`: τ, β, hard attribution, N), each a test of an obvious
               explanation when ARPO does not beat GRPO (not in the default run)

Settings are M:N pairs (default 16:8, the paper's; later ones run `--second-row-methods`). Every run is a fresh
process; the methods of a seed run back to back so they share the machine's state, and `--reuse` keeps every run and
evaluation already complete in --out. Each main-row run's adapter is evaluated right after it trains (its format's
cold-start model first, as the "before RL" row) on the same held-out questions (`--eval-questions` ×
`--eval-samples`), through the vLLM-CPU server by default; the other rows report training-side costs and reward only.

`--stacks` runs every method on each training and generation stack (`STACKS`): `base` is unpacked rows and the waves
engine (what GRPOTrainer does), `packed` adds tree-packed training, `packed_cached` also the event-driven engine with
a prefix KV cache; `default` (the default) takes the recipe's settings. Besides the rollout's costs, each run logs its
training-phase seconds, tokens forwarded and prefilled per group, and its process's peak resident memory.

Each comparison (`PAIRS`, each ablation against arpo and grpo, and each method against its cold start) is made per
training seed: cost ratios of the per-step means (executed tool calls, unique generated tokens, rollout and step
seconds) and differences of the mean reward per step and of held-out pass@1 (across call formats also of the gain
over each one's cold start). One rule for every interval (`arpo_trl.rewards.eval_metrics.seed_interval`): with two
seeds or more, the mean of the per-seed values and a 95 % Student t interval over them (the seeds are the sample:
between-seed variance dominates); with one seed, that seed's value with a bootstrap over its steps or questions,
marked "1 seed, question noise only" and never starred. Each comparison keeps its per-seed values. Writes
`<out>/results.json` (commit, machine load, each run's seed, commit and steps), `<out>/results.md` and `<out>/*.png`,
and copies them to `--results`. `--runs-from RESULTS...` reports the runs results files recorded (no run folders):
seed pairs run in separate sessions or on separate machines, each published with `--results` (each run keeps its
commit and the cold start it was measured against: the cold start's weights and samples differ by machine), are
reported together.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# ARPO with one setting changed, after the recipe's (the last flag wins): each tests an explanation of ARPO not beating
# GRPO. τ = 1: fork at every tool result the budget allows; β = 1: the fork rule reads entropy 5× more (with ΔH over
# ln|V|, β = 0.2 moves P by a few hundredths once the first third of training is past: the report's fork-probability
# table); hard attribution: a shared prefix trained once, at its paths' mean advantage; N = 4: half the budget more to
# forks.
ABLATIONS = {"arpo_tau1": ["--branch_threshold", "1.0"], "arpo_beta1": ["--entropy_weight", "1.0"],
             "arpo_hard": ["--advantage_attribution", "hard"], "arpo_n4": ["--initial_rollouts", "4"]}
METHODS = {"arpo": ("tags", "entropy"), "grpo": ("tags", "none"), "arpo_chat": ("chat_template", "entropy"),
           "grpo_chat": ("chat_template", "none"), "trl_grpo": ("chat_template", "trl"), "aepo": ("tags", "aepo"),
           "random": ("tags", "random"),
           **{name: ("tags", "entropy") for name in ABLATIONS}}
AEPO_UPDATE = ["--entropy_balanced_clipping", "true", "--entropy_advantage_weight", "0.2"]  # the authors' a
PAIRS = (("arpo", "grpo"), ("random", "grpo"), ("arpo", "random"), ("arpo_chat", "grpo_chat"),
         ("grpo_chat", "trl_grpo"), ("arpo_chat", "trl_grpo"), ("arpo", "trl_grpo"), ("aepo", "grpo"), ("aepo", "arpo"),
         *((name, base) for name in ABLATIONS for base in ("arpo", "grpo")))
# The cold-start models (one SFT recipe per call format, trained first when missing). `headroom` (10 SFT steps) leaves
# RL room to learn: held-out pass@1 0.23 and all 8 of 8 samples distinct (benchmarks/regime_candidates.py); `peaked`
# (24 steps) already scores 0.89 with about 2 distinct samples in 8, the regime of the earlier results; `recipe` takes
# the training recipes' own model_name_or_path.
COLD_STARTS = {"headroom": {"tags": "recipes/headroom_sft.yaml", "chat_template": "recipes/headroom_chat_sft.yaml"},
               "peaked": {"tags": "recipes/multi_call_sft.yaml", "chat_template": "recipes/multi_call_chat_sft.yaml"},
               "recipe": {}}
# The expected-time forecast printed before a run starts, on a quiet 2-core Xeon (AVX-512, AMX), M16N8, one prompt a
# step: seconds per training step, ours (packing + cached engine; the headroom ARPO run of seed 0: 60 steps in 1,057 s)
# and TRL's peer (about 5x ours); per held-out trajectory through the vLLM-CPU server (plain weights; 800 in about 7.5
# minutes) and per evaluation for the merge and the server start. Another CPU can be far slower: on a 2-core AMD EPYC
# (Zen, AVX2 only) the headroom ARPO run of seed 5 took 48 s a step over 60 steps (2.7x; 2,907 s in all), its first
# two 100 and 95 s. So the forecast is rescaled by this machine's own step time (`Forecast`) as soon as a run logs its
# first step (an upper estimate: early steps generate longer and run slower) and again, closer, after each run.
STEP_SECONDS, PEER_STEP_SECONDS, EVAL_TRAJECTORY_SECONDS, EVAL_OVERHEAD_SECONDS = 18.0, 90.0, 0.5, 60.0
CALIBRATION = "a quiet 2-core Xeon with AVX-512"
# How a run trains and generates (tree_packing, the cached in-process engine), None: the recipe's default.
# `default` runs land in <method>/, the others in <method>@<stack>/. TRL's peer has no tree packing: its packed
# stacks train unpacked rows, and `cached` gives it TRL's own continuous batching (its fastest in-process setting).
STACKS = {"default": (None, None), "base": (False, False), "packed": (True, False), "packed_cached": (True, True)}
PER_STEP = {  # metrics.jsonl key -> our name (the TRL peer logs the same arpo/* keys)
    "arpo/tool_calls_per_group": "tool_calls_per_group", "arpo/tool_calls_per_trajectory": "calls_per_trajectory",
    "arpo/tokens_generated_per_group": "tokens_generated_per_group",
    "arpo/tokens_trained_per_group": "tokens_trained_per_group", "arpo/forks_per_group": "forks_per_group",
    "arpo/rollout_seconds": "rollout_seconds", "arpo/tool_seconds": "tool_seconds", "step_time": "step_seconds",
    "reward": "reward", "rewards/answer_accuracy/mean": "accuracy", "arpo/global_samples_per_group": "global_samples",
    "arpo/training_seconds": "training_seconds", "arpo/tokens_forwarded_per_group": "tokens_forwarded_per_group",
    "arpo/prefill_tokens_per_group": "prefill_tokens_per_group",
}
RATIOS = ("tool_calls_per_group", "tokens_generated_per_group", "tokens_trained_per_group", "rollout_seconds",
          "step_seconds", "training_seconds", "tokens_forwarded_per_group", "prefill_tokens_per_group", "peak_rss_mb")
RUN_LEVEL = ("peak_rss_mb",)  # one value per run (resources.json), not per step
DIFFERENCES = ("reward", "heldout_pass@1")
# What results files reported together must share (--runs-from): one cold-start recipe, training length and held-out
# set. Their cold starts' evaluations differ by machine; each run is measured against its own.
SAME_EXPERIMENT = ("cold_start", "steps", "prompts_per_step", "eval_questions", "eval_samples")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["arpo", "grpo", "trl_grpo"], choices=list(METHODS))
    parser.add_argument("--cold-start", default="headroom", choices=list(COLD_STARTS),
                        help="the cold-start models every method starts from (see COLD_STARTS)")
    parser.add_argument("--settings", nargs="+", default=[(16, 8)], type=_setting,
                        help="M:N rollout budgets; the first is the main row (every method)")
    parser.add_argument("--second-row-methods", nargs="*", default=["arpo", "grpo"], choices=list(METHODS),
                        help="methods also run at the settings after the first")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 2, 3],
                        help="training seeds (they generate the questions; 1 made the cold start's transcripts)")
    parser.add_argument("--peer-seeds", nargs="+", type=int, default=None,
                        help="the seeds TRL's peer (trl_grpo) runs, a subset of --seeds (default: the first): it is "
                             "about 5x slower a step")
    parser.add_argument("--stacks", nargs="+", default=["default"], choices=list(STACKS),
                        help="training and generation stacks each method runs with (see STACKS); comparisons are "
                             "made within a stack, and from each stack to the ones listed before it")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the same for every method)")
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--eval-questions", type=int, default=200, help="held-out questions (0: no evaluation)")
    parser.add_argument("--eval-samples", type=int, default=4, help="trajectories per held-out question")
    parser.add_argument("--eval-methods", nargs="+", default=None, choices=list(METHODS),
                        help="methods of the main row to evaluate (default: all; their formats' cold starts too)")
    parser.add_argument("--eval-backend", default="vllm_server", choices=["vllm_server", "transformers"])
    parser.add_argument("--recipe", type=_path, default=str(ROOT / "recipes/arpo_vs_grpo.yaml"),
                        help="training recipe of the tag-format methods")
    parser.add_argument("--chat-recipe", type=_path, default=str(ROOT / "recipes/arpo_vs_grpo_chat.yaml"),
                        help="training recipe of the chat-template methods")
    parser.add_argument("--eval-recipe", type=_path, default=str(ROOT / "recipes/eval_multi_call.yaml"))
    parser.add_argument("--report-only", action="store_true",
                        help="train and evaluate nothing: report the complete runs and evaluations already in --out "
                             "(e.g. of an interrupted run)")
    parser.add_argument("--runs-from", type=_path, nargs="+", default=None,
                        help="with --report-only: report the runs, evaluations and cold starts recorded in these "
                             "results files (e.g. seed pairs run on different machines) instead of the run folders "
                             "in --out; a run recorded twice, or files of another experiment (SAME_EXPERIMENT), are "
                             "refused")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (one-seed comparisons)")
    parser.add_argument("--out", default="runs/arpo_vs_grpo_headroom")
    parser.add_argument("--results", default=None,
                        help="a folder to copy the report (results.json, results.md, curves) to, e.g. "
                             "benchmarks/results/arpo_vs_grpo_headroom")
    parser.add_argument("--reuse", action="store_true", help="keep runs (and evaluations) already complete in --out")
    args = parser.parse_args(argv)
    if args.runs_from and not args.report_only:
        parser.error("--runs-from: expected with --report-only (it reports recorded runs, it trains none)")
    if args.peer_seeds is None:
        args.peer_seeds = args.seeds[:1]
    if not set(args.peer_seeds) <= set(args.seeds):
        parser.error(f"--peer-seeds: expected a subset of --seeds {args.seeds}, got {args.peer_seeds}")
    return args


def _setting(text: str) -> tuple[int, int]:
    m, _, n = text.partition(":")
    if not (m.isdigit() and n.isdigit() and 0 < int(n) <= int(m)):
        raise argparse.ArgumentTypeError(f"expected M:N with 0 < N <= M (e.g. 16:8), got {text!r}")
    return int(m), int(n)


def _path(text: str) -> str:
    """An absolute path: the runs start in the repository root, not in the caller's folder."""
    return str(Path(text).resolve())


def _label(setting: tuple[int, int]) -> str:
    return f"M{setting[0]}N{setting[1]}"


def run(*argv: str, log: Path | None = None, watch: Callable[[], None] | None = None) -> dict:
    """Run a command (`arpo-trl …` or a script) in a fresh process; its wall seconds and peak resident memory (of the
    process, model and rollout included). `watch` is called every few seconds while it runs. A failure stops the
    benchmark."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, text=True)
        try:  # this child's own rusage (subprocess.wait drops it)
            while (waited := os.wait4(process.pid, os.WNOHANG if watch else 0))[0] == 0:
                watch()
                time.sleep(WATCH_SECONDS)
        except BaseException:  # a failing watch, or Ctrl-C: the child goes too
            process.kill()
            process.wait()
            raise
        _, status, usage = waited
        process.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        text = output.read()
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{text[-6000:]}")
    return {"wall_seconds": time.perf_counter() - start, "peak_rss_mb": usage.ru_maxrss / 1024}


WATCH_SECONDS = 5.0


def recipe_value(recipe: str, key: str):
    import yaml

    return yaml.safe_load(Path(recipe).read_text()).get(key)


def recipes(args: argparse.Namespace) -> dict[str, str]:
    return {"tags": args.recipe, "chat_template": args.chat_recipe}


def cold_start_model(args: argparse.Namespace, fmt: str) -> str:
    """The model a format's runs start from: the output of its `--cold-start` SFT recipe, or the training recipe's."""
    sft = COLD_STARTS[args.cold_start].get(fmt)
    recipe = str(ROOT / sft) if sft else recipes(args)[fmt]
    return str((ROOT / recipe_value(recipe, "output_dir" if sft else "model_name_or_path")).resolve())


def ensure_cold_starts(args: argparse.Namespace, formats: set[str]) -> None:
    """Train a format's cold-start model with its `--cold-start` SFT recipe when it is missing."""
    for fmt in formats:
        model = Path(cold_start_model(args, fmt))
        sft = COLD_STARTS[args.cold_start].get(fmt)
        if sft and not (model / "config.json").exists():
            print(f"cold start: arpo-trl sft --config {sft}", file=sys.stderr)
            run("-m", "arpo_trl.cli", "sft", "--config", sft, log=model.parent / f"{model.name}.log")


def run_label(method: str, stack: str) -> str:
    return method if stack == "default" else f"{method}@{stack}"


def stack_flags(method: str, stack: str) -> list[str]:
    packing, cached = STACKS[stack]
    flags = [] if packing is None or METHODS[method][1] == "trl" else ["--tree_packing", str(packing).lower()]
    if cached is None:
        return flags
    if METHODS[method][1] == "trl":  # TRL's own knob, with TRL's meaning: transformers' continuous batching engine
        return flags + ["--use_transformers_continuous_batching", str(cached).lower()]
    return flags + ["--in_process_engine", "cached" if cached else "waves"]


def train(args: argparse.Namespace, method: str, setting: tuple[int, int], seed: int, stack: str = "default",
          forecast: Forecast | None = None) -> Path:
    run_dir = Path(args.out) / _label(setting) / f"seed{seed}" / run_label(method, stack)
    if args.reuse and _trained(run_dir, args.steps):
        return run_dir
    watch = forecast.watch(run_dir, method, setting) if forecast else None
    (fmt, policy), (m, n) = METHODS[method], setting
    common = ["--config", recipes(args)[fmt], "--model_name_or_path", cold_start_model(args, fmt), "--seed", str(seed),
              "--num_generations", str(m), "--max_steps", str(args.steps), "--output_dir", str(run_dir),
              "--per_device_train_batch_size", str(args.prompts_per_step * m), *stack_flags(method, stack)]
    if policy == "trl":
        resources = run(str(ROOT / "benchmarks/trl_peer.py"), *common, log=run_dir / "train.log", watch=watch)
    else:
        resources = run("-m", "arpo_trl.cli", "train", *common, "--branch_policy", policy, "--initial_rollouts",
                        str(m if policy == "none" else n), *(AEPO_UPDATE if policy == "aepo" else []),
                        *ABLATIONS.get(method, []), log=run_dir / "train.log", watch=watch)
    (run_dir / RESOURCES).write_text(json.dumps(resources | {"commit": git_commit()}))  # the code that trained it
    if watch:
        watch(finished=True)
    return run_dir


RESOURCES = "resources.json"  # a run's wall seconds and peak resident memory, from the benchmark's side


def _trained(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and (run_dir / "adapter_config.json").is_file() and (run_dir / RESOURCES).is_file() \
        and sum("step_time" in json.loads(line) for line in metrics.read_text().splitlines()) == steps


def evaluate_run(args: argparse.Namespace, run: dict, cold_start: dict[str, dict]) -> None:
    """Evaluate a main-row run's adapter on the held-out questions, and its format's cold-start model first when this
    benchmark has not yet; sets `run["eval"]` and `cold_start[format]`."""
    fmt = format_of(run["method"])
    recipe, model, base = recipes(args)[fmt], cold_start_model(args, fmt), cold_start_eval_dir(args, fmt)
    todo = [(None, base)] * (fmt not in cold_start) + [(Path(run["dir"]), Path(run["dir"]) / "eval")]
    for adapter, out in todo:
        if not (args.reuse and evaluated(args, out)):
            print(f"eval: {adapter or 'cold start ' + fmt}", file=sys.stderr, flush=True)
            evaluate(args, recipe, fmt, model, adapter, out)
    cold_start[fmt] = read_eval(base)
    run["eval"] = read_eval(Path(run["dir"]) / "eval")


def cold_start_eval_dir(args: argparse.Namespace, fmt: str) -> Path:
    return Path(args.out) / f"cold_start_{args.cold_start}_{fmt}"


def evaluated(args: argparse.Namespace, out: Path) -> bool:
    """Whether `out` holds a finished evaluation of this run's sizes (--eval-questions × --eval-samples)."""
    path = out / "eval_results.json"
    if not path.is_file():
        return False
    records = json.loads(path.read_text())["records"]
    return len(records) == args.eval_questions and all(len(r["completions"]) == args.eval_samples for r in records)


def evaluate(args: argparse.Namespace, recipe: str, fmt: str, model: str, adapter: Path | None, out: Path) -> None:
    """One held-out evaluation, in a subprocess. Through vLLM, a run's LoRA adapter is merged into its model first and
    served as plain weights: vLLM-CPU generates several times faster that way than with LoRA."""
    from arpo_trl.server.launcher import VLLMServer

    flags = ["--adapter", str(adapter)] if adapter else []
    with ExitStack() as stack:
        if args.eval_backend == "vllm_server":
            if adapter:
                merged = out / "merged_model"
                stack.callback(shutil.rmtree, merged, True)  # after the server has stopped (callbacks run last first)
                model, flags = str(merge_adapter(model, adapter, merged)), []
            server = stack.enter_context(VLLMServer(model, max_model_len=2048))
            flags += ["--backend", "vllm_server", "--vllm_server_base_url", server.base_url]
        run("-m", "arpo_trl.cli", "eval", "--config", args.eval_recipe, "--model_name_or_path", model, *flags,
            "--tool_call_format", fmt,
            *(["--system_prompt", prompt] if (prompt := recipe_value(recipe, "system_prompt")) else []),
            "--max_completion_length", str(recipe_value(recipe, "max_completion_length")),
            "--num_samples", str(args.eval_questions), "--n_samples", str(args.eval_samples),
            "--output_dir", str(out), log=out / "eval.log")


def merge_adapter(model: str, adapter: Path, out: Path) -> Path:
    """`model` with the LoRA `adapter` merged in, saved with the adapter's tokenizer (and chat template) to `out`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(out)
    return out


def read_run(run_dir: Path, method: str, setting: tuple[int, int], seed: int, stack: str = "default") -> dict:
    """One run's per-step metrics and their means; `method` is the run's label (`arpo`, or `arpo@packed`)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{ours: row[key] for key, ours in PER_STEP.items() if key in row} for row in rows if "step_time" in row]
    resources = json.loads((run_dir / RESOURCES).read_text())
    trees = read_trees(run_dir)
    for step, distinct in zip(steps, distinct_completions(trees)):
        step["distinct_completions_per_group"] = distinct
    return {"method": run_label(method, stack), "setting": _label(setting), "seed": seed, "dir": str(run_dir),
            "commit": resources.get("commit"),
            "steps": steps, "mean": {key: statistics.fmean(s[key] for s in steps) for key in steps[0]}
            | {key: resources[key] for key in RUN_LEVEL},
            "decisions": decisions_by_third(trees, len(steps))}  # recorded: a results file can be reported again


def read_trees(run_dir: Path) -> list[dict]:
    """A run's tree records (trees.jsonl, one per path); none for TRL's peer, which writes no trees."""
    from arpo_trl.trees import read_jsonl

    return read_jsonl(run_dir / "trees.jsonl") if (run_dir / "trees.jsonl").is_file() else []


def distinct_completions(trees: list[dict]) -> list[float]:
    """Per step, the mean over groups of how many of a group's M completions differ. A peaked policy samples
    duplicates, which tree packing also computes once."""
    groups: dict[tuple[int, int], set[str]] = {}
    for record in trees:
        groups.setdefault((record["step"], record["group"]), set()).add(json.dumps(record["segments"]))
    steps = sorted({step for step, _ in groups})
    return [statistics.fmean(len(v) for (s, _), v in groups.items() if s == step) for step in steps]


THIRDS = ("first", "middle", "last")


def decisions_by_third(trees: list[dict], steps: int) -> dict[str, list[tuple[float, float]]]:
    """The (probability, draw) of every fork decision in a run's trees (`decisions`, one list per path), grouped by
    the third of training its step falls in. Empty for GRPO and for trees written before decisions were recorded."""
    thirds: dict[str, list[tuple[float, float]]] = {third: [] for third in THIRDS}
    for record in trees:
        third = THIRDS[min(2, 3 * record["step"] // max(steps, 1))]
        thirds[third] += [(d["probability"], d["draw"]) for d in record.get("decisions", [])]
    return thirds


def decision_statistics(pairs: list[tuple[float, float]], tau: float) -> dict:
    """How much the entropy moved a set of fork decisions: the quantiles of the probability P = clip(τ + β·ΔH, 0, 1)
    each drew with, the mean |P - τ|, and the share of decisions whose outcome (u < P) differs from the one forking at
    random with p = τ would have given with the same u."""
    import numpy as np

    p, u = np.array(pairs, dtype=float).T
    return {"decisions": len(pairs),
            "quantiles": dict(zip(("p05", "p25", "p50", "p75", "p95"),
                                  np.quantile(p, [0.05, 0.25, 0.5, 0.75, 0.95]).round(4).tolist())),
            "mean_abs_shift": round(float(np.abs(p - tau).mean()), 4),
            "changed_share": round(float(((u < p) != (u < tau)).mean()), 4)}


def method_tau(args: argparse.Namespace, method: str) -> float:
    """The branch threshold τ a method's runs use: an ablation's flag, else the recipe's."""
    flags = ABLATIONS.get(method, [])
    if "--branch_threshold" in flags:
        return float(flags[flags.index("--branch_threshold") + 1])
    return float(recipe_value(recipes(args)[format_of(method)], "branch_threshold"))


def fork_probability_report(args: argparse.Namespace, runs: list[dict]) -> dict:
    """Per setting and branching method: `decision_statistics` per third of training, pooled over its seeds' runs
    and per seed (each run's `decisions`). Methods whose runs recorded no decision are left out."""
    report: dict = {}
    for run in runs:
        method = run["method"].partition("@")[0]
        if METHODS[method][1] in ("none", "trl"):
            continue
        thirds = run.get("decisions", {})
        if not any(thirds.values()):
            continue
        tau = method_tau(args, method)
        entry = report.setdefault(run["setting"], {}).setdefault(
            run["method"], {"tau": tau, "pooled": {third: [] for third in THIRDS}, "per_seed": {}})
        entry["per_seed"][str(run["seed"])] = {t: decision_statistics(pairs, tau)
                                               for t, pairs in thirds.items() if pairs}
        for third, pairs in thirds.items():
            entry["pooled"][third] += pairs
    for methods in report.values():
        for entry in methods.values():
            entry["pooled"] = {t: decision_statistics(pairs, entry["tau"]) for t, pairs in entry["pooled"].items()
                               if pairs}
    return report


def read_eval(path: Path) -> dict:
    results = json.loads((path / "eval_results.json").read_text())
    per_question = [record["num_correct"] / len(record["completions"]) for record in results["records"]]
    calls = [c["tool_calls"] for record in results["records"] for c in record["completions"]]
    return {"pass@1": statistics.fmean(per_question), "per_question": per_question,
            "calls_per_trajectory": statistics.fmean(calls),
            "format_valid_rate": results["summary"]["format_valid_rate"]["mean"]}  # answers the reward can score


def compare(runs: list[dict], mine: str, base: str, setting: str, resamples: int) -> dict:
    """`mine` against `base` at one setting, per seed and across seeds (`seed_interval`): cost ratios and quality
    differences. Methods of different call formats start from different cold starts: their held-out gains over them
    are compared too."""
    from arpo_trl.rewards.eval_metrics import seed_interval

    def units(method: str, key: str) -> dict[int, list[float]]:
        chosen = [r for r in runs if r["method"] == method and r["setting"] == setting]
        if key == "heldout_pass@1":
            return {r["seed"]: r["eval"]["per_question"] for r in chosen if "eval" in r}
        if key == "heldout_gain@1":  # pass@1 minus its cold start's, question by question
            return {r["seed"]: [a - b for a, b in zip(r["eval"]["per_question"], cold)] for r in chosen
                    if (cold := cold_start_of(r))}
        if key in RUN_LEVEL:
            return {r["seed"]: [r["mean"][key]] for r in chosen if key in r["mean"]}  # older runs lack some
        return {r["seed"]: [s[key] for s in r["steps"] if key in s] for r in chosen}

    result = {}
    formats = {format_of(mine), format_of(base)}
    gains = ("heldout_gain@1",) if len(formats) > 1 else ()
    for key, statistic in [(k, "ratio") for k in RATIOS] + [(k, "difference") for k in DIFFERENCES + gains]:
        a, b = units(mine, key), units(base, key)
        if statistic == "ratio" and not any(v for values in b.values() for v in values):
            continue  # the baseline never did it (e.g. made no tool call): no ratio
        if any(a.values()) and any(b.values()) and set(a) & set(b):
            result[key] = seed_interval(a, b, statistic, resamples=resamples)
    return result


def against_cold_start(runs: list[dict], method: str, setting: str, resamples: int) -> dict:
    """Held-out pass@1 of `method`'s runs minus their cold start's, per seed and across seeds ({} without both)."""
    from arpo_trl.rewards.eval_metrics import seed_interval

    chosen = {r["seed"]: (r["eval"]["per_question"], cold) for r in runs
              if r["method"] == method and r["setting"] == setting and (cold := cold_start_of(r))}
    if not chosen:
        return {}
    return {"heldout_pass@1": seed_interval({seed: after for seed, (after, _) in chosen.items()},
                                            {seed: before for seed, (_, before) in chosen.items()}, "difference",
                                            resamples=resamples)}


def attach_cold_starts(runs: list[dict], cold_start: dict[str, dict]) -> None:
    """Give each evaluated run lacking one the per-question pass@1 of its format's cold start in `cold_start` (the
    one evaluated beside it). A run's gain is measured against the cold start of its own machine and session: the
    SFT's weights and vLLM's samples differ across machines, so results files from two machines differ in theirs."""
    for run in runs:
        if "eval" in run and (cold := cold_start.get(format_of(run["method"]))):
            run["eval"].setdefault("cold_start_per_question", cold["per_question"])


def cold_start_of(run: dict) -> list[float]:
    """The per-question pass@1 of the cold start `run` is measured against ([] when not evaluated)."""
    return run.get("eval", {}).get("cold_start_per_question", [])


def pooled_cold_start(evaluations: list[dict]) -> dict:
    """One format's cold-start evaluations from several results files as one (the "before RL" row): the mean of
    each, the mean per question, and each file's pass@1."""
    if len(evaluations) == 1:
        return evaluations[0]
    pooled = {key: statistics.fmean(e[key] for e in evaluations)
              for key in ("pass@1", "calls_per_trajectory", "format_valid_rate")}
    return pooled | {"per_question": [statistics.fmean(q) for q in zip(*(e["per_question"] for e in evaluations))],
                     "evaluations": [e["pass@1"] for e in evaluations]}


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def summarize(runs: list[dict]) -> dict:
    """Per setting and method: the mean over seeds of each run's per-step means and held-out results."""
    summary = {}
    for setting in dict.fromkeys(r["setting"] for r in runs):
        for method in dict.fromkeys(r["method"] for r in runs if r["setting"] == setting):
            mine = [r for r in runs if r["setting"] == setting and r["method"] == method]
            values = {key: statistics.fmean(r["mean"][key] for r in mine) for key in mine[0]["mean"]}
            evaluated = [r["eval"] for r in mine if "eval" in r]
            if evaluated:
                values["heldout_pass@1"] = statistics.fmean(e["pass@1"] for e in evaluated)
                values["heldout_calls_per_trajectory"] = statistics.fmean(e["calls_per_trajectory"] for e in evaluated)
                values["heldout_seeds"] = len(evaluated)
            summary.setdefault(setting, {})[method] = values | {"seeds": len(mine)}
    return summary


def plot(runs: list[dict], out: Path, cold_start: dict | None = None) -> list[str]:
    """Per setting: the training reward, calls per trajectory and executed tool calls per group over training (mean
    of seeds, faint, and its trailing mean over `SMOOTHING` steps), and held-out pass@1 before and after RL where the
    runs were evaluated (mean of seeds; each seed a dot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        keys = (("reward", "training reward"), ("calls_per_trajectory", "tool calls per trajectory"),
                ("tool_calls_per_group", "tool calls executed per group"))
        evaluated = [r for r in runs if r["setting"] == setting and "eval" in r]
        fig, axes = plt.subplots(1, len(keys) + bool(evaluated), figsize=(5 * (len(keys) + bool(evaluated)), 3.6))
        colors = dict(zip(dict.fromkeys(r["method"] for r in runs if r["setting"] == setting), plt.cm.tab10.colors))
        for ax, (key, label) in zip(axes, keys):
            for method, color in colors.items():
                mine = [r["steps"] for r in runs if r["setting"] == setting and r["method"] == method]
                length = min(len(steps) for steps in mine)
                curve = [statistics.fmean(steps[i].get(key, float("nan")) for steps in mine) for i in range(length)]
                steps = range(1, length + 1)
                ax.plot(steps, curve, color=color, alpha=0.3, linewidth=0.8)
                ax.plot(steps, trailing_mean(curve, SMOOTHING), color=color, label=f"{method} ({len(mine)} seeds)")
            ax.set(xlabel="optimizer step", ylabel=label, title=f"{setting}: {label}")
            ax.legend(fontsize=7)
        if evaluated:
            heldout_panel(axes[-1], evaluated, cold_start or {}, setting, colors)
        fig.tight_layout()
        path = out / f"curves_{setting}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


SMOOTHING = 10  # steps in the curves' trailing mean (one prompt a step is a noisy reward)


def trailing_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def heldout_panel(ax, evaluated: list[dict], cold_start: dict, setting: str, colors: dict) -> None:
    """Held-out pass@1: each format's cold start, then each method after RL (bar: mean of seeds; dots: seeds)."""
    bars = [(f"cold start\n({fmt})", [e["pass@1"]]) for fmt, e in cold_start.items()]
    for method in dict.fromkeys(r["method"] for r in evaluated):
        bars.append((method, [r["eval"]["pass@1"] for r in evaluated if r["method"] == method]))
    for x, (label, values) in enumerate(bars):
        ax.bar(x, statistics.fmean(values), color=colors.get(label, "lightgray"))
        ax.plot([x] * len(values), values, "k.", markersize=5)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7, rotation=35, ha="right")
    ax.set(ylabel="held-out pass@1", title=f"{setting}: held-out pass@1, before and after RL", ylim=(0, 1))


def markdown(report: dict) -> str:
    from arpo_trl.markdown import markdown_table

    columns = ["calls_per_trajectory", "tool_calls_per_group", "tokens_generated_per_group", "forks_per_group",
               "rollout_seconds", "training_seconds", "step_seconds", "tokens_forwarded_per_group",
               "prefill_tokens_per_group", "peak_rss_mb", "distinct_completions_per_group", "reward", "heldout_pass@1",
               "heldout_calls_per_trajectory", "heldout_seeds"]
    measured = [c for c in columns if any(c in v for methods in report["summary"].values() for v in methods.values())]
    columns = [c for c in columns if c in measured or c.startswith("heldout") and report.get("cold_start")]
    rows = [[setting, method, *(_fmt(values.get(c)) for c in columns)]
            for setting, methods in report["summary"].items() for method, values in methods.items()]
    cold = {"heldout_pass@1": "pass@1", "heldout_calls_per_trajectory": "calls_per_trajectory"}
    rows += [["before RL", f"cold start ({fmt})" + (f", mean of {len(e['evaluations'])} machines' evaluations"
                                                    if "evaluations" in e else ""),
              *(_fmt(e[cold[c]]) if c in cold else "-" for c in columns)]
             for fmt, e in report.get("cold_start", {}).items()]
    lines = ["Means over seeds:", "", markdown_table(["setting", "method", *columns], rows), "",
             "Per seed, the ratio or difference of the two runs' means; the mean over seeds with a 95 % Student t "
             "interval over them (`n seeds`); * = the interval excludes 1 (ratio) or 0 (difference). A comparison "
             "of one seed shows its bootstrap over steps or questions: question noise only, never starred:", ""]
    keys = [k for k in RATIOS + DIFFERENCES + ("heldout_gain@1",)
            if any(k in values for values in report["comparisons"].values())]
    table = [[name, *(_interval(values.get(k)) for k in keys)] for name, values in report["comparisons"].items()]
    lines += [markdown_table(["comparison", *[f"{k} ({'ratio' if k in RATIOS else 'diff'})" for k in keys]], table)]
    return "\n".join(lines + fork_probability_markdown(report.get("fork_probabilities", {})))


def fork_probability_markdown(report: dict) -> list[str]:
    """The pooled `fork_probability_report` as a table: how far entropy moved P from τ, per third of training."""
    from arpo_trl.markdown import markdown_table

    rows = [[setting, method, third, stats["decisions"], *(_fmt(stats["quantiles"][q]) for q in ("p05", "p50", "p95")),
             _fmt(stats["mean_abs_shift"]), _fmt(stats["changed_share"])]
            for setting, methods in report.items() for method, entry in methods.items()
            for third, stats in entry["pooled"].items()]
    if not rows:
        return []
    return ["", "Fork probabilities P = clip(τ + β·ΔH, 0, 1), pooled over seeds, per third of training; *changed* = "
            "the share of decisions whose outcome (u < P) differs from forking at random with p = τ and the same u:",
            "", markdown_table(["setting", "method", "third", "decisions", "P p05", "P p50", "P p95", "mean |P − τ|",
                                "changed"], rows)]


def _interval(value: dict | None) -> str:
    if not value:
        return "-"
    null = 1.0 if value["statistic"] == "ratio" else 0.0
    defined = not (math.isnan(value["low"]) or math.isnan(value["high"]))  # NaN: no seed had a defined ratio
    if value["interval"] != "t":
        return f"{value['estimate']:.3g} [{value['low']:.3g}, {value['high']:.3g}] (1 seed, question noise only)"
    mark = "*" if defined and not value["low"] <= null <= value["high"] else ""
    return f"{value['estimate']:.3g} [{value['low']:.3g}, {value['high']:.3g}]{mark} ({value['seeds']} seeds)"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def row_methods(args: argparse.Namespace, index: int) -> list[str]:
    """The methods of the `index`-th setting: all of --methods in the main row, those also in --second-row-methods
    after it."""
    return args.methods if index == 0 else [m for m in args.methods if m in args.second_row_methods]


def planned(args: argparse.Namespace, index: int) -> list[tuple[int, str, str]]:
    """(seed, stack, method) of the `index`-th setting's runs: ours a seed's back to back (they share the machine's
    state), then TRL's peer (5x slower a step) at --peer-seeds."""
    ours = [(seed, stack, method) for seed, stack, method in itertools.product(
        args.seeds, args.stacks, row_methods(args, index)) if METHODS[method][1] != "trl"]
    peer = [(seed, stack, method) for seed, stack, method in itertools.product(
        args.peer_seeds, args.stacks, row_methods(args, index)) if METHODS[method][1] == "trl"]
    return ours + peer


def expected_seconds(args: argparse.Namespace) -> float:
    """The run's expected seconds on a quiet 2-core CPU (the constants above), counting only what --reuse keeps not."""
    seconds, evaluation = 0.0, args.eval_questions * args.eval_samples * EVAL_TRAJECTORY_SECONDS + EVAL_OVERHEAD_SECONDS
    for index, setting in enumerate(args.settings):
        for seed, stack, method in planned(args, index):
            run_dir = Path(args.out) / _label(setting) / f"seed{seed}" / run_label(method, stack)
            if not (args.reuse and _trained(run_dir, args.steps)):
                seconds += args.steps * expected_step_seconds(args, method, setting)
            if index == 0 and args.eval_questions and method in (args.eval_methods or args.methods) \
                    and not (args.reuse and evaluated(args, run_dir / "eval")):
                seconds += evaluation
    formats = {METHODS[m][0] for m in args.eval_methods or args.methods}
    if args.eval_questions:
        seconds += evaluation * sum(not (args.reuse and evaluated(args, cold_start_eval_dir(args, f))) for f in formats)
    return seconds


def expected_step_seconds(args: argparse.Namespace, method: str, setting: tuple[int, int]) -> float:
    """The seconds the forecast expects of one training step of `method` at `setting` (on `CALIBRATION`)."""
    step = PEER_STEP_SECONDS if METHODS[method][1] == "trl" else STEP_SECONDS
    return step * args.prompts_per_step * setting[0] / 16


def timed_steps(metrics: Path, since: float) -> list[float]:
    """The `step_time` of each step a run has logged so far in its metrics.jsonl, once the file has been written at or
    after `since` (the run's start: a rerun's trainer drops the rows of the run before it only once it has loaded). A
    last line is skipped while it is not yet JSON (being written); any other such line is an error."""
    if not metrics.is_file() or metrics.stat().st_mtime < since:
        return []
    lines = [line for line in metrics.read_text(encoding="utf-8").split("\n") if line.strip()]
    seconds = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise SystemExit(f"{metrics}, line {number}: not JSON ({error})") from error
        if isinstance(row, dict) and "step_time" in row:
            seconds.append(float(row["step_time"]))
    return seconds


class Forecast:
    """The time the benchmark has left: `expected_seconds` (on `CALIBRATION`) times this machine's rate, the seconds
    the steps timed so far took over the seconds it expects of them. Evaluations are assumed to be as much slower as
    training is."""

    def __init__(self, args: argparse.Namespace, say: Callable[[str], None] | None = None):
        self.args, self.measured, self.expected = args, 0.0, 0.0
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))

    @property
    def rate(self) -> float:
        return self.measured / self.expected if self.expected else 1.0

    def hours_left(self) -> float:
        return expected_seconds(self.args) * self.rate / 3600

    def watch(self, run_dir: Path, method: str, setting: tuple[int, int]) -> Callable[..., None]:
        """A `run` watch for one training run: it counts the run's first step as soon as it is logged and says the
        forecast rescaled; called with `finished=True` after the run, it counts the rest and says it again."""
        start, counted, expected = time.time(), 0, expected_step_seconds(self.args, method, setting)

        def watch(finished: bool = False) -> None:
            nonlocal counted
            steps = timed_steps(run_dir / "metrics.jsonl", start)
            if not (new := steps[counted:] if finished else steps[counted:1]):
                return
            self.measured, self.expected, counted = (self.measured + sum(new), self.expected + len(new) * expected,
                                                     counted + len(new))
            what = (f"{method} took {statistics.fmean(steps):.0f} s a step over its {len(steps)}" if finished
                    else f"{method}'s first step took {steps[0]:.0f} s")
            self.say(f"arpo_vs_grpo: {what}; this machine runs at {self.rate:.1f}x the forecast's time "
                     f"({CALIBRATION}): ~{self.hours_left():.1f} h left at that rate")

        return watch


def format_of(label: str) -> str:
    """The call format of a run label's method (`arpo@packed` -> 'tags')."""
    return METHODS[label.partition("@")[0]][0]


def comparisons(labels: set[str], stacks: list[str]) -> list[tuple[str, str]]:
    """(mine, base) run labels to compare: PAIRS within each stack; each method against itself on every stack listed
    before; and PAIRS with `mine` on a later stack than `base` (e.g. ARPO packed against the GRPO a TRL user runs)."""
    pairs = [(run_label(a, s), run_label(b, s)) for s in stacks for a, b in PAIRS]
    for later, stack in enumerate(stacks):
        for earlier in stacks[:later]:
            pairs += [(run_label(m, stack), run_label(m, earlier)) for m in METHODS]
            pairs += [(run_label(a, stack), run_label(b, earlier)) for a, b in PAIRS]
    return [(a, b) for a, b in pairs if {a, b} <= labels]


def finished_runs(args: argparse.Namespace, report: dict) -> list[dict]:
    """The runs of the plan already complete in --out, with their evaluations where those are complete too."""
    runs = []
    for index, setting in enumerate(args.settings):
        for seed, stack, method in planned(args, index):
            run_dir = Path(args.out) / _label(setting) / f"seed{seed}" / run_label(method, stack)
            if _trained(run_dir, args.steps):
                runs.append(read_run(run_dir, method, setting, seed, stack))
                if (run_dir / "eval" / "eval_results.json").is_file():
                    runs[-1]["eval"] = read_eval(run_dir / "eval")
    bases = {fmt: cold_start_eval_dir(args, fmt) for fmt in recipes(args)}
    report["cold_start"] = {fmt: read_eval(p) for fmt, p in bases.items() if (p / "eval_results.json").is_file()}
    if not runs:
        raise SystemExit(f"--report-only: no complete run in {args.out}.")
    return runs


def recorded_runs(args: argparse.Namespace, report: dict) -> list[dict]:
    """The runs of the plan, evaluations and cold starts that the results files `--runs-from` recorded."""
    wanted = {(_label(setting), seed, run_label(method, stack)) for index, setting in enumerate(args.settings)
              for seed, stack, method in planned(args, index)}
    runs, source, experiment, evaluations, report["runs_from"] = [], {}, None, {}, []
    for path in args.runs_from:
        recorded = json.loads(Path(path).read_text())
        config = {key: recorded.get("config", {}).get(key) for key in SAME_EXPERIMENT}
        if (experiment := experiment or config) != config:
            raise SystemExit(f"--runs-from: {path} ran {config}, the files before it {experiment}; report them "
                             "separately.")
        for run in recorded["runs"]:
            if (key := (run["setting"], run["seed"], run["method"])) not in wanted:
                continue
            if key in source:
                raise SystemExit(f"--runs-from: {key} is recorded in both {source[key]} and {path}.")
            source[key] = path
            attach_cold_starts([run], recorded.get("cold_start", {}))
            runs.append(run)
        for fmt, cold in recorded.get("cold_start", {}).items():
            if cold not in evaluations.setdefault(fmt, []):
                evaluations[fmt].append(cold)
        report["runs_from"].append({"file": _shown(path), "commit": recorded.get("commit")}
                                   | {key: recorded[key] for key in ("load", "load_end", "machine") if key in recorded})
    report["cold_start"] = {fmt: pooled_cold_start(each) for fmt, each in evaluations.items()}
    if len(args.runs_from) == 1:  # the runs' machine
        report |= {key: report["runs_from"][0][key] for key in ("load", "load_end", "machine")
                   if key in report["runs_from"][0]}
    if not runs:
        raise SystemExit(f"--runs-from: {' '.join(args.runs_from)} record none of the planned runs.")
    return runs


def _shown(path: str) -> str:
    """`path` relative to the repository where it lies inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forecast = Forecast(args)
    if not args.report_only:  # --report-only trains nothing, as its help says
        print(f"arpo_vs_grpo: expected ~{expected_seconds(args) / 3600:.1f} h left to do on {CALIBRATION} (another "
              "CPU may take several times that: the forecast is rescaled once a run has timed its first step)",
              file=sys.stderr, flush=True)
        ensure_cold_starts(args, {METHODS[m][0] for m in args.methods})
    report = {"config": vars(args) | {"settings": [_label(s) for s in args.settings]}, "commit": git_commit(),
              "load": os.getloadavg()}
    runs = recorded_runs(args, report) if args.runs_from else finished_runs(args, report) if args.report_only else []
    for index, setting in enumerate([] if args.report_only else args.settings):
        for seed, stack, method in planned(args, index):
            print(f"{_label(setting)} seed {seed}: {run_label(method, stack)}", file=sys.stderr)
            run_dir = train(args, method, setting, seed, stack, forecast)
            runs.append(read_run(run_dir, method, setting, seed, stack))
            if index == 0 and args.eval_questions and method in (args.eval_methods or args.methods):
                evaluate_run(args, runs[-1], report.setdefault("cold_start", {}))  # the main row only
    attach_cold_starts(runs, report.get("cold_start", {}))
    report |= {"runs": runs, "summary": summarize(runs)}
    report["comparisons"] = {f"{setting} {mine} vs {base}": compare(runs, mine, base, setting, args.bootstrap)
                             for setting in report["summary"]
                             for mine, base in comparisons(set(report["summary"][setting]), args.stacks)}
    report["comparisons"] |= {f"{setting} {method} vs cold start": gain
                              for setting in report["summary"] for method in report["summary"][setting]
                              if (gain := against_cold_start(runs, method, setting, args.bootstrap))}
    report["fork_probabilities"] = fork_probability_report(args, runs)
    if args.runs_from and len(args.runs_from) == 1 and not report["fork_probabilities"]:  # runs recorded before
        report["fork_probabilities"] = json.loads(Path(args.runs_from[0]).read_text()).get("fork_probabilities", {})
    report["plots"] = plot(runs, out, report.get("cold_start"))
    report.setdefault("load_end", os.getloadavg())
    (out / "results.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "results.md").write_text(table + "\n")
    if args.results:
        Path(args.results).mkdir(parents=True, exist_ok=True)
        for path in [out / "results.json", out / "results.md", *map(Path, report["plots"])]:
            shutil.copy(path, Path(args.results) / path.name)
    print(json.dumps({k: report[k] for k in ("summary", "comparisons", "plots")}, indent=1))
    print(table)
    return report


if __name__ == "__main__":
    main()
