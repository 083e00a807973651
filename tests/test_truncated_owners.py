"""Attribution × TRL's `mask_truncated_completions` on trees whose shared prefixes belong to truncated paths (issue
28, points 1 and 4). A scripted engine (a test double for the model only; the sampler, TRL and its loss are real)
grows each group so: two global paths call the tool; after the result each forks (τ = 1); the global path rambles
until the token budget cuts it (truncated), its branch answers and ends with EOS. So the prefix a branch shares is
owned by a truncated path."""

import itertools

import pytest
import torch
from test_rollout import CALL, ScriptedEngine
from test_trainer import RecordingTrainer, group_advantages, owner

from arpo_trl import ARPOConfig, Tool

M, MAX_LENGTH = 4, 40


def owner_truncated_script():
    started, seen = itertools.count(), {}

    def script(text, rng):
        if "</result>" not in text:  # a new global path: a call of its own (distinct text per path)
            return f"go{next(started)} {CALL}", 1.0, "stop"
        seen[text] = seen.get(text, 0) + 1
        if seen[text] == 1:  # the path that made the call (first in its wave) rambles past the budget
            return "blah " * MAX_LENGTH, 1.0, "length"
        return "<answer>\\boxed{2}</answer>", 1.0, "eos"  # its branch answers
    return script


class Recorder(RecordingTrainer):
    """Also keeps each rollout's model-token masks, as the sampler made them."""

    def _arpo_rollout(self, prompts, trainer=None):
        sample = self.sampler.sample

        def recording_sample(*args, **kwargs):
            result = sample(*args, **kwargs)
            self.env_masks = getattr(self, "env_masks", []) + [[list(t.mask) for t in result.trajectories]]
            return result

        self.sampler.sample = recording_sample
        try:
            return super()._arpo_rollout(prompts, trainer)
        finally:
            self.sampler.sample = sample


def _train(tiny_model_dir, tokenizer, addition_dataset, tmp_path, attribution, mask_truncated):
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * M, num_generations=M, initial_rollouts=2,
        branch_threshold=1.0, max_completion_length=MAX_LENGTH, max_steps=1, learning_rate=1e-3, logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0,
        advantage_attribution=attribution, mask_truncated_completions=mask_truncated,
    )
    engine = ScriptedEngine(tokenizer, owner_truncated_script(), vocab_size=len(tokenizer))
    trainer = Recorder(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [
        float("boxed" in str(c)) + 0.01 * i for i, c in enumerate(completions)],
        args=args, train_dataset=addition_dataset, processing_class=tokenizer,
        tools=[Tool("python", lambda code: "2")], engine=engine)
    trainer.train()
    return trainer


@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("attribution", ["soft", "hard"])
def test_shared_tokens_are_trained_as_the_attribution_defines(tiny_model_dir, tokenizer, addition_dataset, tmp_path,
                                                              attribution, mask_truncated):
    trainer = _train(tiny_model_dir, tokenizer, addition_dataset, tmp_path, attribution, mask_truncated)
    (output,), (rows,), (rewards,), (env_mask,) = (trainer.recorded, trainer.recorded_rows, trainer.recorded_rewards,
                                                   trainer.env_masks)
    loss_mask = (output["completion_mask"] * output["tool_mask"]).tolist()
    group_adv = group_advantages(rewards.double(), M)
    advantages = output["advantages"].double()
    eos = tokenizer.eos_token_id
    truncated = [output["completion_ids"][i, row["arpo_length"] - 1].item() != eos for i, row in enumerate(rows)]
    kept = [not (mask_truncated and cut) for cut in truncated]
    assert sum(truncated) == len(rows) // 2, "every global path is truncated, every branch ends with EOS"
    truncated_owner_shares, trained_total = 0, 0
    for i, row in enumerate(rows):
        for t in range(row["arpo_length"]):
            node = owner(rows, i, t)
            if node != row["arpo_node"]:
                continue  # each token instance is checked once, from the row of the path that generated it
            sharing = [j for j, other in enumerate(rows) if other["arpo_group"] == row["arpo_group"]
                       and t < other["arpo_length"] and owner(rows, j, t) == node]
            kept_sharing = [j for j in sharing if kept[j]]
            trained_in = [j for j in sharing if loss_mask[j][t]]
            truncated_owner_shares += truncated[i] and len(sharing) > 1 and bool(kept_sharing)
            if not env_mask[i][t]:  # a tool result: trained nowhere
                assert trained_in == []
                continue
            if attribution == "soft":  # plain GRPO: each kept copy, with its own advantage
                assert trained_in == kept_sharing
                assert all(advantages[j] == pytest.approx(group_adv[j].item(), abs=1e-4) for j in trained_in)
            else:  # once, if any row sharing it is kept, at the mean advantage of the kept rows sharing it
                assert len(trained_in) == (1 if kept_sharing else 0), (i, t, sharing, trained_in, kept)
                assert set(trained_in) <= set(kept_sharing)
                for j in trained_in:
                    expected = group_adv[kept_sharing].mean().item()
                    assert advantages[j, t].item() == pytest.approx(expected, abs=1e-4)
            trained_total += len(trained_in)
    assert truncated_owner_shares > 0, "no shared prefix owned by a truncated path that a kept row shares"
    logged = trainer.state.log_history[0]
    assert logged["arpo/tokens_trained_per_group"] == pytest.approx(trained_total / (len(rows) // M))


@pytest.mark.parametrize("attribution", ["soft", "hard"])
def test_completion_length_metrics_are_true_lengths(tiny_model_dir, tokenizer, addition_dataset, tmp_path,
                                                    attribution):
    """TRL's `completions/*_length` count every model token of a trajectory, its shared prefix included, whatever
    the attribution trains (point 4)."""
    trainer = _train(tiny_model_dir, tokenizer, addition_dataset, tmp_path, attribution, mask_truncated=False)
    lengths = torch.tensor([sum(row) for row in trainer.env_masks[0]], dtype=torch.float)
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] == pytest.approx(lengths.mean().item())
    assert logged["completions/min_length"] == lengths.min().item()
    assert logged["completions/max_length"] == lengths.max().item()
