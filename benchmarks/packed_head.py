"""A decode step with the LM head packed once (`arpo_trl.generation.cpu.packed_head`) against the model's own head, on
the CPU.

Per number of rows: a cache of `--context` positions, then decode steps of one token per row, the two ways
alternating step by step (so that the machine's load falls on both alike); the median step of each, their ratio, the
largest logit difference, and the seconds the packing took.

    python benchmarks/packed_head.py                      # SmolLM2-135M-Instruct, float32
    python benchmarks/packed_head.py --model runs/quickstart-sft --rows 1,6,16

Prints one JSON object, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from arpo_trl.generation.cpu.packed_head import packed_head


def step_seconds(model, rows: int, context: int, steps: int, seed: int) -> dict:
    """`steps` decode steps each way from the same cache (cropped back after every step), alternating."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = torch.randint(0, model.config.vocab_size, (rows, 1), generator=generator)
        seconds, logits = {"plain": [], "packed": []}, {}
        packing = time.perf_counter()
        with packed_head(model) as packed:
            pack_seconds = time.perf_counter() - packing
            assert packed, "this model's head is not packable here (packable_head)"
        for step in range(2 * steps + 2):  # the first pair warms up
            way = ("plain", "packed")[(step + step // 2) % 2]
            with packed_head(model) if way == "packed" else torch.no_grad():
                start = time.perf_counter()
                logits[way] = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                if step >= 2:
                    seconds[way].append(time.perf_counter() - start)
            cache.crop(-1)  # back to the `context` cached positions
    plain, fast = (statistics.median(seconds[way]) for way in ("plain", "packed"))
    return {"rows": rows, "plain_ms": 1e3 * plain, "packed_ms": 1e3 * fast, "packed / plain": fast / plain,
            "max_logit_difference": (logits["packed"] - logits["plain"]).abs().max().item(),
            "pack_seconds": pack_seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--rows", default="1,2,4,6,8,16,32,64,128")
    parser.add_argument("--context", type=int, default=150, help="cached positions per row")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per way and row count")
    args = parser.parse_args(argv)
    if args.model is None:
        from arpo_trl.data.models import smollm2_path

        args.model = str(smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [int(r) for r in args.rows.split(",")]
    report = {
        "model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(), "context": args.context, "steps": args.steps,
        "decode_steps": [step_seconds(model, r, args.context, args.steps, seed=r) for r in rows],
    }
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    print("\n| rows | step ms, own head | step ms, packed head | packed / own | max logit diff | pack s |")
    print("|---|---|---|---|---|---|")
    for r in report["decode_steps"]:
        print(f"| {r['rows']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | {r['packed / plain']:.2f} | "
              f"{r['max_logit_difference']:.1e} | {r['pack_seconds']:.2f} |")
    return report


if __name__ == "__main__":
    main()
