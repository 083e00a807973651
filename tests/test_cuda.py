"""What only a GPU can check; skipped without CUDA (docs/gpu_checks.md: what they found on a lent H200).

- The cached engine on CUDA tensors (KV batch, prefill, two-level sampling, prefix cache): greedy segments and trees
  equal the waves engine's on the CPU; a sampled event-driven rollout keeps exactly M paths per prompt.
- Tree-packed training under the GPU's attention kernels: loss and every gradient equal the unpacked forward's in
  fp32 (SDPA, eager, and FlexAttention, whose backward PyTorch runs on GPUs only, on packs of whole blocks); a bf16
  model's packed log-probabilities within bf16's rounding.
- ARPO training steps on the GPU (cached engine, tree packing, bf16 autocast; full fine-tuning and LoRA).
"""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from test_cached_engine import GREEDY, _as_tuples, _prompt
from test_tree_packing import LOSS_TYPES, assert_packed_matches_unpacked, make_trainer, micro_batch
from transformers import AutoModelForCausalLM

from arpo_trl import ARPOConfig, ARPOTrainer, arpo_math_reward
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on(batch: dict, device: str) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def test_cached_engine_on_cuda_grows_the_cpu_waves_engines_greedy_trees(tool_model_dir, tokenizer,
                                                                        poisoned_buffers):
    """float64 on both devices, so that the GPU's other reduction order cannot flip a greedy argmax."""
    cpu = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().double()
    gpu = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().double().cuda()
    prefixes = [_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "hi")[:5], [5, 6, 7]]
    budgets, stop = [40, 9, 13], ["</python>"]
    waves = TransformersEngine(cpu, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    cached = CachedTransformersEngine(gpu, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    for a, b in zip(waves, cached):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(b.entropies), torch.tensor(a.entropies), atol=1e-6, rtol=0)

    def grow(engine):
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=4,
                                   max_completion_length=80, branch_policy="random", seed=3, scheduler="waves")
        return sampler.sample([_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")])

    expected = grow(TransformersEngine(cpu, tokenizer, sampling=GREEDY))
    engine = CachedTransformersEngine(gpu, tokenizer, sampling=GREEDY)
    assert any(t.kind == "branch" for t in expected.trajectories)
    assert _as_tuples(grow(engine)) == _as_tuples(expected)
    assert len(engine.prefix_cache) == 0


def test_cached_engine_samples_on_cuda_with_exact_m(tool_model_dir, tokenizer):
    """Sampling (temperature 1, top-k) on the GPU, event-driven: exactly M paths per prompt, forks included."""
    gpu = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval().cuda()
    engine = CachedTransformersEngine(gpu, tokenizer)
    sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=8,
                               initial_rollouts=2, max_completion_length=64, branch_policy="random", seed=0,
                               scheduler="events")
    result = sampler.sample([_prompt(tokenizer, f"What is {a}+{b}?") for a, b in ((12, 30), (7, 5), (40, 2))])
    assert [len(group) for group in result.groups] == [8, 8, 8]
    assert any(t.kind == "branch" for t in result.trajectories)
    assert all(math.isfinite(x) for t in result.trajectories for x in t.logprobs)


CUDA_SETUPS = [  # (architecture, attention, lora, beta, gradient checkpointing)
    ("llama", "sdpa", False, 0.04, False),
    ("qwen3", "sdpa", True, 0.0, True),
    ("llama", "eager", True, 0.04, False),
    ("llama", "flex_attention", False, 0.04, False),
    ("qwen3", "flex_attention", True, 0.0, True),
]


@pytest.mark.parametrize("architecture,attention,lora,beta,checkpointing", CUDA_SETUPS)
def test_packed_loss_and_gradients_equal_unpacked_on_cuda(architecture, attention, lora, beta, checkpointing,
                                                          model_dirs, tokenizer, addition_dataset, tmp_path):
    """fp32 on the GPU (TF32 off: PyTorch's default for float32 matmuls), same tolerances as on the CPU. The unpacked
    reference runs the same attention implementation, FlexAttention's included."""
    assert not torch.backends.cuda.matmul.allow_tf32
    trainer = make_trainer(model_dirs[architecture], tokenizer, addition_dataset, tmp_path, lora=lora, beta=beta,
                           checkpointing=checkpointing, attention=attention, use_cpu=False)
    assert trainer.accelerator.device.type == "cuda" and trainer._packing_fallback(trainer.model) is None
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    for step, loss_type in enumerate(LOSS_TYPES):
        trainer.loss_type = loss_type
        attribution = ("soft", "hard")[step % 2]
        trees = [("grpo", "several_forks"), ("one_fork", "grpo"), ("several_forks", "one_fork")][step % 3]
        batch = _on(micro_batch(list(trees), vocab, pad, attribution, truncate_row=step % 8, seed=step), "cuda")
        assert_packed_matches_unpacked(trainer, batch, old_logps=step % 3 == 0,
                                       what=f"{attention}/{loss_type}/{attribution}/{trees}")


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_packed_log_probabilities_in_bf16_on_cuda(attention, model_dirs, tokenizer, addition_dataset, tmp_path):
    """A bf16 model: the packed forward's log-probabilities are the unpacked ones within bf16's rounding (the
    reductions run in another order over other shapes, so exact equality is not expected)."""
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path, attention=attention,
                           use_cpu=False)
    model = trainer.model.to(torch.bfloat16).eval()
    batch = _on(micro_batch(["several_forks", "grpo"], len(tokenizer), tokenizer.pad_token_id, truncate_row=1), "cuda")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width, results = batch["completion_ids"].size(1), []
    for packed in (True, False):
        trainer.args.tree_packing = packed
        with torch.no_grad():
            results.append(trainer._get_per_token_logps_and_entropies(model, ids, mask, width)[0].float())
    real = batch["completion_mask"].bool()
    difference = (results[0] - results[1])[real].abs()
    assert difference.max().item() < 0.1 and difference.mean().item() < 0.02, difference.max().item()


def _distinct_rewards(completions, **kwargs):
    """Every row of a group its own reward, so that advantages are never all zero and the weights must move."""
    return [row / len(completions) for row in range(len(completions))]


def _train(tool_model_dir, tokenizer, addition_dataset, tmp_path, lora: bool, **kw):
    args = ARPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
                      max_completion_length=48, max_steps=2, learning_rate=5e-3, logging_steps=1, bf16=True,
                      report_to="none", save_strategy="no", seed=0, beta=0.04, log_trees=False,
                      in_process_engine="cached", **kw)
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward, _distinct_rewards],
                          args=args, train_dataset=addition_dataset, processing_class=tokenizer,
                          tools=[Tool("python", lambda code: "42")],
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM") if lora else None)
    assert isinstance(trainer.engine, CachedTransformersEngine) and trainer.accelerator.device.type == "cuda"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_arpo_trains_on_cuda_with_the_cached_engine_and_tree_packing(attention, tool_model_dir, tokenizer,
                                                                     addition_dataset, tmp_path):
    """sdpa: full fine-tuning; flex_attention: LoRA. Two steps, bf16 autocast; the trainable weights move and every
    logged loss and reward is finite."""
    trainer, before = _train(tool_model_dir, tokenizer, addition_dataset, tmp_path, lora=attention == "flex_attention",
                             tree_packing=True, model_init_kwargs={"attn_implementation": attention})
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all(math.isfinite(entry["reward"]) for entry in logs)
    assert all(entry["arpo/tokens_forwarded_per_group"] > 0 for entry in logs)
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all(p.device.type == "cuda" for p in trainer.model.parameters())
