"""A clean console: two ARPO steps (LoRA, activation checkpointing, the Python tool, as the quickstart) repeat no
warning from step to step."""

import collections
import logging
import warnings

from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.rewards import format_credit_reward


def test_two_steps_repeat_no_warning(tool_model_dir, addition_dataset, tmp_path, caplog):
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
        max_completion_length=32, max_steps=2, learning_rate=1e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", seed=0, beta=0.0, gradient_checkpointing=True, log_trees=False,
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.resetwarnings()  # not pytest's filters (they hide FutureWarning): every warning, every time,
        warnings.simplefilter("always")  # except what ARPOTrainer itself filters when it is built
        trainer = ARPOTrainer(
            model=str(tool_model_dir), reward_funcs=[arpo_math_reward, format_credit_reward], args=args,
            train_dataset=addition_dataset, tools=[PythonTool(timeout=5)],
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )
        caplog.clear()
        before = len(caught)
        trainer.train()
    caught = caught[before:]
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    messages += [f"log {r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    repeated = {m: n for m, n in collections.Counter(messages).items() if n > 1}
    assert trainer.state.global_step == 2
    assert not repeated, repeated
    assert not any("gradient_checkpointing_" in m and "deprecated" in m for m in messages), messages
