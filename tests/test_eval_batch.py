"""The evaluation batch must hold whole groups of `num_generations_eval` trajectories on each process, as the
training batch must hold whole groups of `num_generations` (issue 28, point 6): the sampler builds each prompt's
trajectories on one process, from one batch."""

import pytest

from arpo_trl import ARPOConfig, ARPOTrainer, Tool


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, initial_rollouts=2,
                max_completion_length=16, use_cpu=True, bf16=False, report_to="none", save_strategy="no")
    return ARPOConfig(**{**base, **kw})


def test_config_rejects_an_eval_batch_that_splits_groups_across_processes(tmp_path, monkeypatch):
    # Two processes × 2 rows = 4 rows: TRL's global check (4 % 4) passes, but each process would get half a group.
    monkeypatch.setattr(ARPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size \(2\).*num_generations_eval \(4\)"):
        _config(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2, num_generations_eval=4)
    _config(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8, num_generations_eval=4)
    _config(tmp_path, per_device_eval_batch_size=2, num_generations_eval=4)  # no evaluation configured


def test_evaluate_rejects_a_batch_that_splits_a_group(tiny_model_dir, tokenizer, addition_dataset, tmp_path):
    # Evaluation started by hand (eval_strategy='no'): 6 rows hold one group of 4 and half of the next.
    args = _config(tmp_path, per_device_eval_batch_size=6, num_generations_eval=4)
    trainer = ARPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=addition_dataset, eval_dataset=addition_dataset.select(range(4)),
                          processing_class=tokenizer, tools=[Tool("python", lambda code: "2")])
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size.*num_generations_eval \(4\)"):
        trainer.evaluate()
