"""One GPU, colocated vLLM, LoRA: an ESTIMATE of where the memory goes, for Qwen2.5-1.5B/3B on 24, 48 and 80 GB cards.

    python benchmarks/one_gpu_memory.py                  # table + JSON, saved to benchmarks/results/one_gpu_memory.*
    python benchmarks/one_gpu_memory.py --lora-r 16 --out /tmp/x

Nothing is measured and nothing is downloaded: every number is arithmetic on the models' architecture (embedded below)
and the recipe's shape, so each one can be checked by hand. The two phases of a colocated run:

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
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Arch:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    published_params: float  # the model card's "Number of Parameters", for the check only


# From the models' config.json on the Hugging Face Hub (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, hidden_size / num_attention_heads, vocab_size, tie_word_embeddings).
# Qwen2 attention has biases on q, k and v only.
MODELS = {
    "Qwen2.5-1.5B-Instruct": Arch(1536, 8960, 28, 12, 2, 128, 151936, True, 1.54e9),
    "Qwen2.5-3B-Instruct": Arch(2048, 11008, 36, 16, 2, 128, 151936, True, 3.09e9),
}
CARDS_GIB = (24, 48, 80)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


# Assumptions that are not arithmetic on the architecture (each one is in the output).
BF16, FP32 = 2, 4
LORA_BYTES_PER_PARAM = FP32 + FP32 + 2 * FP32  # fp32 weight (PEFT's autocast_adapter_dtype), grad, AdamW m and v
LOGPROB_TOKEN_TILE, LOGPROB_VOCAB_TILE = 4096, 32768  # TRL 1.16 fused LM head tile (kernels/chunked_logprob.py)
VLLM_PROFILE_TOKENS = 4096  # TRL's colocate LLM(max_num_batched_tokens=4096): vLLM's profile-run forward
VLLM_MAX_NUM_SEQS = 256  # the sampler's fp32 logits rows at profile time (assumed; vLLM's default can be larger)
VLLM_FIXED_BYTES = 1 * GIB  # CUDA graphs pool + non-torch memory vLLM counts in its share (assumed)
RESERVE_FIXED_BYTES = 1 * GIB  # training process's CUDA context + cuBLAS workspaces (assumed)
RESERVE_FRACTION = 0.05  # allocator fragmentation (assumed)
UTIL_STEP = 0.05

ASSUMPTIONS = [
    "Estimate, not a measurement; bytes are exact arithmetic on the assumptions below. GiB = 2^30 bytes; a "
    "'24 GB' card is taken as 24 GiB.",
    "Trainer weights in bf16 (2 bytes/param), embeddings tied (one copy); no reference model (beta 0; with PEFT the "
    "reference is the adapter switched off).",
    "LoRA on q,k,v,o,gate,up,down: r x (in + out) params per module; PEFT keeps adapters in fp32 "
    "(autocast_adapter_dtype=True): 4 (weight) + 4 (grad) + 8 (AdamW m, v) = 16 bytes/param.",
    "Activations under activation checkpointing for one micro-batch of rows x (prompt + completion) tokens, padded "
    "to the longest (worst case), tree packing off (packing computes shared prefixes once: less): one bf16 "
    "checkpoint per layer (hidden) + the working set of the layer being recomputed, taken as (14 hidden + 4 kv_heads "
    "x head_dim + 7 intermediate) bf16 values per token (saved tensors incl. LoRA dropout copies, plus its "
    "gradients) + the boolean 4D attention mask rows x seq^2.",
    "Log-probabilities: TRL 1.16 never materialises (rows, seq, vocab) logits: _get_per_token_logps_and_entropies "
    "calls model(..., fused_lm_head=True) (trainer/utils.py add_fused_lm_head), which projects only completion "
    f"positions, in tiles of {LOGPROB_TOKEN_TILE} tokens x {LOGPROB_VOCAB_TILE} vocab (bf16 under autocast). "
    "Counted: the final hidden states (bf16), the gathered completion hidden states (bf16), the fp32 gradient of "
    "them in backward and one tile.",
    f"vLLM's share (vllm_gpu_memory_utilization x card) = its bf16 weight copy + profile-run activations "
    f"({VLLM_PROFILE_TOKENS} tokens x (2 intermediate + 4 hidden) bf16) + sampler logits ({VLLM_MAX_NUM_SEQS} rows "
    f"x vocab x 3 fp32 buffers; max_num_seqs {VLLM_MAX_NUM_SEQS} assumed, vLLM's default can be larger: 1024 rows "
    f"would add ~1.3 GiB at this vocab) + {VLLM_FIXED_BYTES // GIB} GiB fixed (CUDA graphs, non-torch memory) "
    "+ KV cache. The KV cache is what is left.",
    "KV bytes/token = 2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16). 'Paths held' = KV tokens / "
    "(prompt + completion): worst-case paths with no prefix sharing; ARPO's forks share their prefix blocks, so "
    "more fit.",
    "Sleep mode (training phase): level 2, as arpo-trl's colocate mode sleeps: the KV cache and vLLM's weight copy "
    "are freed; its fixed buffers stay.",
    f"Reserve: {RESERVE_FIXED_BYTES // GIB} GiB (CUDA context, cuBLAS) + {RESERVE_FRACTION:.0%} of the card "
    "(fragmentation). A phase fits when it is <= card - reserve. vllm_gpu_memory_utilization is picked as the "
    f"largest multiple of {UTIL_STEP} that lets the rollout phase fit; the micro-batch as the largest that lets the "
    "training phase fit.",
]


def param_count(arch: Arch) -> int:
    """All parameters: embeddings (+ an untied head), per layer q/k/v (with bias), o, gate/up/down, two norms."""
    kv = arch.kv_heads * arch.head_dim
    q = arch.heads * arch.head_dim
    attention = arch.hidden * q + q + 2 * (arch.hidden * kv + kv) + q * arch.hidden
    mlp = 3 * arch.hidden * arch.intermediate
    layer = attention + mlp + 2 * arch.hidden
    embeddings = arch.vocab * arch.hidden * (1 if arch.tied_embeddings else 2)
    return embeddings + arch.layers * layer + arch.hidden


def lora_param_count(arch: Arch, r: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """r x (in_features + out_features) per targeted linear, per layer."""
    h, kv, q, i = arch.hidden, arch.kv_heads * arch.head_dim, arch.heads * arch.head_dim, arch.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return arch.layers * sum(r * sum(shapes[name]) for name in targets)


def kv_bytes_per_token(arch: Arch) -> int:
    return 2 * arch.layers * arch.kv_heads * arch.head_dim * BF16


def activation_bytes(arch: Arch, rows: int, shape: Shape) -> dict[str, int]:
    """One micro-batch's training activations under activation checkpointing (see ASSUMPTIONS)."""
    seq, completion = shape.path_tokens, shape.completion_tokens
    tokens = rows * seq
    per_token_layer = 14 * arch.hidden + 4 * arch.kv_heads * arch.head_dim + 7 * arch.intermediate
    scored = rows * completion
    head = (tokens * arch.hidden * BF16 + scored * arch.hidden * (BF16 + FP32)
            + min(scored, LOGPROB_TOKEN_TILE) * LOGPROB_VOCAB_TILE * BF16)
    parts = {
        "checkpoints": arch.layers * tokens * arch.hidden * BF16,
        "layer_working_set": tokens * per_token_layer * BF16,
        "logprob_head": head,
        "attention_mask": rows * seq * seq,
    }
    return {**parts, "total": sum(parts.values())}


def vllm_fixed_bytes(arch: Arch) -> int:
    """vLLM's share minus its weights and KV cache: profile activations, sampler logits, CUDA graphs."""
    activations = VLLM_PROFILE_TOKENS * (2 * arch.intermediate + 4 * arch.hidden) * BF16
    sampler = VLLM_MAX_NUM_SEQS * arch.vocab * FP32 * 3
    return activations + sampler + VLLM_FIXED_BYTES


def reserve_bytes(card_bytes: int) -> int:
    return RESERVE_FIXED_BYTES + int(RESERVE_FRACTION * card_bytes)


def plan_card(name: str, arch: Arch, card_gib: int, shape: Shape) -> dict:
    """The settings that fit `card_gib` for `name`, with both phases' bytes; `fits` False when none does."""
    card = card_gib * GIB
    usable = card - reserve_bytes(card)
    weights = param_count(arch) * BF16
    lora_state = lora_param_count(arch, shape.lora_r) * LORA_BYTES_PER_PARAM
    trainer = weights + lora_state
    vllm_floor = weights + vllm_fixed_bytes(arch)  # vLLM's share before any KV
    steps = int((usable - trainer) / card / UTIL_STEP + 1e-9)
    util = round(steps * UTIL_STEP, 2)
    kv = int(util * card) - vllm_floor
    kv = max(kv, 0)
    row = {"model": name, "card_gib": card_gib, "usable_gib": usable / GIB, "trainer_weights": weights,
           "lora_state": lora_state, "vllm_weights": weights, "vllm_fixed": vllm_fixed_bytes(arch),
           "vllm_gpu_memory_utilization": util, "kv_bytes": kv, "kv_tokens": kv // kv_bytes_per_token(arch),
           "kv_bytes_per_token": kv_bytes_per_token(arch), "rollout_phase": trainer + int(util * card)}
    row["paths_held"] = row["kv_tokens"] // shape.path_tokens
    row["micro_batches"] = {}
    for rows in shape.micro_batches:
        acts = activation_bytes(arch, rows, shape)["total"]
        sleeping = trainer + acts + vllm_fixed_bytes(arch)  # level-2 sleep frees vLLM's KV and weights
        awake = trainer + acts + int(util * card)
        row["micro_batches"][rows] = {"activations": acts, "training_phase_sleep": sleeping,
                                      "fits_with_sleep": sleeping <= usable, "training_phase_no_sleep": awake,
                                      "fits_without_sleep": awake <= usable}
    fitting = [rows for rows, m in row["micro_batches"].items() if m["fits_with_sleep"]]
    row["per_device_train_batch_size"] = max(fitting) if fitting else None
    row["gradient_accumulation_steps"] = (shape.rows_per_rollout // row["per_device_train_batch_size"]
                                          if fitting else None)
    row["holds_all_paths"] = row["paths_held"] >= shape.rows_per_rollout
    row["fits"] = kv >= shape.path_tokens * kv_bytes_per_token(arch) and bool(fitting)
    return row


def report(shape: Shape) -> dict:
    models = {name: {"params": param_count(arch), "published_params": arch.published_params,
                     "lora_params": lora_param_count(arch, shape.lora_r),
                     "kv_bytes_per_token": kv_bytes_per_token(arch),
                     "architecture": asdict(arch),
                     "activations_by_micro_batch": {rows: activation_bytes(arch, rows, shape)
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
                     f"{_gib(m['params'] * BF16)} | {_gib(m['lora_params'] * LORA_BYTES_PER_PARAM)} | "
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
