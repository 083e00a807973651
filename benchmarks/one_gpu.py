"""The one-GPU recipe for a few steps with each engine: step seconds, tokens/s, peak memory, prefix-cache hit rate.

    python benchmarks/one_gpu.py --dry-run                       # the commands and recipes, nothing run
    python benchmarks/one_gpu.py                                 # ARPO colocated and TRL's peer, 3 steps each
    python benchmarks/one_gpu.py --engines colocate in_process server trl_colocate --steps 5
    python benchmarks/one_gpu.py --model smollm2 --engines colocate --steps 1 --max-completion-length 64 \\
        --python $(python -m arpo_trl.server setup --colocate | tail -n 1) \\
        --set num_generations=2 initial_rollouts=1 per_device_train_batch_size=2 gradient_accumulation_steps=1 \\
        max_tool_calls=1 dataset_name=gsm8k100            # CPU smoke test (the colocate env has no reasoning-gym)

Needs, on the GPU machine: arpo-trl with vLLM in the range TRL 1.16 supports and the recipe's dataset
(`pip install -e ".[vllm,reasoning-gym]"`, vLLM 0.22 to 0.31, which brings its CUDA torch), and the recipe's
model in the Hugging Face cache (the runs set HF_HUB_OFFLINE=1 unless it is set: `huggingface-cli download
Qwen/Qwen2.5-3B-Instruct` first); nvidia-smi for the GPU's peak memory.
The default run (two engines, 3 steps, the model cached) is sized to end within 8 minutes on one H100/H200-class GPU;
it prints its expected time first.

Engines, each a subprocess of its own so the GPU's memory is clean between them:
* colocate: `arpo-trl train` with `vllm_mode: colocate` (the recipe);
* trl_colocate: TRL's own `GRPOTrainer(tools=[python])` with `vllm_mode="colocate"` (benchmarks/trl_peer.py), the
  peer: one synchronous `generate` per tool turn, all paths in lockstep;
* server (not by default): `arpo-trl vllm-serve --config` on the same GPU (`vllm_mode: server`, LoRA adapters loaded
  every step), then `arpo-trl train` against it;
* in_process (not by default): `arpo-trl train` with `use_vllm: false` (the transformers cached engine).
Both default engines run the recipe with chat-template tool calls (`tool_call_format: chat_template` and a system
prompt without tags, `CHAT_OVERRIDES`), the format TRL's tool loop parses, in the recipe's dtype (bfloat16), on a
shortened rollout (`RUN_OVERRIDES`: 4 prompts x M 8, 1024 new tokens) so that three steps fit.

Per engine: the set-up seconds before the first step (model load and vLLM's start, from the process's start to
`Trainer.train`), step seconds (TRL's `step_time`: rollout + training of one optimizer step; the first step, which
includes warm-up, apart), rollout and training seconds, model tokens generated per step and per second of step,
peak memory (the training process's `torch.cuda.max_memory_allocated`, and the GPU's `nvidia-smi` memory.used sampled
every second, which counts a server's memory too; on CPU the process's peak RSS), and the prefix-cache hit rate and
weight-sync seconds where the engine logs them (`arpo/prefix_cache_hit_rate`, `arpo/weight_sync_seconds`).
Read from each run's `metrics.jsonl`. Prints the expected time first, one JSON object and a table at the end;
writes benchmarks/results/one_gpu_<device>.json with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import runpy
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "qwen2.5-3b_lora_colocate.yaml"
ENGINES = ("colocate", "trl_colocate", "server", "in_process")
DEFAULT_ENGINES = ("colocate", "trl_colocate")
# The chat-template call format for every engine: TRL's loop parses the template's tool calls only, and the recipe's
# tag-format system prompt would ask for <python> tags it never runs (recipes/arpo_vs_grpo_chat.yaml's prompt).
CHAT_OVERRIDES = {"tool_call_format": "chat_template", "system_prompt": (
    "Solve the task. Use the python tool to run code. Think inside <think></think>, then give the final answer as "
    "<answer>\\boxed{...}</answer>.")}
# A shorter rollout than the recipe's 8 prompts x M 8 x 2048 tokens, so that two engines x 3 steps fit 8 minutes.
RUN_OVERRIDES = {"gradient_accumulation_steps": 4, "max_completion_length": 1024}
# Guesses for the expected-time line and the default per-run timeout, seconds: (set-up, one step). GPU: the 3B recipe
# at RUN_OVERRIDES (32 rows of up to 1024 tokens); CPU: a tiny smoke test.
GUESS = {"gpu": {"start": 90, "step": 45, "server_start": 120}, "cpu": {"start": 60, "step": 180, "server_start": 240}}


def device_name() -> str:
    """'h200' from nvidia-smi's 'NVIDIA H200', or 'cpu' when there is no GPU."""
    name = _nvidia_smi("name")
    if not name:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", name[0].lower().removeprefix("nvidia ")).strip("_")


def _nvidia_smi(field: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


class GpuMemorySampler:
    """Peak of nvidia-smi's memory.used (MiB) on GPU 0, sampled every `period` seconds while running."""

    def __init__(self, period: float = 1.0):
        self.period, self.peak_mib, self._stop = period, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = _nvidia_smi("memory.used")
            if used:
                self.peak_mib = max(self.peak_mib or 0, int(float(used[0])))
            self._stop.wait(self.period)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def engine_recipe(base: dict, engine: str, overrides: dict, port: int | None = None) -> dict:
    """The recipe `engine` runs: `base` + the engine's keys + `overrides` (common to every engine)."""
    recipe = dict(base)
    if engine == "server":
        recipe.update(vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_weight_sync="lora")
        recipe.pop("vllm_enable_sleep_mode", None)  # the server's own; the trainer holds no engine
        recipe.pop("vllm_tensor_parallel_size", None)
    elif engine == "in_process":
        recipe = {k: v for k, v in recipe.items() if not k.startswith("vllm_")}
        recipe["use_vllm"] = False
    else:  # colocate, trl_colocate: the recipe as written
        recipe.update(use_vllm=True, vllm_mode="colocate")
    recipe.update(overrides)
    return recipe


def common_overrides(args: argparse.Namespace, gpu: bool) -> dict:
    overrides = {"max_steps": args.steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                 **CHAT_OVERRIDES, **RUN_OVERRIDES}
    if args.model:
        overrides["model_name_or_path"] = args.model
    if args.max_completion_length:
        overrides["max_completion_length"] = args.max_completion_length
    if not gpu:
        overrides.update(use_cpu=True, bf16=False)
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    return overrides


def commands(engine: str, recipe_path: Path, peak_file: Path, python: str, vllm_python: str | None) -> dict:
    """The train command (through `--child`, which records the process's peak memory) and a server's, if any."""
    child = [python, str(Path(__file__).resolve()), "--child", str(peak_file)]
    if engine == "trl_colocate":
        train = [*child, str(ROOT / "benchmarks" / "trl_peer.py"), "--config", str(recipe_path)]
    else:
        train = [*child, "arpo_trl.cli", "train", "--config", str(recipe_path)]
    serve = None
    if engine == "server":
        serve = [python, "-m", "arpo_trl.cli", "vllm-serve", "--config", str(recipe_path)]
        serve += ["--python", vllm_python] if vllm_python else []
    return {"train": train, "serve": serve}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the vLLM server was not healthy after {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    """End `process` and its children (it leads a session of its own)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_engine(engine: str, folder: Path, cmds: dict, timeout: float, server_timeout: float, url: str | None) -> dict:
    """Run one engine's commands; the outcome, wall time and GPU peak (metrics are read afterwards)."""
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONPATH": str(ROOT)}
    server, outcome, start = None, "ok", time.monotonic()
    with GpuMemorySampler() as sampler, open(folder / "train.log", "w") as log:
        try:
            if cmds["serve"]:
                server_log = open(folder / "server.log", "w")  # noqa: SIM115 - closed with the server below
                server = subprocess.Popen(cmds["serve"], cwd=ROOT, env=env, stdout=server_log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
                wait_healthy(url, server, server_timeout)
            train = subprocess.Popen(cmds["train"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            try:
                code = train.wait(timeout=timeout)
                outcome = "ok" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                _stop(train)
                outcome = f"timed out after {timeout:.0f} s"
        except RuntimeError as error:
            outcome = str(error)
        finally:
            if server is not None:
                _stop(server)
                server_log.close()
    return {"outcome": outcome, "wall_s": round(time.monotonic() - start, 1), "gpu_peak_mib": sampler.peak_mib}


def summarize(folder: Path, recipe: dict) -> dict:
    """Per-step figures from `<run>/metrics.jsonl` (the training logs: rows with a reward) and the peak file."""
    metrics, peak_file = folder / "run" / "metrics.jsonl", folder / "peak.json"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [row for row in rows if "reward" in row]
    groups = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] / recipe["num_generations"]

    def mean(key: str, rows: list[dict] = steps) -> float | None:
        values = [row[key] for row in rows if row.get(key) is not None]
        return round(statistics.mean(values), 4) if values else None

    warm = steps[1:] or steps
    step_s, tokens = mean("step_time", warm), mean("arpo/tokens_generated_per_group", warm)
    out = {"steps_logged": len(steps), "first_step_s": steps[0].get("step_time") if steps else None,
           "step_s": step_s, "rollout_s": mean("arpo/rollout_seconds", warm),
           "training_s": mean("arpo/training_seconds", warm),
           "tokens_generated_per_step": round(tokens * groups) if tokens is not None else None,
           "prefix_cache_hit_rate": mean("arpo/prefix_cache_hit_rate", warm),
           "weight_sync_s": mean("arpo/weight_sync_seconds", warm), "reward": mean("reward")}
    out["tokens_per_s"] = (round(out["tokens_generated_per_step"] / step_s, 1)
                           if out["tokens_generated_per_step"] and step_s else None)
    peak = json.loads(peak_file.read_text()) if peak_file.is_file() else {}
    return {**out, **peak}


def table(report: dict) -> str:
    lines = ["| engine | outcome | set-up s | first step s | step s | rollout s | training s | tokens/step | "
             "tokens/s | torch peak GiB | GPU peak GiB (nvidia-smi) | peak RSS GiB | prefix-cache hits | "
             "weight sync s |",
             "|---" * 14 + "|"]

    def cell(value, scale: float = 1.0) -> str:
        return "-" if value is None else (f"{value / scale:.2f}" if isinstance(value, float) or scale != 1.0
                                          else str(value))

    for name, r in report["engines"].items():
        lines.append(f"| {name} | {r['outcome']} | {cell(r.get('setup_s'))} | {cell(r.get('first_step_s'))} | "
                     f"{cell(r.get('step_s'))} | "
                     f"{cell(r.get('rollout_s'))} | {cell(r.get('training_s'))} | "
                     f"{cell(r.get('tokens_generated_per_step'))} | {cell(r.get('tokens_per_s'))} | "
                     f"{cell(r.get('max_memory_allocated'), 1024**3)} | {cell(r.get('gpu_peak_mib'), 1024)} | "
                     f"{cell(r.get('peak_rss_kib'), 1024**2)} | {cell(r.get('prefix_cache_hit_rate'))} | "
                     f"{cell(r.get('weight_sync_s'))} |")
    return "\n".join(lines)


def child(argv: list[str]) -> None:
    """`--child PEAK_FILE TARGET ARGS...`: run TARGET (a module, or a .py file) as __main__, then write this
    process's peak memory to PEAK_FILE (also when TARGET exits with an error)."""
    import atexit

    peak_file, target, *rest = argv
    started, set_up = time.monotonic(), {}

    def note_training_start() -> None:  # the set-up (model load, vLLM's start) ends where Trainer.train begins
        from transformers import Trainer

        train = Trainer.train

        def timed(self, *args, **kwargs):
            set_up.setdefault("setup_s", round(time.monotonic() - started, 1))
            return train(self, *args, **kwargs)

        Trainer.train = timed

    def write_peak() -> None:
        peak = {"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **set_up}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            peak.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                        max_memory_reserved=torch.cuda.max_memory_reserved())
        Path(peak_file).write_text(json.dumps(peak))

    atexit.register(write_peak)
    note_training_start()
    sys.argv = [target, *rest]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--model", default=None, help="model_name_or_path override (e.g. smollm2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more recipe overrides (YAML)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with arpo-trl (and vLLM for the "
                        "vLLM engines): e.g. $(python -m arpo_trl.server setup --colocate | tail -n 1)")
    parser.add_argument("--vllm-python", default=None, help="the server's interpreter, if not --python")
    parser.add_argument("--timeout", type=float, default=None, help="per-run seconds (default: 1.5 x expected)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_one_gpu")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/one_gpu_<device>.json")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and recipes; run nothing")
    return parser.parse_args(argv)


def expected_seconds(engine: str, steps: int, gpu: bool) -> float:
    guess = GUESS["gpu" if gpu else "cpu"]
    return guess["start"] + steps * guess["step"] + (guess["server_start"] if engine == "server" else 0)


def git_commit() -> dict:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def plan(args: argparse.Namespace, gpu: bool) -> dict:
    """Per engine: its folder, recipe, commands, port and timeout; the recipes are written (also on a dry run)."""
    base, overrides, runs = yaml.safe_load(args.recipe.read_text()), common_overrides(args, gpu), {}
    for engine in args.engines:
        folder = (args.work / engine).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port() if engine == "server" else None
        recipe = engine_recipe(base, engine, {**overrides, "output_dir": str(folder / "run")}, port)
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        expected = expected_seconds(engine, args.steps, gpu)
        runs[engine] = {"folder": folder, "recipe": recipe, "expected_s": expected,
                        "timeout_s": args.timeout or 1.5 * expected,
                        "url": f"http://127.0.0.1:{port}" if port else None,
                        "commands": commands(engine, folder / "recipe.yaml", folder / "peak.json", args.python,
                                             args.vllm_python)}
    return runs


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    args = parse_args(argv)
    device = device_name()
    gpu = device != "cpu"
    runs = plan(args, gpu)
    total, worst = sum(r["expected_s"] for r in runs.values()), sum(r["timeout_s"] for r in runs.values())
    print(f"one_gpu: {len(runs)} engine(s) x {args.steps} step(s) on {device}: expected ~{total / 60:.0f} min "
          f"(a guess; at most {worst / 60:.0f} min with the per-run timeouts)", flush=True)
    for engine, r in runs.items():
        for name, cmd in r["commands"].items():
            if cmd:
                print(f"[{engine}] {name}: {' '.join(cmd)}", flush=True)
        print(f"[{engine}] recipe {r['folder'] / 'recipe.yaml'}, timeout {r['timeout_s']:.0f} s", flush=True)
    if args.dry_run:
        return None
    report = {"device": device, "gpus": _nvidia_smi("name,memory.total"), **git_commit(),
              "recipe": str(args.recipe.relative_to(ROOT) if args.recipe.is_relative_to(ROOT) else args.recipe),
              "steps": args.steps, "overrides": common_overrides(args, gpu), "engines": {}}
    for engine, r in runs.items():
        outcome = run_engine(engine, r["folder"], r["commands"], r["timeout_s"], 2 * r["expected_s"], r["url"])
        report["engines"][engine] = {**outcome, **summarize(r["folder"], r["recipe"]), "folder": str(r["folder"])}
        print(json.dumps({engine: report["engines"][engine]}), file=sys.stderr, flush=True)
    out = args.out or ROOT / "benchmarks" / "results" / f"one_gpu_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
