"""ARPOTrainer end to end on CPU: a tiny model that calls `<python>`, real PythonTool subprocesses, TRL's loss."""

import json
import re

import pytest
import torch
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.rewards import completion_text, validate_format
from arpo_trl.trees import read_jsonl


def length_reward(completions, **kwargs):
    """Shaping so that a 107k-parameter model's group rewards differ: the ARPO reward alone is mostly -1."""
    return [len(completion_text(c)) / 100 for c in completions]


REWARDS = [arpo_math_reward, length_reward]


class RecordingTrainer(ARPOTrainer):
    """Keeps what TRL hands to the loss, to check masks and advantages."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.recorded = getattr(self, "recorded", []) + [output]
        return output


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
        max_completion_length=48, max_steps=2, learning_rate=5e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", seed=0, beta=0.0, gradient_checkpointing=False,
    )
    base.update(kw)
    return ARPOConfig(**base)


def check_masks(trainer, tokenizer, before, hard=False):
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before), "no trainable weight changed"
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"arpo/forks_per_group", "arpo/tool_calls_per_group", "arpo/tokens_generated_per_group"} <= logs
    tool_calls = 0
    for output in trainer.recorded:
        ids, loss_mask = output["completion_ids"], output["completion_mask"] * output["tool_mask"]
        real = output["completion_mask"]
        for row, mask, keep in zip(ids.tolist(), output["tool_mask"].tolist(), real.tolist()):
            spans, current = [], []
            for token, bit, is_real in zip(row, mask, keep):
                if bit == 0 and is_real:
                    current.append(token)
                elif current:
                    spans, current = spans + [current], []
            spans += [current] if current else []
            if hard:  # shared tokens are masked in every row but their owner's: spans are not result blocks
                tool_calls += tokenizer.decode([t for t, k in zip(row, keep) if k]).count("<result>")
                continue
            length = sum(keep)
            for k, span in enumerate(spans):  # every masked span is a result block (or the EOS after the call limit)
                text = tokenizer.decode(span)
                ends_row = k == len(spans) - 1 and row[length - len(span) : length] == span
                if ends_row and not text.endswith(("</result>", "<|im_end|>")):  # cut by the token budget
                    assert text.startswith(" <result>\n"), text
                    continue
                assert re.fullmatch(r" <result>\n.*\n</result>(<\|im_end\|>)?|<\|im_end\|>", text, re.DOTALL), text
                tool_calls += text.count("<result>")
        assert loss_mask.sum() > 0
    assert tool_calls > 0, "the tiny tool model should have called <python>"
    return tool_calls


def test_end_to_end_full_finetune_with_python_tool(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    trainer = RecordingTrainer(
        model=str(tool_model_dir), reward_funcs=REWARDS, args=_args(tmp_path),
        train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)],
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    check_masks(trainer, tokenizer, before)
    rewards = [e["rewards/arpo_math_reward/mean"] for e in trainer.state.log_history if "reward" in e]
    assert rewards and all(-1.0 <= r <= 1.1 for r in rewards)
    check_run_folder(tmp_path, trainer, steps=2)


def check_run_folder(run, trainer, steps):
    """trees.jsonl holds every step's trees with the rewards TRL computed; metrics, curve and pictures exist."""
    records = read_jsonl(run / "trees.jsonl")
    assert sorted({r["step"] for r in records}) == list(range(steps))
    m = trainer.args.num_generations
    for step in range(steps):
        rows = [r for r in records if r["step"] == step]
        assert len(rows) == 2 * m  # 8 completions per step = 2 prompts × M
        for r in rows:  # reward = length shaping + ARPO's reward, recomputed from the record's own text
            text = "".join(seg["text"] for seg in r["segments"])
            arpo_part = r["reward"] - length_reward([text])[0]
            if validate_format(text) is not None:
                assert arpo_part == pytest.approx(-1.0, abs=1e-6)
            else:
                assert min(abs(arpo_part - v) for v in (0.0, 1.0)) < 1e-6
            assert r["advantage"] is not None
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics if "reward" in row] == list(range(1, steps + 1))
    pictures = {p.name for p in (run / "trees").iterdir()}
    assert {"entropy_around_tools.png", "entropy_around_tools.json", f"tree_step{steps - 1}_group0.png",
            f"tree_step{steps - 1}_group0.html"} <= pictures
    assert (run / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_end_to_end_lora_hard_attribution(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = RecordingTrainer(
        model=str(tool_model_dir), reward_funcs=REWARDS,
        args=_args(tmp_path, advantage_attribution="hard", branch_threshold=1.0),
        train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)],
        peft_config=lora,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("lora" in n for n in before)
    trainer.train()
    check_masks(trainer, tokenizer, before, hard=True)
    output = trainer.recorded[0]
    assert output["advantages"].dim() == 2  # per-token advantages
    forks = [e["arpo/forks_per_group"] for e in trainer.state.log_history if "arpo/forks_per_group" in e]
    assert sum(forks) > 0, "τ=1 forks at every tool result while the budget lasts"
    for entry in trainer.state.log_history:  # each generated token trained exactly once
        if "arpo/tokens_trained_per_group" in entry:
            assert entry["arpo/tokens_trained_per_group"] == entry["arpo/tokens_generated_per_group"]


def test_trainer_rejects_bad_setup(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    from trl import GRPOConfig

    grpo = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                      bf16=False, report_to="none")
    with pytest.raises(TypeError, match="ARPOConfig"):
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=grpo,
                    train_dataset=addition_dataset, processing_class=tokenizer)
    with pytest.raises(TypeError, match="Tool"):
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path),
                    train_dataset=addition_dataset, processing_class=tokenizer, tools=[print])


def test_model_card_names_arpo_and_cites_the_paper(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path),
                          train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool()])
    trainer.create_model_card(model_name="tiny-arpo", dataset_name="addition")
    card = (tmp_path / "README.md").read_text()
    assert "ARPO" in card and "2507.19849" in card and "Agentic Reinforced Policy Optimization" in card
    assert "arpo" in card and "trl" in card  # tags
