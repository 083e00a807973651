"""`resume_from_checkpoint` continues a run, and with the same seed the in-process engine under the waves scheduler
grows the same trees after resuming as the uninterrupted run did (torch RNG from Trainer's checkpoint, fork RNG from
ours)."""

import json
import logging
import os

import torch
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.trainer import SAMPLER_STATE_FILE
from arpo_trl.training.tracking import read_metrics
from arpo_trl.trees import read_jsonl

TREE_KEYS = ("step", "group", "node", "parent", "kind", "fork_position", "tool_calls", "finish_reason", "segments")


def _trainer(model_dir, tokenizer, dataset, output_dir, **kw):
    args = ARPOConfig(**dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
        max_completion_length=48, max_steps=4, learning_rate=5e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="steps", save_steps=2, seed=3, beta=0.0, temperature=1.2,
        rollout_scheduler="waves",
    ) | kw)
    return ARPOTrainer(model=str(model_dir), reward_funcs=[arpo_math_reward, _length], args=args,
                       train_dataset=dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5, pool_size=0)],
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def _length(completions, **kwargs):
    return [len(str(c)) / 100 for c in completions]


def _trees(run_dir, from_step):
    records = [r for r in read_jsonl(os.path.join(run_dir, "trees.jsonl")) if r["step"] >= from_step]
    return [{k: r[k] for k in TREE_KEYS} for r in records]


def _lora_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" in n}


def test_resume_reproduces_the_trees_of_the_uninterrupted_run(tool_model_dir, tokenizer, addition_dataset, tmp_path,
                                                              caplog):
    full = _trainer(tool_model_dir, tokenizer, addition_dataset, tmp_path / "full")
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / SAMPLER_STATE_FILE.format(rank=0)).is_file()
    expected = _trees(tmp_path / "full", from_step=2)
    assert {r["step"] for r in expected} == {2, 3} and any(r["kind"] == "branch" for r in expected)

    resumed = _trainer(tool_model_dir, tokenizer, addition_dataset, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert _trees(tmp_path / "resumed", from_step=0) == expected, "resumed run grew different trees"
    full_w, resumed_w = _lora_weights(full), _lora_weights(resumed)
    assert all(torch.allclose(full_w[n], resumed_w[n], atol=1e-5) for n in full_w)

    # The saved state is not a fresh seed's: steps 0-1 drew fork decisions, so without it the draws would differ.
    # (Comparing the trees instead would depend on chance: a handful of p~0.5 decisions can coincide.)
    saved = json.loads((checkpoint / SAMPLER_STATE_FILE.format(rank=0)).read_text())
    os.remove(checkpoint / SAMPLER_STATE_FILE.format(rank=0))  # an old checkpoint: resumes, and says what differs
    old = _trainer(tool_model_dir, tokenizer, addition_dataset, tmp_path / "old")
    fresh = old.sampler.state_dict()
    assert saved["rollouts"] == 2 and fresh["rollouts"] == 0, "the saved state does not count steps 0-1's rollouts"
    with caplog.at_level(logging.WARNING, logger="arpo_trl.trainer"):
        old.train(resume_from_checkpoint=str(checkpoint))
    assert "no sampler RNG state" in caplog.text
    assert old.state.global_step == 4


def _logged_steps(run_dir):
    return [row["step"] for row in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "reward" in row]


def test_a_run_started_again_in_its_folder_logs_each_step_once(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """metrics.jsonl and trees.jsonl are appended to: a run resumed in its own folder keeps the rows up to its
    checkpoint and logs the rest once; a run started afresh there keeps none of the earlier run's."""
    run = tmp_path / "run"
    _trainer(tool_model_dir, tokenizer, addition_dataset, run).train()
    first = read_jsonl(run / "trees.jsonl")
    assert _logged_steps(run) == [1, 2, 3, 4] and sorted({r["step"] for r in first}) == [0, 1, 2, 3]

    _trainer(tool_model_dir, tokenizer, addition_dataset, run).train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert _logged_steps(run) == [1, 2, 3, 4]
    resumed = read_jsonl(run / "trees.jsonl")
    assert [r for r in resumed if r["step"] < 2] == [r for r in first if r["step"] < 2]
    assert len(resumed) == len({(r["step"], r["group"], r["node"]) for r in resumed}), "a step's trees twice"
    assert sorted({r["step"] for r in resumed}) == [0, 1, 2, 3]

    _trainer(tool_model_dir, tokenizer, addition_dataset, run, max_steps=1, save_strategy="no").train()
    assert _logged_steps(run) == [1] and {r["step"] for r in read_jsonl(run / "trees.jsonl")} == {0}
