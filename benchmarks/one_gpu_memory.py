"""One GPU, colocated vLLM, LoRA: an ESTIMATE of where the memory goes, for Qwen2.5-1.5B/3B on 24, 48 and 80 GB cards.

    python benchmarks/one_gpu_memory.py                  # table + JSON, saved to benchmarks/results/one_gpu_memory.*
    python benchmarks/one_gpu_memory.py --lora-r 16 --out /tmp/x

Nothing is measured and nothing is downloaded: every number is arithmetic on the models' architecture
(`arpo_trl.colocate.memory_plan.KNOWN_ARCHITECTURES`) and the recipe's shape, so each one can be checked by hand; the
arithmetic is the trainer's own startup check (`arpo_trl.colocate.memory_plan.plan`, `arpo-trl memory-plan`). The two
phases of a colocated run:

* rollout: the trainer's weights and LoRA state + vLLM's whole share (`vllm_gpu_memory_utilization` x card: its own
  weight copy, its activations, its KV cache). The trainer's activations are freed before vLLM wakes (TRL's colocate
  mode calls `empty_cache()` first).
* training: the trainer's weights, LoRA state and the activations of one micro-batch + what vLLM keeps while it
  sleeps. arpo-trl's colocate mode sleeps at level 2: vLLM's KV cache and its weight copy are freed (the weights are
  loaded again at the next sync, which sends every tensor anyway); its fixed buffers (CUDA graphs, profile-run
  workspace, sampler) stay.

A card "fits" a setting when both phases stay under the card minus a reserve (CUDA context, cuBLAS workspaces,
allocator fragmentation). The assumptions are listed in the output; correct them with what vLLM prints at startup
("Available KV cache memory") and with `torch.cuda.max_memory_allocated` (benchmarks/one_gpu.py records it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from arpo_trl.colocate.engine_args import MAX_NUM_BATCHED_TOKENS  # noqa: E402
from arpo_trl.colocate.memory_plan import (  # noqa: E402  (the arithmetic the trainer's startup check runs)
    ASSUMPTIONS,
    GIB,
    KNOWN_ARCHITECTURES,
    LORA_BYTES_PER_PARAM,
    LORA_TARGETS,
    UTILIZATION_STEP,
    RunShape,
    activation_bytes,
    plan,
)

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {name.split("/")[1]: KNOWN_ARCHITECTURES[name] for name in ("Qwen/Qwen2.5-1.5B-Instruct",
                                                                     "Qwen/Qwen2.5-3B-Instruct")}
PUBLISHED_PARAMS = {"Qwen2.5-1.5B-Instruct": 1.54e9, "Qwen2.5-3B-Instruct": 3.09e9}  # the model cards', for a check
CARDS_GIB = (24, 48, 80)


@dataclass(frozen=True)
class Shape:
    """The recipe's shape (recipes/qwen2.5-3b_lora_colocate.yaml)."""

    prompt_tokens: int = 512  # max_prompt_length
    completion_tokens: int = 2048  # max_completion_length (tool results included)
    rows_per_rollout: int = 64  # per_device_train_batch_size x gradient_accumulation_steps = 8 prompts x M 8
    lora_r: int = 64
    micro_batches: tuple[int, ...] = (8, 4, 2, 1)  # per_device_train_batch_size candidates, largest first

    @property
    def path_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def run(self, rows: int, utilization: float) -> RunShape:
        """At the batch limits the trainer gives the engine: two sequences per path of a rollout."""
        return RunShape("bfloat16", self.prompt_tokens, self.completion_tokens, rows, self.rows_per_rollout,
                        self.lora_r, 2 * self.rows_per_rollout, MAX_NUM_BATCHED_TOKENS, LORA_TARGETS,
                        gpu_memory_utilization=utilization)


def plan_card(name: str, arch, card_gib: int, shape: Shape) -> dict:
    """The largest vllm_gpu_memory_utilization (a multiple of the step) whose rollout phase and start fit `card_gib`,
    and the largest micro-batch whose training phase fits then; `fits` False when none does."""
    card = card_gib * GIB

    def starts_and_rolls_out(util: float) -> bool:  # all but the training phase fit (the micro-batch decides that)
        problems = plan(arch, shape.run(min(shape.micro_batches), util), card).problems
        return all(field == "per_device_train_batch_size" for field, _ in problems)

    utilizations = [round(k * UTILIZATION_STEP, 2) for k in range(int(1 / UTILIZATION_STEP), 0, -1)]
    util = next((u for u in utilizations if starts_and_rolls_out(u)), utilizations[-1])
    plans = {rows: plan(arch, shape.run(rows, util), card) for rows in shape.micro_batches}
    first = plans[shape.micro_batches[0]]
    row = {"model": name, "card_gib": card_gib, "usable_gib": first.usable / GIB,
           "trainer_weights": first.trainer_weights, "lora_state": first.lora_state, "vllm_weights": first.vllm_weights,
           "vllm_fixed": first.vllm_fixed, "vllm_gpu_memory_utilization": util, "kv_bytes": first.kv_bytes,
           "kv_tokens": first.kv_tokens, "kv_bytes_per_token": arch.kv_bytes_per_token(2),
           "rollout_phase": first.rollout_phase, "paths_held": first.paths_held, "micro_batches": {}}
    for rows, p in plans.items():
        awake = replace(shape.run(rows, util), sleep=False)
        row["micro_batches"][rows] = {"activations": p.activations, "training_phase_sleep": p.training_phase,
                                      "fits_with_sleep": p.training_phase <= p.usable,
                                      "training_phase_no_sleep": plan(arch, awake, card).training_phase,
                                      "fits_without_sleep": plan(arch, awake, card).training_phase <= p.usable}
    fitting = [rows for rows, p in plans.items() if p.fits]
    row["per_device_train_batch_size"] = max(fitting) if fitting else None
    row["gradient_accumulation_steps"] = (shape.rows_per_rollout // row["per_device_train_batch_size"]
                                          if fitting else None)
    row["holds_all_paths"] = row["paths_held"] >= shape.rows_per_rollout
    row["fits"] = bool(fitting)
    return row


def report(shape: Shape) -> dict:
    models = {name: {"params": arch.params(), "published_params": PUBLISHED_PARAMS[name],
                     "lora_params": arch.lora_params(shape.lora_r), "kv_bytes_per_token": arch.kv_bytes_per_token(2),
                     "architecture": asdict(arch),
                     "activations_by_micro_batch": {rows: {"total": activation_bytes(arch, rows, shape.run(rows, 0.5))}
                                                    for rows in shape.micro_batches}}
              for name, arch in MODELS.items()}
    plans = [plan_card(name, arch, card, shape) for name, arch in MODELS.items() for card in CARDS_GIB]
    return {"estimate": True, "shape": {**asdict(shape), "path_tokens": shape.path_tokens},
            "assumptions": ASSUMPTIONS, "models": models, "plans": plans}


def _gib(value: int | float) -> str:
    return f"{value / GIB:.2f}"


def tables(rep: dict) -> str:
    shape = rep["shape"]
    lines = [f"**Estimate** (not measured) for the one-GPU colocate LoRA run: r {shape['lora_r']} on q,k,v,o,gate,up,"
             f"down; paths of {shape['prompt_tokens']} + {shape['completion_tokens']} = {shape['path_tokens']} "
             f"tokens; {shape['rows_per_rollout']} paths per rollout. GiB.", "",
             "| model | params | LoRA params | weights (bf16) | LoRA + grad + AdamW (fp32) | KV bytes/token | "
             "activations, micro-batch " + " / ".join(str(r) for r in shape["micro_batches"]) + " |",
             "|---|---|---|---|---|---|---|"]
    for name, m in rep["models"].items():
        acts = " / ".join(_gib(a["total"]) for a in m["activations_by_micro_batch"].values())
        lines.append(f"| {name} | {m['params'] / 1e9:.3f} B | {m['lora_params'] / 1e6:.1f} M | "
                     f"{_gib(m['params'] * 2)} | {_gib(m['lora_params'] * LORA_BYTES_PER_PARAM)} | "
                     f"{m['kv_bytes_per_token']:,} | {acts} |")
    lines += ["", "| model | card | vllm_gpu_memory_utilization | vLLM: weights + fixed + KV | KV tokens | paths held "
              "| micro-batch x grad. acc. | rollout phase | training phase (sleep) | without sleep | fits |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in rep["plans"]:
        mb = p["per_device_train_batch_size"]
        chosen = p["micro_batches"][mb] if mb else p["micro_batches"][min(p["micro_batches"])]
        no_sleep = "fits" if chosen["fits_without_sleep"] else f"{_gib(chosen['training_phase_no_sleep'])}: NO"
        lines.append(
            f"| {p['model']} | {p['card_gib']} GiB (usable {p['usable_gib']:.1f}) | {p['vllm_gpu_memory_utilization']} "
            f"| {_gib(p['vllm_weights'])} + {_gib(p['vllm_fixed'])} + {_gib(p['kv_bytes'])} | {p['kv_tokens']:,} | "
            f"{p['paths_held']}{'' if p['holds_all_paths'] else ' (< ' + str(shape['rows_per_rollout']) + ')'} | "
            f"{mb or '-'} x {p['gradient_accumulation_steps'] or '-'} | {_gib(p['rollout_phase'])} | "
            f"{_gib(chosen['training_phase_sleep'])} | {no_sleep} | {'yes' if p['fits'] else 'NO'} |")
    refused = [f"{p['model']} on {p['card_gib']} GiB, micro-batch {rows}: training phase "
               f"{_gib(m['training_phase_sleep'])} GiB > usable {p['usable_gib']:.2f} GiB"
               for p in rep["plans"] for rows, m in p["micro_batches"].items() if not m["fits_with_sleep"]]
    lines += ["", "Does not fit (with sleep mode, at the utilization above):", ""]
    lines += [f"- {line}" for line in refused] or ["- none"]
    lines += ["", "Assumptions:", ""] + [f"- {a}" for a in rep["assumptions"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lora-r", type=int, default=Shape.lora_r)
    parser.add_argument("--prompt-tokens", type=int, default=Shape.prompt_tokens)
    parser.add_argument("--completion-tokens", type=int, default=Shape.completion_tokens)
    parser.add_argument("--rows-per-rollout", type=int, default=Shape.rows_per_rollout)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for one_gpu_memory.json and .md")
    args = parser.parse_args(argv)
    shape = Shape(args.prompt_tokens, args.completion_tokens, args.rows_per_rollout, args.lora_r)
    rep = report(shape)
    text = tables(rep)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "one_gpu_memory.json").write_text(json.dumps(rep, indent=1) + "\n")
    (args.out / "one_gpu_memory.md").write_text(text + "\n")
    print(json.dumps(rep, indent=1))
    print(text)
    return rep


if __name__ == "__main__":
    main()
