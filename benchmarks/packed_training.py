"""Tree-packed training against unpacked rows: what the training phase of one ARPO or GRPO step costs.

    python benchmarks/packed_training.py                                  # M16N8 and M4N2, 3 seeds × 3 steps
    python benchmarks/packed_training.py --settings 4:2 --seeds 0 --steps 2   # a quick look
    python benchmarks/packed_training.py --device cuda --settings 16:8 --seeds 0 1   # on a GPU, bf16 autocast
    python benchmarks/packed_training.py --micro-batches shuffled   # TRL's shuffled micro-batches, not regrouped

Each run is a fresh process doing TRL's training phase on SmolLM2-135M's architecture (random weights: the cost of
a forward does not depend on them) with the multi-call recipe's LoRA (r 16 on q/k/v/o) and loss (dapo, beta 0,
num_iterations 1: the policy pass and its backward), fp32 on CPU or, with `--device cuda`, bf16 autocast on the GPU:
`ARPOTrainer.compute_loss` and `backward` on each step's micro-batch, packed (`tree_packing=True`) or not. The
micro-batches are rollout trees built by construction with the shapes the multi-call benchmark's rollouts have
(benchmarks/arpo_vs_grpo.py, recipes/arpo_vs_grpo.yaml and recipes/quickstart.yaml): per prompt, `arpo` has N global
paths and M-N branches forked after a tool result (at 30 % or 60 % of a path, so about 0.75 of GRPO's unique tokens),
`grpo` M global paths sharing only the prompt; a path is 60-100 % of max_completion_length long. Every configuration
sees the same trees for a (setting, seed, step). `--micro-batches grouped` (the default) trains one micro-batch of
whole groups, as `ARPOTrainer` regroups them where that changes no gradient (the default dapo loss); `shuffled`
trains one of `--steps-per-generation` micro-batches of TRL's row-shuffled generation batch, which is what packing
gets where regrouping would change the gradient (bnpo, an entropy bonus, `top_entropy_quantile`, ...).
`predicted_cost_ratio` is the packed layout's FLOP estimate over the unpacked one's
(`packing.ForwardCost`; below 1 the trainer packs); `--force-packing` packs every chunk whatever that
estimate says, to measure what the fallback avoids.

Per step: tokens forwarded per group (padding included), training-phase seconds (wall clock, the GPU synchronised
before the clock is read; and the process's CPU seconds, which other jobs on a shared machine disturb less), and the
peak memory the training phase adds (on CPU the process's ru_maxrss after the steps minus before them; on a GPU the
peak allocated GPU memory above what was allocated before them). Ratios are made per seed (of the per-step means) and
get the 95 % Student t interval over the seeds of `arpo_trl.rewards.eval_metrics.seed_interval`, as
benchmarks/arpo_vs_grpo.py (one seed: a bootstrap over its steps, the steps' noise only). `--runs-from RESULTS`
reports the runs a results file recorded again, measuring nothing.
Step seconds (rollout included) come from the multi-call benchmark's runs with `--tree_packing true/false`; this
script measures the phase packing changes. Writes `<out>/results.json` and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.arpo_vs_grpo import _interval, _label, _setting  # noqa: E402

SETTINGS = {(16, 8): {"prompts": 1, "max_completion_length": 160}, (4, 2): {"prompts": 2, "max_completion_length": 80}}
PROMPT_TOKENS = 110  # the multi-call recipe's system prompt and question, chat template applied
METRICS = ("tokens_forwarded_per_group", "training_seconds", "training_cpu_seconds", "peak_memory_mb",
           "predicted_cost_ratio")
PAIRS = (("arpo_packed", "arpo_unpacked"), ("grpo_packed", "grpo_unpacked"), ("arpo_packed", "grpo_unpacked"),
         ("arpo_packed", "grpo_packed"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", type=_setting, default=[(16, 8), (4, 2)], help="M:N pairs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up step)")
    parser.add_argument("--max-length", type=int, default=None, help="tree_packing_max_length (default: ARPOConfig's)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: bf16 autocast on the GPU, seconds between synchronisations, peak GPU memory")
    parser.add_argument("--attention", choices=["sdpa", "eager", "flex_attention"], default="sdpa")
    parser.add_argument("--micro-batches", choices=["grouped", "shuffled"], default="grouped",
                        help="whole groups (regrouped) or one of TRL's shuffled micro-batches")
    parser.add_argument("--steps-per-generation", type=int, default=4, help="with --micro-batches shuffled")
    parser.add_argument("--force-packing", action="store_true", help="pack every chunk (no cost fallback)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama instead (checks the script only)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (one-seed comparisons)")
    parser.add_argument("--runs-from", default=None, help="report the runs recorded in this results.json again")
    parser.add_argument("--out", default="runs/packed_training")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def tree_paths(rng: random.Random, m: int, n: int, method: str, width: int) -> list[tuple]:
    """One prompt's paths (parent, fork position, own tokens), as tests/packed_batches.py takes them."""
    lengths = [rng.randint(int(0.6 * width), width) for _ in range(m)]
    if method == "grpo":
        return [(None, 0, length) for length in lengths]
    paths = [(None, 0, length) for length in lengths[:n]]
    for length in lengths[n:]:
        parent = rng.randrange(len(paths))
        parent_length = (paths[parent][1] if paths[parent][0] is not None else 0) + paths[parent][2]
        fork = max(6, int(parent_length * rng.choice((0.3, 0.6))))
        paths.append((parent, fork, max(1, min(length, width) - fork)))
    return paths


def zero_reward(completions, **kwargs) -> list[float]:
    """The training phase's cost does not depend on the rewards."""
    return [0.0] * len(completions)


def make_trainer(spec: dict):
    """The trainer a run measures: SmolLM2-135M's architecture (or the tiny Llama), LoRA, the spec's device,
    attention and packing."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from tiny import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from arpo_trl import ARPOConfig, ARPOTrainer

    torch.manual_seed(0)
    torch.set_num_threads(spec["threads"])
    m, n = spec["setting"]
    shape = SETTINGS[(m, n)]
    dims = (dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32) if spec["tiny"] else
            dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64))  # SmolLM2-135M's
    config = LlamaConfig(num_hidden_layers=spec["layers"], max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, attn_implementation=spec["attention"], **dims)
    cuda = spec["device"] == "cuda"
    extra = {} if spec["max_length"] is None else {"tree_packing_max_length": spec["max_length"]}
    args = ARPOConfig(output_dir=spec["out"], per_device_train_batch_size=shape["prompts"] * m, num_generations=m,
                      initial_rollouts=n, max_completion_length=shape["max_completion_length"], loss_type="dapo",
                      beta=0.0, use_cpu=not cuda, bf16=cuda, report_to="none", save_strategy="no", log_trees=False,
                      tree_packing=spec["packed"], **extra)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = ARPOTrainer(model=LlamaForCausalLM(config), reward_funcs=zero_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 4), processing_class=build_tokenizer(),
                          peft_config=lora)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def step_batch(spec: dict, step: int, trainer) -> dict:
    """The (setting, seed, step)'s micro-batch of `spec["method"]`'s trees, on the trainer's device: every
    configuration sees the same trees. Shuffled: the first of TRL's `steps_per_generation` micro-batches of a
    row-shuffled generation batch holding that many times the groups."""
    from packed_batches import micro_batch

    m, n = spec["setting"]
    shape = SETTINGS[(m, n)]
    rng = random.Random(f"{spec['seed']}/{step}/{m}")
    splits = spec["steps_per_generation"] if spec["micro_batches"] == "shuffled" else 1
    groups = shape["prompts"] * splits
    trees = [tree_paths(rng, m, n, spec["method"], shape["max_completion_length"]) for _ in range(groups)]
    batch = micro_batch(trees, trainer.model.config.vocab_size, 0, seed=rng.randrange(1 << 30),
                        prompt_lengths=[PROMPT_TOKENS + 3 * (i % shape["prompts"]) for i in range(groups)])
    if splits > 1:
        rows = random.Random(f"{spec['seed']}/{step}/shuffle").sample(range(groups * m), shape["prompts"] * m)
        batch = {key: value[rows] if value.ndim else value for key, value in batch.items()}
    return {key: value.to(trainer.accelerator.device) for key, value in batch.items()}


def predicted_cost_ratio(trainer, batch: dict) -> float:
    """The packed layout's FLOP estimate over TRL's rows', as `TreePackedTraining` weighs them for this batch."""
    import torch

    from arpo_trl.training.compatibility import base_model
    from arpo_trl.training.packed_logps import real_rows
    from arpo_trl.training.packing import ForwardCost, pack_rows

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).cpu()
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).cpu()
    rows, prompt_lengths = real_rows(ids, mask, batch["prompt_ids"].size(1))
    width = batch["completion_ids"].size(1)
    packed = pack_rows(rows, prompt_lengths, width, trainer.args.tree_packing_max_length)
    config = trainer._packing_config(trainer.model)
    cost = ForwardCost.of(base_model(trainer.model), config, config._attn_implementation)
    return cost.packed(packed) / cost.unpacked(len(rows), ids.size(1))


def worker(spec: dict) -> dict:
    """One configuration in this process: its per-step metrics."""
    import torch

    trainer, cuda = make_trainer(spec), spec["device"] == "cuda"
    if spec["force_packing"]:
        from arpo_trl.training.packing import ForwardCost

        ForwardCost.packed = lambda self, packed: 0.0
    baseline, steps = None, []
    for step in range(spec["steps"] + 1):  # step 0 warms up
        batch = step_batch(spec, step, trainer)
        if baseline is None:
            baseline = _memory_now(cuda)
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        trainer.model.zero_grad(set_to_none=True)
        tokens = trainer._metrics["train"]["arpo/tokens_forwarded_per_group"][-1]
        if step:
            steps.append({"tokens_forwarded_per_group": tokens, "training_seconds": seconds,
                          "training_cpu_seconds": cpu_seconds,
                          "predicted_cost_ratio": predicted_cost_ratio(trainer, batch)})
    peak = _peak_memory(cuda) - baseline
    for record in steps:
        record["peak_memory_mb"] = peak
    return {"steps": steps}


def _memory_now(cuda: bool) -> float:
    """MiB: the process's peak resident memory so far, or on the GPU the memory allocated now (its peak reset)."""
    import torch

    if not cuda:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def _peak_memory(cuda: bool) -> float:
    import torch

    if not cuda:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return torch.cuda.max_memory_allocated() / 2**20


def run_config(args, setting, seed: int, method: str, packed: bool) -> dict:
    spec = {"setting": list(setting), "seed": seed, "method": method, "packed": packed, "steps": args.steps,
            "max_length": args.max_length, "layers": args.layers, "tiny": args.tiny, "threads": 2, "out": args.out,
            "device": args.device, "attention": args.attention, "micro_batches": args.micro_batches,
            "steps_per_generation": args.steps_per_generation, "force_packing": args.force_packing}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"worker {spec} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    name = f"{method}_{'packed' if packed else 'unpacked'}"
    return {"setting": _label(tuple(setting)), "seed": seed, "config": name, "steps": result["steps"]}


def compare(runs: list[dict], mine: str, base: str, setting: str, resamples: int) -> dict:
    from arpo_trl.rewards.eval_metrics import seed_interval

    def units(config: str, key: str) -> dict[int, list[float]]:
        return {r["seed"]: [s[key] for s in r["steps"]] for r in runs if r["config"] == config
                and r["setting"] == setting}

    return {key: seed_interval(units(mine, key), units(base, key), "ratio", resamples=resamples) for key in METRICS}


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for r in runs:
        per_step = summary.setdefault(r["setting"], {}).setdefault(r["config"], {k: [] for k in METRICS})
        for key in METRICS:
            per_step[key] += [s[key] for s in r["steps"]]
    return {setting: {config: {k: statistics.fmean(v) for k, v in values.items()} for config, values in configs.items()}
            for setting, configs in summary.items()}


def markdown(report: dict) -> str:
    from arpo_trl.markdown import markdown_table

    rows = [[setting, config, *(f"{values[k]:.4g}" for k in METRICS)]
            for setting, configs in report["summary"].items() for config, values in configs.items()]
    table = [[name, *(_interval(values.get(k)) for k in METRICS)] for name, values in report["comparisons"].items()]
    device = f"{report['device']}, {report['attention']}, {report.get('micro_batches', 'grouped')} micro-batches"
    if report.get("force_packing"):
        device += ", packing forced"
    return "\n".join([f"Device: {device}. Load: {report['uptime']}", "", "Means over seeds and steps:", "",
                      markdown_table(["setting", "configuration", *METRICS], rows), "",
                      "Ratios per seed, their mean and 95 % Student t interval over the seeds; * = the interval "
                      "excludes 1:", "",
                      markdown_table(["comparison", *METRICS], table)])


def measure(args: argparse.Namespace) -> list[dict]:
    runs = []
    for setting in args.settings:
        for seed in args.seeds:
            for method in ("arpo", "grpo"):
                for packed in (True, False):  # back to back, so that each pair shares the machine's state
                    runs.append(run_config(args, setting, seed, method, packed))
                    print(json.dumps(runs[-1]), file=sys.stderr)
    return runs


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: shapes are defined for {[_label(s) for s in SETTINGS]}, got {unknown}")
    if args.runs_from:  # the measured runs and their settings as recorded; the comparisons made anew
        report = json.loads(Path(args.runs_from).read_text())
        runs, settings = report["runs"], report["settings"]
    else:
        runs, settings = measure(args), [_label(s) for s in args.settings]
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        report = {"settings": settings, "seeds": args.seeds, "steps": args.steps,
                  "layers": args.layers, "tiny": args.tiny, "device": args.device,
                  "attention": args.attention, "micro_batches": args.micro_batches,
                  "steps_per_generation": args.steps_per_generation, "force_packing": args.force_packing,
                  "uptime": uptime, "runs": runs}
    report["summary"] = summarize(runs)
    report["comparisons"] = {f"{mine} / {base} ({s})": compare(runs, mine, base, s, args.bootstrap)
                             for s in settings for mine, base in PAIRS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report) + "\n")
    print(json.dumps({k: report[k] for k in ("summary", "comparisons", "uptime")}, indent=1))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
