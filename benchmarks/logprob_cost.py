"""Colocated vLLM: what the entropy's top-k logprobs cost per generated token. ARPO asks vLLM for each token's top-k
(`entropy_top_k`, 20) processed logprobs, to read the entropy that decides its forks; TRL's GRPO asks for `logprobs=0`
(the sampled token's logprob, for its importance-sampling correction); `none` asks for no logprobs at all; `split`
asks for the top-k of the first `--probe` tokens only (the entropy window), then continues each request as a second
request with `logprobs=0`, as the colocated engine does on a GPU (`ColocatedVLLMEngine.split_logprobs`).

Besides the wall time, each mode's host time: the seconds vLLM's output processor takes (`LLMEngine.output_processor.
process_outputs`, which detokenises every returned logprob's token on the calling thread: `vllm/v1/engine/
logprobs.py::LogprobsProcessor._update_sample_logprobs`). That work does not shrink on a GPU, where a decode step of
a small model takes a few hundred µs, so the host time per token is the part of these CPU numbers that carries over.

The same requests (`--rows` prompts of `--tokens` tokens each, all at once, temperature 1, `min_tokens` = `max_tokens`
so every mode generates exactly as many tokens; final outputs only, as the colocated engine asks) run in each mode,
alternated with each mode first in turn, `--repeats` times, with the prefix cache reset before each; a mode's time is
its fastest repeat, `spread` its slowest over its fastest, less 1. Also arpo-trl's own read of the top-k outputs (the
`/v1/completions` contract and the entropies, `ColocatedVLLMEngine._segment`) per token. Run it with the colocate
environment's python (`python -m arpo_trl.server setup --colocate`):

    PY=$(python -m arpo_trl.server setup --colocate | tail -n 1)
    $PY benchmarks/logprob_cost.py                     # SmolLM2-135M on this machine's CPU
    $PY benchmarks/logprob_cost.py --model PATH --dtype bfloat16 --rows 256 --tokens 512   # on a GPU

Prints one JSON object, then a table; writes benchmarks/results/logprob_cost_<device>.json with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

MODES = {"none": None, "sampled": 0}  # and "top<k>" for the entropy's top-k, "split" for top-k on the first --probe


class HostClock:
    """Seconds spent in `llm.output_processor.process_outputs` (vLLM's output processing: detokenisation, logprobs)."""

    def __init__(self, llm):
        self.seconds, processor = 0.0, llm.output_processor
        original = processor.process_outputs

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        processor.process_outputs = timed


def _engine(args):
    import torch

    from arpo_trl.colocate.engine_args import MAX_NUM_BATCHED_TOKENS, ColocateSettings, start_llm_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = ColocateSettings(model=args.model, dtype=args.dtype, max_model_len=args.tokens + 64,
                                gpu_memory_utilization=0.8, enable_sleep_mode=False, seed=0, device=device,
                                max_num_seqs=2 * args.rows, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                cpu_kv_cache_gib=2.0)
    return start_llm_engine(settings), device


def _requests(llm, prompts: list[list[int]], tokens: int, logprobs: int | None, tag: str) -> list:
    """All requests at once until every one has finished; the finished outputs in prompt order."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, logprobs=logprobs,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as `ColocatedVLLMEngine` asks
    for i, prompt in enumerate(prompts):
        llm.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    finished = {}
    while llm.has_unfinished_requests():
        finished.update((output.request_id, output) for output in llm.step() if output.finished)
    return [finished[f"{tag}-{i}"] for i in range(len(prompts))]


def _run(llm, prompts: list[list[int]], tokens: int, logprobs: int | None, tag: str,
         probe: int | None = None) -> tuple[float, list]:
    """(seconds, finished outputs) of one mode: each prompt's `tokens` tokens in one request, or with `probe` the first
    `probe` with `logprobs` and the rest in a second request with `logprobs=0` (the prefix cache serves the first)."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    if probe is None:
        outputs = _requests(llm, prompts, tokens, logprobs, tag)
    else:
        first = _requests(llm, prompts, probe, logprobs, f"{tag}-probe")
        continued = [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, first)]
        outputs = first + _requests(llm, continued, tokens - probe, 0, f"{tag}-rest")
    return time.perf_counter() - start, outputs


def _read_seconds(outputs: list, tokenizer, top_k: int, tokens: int) -> float:
    """arpo-trl's read of top-k outputs, as the colocated engine reads each finished request."""
    from arpo_trl.colocate.outputs import WHERE, completion_body
    from arpo_trl.generation.engine import SamplingSettings
    from arpo_trl.server.segments import SegmentReader

    reader = SegmentReader(tokenizer, SamplingSettings(entropy_top_k=top_k), WHERE, "benchmark", "colocated vLLM")
    start = time.perf_counter()
    for output in outputs:
        reader.read(completion_body(output), tokens, [])
    return time.perf_counter() - start


def measure(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm, device = _engine(args)
    clock = HostClock(llm)
    top = f"top{args.top_k}"
    modes = {**MODES, top: args.top_k, "split": args.top_k}
    probes = {"split": args.probe}
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {2 * i}?") for i in range(args.rows)]
    for name, logprobs in modes.items():  # warm-up, not timed
        _run(llm, prompts[:4], 8, logprobs, f"warm-{name}", probes.get(name) and 4)
    runs: dict[str, list[float]] = {name: [] for name in modes}
    host: dict[str, list[float]] = {name: [] for name in modes}
    read: list[float] = []
    order = list(modes)
    for repeat in range(args.repeats):
        turn = repeat % len(order)  # each mode first in turn: no mode always runs last
        for name in order[turn:] + order[:turn]:
            logprobs, before = modes[name], clock.seconds
            seconds, outputs = _run(llm, prompts, args.tokens, logprobs, f"{name}-{repeat}", probes.get(name))
            if sum(len(o.outputs[0].token_ids) for o in outputs) != args.rows * args.tokens:
                raise RuntimeError(f"mode {name}: the requests did not generate {args.tokens} tokens each")
            runs[name].append(round(seconds, 3))
            host[name].append(round(clock.seconds - before, 4))
            if name == top:
                read.append(_read_seconds(outputs, tokenizer, args.top_k, args.tokens))
    generated = args.rows * args.tokens
    us = {name: 1e6 * min(seconds) / generated for name, seconds in runs.items()}
    host_us = {name: 1e6 * min(seconds) / generated for name, seconds in host.items()}
    return {
        "model": args.model, "dtype": args.dtype, "device": device, "rows": args.rows, "tokens": args.tokens,
        "probe": args.probe, "repeats": args.repeats, "seconds": runs, "host_seconds": host,
        "us_per_token": {k: round(v, 1) for k, v in us.items()},
        "host_us_per_token": {k: round(v, 1) for k, v in host_us.items()},
        "spread": {name: round(max(seconds) / min(seconds) - 1, 3) for name, seconds in runs.items()},
        "top_k_vs_sampled": round(us[top] / us["sampled"], 3), "top_k_vs_none": round(us[top] / us["none"], 3),
        "split_vs_top_k": round(us["split"] / us[top], 3),
        "host_split_vs_top_k": round(host_us["split"] / host_us[top], 3),
        "arpo_read_us_per_token": round(1e6 * min(read) / generated, 1),
        "torch_threads": torch.get_num_threads(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "command": "$PY " + shlex.join(sys.argv), "machine": args.machine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct, offline)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=20, help="ARPO's entropy_top_k")
    parser.add_argument("--probe", type=int, default=20, help="split mode: tokens with top-k (ARPO's entropy_window)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default="", help="what else ran on the machine, for the results file")
    parser.add_argument("--out", default=None, help="results file (default: results/logprob_cost_<device>.json)")
    args = parser.parse_args()
    if not 0 < args.probe < args.tokens:
        parser.error(f"--probe must be between 1 and --tokens - 1 ({args.tokens - 1}): the split continues each "
                     f"request after its first --probe tokens; got --probe {args.probe}.")
    if args.model is None:
        from arpo_trl.data.models import smollm2_path

        args.model = str(smollm2_path())
    result = measure(args)
    out = Path(args.out or Path(__file__).parent / "results" / f"logprob_cost_{result['device']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    print(f"\n{'logprobs':<10}{'µs/token':>10}{'host µs':>9}{'spread':>9}   fastest of {args.repeats} ({args.rows} "
          f"rows × {args.tokens} tokens; split: top-k on the first {args.probe})")
    for name, value in result["us_per_token"].items():
        print(f"{name:<10}{value:>10.1f}{result['host_us_per_token'][name]:>9.1f}{result['spread'][name]:>9.1%}")
    print(f"{'read':<10}{result['arpo_read_us_per_token']:>10.1f}   arpo-trl's read of the top-k outputs\n"
          f"written: {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
