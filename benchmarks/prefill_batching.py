"""Batched prefill in the cached engine: the requests that join in one step, prefilled in one forward per group
(`arpo_trl.generation.prefill`) against one forward per request, on the join pattern of real rollouts.

A rollout's wall time on a 2-core CPU varies by ±15 % from one seed to the next (its trees and tool calls differ), more
than the prefill's share of it, so the two ways are compared on the same joins instead: ARPO and GRPO rollouts of the
multi-call benchmark's M16N8 setting record, per engine step, each joining request's cached and new positions; then
every step's joins are prefilled both ways, alternately (random tokens, a real cached prefix of that length),
and the seconds are summed. Also reported: each rollout's wall time and the seconds its own prefills took.

    arpo-trl sft --config recipes/multi_call_sft.yaml         # the cold start, once (runs/multi-call-sft)
    python benchmarks/prefill_batching.py --model runs/multi-call-sft

Prints one JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation import admission as admission_module
from arpo_trl.generation.prefill import FORWARD_COST_TOKENS, PrefillJob, prefill
from arpo_trl.generation.prefix_cache import crop, stack_layers

sys.path.insert(0, str(Path(__file__).parent))
from rollout_throughput import make_sampler, prompt_ids  # noqa: E402  (the same prompts and sampler)


def record_joins(engine, sampler, prompts, seed: int) -> tuple[list[list[tuple[int, int]]], float, float]:
    """One rollout; returns its prefill calls as (cached, new) positions per job, its wall time and prefill seconds."""
    calls, seconds = [], [0.0]

    def recording(model, jobs, forward_cost=FORWARD_COST_TOKENS):
        start = time.perf_counter()
        try:
            return prefill(model, jobs, forward_cost)
        finally:
            seconds[0] += time.perf_counter() - start
            calls.append([(job.start, job.new) for job in jobs])

    admission_module.prefill = recording
    try:
        torch.manual_seed(seed)
        start = time.perf_counter()
        sampler.sample(prompts)
        wall = time.perf_counter() - start
    finally:
        admission_module.prefill = prefill
    return calls, wall, seconds[0]


@torch.no_grad()
def replay(model, calls: list[list[tuple[int, int]]], seed: int) -> dict:
    """Every call's jobs prefilled one by one and grouped as the engine did (`FORWARD_COST_TOKENS`), alternating which
    goes first."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(start + new for call in calls for start, new in call)
    tokens = torch.randint(0, model.config.vocab_size, (longest,), generator=generator).tolist()
    cache = DynamicCache()
    model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True, logits_to_keep=1)
    full = stack_layers([(layer.keys, layer.values) for layer in cache.layers])

    def jobs(call):
        return [PrefillJob(tokens[: start + new], crop(full, start) if start else None, start) for start, new in call]

    seconds = {"one_by_one": 0.0, "batched": 0.0}
    forwards = {"one_by_one": 0, "batched": 0}
    for index, call in enumerate(calls):
        ways = [("one_by_one", lambda c=call: [prefill(model, [job], FORWARD_COST_TOKENS) for job in jobs(c)]),
                ("batched", lambda c=call: [prefill(model, jobs(c), FORWARD_COST_TOKENS)])]
        for name, run in ways[index % 2:] + ways[: index % 2]:
            start = time.perf_counter()
            done = run()
            seconds[name] += time.perf_counter() - start
            forwards[name] += sum(len(positions) for _, positions in done)
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "forwards": forwards,
            "ratio": round(seconds["batched"] / seconds["one_by_one"], 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF folder (the multi-call benchmark's cold start)")
    parser.add_argument("--system-prompt", default="python_short")
    parser.add_argument("--dataset", default="arithmetic_chain:64")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=16)
    parser.add_argument("--initial-rollouts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = prompt_ids(tokenizer, args)
    engine = CachedTransformersEngine(model, tokenizer)
    report = {"model": args.model, "prompts": len(prompts),
              "M": args.num_generations, "N": args.initial_rollouts,
              "torch_threads": torch.get_num_threads(), "load_avg_start": os.getloadavg(), "policies": {}}
    for policy in ("entropy", "none"):
        sampler = make_sampler(engine, tokenizer, args, policy)
        sampler.sample(prompts[:1])  # warm-up
        report["forward_cost_tokens"] = FORWARD_COST_TOKENS
        forwards = engine.counters.prefill_forwards
        calls, wall, prefill_seconds = record_joins(engine, sampler, prompts, args.seed)
        report["policies"][policy] = {
            "rollout_wall_s": round(wall, 1), "rollout_prefill_s": round(prefill_seconds, 1),
            "rollout_prefill_forwards": engine.counters.prefill_forwards - forwards,
            "requests_prefilled": sum(map(len, calls)), "joins": calls,
            **replay(model, calls, args.seed)}
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    print("\n| policy | rollout s | its prefill s | requests prefilled | forwards one by one / batched | "
          "replayed s one by one | batched | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, r in report["policies"].items():
        f, s = r["forwards"], r["seconds"]
        print(f"| {policy} | {r['rollout_wall_s']} | {r['rollout_prefill_s']} | {r['requests_prefilled']} | "
              f"{f['one_by_one']} / {f['batched']} | {s['one_by_one']} | {s['batched']} | {r['ratio']} |")
    return report


if __name__ == "__main__":
    main()
