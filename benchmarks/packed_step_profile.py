"""Where one training step's time goes on a GPU, tree-packed against unpacked (docs/gpu_checks.md).

    python benchmarks/packed_step_profile.py [sdpa|eager|flex_attention]

SmolLM2-135M's architecture (random weights), the multi-call recipe's LoRA and loss, bf16 autocast, eight M16N8 ARPO
micro-batches built as benchmarks/packed_training.py builds them. Three warm-up steps per mode on the first three
batches, then five steps per mode on batches the run has not seen (the first sight of each shape), the same five again
(shapes seen), and a torch.profiler table of one step per mode. Prints seconds and the tables; needs CUDA.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from packed_batches import micro_batch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tiny import build_tokenizer  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from arpo_trl import ARPOConfig, ARPOTrainer  # noqa: E402
from benchmarks.packed_training import PROMPT_TOKENS, SETTINGS, tree_paths  # noqa: E402

M, N = 16, 8
SHAPE = SETTINGS[(M, N)]
LORA = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def make_trainer(attention: str) -> ARPOTrainer:
    config = LlamaConfig(num_hidden_layers=30, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True, attn_implementation=attention, vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    torch.manual_seed(0)
    args = ARPOConfig(output_dir="runs/packed_step_profile", per_device_train_batch_size=SHAPE["prompts"] * M,
                      num_generations=M, initial_rollouts=N, max_completion_length=SHAPE["max_completion_length"],
                      loss_type="dapo", beta=0.0, bf16=True, report_to="none", save_strategy="no", log_trees=False)
    trainer = ARPOTrainer(model=LlamaForCausalLM(config), reward_funcs=zero_reward,
                          args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
                          processing_class=build_tokenizer(), peft_config=LORA)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def micro_batches(count: int, vocab: int) -> list[dict]:
    batches = []
    for step in range(count):
        rng = random.Random(f"0/{step}/{M}")
        trees = [tree_paths(rng, M, N, "arpo", SHAPE["max_completion_length"]) for _ in range(SHAPE["prompts"])]
        batch = micro_batch(trees, vocab, 0, seed=rng.randrange(1 << 30),
                            prompt_lengths=[PROMPT_TOKENS + 3 * i for i in range(len(trees))])
        batches.append({key: value.cuda() for key, value in batch.items()})
    return batches


def step_seconds(trainer: ARPOTrainer, batch: dict, packed: bool) -> float:
    trainer.args.tree_packing = packed
    torch.cuda.synchronize()
    started = time.perf_counter()
    trainer.compute_loss(trainer.model, batch).backward()
    torch.cuda.synchronize()
    trainer.model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main(attention: str) -> None:
    trainer = make_trainer(attention)
    batches = micro_batches(8, trainer.model.config.vocab_size)
    for packed in (True, False):
        for batch in batches[:3]:
            step_seconds(trainer, batch, packed)
    for seen, packed in ((False, True), (False, False), (True, True), (True, False)):
        times = [round(step_seconds(trainer, batch, packed), 3) for batch in batches[3:]]
        print(attention, "packed" if packed else "unpacked", "shapes seen" if seen else "first sight", times)
    for packed in (True, False):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            step_seconds(trainer, batches[3], packed)
        for key, rows in (("self_cpu_time_total", 18), ("self_device_time_total", 12)):
            print(f"==== {attention} {'packed' if packed else 'unpacked'}: top by {key}")
            print(profiler.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sdpa")
