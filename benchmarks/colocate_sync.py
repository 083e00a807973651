"""Colocated vLLM: how to hand it the trained policy, measured. Merged weights (every tensor, LoRA folded in, loaded
in place through vLLM's layerwise reload; what `vllm_mode='colocate'` does) against a LoRA adapter (saved to a new
folder and added under a new name, every request sampling through it; what server mode does).

Per way: the sync's seconds (median of `--syncs`, new LoRA values each time) and decode throughput after it
(`--prompts` requests of `--tokens` tokens, all at once, temperature 1, the entropy's top-20 logprobs), on the same
model and LoRA shape. Each way runs in a subprocess of its own (one in-process engine per process). Run it with the
colocate environment's python (`python -m arpo_trl.server setup --colocate`):

    PY=$(python -m arpo_trl.server setup --colocate | tail -n 1)
    $PY benchmarks/colocate_sync.py                        # SmolLM2-135M, LoRA r 16 on q/v and r 64 on all
    $PY benchmarks/colocate_sync.py --model PATH --dtype bfloat16   # on a GPU

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LORA_SHAPES = {"r16-qv": (16, ["q_proj", "v_proj"]),
               "r64-all": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def _model_with_lora(model_dir: str, shape: str, dtype):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rank, targets = LORA_SHAPES[shape]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))
    return model, torch


def _refresh(model, torch) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1e-3)


def _decode(llm, prompts: list[list[int]], tokens: int, lora_request=None) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=1.0, logprobs=20)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params, lora_request=lora_request)
    generated = 0
    while llm.has_unfinished_requests():
        generated += sum(len(o.outputs[0].token_ids) for o in llm.step() if o.finished)
    return generated / (time.perf_counter() - start)


def run_way(way: str, args) -> dict:
    """One way in this process: start the engine, sync `--syncs` times, then decode."""
    import torch
    from vllm.lora.request import LoRARequest

    from arpo_trl.colocate.engine import ColocatedVLLMEngine
    from arpo_trl.colocate.engine_args import MAX_NUM_BATCHED_TOKENS, ColocateSettings, start_llm_engine
    from arpo_trl.colocate.weight_sync import policy_weights

    dtype = getattr(torch, args.dtype)
    model, _ = _model_with_lora(args.model, args.shape, dtype)
    settings = ColocateSettings(model=args.model, dtype=args.dtype, max_model_len=1024, gpu_memory_utilization=0.5,
                                enable_sleep_mode=False, seed=0, device="cuda" if torch.cuda.is_available() else "cpu",
                                max_num_seqs=64, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    lora = {"enable_lora": True, "max_lora_rank": max(16, LORA_SHAPES[args.shape][0]), "max_loras": 2}
    llm = start_llm_engine(settings, **(lora if way == "adapter" else {}))
    engine = ColocatedVLLMEngine(llm, llm.get_tokenizer())
    times, request, folder = [], None, tempfile.mkdtemp(prefix="colocate-sync-")
    for version in range(args.syncs):
        _refresh(model, torch)
        start = time.perf_counter()
        if way == "merged":
            engine.load_weights(policy_weights(model))
        else:
            path = os.path.join(folder, f"v{version}")
            model.save_pretrained(path)
            request = LoRARequest(f"v{version}", version + 1, path)
            llm.add_lora(request)
            if version:
                llm.remove_lora(version)
        engine.reset_prefix_cache()
        times.append(time.perf_counter() - start)
    prompts = [[(7 * i + j) % 2000 + 100 for j in range(64)] for i in range(args.prompts)]
    _decode(llm, prompts[:2], 8, request)  # warm-up
    rate = _decode(llm, prompts, args.tokens, request)
    return {"sync_s_median": round(statistics.median(times), 4), "sync_s_all": [round(t, 4) for t in times],
            "decode_tokens_per_s": round(rate, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shapes", default="r16-qv,r64-all")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--way", choices=("merged", "adapter"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:  # a subprocess: one way, one shape
        print(json.dumps(run_way(args.way, args)))
        return
    if args.model is None:
        from arpo_trl.data.models import smollm2_path

        args.model = str(smollm2_path())
    report = {"model": args.model, "dtype": args.dtype, "prompts": args.prompts, "tokens": args.tokens,
              "load_avg_start": os.getloadavg(), "runs": {}}
    for shape in args.shapes.split(","):
        for way in ("merged", "adapter"):
            cmd = [sys.executable, __file__, "--way", way, "--shape", shape, "--model", args.model, "--dtype",
                   args.dtype, "--syncs", str(args.syncs), "--prompts", str(args.prompts), "--tokens",
                   str(args.tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if proc.returncode:
                raise SystemExit(f"{way} {shape} failed:\n{proc.stderr[-4000:]}")
            report["runs"][f"{shape}/{way}"] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    print("\n| LoRA shape | way | sync s (median) | decode tokens/s |\n|---|---|---|---|")
    for name, run in report["runs"].items():
        shape, way = name.split("/")
        print(f"| {shape} | {way} | {run['sync_s_median']} | {run['decode_tokens_per_s']} |")


if __name__ == "__main__":
    main()
