"""What tree packing must not change (issue "training-signal correctness, round 2"): models whose forward depends on
how a batch is laid out fall back to TRL's unpacked rows, and regrouping rows into micro-batches happens only where
every optimizer step sees the same rows with the same loss weights as under `GRPOTrainer`."""

from __future__ import annotations

import pytest
import torch
from packed_batches import micro_batch
from test_tree_packing import loss_and_grads, make_trainer

from arpo_trl.training.compatibility import packing_blocker

HEAD_DIM = 32  # head_dim / 2 RoPE frequencies
ORIGINAL_CONTEXT = 16  # the rows below are 20-40 tokens deep: past it, the long/short choices differ
ROPE_PARAMETERS = {  # every rope_type of transformers 5.24's ROPE_INIT_FUNCTIONS, and the default
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "longrope": {"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [4.0] * (HEAD_DIM // 2),
                 "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "llama3": {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "proportional": {},
}
LENGTH_DEPENDENT = {"dynamic", "longrope"}


def save_rope_model(tokenizer, path, rope_type: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2 * ORIGINAL_CONTEXT, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_PARAMETERS[rope_type]},
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_every_rope_type_of_transformers_is_checked():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_PARAMETERS), "a new rope_type: add it to the tests"


@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
def test_rope_scaling_that_depends_on_the_length_falls_back_and_the_rest_packs_exactly(
        rope_type, tokenizer, addition_dataset, tmp_path):
    """A pack's longest position is its deepest token; TRL's padded rows reach the padded width. Dynamic NTK and
    LongRoPE pick frequencies from that position, so packed log-probabilities would differ from TRL's (and the
    old-logprob pass from the policy pass): they fall back. Every static rope_type stays packed and exact."""
    model_dir = save_rope_model(tokenizer, tmp_path / "model", rope_type)
    trainer = make_trainer(model_dir, tokenizer, addition_dataset, tmp_path / "out", beta=0.04)
    reason = trainer._packing_fallback(trainer.model)
    batch = micro_batch(["one_fork", "several_forks"], len(tokenizer), tokenizer.pad_token_id, prompt_lengths=[9, 13])
    loss, grads = loss_and_grads(trainer, batch, packed=False, old_logps=True)
    packed_loss, packed_grads = loss_and_grads(trainer, batch, packed=True, old_logps=True)
    if rope_type in LENGTH_DEPENDENT:
        assert reason is not None and repr(rope_type) in reason
        assert torch.equal(packed_loss, loss)  # TRL's own forward
    else:
        assert reason is None, reason
        assert torch.allclose(packed_loss, loss, rtol=1e-5, atol=1e-7), (packed_loss, loss)
        for name, grad in grads.items():
            assert torch.allclose(packed_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_length_dependent_rope_per_layer_type_is_found():
    from types import SimpleNamespace

    from arpo_trl.training.compatibility import rope_types

    nested = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default"},
                                              "sliding_attention": {"rope_type": "longrope"}})
    assert rope_types(nested) == {"default", "longrope"}
    assert rope_types(SimpleNamespace(rope_scaling={"type": "dynamic", "factor": 2.0})) == {"dynamic"}
    assert rope_types(SimpleNamespace()) == set()


@pytest.mark.parametrize("tuning", ["prompt", "prefix"])
def test_peft_prompt_learning_falls_back_to_unpacked_rows(tuning, model_dirs, tokenizer, addition_dataset, tmp_path):
    """PEFT's prompt/prefix tuning prepends virtual tokens and a 2D mask to every forward and drops position_ids:
    with a tree mask that crashed; now it trains on TRL's rows, with TRL's numbers."""
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from arpo_trl import ARPOConfig, ARPOTrainer

    config = (PromptTuningConfig if tuning == "prompt" else PrefixTuningConfig)(task_type="CAUSAL_LM",
                                                                                num_virtual_tokens=4)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dirs["llama"]), config)
    assert "prompt-learning" in packing_blocker(model)
    args = ARPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=48, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      log_trees=False)
    trainer = ARPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=addition_dataset, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch = micro_batch(["one_fork"], len(tokenizer), tokenizer.pad_token_id)
    packed_loss, _ = loss_and_grads(trainer, batch, packed=True, old_logps=True)
    loss, _ = loss_and_grads(trainer, batch, packed=False, old_logps=True)
    assert torch.equal(packed_loss, loss)


class RecordingTrainer:
    """Records, per micro-batch `_compute_loss` trains on, its rows and their loss weights."""

    def _compute_loss(self, model, inputs):
        prompts = inputs["prompt_ids"].tolist()
        completions = inputs["completion_ids"].tolist()
        advantages = inputs["advantages"].tolist()
        rows = [(tuple(p), tuple(c), a) for p, c, a in zip(prompts, completions, advantages)]
        self.micro_batches = getattr(self, "micro_batches", []) + [rows]
        return super()._compute_loss(model, inputs)


def train_recording(model_dir, tokenizer, dataset, tmp_path, *, packed: bool, **overrides):
    from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward

    def length_reward(completions, **kwargs):
        return [len(str(c)) / 100 for c in completions]

    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=2,
                    max_steps=2, loss_type="dapo", optim="sgd", learning_rate=0.05)
    settings.update(overrides)
    args = ARPOConfig(
        output_dir=str(tmp_path), num_generations=4, initial_rollouts=2, max_completion_length=32, logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0, log_trees=False,
        tree_packing=packed, rollout_scheduler="waves", **settings,  # waves: the same trees in both runs
    )
    trainer = type("Recording", (RecordingTrainer, ARPOTrainer), {})(
        model=str(model_dir), reward_funcs=[arpo_math_reward, length_reward], args=args, train_dataset=dataset,
        processing_class=tokenizer, tools=[PythonTool()])
    trainer.train()
    return trainer


def steps(micro_batches: list, window: int) -> list[list]:
    return [sorted(row for batch in micro_batches[i:i + window] for row in batch)
            for i in range(0, len(micro_batches), window)]


@pytest.mark.parametrize("loss_type,spg,ga,regrouped", [
    ("bnpo", 2, 1, False),  # bnpo divides each micro-batch by its own tokens: TRL's micro-batches exactly
    ("dapo", 4, 2, True),  # rows move only inside each optimizer step's two micro-batches
])
def test_packing_trains_each_optimizer_step_on_grpo_trainers_rows_and_weights(
        loss_type, spg, ga, regrouped, tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """The same seed with and without packing (TRL's own micro-batches) gives every optimizer step the same rows,
    advantages and, through TRL's loss, parameters. Today's main regrouped over the whole generation batch."""
    runs = {packed: train_recording(tool_model_dir, tokenizer, addition_dataset, tmp_path / str(packed), packed=packed,
                                    loss_type=loss_type, steps_per_generation=spg, gradient_accumulation_steps=ga,
                                    max_steps=spg // ga)
            for packed in (False, True)}
    unpacked, packed = runs[False].micro_batches, runs[True].micro_batches
    assert len(packed) == len(unpacked) == spg
    assert steps(packed, ga) == steps(unpacked, ga)
    if not regrouped:
        assert packed == unpacked
    else:
        for window in range(0, spg, ga):  # within a step, each prompt's rows are contiguous
            prompts = [row[0] for batch in packed[window:window + ga] for row in batch]
            starts = [p for i, p in enumerate(prompts) if i == 0 or prompts[i - 1] != p]
            assert len(starts) == len(set(starts)), prompts
    for (name, p), q in zip(runs[False].model.named_parameters(), runs[True].model.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


def _shuffled_batches(rows: int, splits: int, group_size: int) -> list[dict]:
    from arpo_trl.training.grouping import ROW_INDEX

    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    per = rows // splits
    return [{"completion_ids": order[i * per:(i + 1) * per, None].repeat(1, 3), ROW_INDEX: order[i * per:(i + 1) * per]}
            for i in range(splits)]


@pytest.mark.parametrize("setting,expected", [
    ({"loss_type": "bnpo"}, "bnpo"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    ({"entropy_coef": 0.01}, "entropy bonus"),
    ({"entropy_advantage_weight": 0.5}, "entropy_advantage_weight"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "unevenly"),
    ({"architecture": "fallback"}, "architecture"),
    ({}, None),
])
def test_regrouping_happens_only_where_it_changes_no_gradient(setting, expected, model_dirs, tokenizer,
                                                              addition_dataset, tmp_path, monkeypatch, caplog):
    from arpo_trl.training import compatibility
    from arpo_trl.training.grouping import ROW_INDEX

    setting = dict(setting)
    if setting.pop("architecture", None):
        monkeypatch.setattr(compatibility, "TREE_MASK_ARCHITECTURES", ("qwen3",))
    spg = setting.pop("steps_per_generation", 2)
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path,
                           gradient_accumulation_steps=setting.pop("gradient_accumulation_steps", 2),
                           steps_per_generation=spg, **setting)
    batches = _shuffled_batches(8 * spg // 2, spg, 4)
    before = [batch["completion_ids"].clone() for batch in batches]
    with caplog.at_level("INFO", logger="arpo_trl.training.packed_logps"):
        result = trainer._regrouped(batches)
    assert all(ROW_INDEX not in batch for batch in result)
    unchanged = all(torch.equal(b["completion_ids"], a) for b, a in zip(result, before))
    if expected is None:
        assert not unchanged  # every group of 4 rows now contiguous
        assert all(len(set((b["completion_ids"][:, 0] // 4).tolist())) <= 2 for b in result)
    else:
        assert unchanged
        assert any(expected in record.getMessage() for record in caplog.records), caplog.text


@pytest.mark.parametrize("trees,max_length,packs", [
    ([[(None, 0, 150)] * 4], None, False),  # 4 long rows sharing only the prompt: one 600-slot pack, L² attention
    ([[(None, 0, 150), (None, 0, 5), (None, 0, 6), (None, 0, 5)]], 40, True),  # a row past the cap: 2 packs of 155
])
def test_a_chunk_whose_packs_cost_more_than_trls_rows_is_forwarded_as_rows(trees, max_length, packs, model_dirs,
                                                                           tokenizer, addition_dataset, tmp_path,
                                                                           caplog):
    """Packs attend over all their slot pairs (SDPA's dense mask): rows that share little, packed together, cost
    more than TRL's padded rows, and are forwarded as those. A row longer than the cap pads every pack to its length,
    but TRL pads every row to it too: packing stays cheaper there."""
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path,
                           tree_packing_max_length=max_length)
    batch = micro_batch(trees, len(tokenizer), tokenizer.pad_token_id, prompt_lengths=[6])
    rows = batch["prompt_ids"].size(0) * (batch["prompt_ids"].size(1) + batch["completion_ids"].size(1))
    loss, _ = loss_and_grads(trainer, batch, packed=False, old_logps=False)
    with caplog.at_level("INFO", logger="arpo_trl.training.packed_logps"):
        packed_loss, _ = loss_and_grads(trainer, batch, packed=True, old_logps=False)
    forwarded = trainer._metrics["train"]["arpo/tokens_forwarded_per_group"][-1] * len(trees)
    if packs:
        assert forwarded < rows
        assert torch.allclose(packed_loss, loss, rtol=1e-5)
    else:
        assert forwarded == rows and "would cost more" in caplog.text
        assert torch.equal(packed_loss, loss)


@pytest.mark.parametrize("architecture,settings,refused", [
    ("mistral", {"sliding_window": 64}, True),  # a window set alone
    ("mistral", {"sliding_window": None}, False),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, True),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, False),  # Qwen2's default: the window is off
])
def test_packing_and_the_cached_engine_refuse_sliding_windows_alike(architecture, settings, refused):
    from transformers import AutoConfig, AutoModelForCausalLM

    from arpo_trl.generation.support import cached_engine_blocker

    config = AutoConfig.for_model(architecture, vocab_size=64, hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, **settings)
    model = AutoModelForCausalLM.from_config(config)
    assert (packing_blocker(model) is not None) == refused
    assert (cached_engine_blocker(model, None, None, False) is not None) == refused
