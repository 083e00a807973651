"""`ARPOTrainer` as a drop-in for `GRPOTrainer`: TRL's documented examples with `GRPOTrainer` / `GRPOConfig` swapped for
`ARPOTrainer` / `ARPOConfig` and nothing else changed (rewards returning None, `generation_kwargs`, what
`training_step` receives). Plain-function tools: tests/test_function_tools.py."""

import json
import math

import pytest
import torch
from datasets import Dataset
from tiny import question, tiny_model
from trl.trainer import grpo_trainer

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.training.advantages import hard_advantages, token_owners


def config(tmp_path, **kw) -> ARPOConfig:
    return ARPOConfig(**{
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 16, "max_steps": 1, "logging_steps": 1, "use_cpu": True, "bf16": False,
        "report_to": "none", "save_strategy": "no", "log_trees": False, "seed": 0, **kw})


# ---- rewards returning None ------------------------------------------------------------------------------------
def math_reward_func(completions, task, **kwargs):
    """TRL's multi-task example: a reward for the math rows, None for the others."""
    return [1.0 if t == "math" else None for t in task]


def length_reward_func(completions, task, **kwargs):
    return [len(c[0]["content"]) / 100 if t == "code" else None for c, t in zip(completions, task)]


def test_hard_attribution_leaves_rows_without_any_reward_out_of_a_shared_tokens_mean():
    # one group: path 0 (6 tokens), branch 1 forked from it at 2, branch 2 forked from it at 4
    owners = token_owners([0, 1, 2], [None, 0, 0], [None, 2, 4], [6, 6, 6], 6)
    advantages = torch.tensor([1.0, -1.0, 0.0])  # row 2 unscored: TRL gave it advantage 0
    out = hard_advantages(advantages, owners, [0, 0, 0], scored=[True, True, False])
    assert out[0, :2].tolist() == [0.0, 0.0]  # shared by 0, 1 (and 2, not counted): mean of 1 and -1
    assert out[0, 2:4].tolist() == [1.0, 1.0]  # shared by 0 and 2: row 0's alone, not diluted to 0.5
    assert out[2, 4:].tolist() == [0.0, 0.0]  # row 2's own tokens: no signal
    assert hard_advantages(advantages, owners, [0, 0, 0])[0, 2:4].tolist() == [0.5, 0.5]  # all scored: as before


def test_rewards_returning_none_follow_trl(tmp_path, tokenizer, monkeypatch):
    """TRL: None → NaN, summed with nansum; a row with no reward at all is warned about and gets advantage 0."""
    warnings = []
    monkeypatch.setattr(grpo_trainer.logger, "warning", lambda message, *a, **k: warnings.append(str(message)))
    rows = [{"prompt": [{"role": "user", "content": question(i, i)}], "task": task}
            for i, task in enumerate(["math", "code", "poetry"])]
    args = config(tmp_path, max_steps=3, log_trees=True, advantage_attribution="hard")
    trainer = ARPOTrainer(model=tiny_model(tokenizer), reward_funcs=[math_reward_func, length_reward_func], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    assert any("All reward functions returned None" in w for w in warnings)
    steps = [row for row in trainer.state.log_history if "reward" in row]
    assert len(steps) == 3
    records = [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()]
    by_step = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    kinds = sorted(tuple(sorted({r["reward"] is None for r in group})) for group in by_step.values())
    assert kinds == [(False,), (False,), (True,)]  # one prompt (poetry) had no reward at all: null, not 0
    unscored = next(group for group in by_step.values() if group[0]["reward"] is None)
    assert all(r["advantage"] == 0.0 for r in unscored)
    assert (tmp_path / "reward_curve.png").exists()
    assert any(row.get("rewards/math_reward_func/mean") is None or
               math.isnan(row["rewards/math_reward_func/mean"]) for row in steps)


# ---- generation_kwargs -------------------------------------------------------------------------------------------
def test_generation_kwargs_override_the_defaults_as_in_grpo_trainer(tmp_path, tokenizer, addition_dataset):
    """TRL's docs: `GRPOConfig(generation_kwargs={...})` overrides the trainer's own sampling settings."""
    args = config(tmp_path, temperature=1.0, generation_kwargs={"do_sample": True, "top_k": 50, "top_p": 0.9,
                                                                "temperature": 0.7, "no_repeat_ngram_size": 3})
    trainer = ARPOTrainer(model=tiny_model(tokenizer), reward_funcs=length_reward, args=args,
                          train_dataset=addition_dataset, processing_class=tokenizer)
    engine = trainer.engine  # the warpers run in ARPO's recorder, so that its logprobs are those sampled from
    assert engine.warper_settings == (0.7, 50, 0.9, None) and engine.temperature == 0.7
    assert (engine.sampling["top_k"], engine.sampling["top_p"], engine.sampling["temperature"]) == (0, 1.0, 1.0)
    assert engine.sampling["no_repeat_ngram_size"] == 3 and engine.sampling["do_sample"]
    trainer.train()
    assert trainer.state.global_step == 1


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_beams": 4}, r"^generation_kwargs\['num_beams'\]=4 cannot work with ARPO's branching rollout: beam search"),
    ({"num_return_sequences": 2}, r"num_return_sequences'\]=2 .*num_generations sets how many"),
    ({"max_new_tokens": 64}, r"max_new_tokens'\]=64 .*max_completion_length"),
    ({"prompt_lookup_num_tokens": 3}, r"assisted decoding skips the logits processors"),
])
def test_generation_kwargs_that_cannot_branch_are_refused_in_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        config(tmp_path, generation_kwargs=kwargs)
    assert "\n" not in str(error.value)
    config(tmp_path, generation_kwargs={"num_beams": 1, "num_return_sequences": 1})  # the defaults themselves: fine


# ---- what training_step and compute_loss receive -----------------------------------------------------------------
def recording(base):
    class Recording(base):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)  # the keys once the step has run
            self.step_keys = getattr(self, "step_keys", []) + [sorted({k for example in inputs for k in example})]
            return loss

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.loss_keys = sorted(inputs)
            return super().compute_loss(model, inputs, *args, **kwargs)
    return Recording


def test_training_step_and_compute_loss_see_what_grpo_trainer_gives_them(tmp_path, tokenizer, addition_dataset):
    from trl import GRPOConfig, GRPOTrainer

    seen = {}

    def reward(completions, **kwargs):
        seen.update(kwargs)
        return [float(len(c[0]["content"])) for c in completions]

    common = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "max_steps": 2,
              "use_cpu": True, "bf16": False, "report_to": "none", "save_strategy": "no", "logging_steps": 1}
    grpo = recording(GRPOTrainer)(model=tiny_model(tokenizer), reward_funcs=reward,
                                  args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common),
                                  train_dataset=addition_dataset, processing_class=tokenizer)
    grpo.train()
    arpo = recording(ARPOTrainer)(model=tiny_model(tokenizer), reward_funcs=reward,
                                  args=ARPOConfig(output_dir=str(tmp_path / "arpo"), log_trees=False,
                                                  advantage_attribution="hard", **common),
                                  train_dataset=addition_dataset, processing_class=tokenizer)
    seen.clear()
    arpo.train()
    assert arpo.step_keys == grpo.step_keys == [["ground_truth", "prompt"]] * 2
    # documented extras, as GRPOTrainer has them with tools (tool_mask) and with vLLM (the sampler's logprobs)
    assert set(arpo.loss_keys) - set(grpo.loss_keys) == {"tool_mask", "sampling_per_token_logps"}
    assert {"arpo_node", "arpo_parent", "arpo_calls", "arpo_fork_position"} <= set(seen)  # rewards still get them
    assert not any(key.startswith("arpo_") for row in addition_dataset for key in row)


# ---- the engine's per-token statistics cannot be skipped silently ------------------------------------------------
def test_a_generate_that_skips_the_logits_processor_is_named(tokenizer):
    from arpo_trl.generation.transformers_engine import TransformersEngine

    model = tiny_model(tokenizer)
    standard = model.generate

    def custom_generate(*args, logits_processor=None, **kwargs):  # as a remote-code generate that drops it
        return standard(*args, **kwargs)

    model.generate = custom_generate
    engine = TransformersEngine(model, tokenizer)
    prefix = tokenizer.encode("What is 1+1?", add_special_tokens=False)
    with pytest.raises(RuntimeError, match=r"called ARPO's logits processor 0 times.*custom or remote-code `generate`"):
        engine.generate([prefix], [4], [])
    model.generate = standard
    (segment,) = engine.generate([prefix], [4], [])
    assert len(segment.logprobs) == len(segment.entropies) == len(segment.token_ids) > 0
