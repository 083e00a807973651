"""AEPO (arXiv 2510.14545) as options of the ARPO trainer: the rollout rules on hand-built trees (exact values), the
update terms against hand-computed losses and gradients through TRL's own loss, and a tiny end-to-end run with every
AEPO option on. Formulas and sources: docs/aepo.md."""

import math

import pytest
import torch
from test_rollout import CALL, _prompts, _sampler, _waves_with_bare_prompts
from test_trainer import length_reward

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.rollout.arpo import aepo_fork_probability, global_samples
from arpo_trl.training.entropy_balanced_update import BOUND_MARGIN, entropy_aware_advantages, keep_clipped_gradients

VOCAB_LOG = math.log(1000)  # the scripted engine's ln|V|
WINDOW = 4  # entropy_window k in the rollout tests: a segment's entropy is 4 tokens' sum / ln|V|


def segment_entropy(per_token: float) -> float:
    return WINDOW * per_token / VOCAB_LOG


# ---- rollout rules ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("root", "segments", "budget", "expected"), [
    (2.0, [2.0, 1.0, 0.0], 16, 10),  # mean 1: σ(0.5) = 0.6225 -> floor(9.96) + 1
    (0.0, [0.0, 4.0], 16, 5),  # mean 2: σ(-1) = 0.2689 -> floor(4.30) + 1
    (1.0, [], 16, 9),  # no segment: mean = H_root, σ(0) -> 8 + 1
    (1.0, [1.0], 8, 5),
    (1e6, [0.0], 16, 16),  # σ -> 1: floor(16) + 1, kept to M
    (-1e6, [0.0], 16, 1),  # σ -> 0, no overflow
])
def test_global_samples_split_the_budget_by_the_entropy_gap(root, segments, budget, expected):
    assert global_samples(budget, root, segments, beta=0.5) == expected


@pytest.mark.parametrize(("delta", "forks_in_a_row", "expected"), [
    (0.0, 0, 0.5),  # l = 0, τ = 0.5: ARPO's clip(τ + β·ΔH)
    (1.0, 0, 0.7),
    (0.0, 2, 1 - 0.5 / 0.9),  # penalty 1 - 0.05·2
    (1.0, 2, 1 - 0.5 / 0.9 + 0.2),
    (-3.0, 1, 0.0),
    (0.0, 20, 0.0),  # 1 - 0.05·20 = 0: never
    (5.0, 30, 0.0),
])
def test_branch_penalty_lowers_the_fork_probability(delta, forks_in_a_row, expected):
    p = aepo_fork_probability(delta, forks_in_a_row, threshold=0.5, weight=0.2, penalty=0.05)
    assert p == pytest.approx(expected, abs=1e-12)


def test_fork_probability_equals_the_frequency_of_the_authors_rule():
    """The closed form is P(u ~ U(0,1): clip((u + β·ΔH)·(1 - λ·l), 0, 1) >= τ), the authors' code's test."""
    rng = torch.Generator().manual_seed(0)
    u = torch.rand(200_000, generator=rng, dtype=torch.float64)
    for delta, in_a_row, tau in [(0.3, 0, 0.5), (-0.7, 3, 0.4), (1.5, 5, 0.6), (0.0, 1, 0.9)]:
        rule = (((u + 0.2 * delta) * max(0.0, 1 - 0.05 * in_a_row)).clamp(0, 1) >= tau).double().mean().item()
        assert aepo_fork_probability(delta, in_a_row, tau, 0.2, 0.05) == pytest.approx(rule, abs=0.005)


def monitor_script(h_root, h_tools):
    """Every path: a call with entropy `h_root` per token, then calls with h_tools[0], h_tools[1], ..., then an
    answer with the next entropy."""
    def script(text, rng):
        calls = text.count("</result>")
        if calls < len(h_tools):
            return f"step {calls} {CALL}", (h_root if calls == 0 else h_tools[calls - 1]), "stop"
        return "<answer>\\boxed{2}</answer>", h_tools[-1], "eos"
    return script


@pytest.mark.parametrize(("h_root", "h_tools"), [(3.0, [1.0, 1.0, 1.0]), (0.5, [2.0, 4.0, 4.0]), (1.0, [1.0] * 3)])
def test_pre_monitoring_sets_the_global_samples_after_one_path(tokenizer, h_root, h_tools):
    """One non-forking path per prompt runs first; when it ends, m - 1 more global samples start at once (one wave),
    m = global_samples(M, H_root, its segment entropies)."""
    m_budget = 8
    sampler = _sampler(tokenizer, monitor_script(h_root, h_tools), num_generations=m_budget, branch_policy="aepo",
                       entropy_window=WINDOW, max_tool_calls=3, seed=0)
    prompts = _prompts(tokenizer, 2)
    result = sampler.sample(prompts)
    segments = [segment_entropy(h_root)] + [segment_entropy(h) for h in h_tools]
    m = global_samples(m_budget, segment_entropy(h_root), segments, 0.5)
    assert result.stats.global_samples == {0: m, 1: m}
    bare = _waves_with_bare_prompts(sampler.engine, prompts)
    assert bare[0] == 2 and bare[1:4] == [0, 0, 0]  # the two monitors' four segments, alone
    assert bare[4] == 2 * (m - 1)  # then every other global sample at once
    for group in result.groups:
        assert len(group) == m_budget
        monitor = group[0]
        assert monitor.kind == "global" and monitor.segment_entropies == pytest.approx(segments)
        assert sum(t.kind == "global" for t in group) == m
        assert not any(t.parent == monitor.id for t in group), "the monitoring path never forks"


def penalty_script(text, rng):
    """The first segment is calm and every segment after a tool result is uncertain (ΔH = 2, so β·ΔH = 0.4 >= τ
    with τ = 0.4: an unpenalised decision always forks); three calls, then the answer."""
    calls = text.count("</result>")
    h = 0.0 if calls == 0 else segment_entropy_inverse(2.0)
    if calls < 3:
        return f"step {calls} {CALL}", h, "stop"
    return "<answer>\\boxed{2}</answer>", h, "eos"


def segment_entropy_inverse(segment: float) -> float:
    return segment * VOCAB_LOG / WINDOW


def fork_tree(tokenizer, penalty: float, policy: str = "aepo", threshold: float = 0.4) -> list:
    sampler = _sampler(tokenizer, penalty_script, num_generations=16, initial_rollouts=1, branch_policy=policy,
                       pre_monitoring_beta=None, branch_penalty=penalty, branch_threshold=threshold, entropy_weight=0.2,
                       entropy_window=WINDOW, max_tool_calls=3, seed=0)
    return sampler.sample(_prompts(tokenizer, 1)).groups[0]


def forks_at(group) -> list[tuple[int, int]]:
    """(parent id, the parent's tool results before the fork) of every branch, sorted."""
    by_id = {t.id: t for t in group}
    return sorted((t.parent, sum(c.answered and c.result_end <= t.fork_position for c in by_id[t.parent].calls))
                  for t in group if t.kind == "branch")


def test_branch_penalty_stops_consecutive_forks_on_a_hand_built_tree(tokenizer):
    """τ = 0.4, β·ΔH = 0.4: with no penalty every decision forks (1 -> 2 -> 4 -> 8 paths, as ARPO's rule with τ = 0.6:
    AEPO's score u + β·ΔH >= τ forks with probability 1 - τ + β·ΔH, ARPO's with τ + β·ΔH).
    With λ = 1 a path that just forked cannot fork again (1 - λ·1 = 0): the first decision forks, the second forks
    nowhere (and resets l), the third forks on both paths."""
    unpenalised = fork_tree(tokenizer, penalty=0.0)
    assert len(forks_at(unpenalised)) == 7 == len(forks_at(fork_tree(tokenizer, 0, "entropy", 0.6)))
    group = fork_tree(tokenizer, penalty=1.0)
    root = group[0]
    first = [t for t in group if t.kind == "branch" and t.parent == root.id and forks_at([root, t])[0][1] == 1]
    assert len(first) == 1
    assert forks_at(group) == sorted([(root.id, 1), (root.id, 3), (first[0].id, 3)])
    assert sum(t.kind == "fill" for t in group) == 16 - 4
    assert {t.growth.consecutive_forks for t in group if t.kind != "fill"} == {1}  # each ended right after a fork


# ---- update terms -------------------------------------------------------------------------------------------------
def test_entropy_aware_advantages_by_hand():
    advantages = torch.tensor([1.0, -2.0])
    entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    trained = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    z = (entropies - trained.mean()) / trained.std()  # mean 3, std sqrt(2.5)
    expected = advantages[:, None] * (1 + 0.2 * z)
    assert torch.allclose(entropy_aware_advantages(advantages, entropies, mask, 0.2), expected)
    assert entropy_aware_advantages(advantages, entropies, mask, 0.2)[0, 2] == pytest.approx(1 * (1 + 0.2 * 0))
    flat = entropy_aware_advantages(advantages, torch.full((2, 3), 7.0), mask, 0.2)  # std 0 counts as 1
    assert torch.equal(flat, advantages[:, None].expand(2, 3))


def test_keep_clipped_gradients_value_and_gradient_by_hand():
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-2.0, -2.0, -0.5])
    clipped = torch.tensor([True, False, False])
    out = keep_clipped_gradients(logps, old, clipped, epsilon_high=0.28)
    ratio = torch.exp(out - old)
    c = 1.28 * math.exp(-BOUND_MARGIN)
    assert ratio[0].item() == pytest.approx(c, rel=1e-6) and ratio[0].item() < 1.28
    assert torch.equal(out[1:], logps[1:])
    (grad,) = torch.autograd.grad(ratio[0], logps)
    assert grad.tolist() == pytest.approx([c, 0.0, 0.0], rel=1e-6)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
                max_completion_length=48, max_steps=2, learning_rate=5e-3, logging_steps=1, use_cpu=True, bf16=False,
                report_to="none", save_strategy="no", seed=0, beta=0.0, gradient_checkpointing=False,
                loss_type="grpo")
    return ARPOConfig(**(base | kw))


@pytest.fixture(scope="module")
def loss_batch(tokenizer):
    """One hand-made row: 6 completion tokens, the 5th a tool result (mask 0), advantage +1."""
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    return {
        "prompt_ids": torch.randint(0, vocab, (1, 5)), "prompt_mask": torch.ones(1, 5, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (1, 6)), "completion_mask": torch.ones(1, 6, dtype=torch.long),
        "tool_mask": torch.tensor([[1, 1, 1, 1, 0, 1]]), "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(5.0),
    }


def _trainer(model_dir, tokenizer, addition_dataset, tmp_path, **kw):
    trainer = ARPOTrainer(model=str(model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path, **kw),
                          train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)])
    trainer.model.eval()  # eval mode: TRL's loss is not divided by gradient accumulation steps
    return trainer


def _forward(trainer, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].shape[1],
                                                      compute_entropy=True)


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def _hand_grads(trainer, batch, weights_of_clipped: float, advantages: torch.Tensor):
    """The gradient of -(1/n)·Σ_trained [A_t·r_t (unclipped) + w·A_t·log π_t (clipped)], n = trained tokens."""
    trainer.model.zero_grad()
    logps, _, _ = _forward(trainer, batch)
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    clipped = ratio.detach() > 1.2
    trained = (batch["completion_mask"] * batch["tool_mask"]).bool()
    terms = torch.where(clipped, weights_of_clipped * logps, ratio) * advantages
    (-(terms[trained]).sum() / trained.sum()).backward()
    return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def test_stop_gradient_clipping_keeps_the_clipped_tokens_gradient(tiny_model_dir, tokenizer, addition_dataset,
                                                                  tmp_path, loss_batch):
    """Through TRL's own grpo loss: tokens 0-1 have ratio e > 1+ε (A > 0, clipped), the others ratio 1. Without the
    option the clipped tokens' gradient is zero, with it (1+ε)·A·∇log π; the loss value is PPO's either way."""
    results = {}
    for option in (False, True):
        trainer = _trainer(tiny_model_dir, tokenizer, addition_dataset, tmp_path, entropy_balanced_clipping=option)
        with torch.no_grad():
            logps = _forward(trainer, loss_batch)[0]
        batch = dict(loss_batch, old_per_token_logps=logps - torch.tensor([[1.0, 1.0, 0, 0, 0, 0]]))
        loss, grads = _loss_and_grads(trainer, batch)
        weight = 1.2 * math.exp(-BOUND_MARGIN) if option else 0.0
        for got, want in zip(grads, _hand_grads(trainer, batch, weight, torch.ones(1, 6))):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
        results[option] = loss, grads
    (loss_off, grads_off), (loss_on, grads_on) = results[False], results[True]
    assert loss_on.item() == pytest.approx(loss_off.item(), rel=1e-3)  # 1.2·e^-1e-4 for 1.2 on two tokens
    assert any(not torch.allclose(a, b) for a, b in zip(grads_off, grads_on))


def test_entropy_aware_advantage_through_trls_loss(tiny_model_dir, tokenizer, addition_dataset, tmp_path, loss_batch):
    trainer = _trainer(tiny_model_dir, tokenizer, addition_dataset, tmp_path, entropy_advantage_weight=0.2)
    with torch.no_grad():
        logps, entropies, _ = _forward(trainer, loss_batch)
    batch = dict(loss_batch, old_per_token_logps=logps)
    loss, grads = _loss_and_grads(trainer, batch)
    assert torch.equal(batch["advantages"], loss_batch["advantages"])  # the caller's batch is left as it was
    mask = batch["completion_mask"] * batch["tool_mask"]
    advantages = entropy_aware_advantages(batch["advantages"], entropies, mask, 0.2)
    assert not torch.allclose(advantages, torch.ones(1, 6))
    for got, want in zip(grads, _hand_grads(trainer, batch, 0.0, advantages)):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert loss.item() == pytest.approx(-(advantages[mask.bool()]).mean().item(), rel=1e-5)  # ratios are 1


@pytest.mark.parametrize(("kw", "field"), [
    ({"branch_penalty": -0.1}, "branch_penalty"),
    ({"pre_monitoring_beta": float("nan")}, "pre_monitoring_beta"),
    ({"entropy_advantage_weight": float("inf")}, "entropy_advantage_weight"),
    ({"entropy_balanced_clipping": True, "loss_type": "cispo"}, "loss_type"),
    ({"entropy_balanced_clipping": True, "importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"entropy_balanced_clipping": True, "beta": 0.04}, "beta"),
])
def test_bad_aepo_options_name_their_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        _args(tmp_path, **kw)


# ---- end to end ---------------------------------------------------------------------------------------------------
@pytest.mark.long  # 33 s; each option's effect has its own test above
def test_all_aepo_options_train_end_to_end(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """The tiny tool model, the real PythonTool, TRL's loss: AEPO's rollout and update together, two optimizer steps
    over four micro-batches each (steps_per_generation=2 makes the second micro-batch off-policy, where clipping
    acts)."""
    args = dict(branch_policy="aepo", entropy_balanced_clipping=True, entropy_advantage_weight=0.2,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
                num_generations=8, loss_type="dapo")
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward, length_reward],
                          args=_args(tmp_path, **args),
                          train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert 1 <= logged["arpo/global_samples_per_group"] <= 8
    assert 0 <= logged["aepo/rescaled_clip_ratio"] <= 1
    assert math.isfinite(logged["train_loss"])
