"""Entropy estimators against the exact entropy on a real model (SmolLM2-135M-Instruct) after real tool results.

For each prompt (a multiplication question with the tool instructions), the model writes the start of its answer
(at most k tokens, its first segment); a Python call is then written for it (right, failing, or printing something
off-topic) and run by the real `PythonTool`; its output goes in as the tool result, and the model writes the next k
tokens (stopping early at a closing tag or EOS, as a quick call or answer would). One forward pass gives every
position's full next-token distribution, from which each estimator's per-token entropy, each segment statistic, and
so ΔH = H(after the result) - H(first segment) follow, exactly as the sampler computes them (`arpo_trl.entropy`).

Reported per estimator and statistic, against the exact entropy with the default 'mean' statistic:
* Spearman's rank correlation of ΔH with the exact ΔH;
* fork agreement: the share of fork decisions that agree with the exact ones when both use the same random draw,
  i.e. the mean over decisions of 1 - |P_est - P_exact|, with P = clip(τ + β·ΔH, 0, 1) (τ=0.5, β=0.2).

    python benchmarks/entropy_estimators.py                 # 48 questions × 2 samples; JSON + a markdown table
    python benchmarks/entropy_estimators.py --questions 8   # quicker look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_trl.data.models import smollm2_path
from arpo_trl.entropy import segment_entropy, token_entropy
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.tools import PythonTool

SYSTEM = ("Solve the problem. You may run Python by writing <python>code</python>; its output appears in "
          "<result></result>. End with <answer>\\boxed{number}</answer>.")
CALLS = {  # what the written call runs: the right product, a crash, or output that has nothing to do with it
    "right": lambda a, b: f"print({a} * {b})",
    "error": lambda a, b: f"print({a} * undefined_{b})",
    "off-topic": lambda a, b: "import string; print(string.ascii_letters * 3)",
}
ESTIMATORS = [("exact", None, "mean"), ("exact", None, "sum"), ("top_k_tail", 20, "mean"), ("top_k_tail", 10, "mean"),
              ("top_k", 20, "mean"), ("top_k", 10, "mean"), ("top_k", 10, "sum")]
TAU, BETA = 0.5, 0.2


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for t in range(i, j + 1):
                out[order[t]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / ((sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5 or 1.0)


def fork_probability(delta: float) -> float:
    return min(1.0, max(0.0, TAU + BETA * delta))


def collect(model, tokenizer, args) -> list[dict]:
    """One record per (question, sample): the two segments' positions in the full sequence and its logprobs."""
    engine = TransformersEngine(model, tokenizer, sampling=SamplingSettings(temperature=1.0), max_batch_size=16)
    tool, rng = PythonTool(timeout=10), random.Random(args.seed)
    questions = [(rng.randint(3, 99), rng.randint(3, 99)) for _ in range(args.questions)]
    prefixes, kinds = [], []
    for a, b in questions:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b}?"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        for _ in range(args.samples):
            prefixes.append(list(prompt))
            kinds.append(((a, b), list(CALLS)[len(kinds) % len(CALLS)]))
    torch.manual_seed(args.seed)
    first = engine.generate(prefixes, [args.window] * len(prefixes), stop=["</python>", "</answer>"])
    continued = []
    try:
        for prefix, segment, ((a, b), kind) in zip(prefixes, first, kinds):
            code = CALLS[kind](a, b)
            result = tool(code).strip()
            text = f"\n<python>{code}</python> <result>\n{result}\n</result>"
            continued.append(prefix + segment.token_ids + tokenizer.encode(text, add_special_tokens=False))
    finally:
        tool.close()
    second = engine.generate(continued, [args.window] * len(continued), stop=["</python>", "</answer>"])
    records = []
    for prefix, seg1, after, seg2, (_, kind) in zip(prefixes, first, continued, second, kinds):
        sequence = after + seg2.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        spans = [(len(prefix), len(prefix) + len(seg1.token_ids)), (len(after), len(sequence))]
        per_token = {(e, k): [token_entropy(logprobs[start - 1 : end - 1], e, k, len(tokenizer)).tolist()
                              for start, end in spans] for e, k, _ in ESTIMATORS}
        records.append({"kind": kind, "lengths": [len(seg1.token_ids), len(seg2.token_ids)], "entropies": per_token})
    return records


def delta(record: dict, estimator: str, top_k: int | None, statistic: str, window: int, vocab: int) -> float:
    values = [segment_entropy(entropies, window, vocab, statistic)
              for entropies in record["entropies"][(estimator, top_k)]]
    return values[1] - values[0]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--samples", type=int, default=2, help="samples per question")
    parser.add_argument("--window", type=int, default=20, help="k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = collect(model, tokenizer, args)
    vocab = len(tokenizer)
    deltas = {f"{e}{'' if k is None else f'@{k}'}/{s}": [delta(r, e, k, s, args.window, vocab) for r in records]
              for e, k, s in ESTIMATORS}
    exact = deltas["exact/mean"]
    rows = {}
    for name, values in deltas.items():
        agreement = statistics.fmean(1 - abs(fork_probability(v) - fork_probability(x)) for v, x in zip(values, exact))
        rows[name] = {"spearman_vs_exact": round(spearman(values, exact), 3), "fork_agreement": round(agreement, 3),
                      "mean_delta": round(statistics.fmean(values), 3),
                      "exact_sign_agreement": round(statistics.fmean((v > 0) == (x > 0) for v, x in zip(values, exact)),
                                                    3)}
    short = sum(min(r["lengths"]) < args.window for r in records)
    report = {"model": "SmolLM2-135M-Instruct", "decisions": len(records), "segments_shorter_than_k": short,
              "window": args.window, "tau": TAU, "beta": BETA, "vocab": vocab, "estimators": rows}
    print(json.dumps(report, indent=2))
    print(f"\n{len(records)} fork decisions ({short} with a segment shorter than k={args.window}), SmolLM2-135M\n")
    print("| estimator / statistic | Spearman ρ of ΔH vs exact | fork agreement | sign agreement | mean ΔH |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['spearman_vs_exact']:.3f} | {r['fork_agreement']:.3f} | {r['exact_sign_agreement']:.3f} "
              f"| {r['mean_delta']:+.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
