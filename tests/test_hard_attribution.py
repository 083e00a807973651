"""Hard attribution against TRL's per-row normalisations (issue 54, point 3) and in evaluation.

Hard attribution trains a shared token in one row only, so a branch's row holds just its own suffix. grpo and sapo
divide a row by its trained tokens: they must still weigh a token by its trajectory's length. Settings that weigh or
drop a row by a statistic over its trained tokens are refused."""

import math

import pytest
import torch
from test_rollout import ScriptedEngine
from test_trainer import group_advantages, owner
from test_truncated_owners import MAX_LENGTH, M, Recorder, owner_truncated_script

from arpo_trl import ARPOConfig, ARPOTrainer, Tool

BASE = dict(per_device_train_batch_size=4, num_generations=4, use_cpu=True, bf16=False, report_to="none")

REFUSED = [
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
    ({"importance_sampling_level": "sequence", "loss_type": "luspo"}, "importance_sampling_level='sequence'"),
    ({"loss_type": "vespo"}, "loss_type='vespo'"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold=0.5"),
    ({"use_vllm": True}, "use_vllm=True, vllm_importance_sampling_mode='sequence_mask'"),
    ({"use_vllm": True, "vllm_importance_sampling_mode": "sequence_truncate"}, "'sequence_truncate'"),
    ({"loss_type": "grpo", "beta": 0.04}, "loss_type='grpo', beta=0.04"),
    ({"loss_type": "sapo", "beta": 0.04}, "loss_type='sapo', beta=0.04"),
]

ALLOWED = [
    {"loss_type": loss_type} for loss_type in ("dapo", "bnpo", "dr_grpo", "cispo", "luspo", "grpo", "sapo")
] + [
    {"beta": 0.04},  # dapo's KL term is a token sum too
    {"top_entropy_quantile": 0.5},  # a quantile over the batch's trained tokens, each counted once
    {"use_vllm": True, "vllm_importance_sampling_mode": "token_mask"},
    {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"},
    {"use_vllm": True, "vllm_importance_sampling_correction": False},
]


@pytest.mark.parametrize(("settings", "named"), REFUSED)
def test_settings_that_judge_a_row_by_its_trained_tokens_are_refused_in_one_line(tmp_path, settings, named):
    with pytest.raises(ValueError) as refused:
        ARPOConfig(output_dir=str(tmp_path), advantage_attribution="hard", **BASE, **settings)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("advantage_attribution='hard'") and named in message
    assert message.endswith("or advantage_attribution='soft'.")
    ARPOConfig(output_dir=str(tmp_path), advantage_attribution="soft", **BASE, **settings)


@pytest.mark.parametrize("settings", ALLOWED)
def test_token_level_settings_are_allowed(tmp_path, settings):
    ARPOConfig(output_dir=str(tmp_path), advantage_attribution="hard", **BASE, **settings)


def token_weights(trainer, output: dict) -> torch.Tensor:
    """-d loss / d log π of every completion token under TRL's own `_compute_loss`, at ratio 1, without gradient
    accumulation (eval mode): the weight each token instance is trained with."""
    logps = torch.zeros(output["completion_ids"].shape, requires_grad=True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    trainer.model.eval()
    trainer._compute_loss(trainer.model, {k: v for k, v in output.items() if k != "old_per_token_logps"}).backward()
    return -logps.grad


@pytest.mark.parametrize(("loss_type", "mask_truncated"), [("grpo", False), ("sapo", False), ("dapo", False),
                                                          ("grpo", True)])
def test_a_shared_token_weighs_the_mean_of_its_trajectories_weights(tiny_model_dir, tokenizer, addition_dataset,
                                                                    tmp_path, loss_type, mask_truncated):
    """grpo/sapo weigh a token of trajectory i by A_i / (B·L_i), L_i its trained tokens; hard attribution gives a
    shared token the mean of those weights over the kept trajectories sharing it, once (dapo: the mean of A_i / N).
    The scripted trees (tests/test_truncated_owners.py) share long trunks with short branches."""
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * M, num_generations=M, initial_rollouts=2,
        branch_threshold=1.0, max_completion_length=MAX_LENGTH, max_steps=1, learning_rate=0.0, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0, loss_type=loss_type,
        advantage_attribution="hard", mask_truncated_completions=mask_truncated, log_trees=False)
    trainer = Recorder(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [
        float("boxed" in str(c)) + 0.01 * i for i, c in enumerate(completions)],
        args=args, train_dataset=addition_dataset, processing_class=tokenizer,
        tools=[Tool("python", lambda code: "2")], engine=ScriptedEngine(tokenizer, owner_truncated_script(),
                                                                         vocab_size=len(tokenizer)))
    trainer.train()
    (output,), (rows,), (rewards,), (env_mask,) = (trainer.recorded, trainer.recorded_rows, trainer.recorded_rewards,
                                                   trainer.env_masks)
    weights = token_weights(trainer, output).double()
    advantages = group_advantages(rewards.double(), M)
    lengths = [sum(mask) for mask in env_mask]  # each trajectory's trained tokens: what soft mode divides it by
    per_token = ([a / (len(rows) * n) for a, n in zip(advantages.tolist(), lengths)] if loss_type != "dapo" else
                 (advantages / output["num_items_in_batch"]).tolist())
    owned = (output["completion_mask"] * output["tool_mask"]).sum(-1).tolist()
    kept = output["completion_mask"].any(1).tolist()
    if not mask_truncated:  # else the truncated global paths leave the loss, and their branches train their trunks
        assert max(n / o for n, o in zip(lengths, owned)) > 2, "no branch trains under half its trajectory"
    for i, row in enumerate(rows):
        for t in range(row["arpo_length"]):
            if owner(rows, i, t) != row["arpo_node"] or not env_mask[i][t]:
                continue  # each model token checked once, from the row of the path that generated it
            sharing = [j for j, other in enumerate(rows) if other["arpo_group"] == row["arpo_group"]
                       and t < other["arpo_length"] and owner(rows, j, t) == row["arpo_node"]]
            counted = [j for j in sharing if kept[j]]
            expected = sum(per_token[j] for j in counted) / max(len(counted), 1)
            assert weights[sharing, t].sum().item() == pytest.approx(expected, rel=1e-4, abs=1e-7), (i, t, sharing)


def test_evaluate_with_an_eval_batch_larger_than_the_generation_batch(tiny_model_dir, tokenizer, addition_dataset,
                                                                      tmp_path):
    """TRL's logs keep the last `generation_batch_size` rows (4 here), from which the unscored rows were read; one
    eval batch holds 8. Evaluation never forks, so hard attribution has nothing to do there."""
    args = ARPOConfig(output_dir=str(tmp_path), initial_rollouts=2, per_device_eval_batch_size=8,
                      num_generations_eval=4, max_completion_length=12, save_strategy="no",
                      advantage_attribution="hard", log_trees=False, **BASE)
    trainer = ARPOTrainer(model=str(tiny_model_dir), args=args, train_dataset=addition_dataset,
                          eval_dataset=addition_dataset.select(range(2)), processing_class=tokenizer,
                          reward_funcs=lambda completions, **kw: [None] + [float(len(str(c))) for c in completions[1:]],
                          tools=[Tool("python", lambda code: "2")])
    assert args.generation_batch_size == 4
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    with pytest.raises(RuntimeError, match="fewer than the 8"):
        trainer._trl.unscored(8)  # never read short again
