"""Tree-packed training (arpo_trl/training/, docs/tree_packing.md): packed against unpacked forwards of the same
micro-batch, fp32 on CPU, through TRL's own loss code. Loss within 1e-5 relative and every parameter gradient
allclose (rtol 1e-4) over loss types, attribution, beta, old log-probs (num_iterations 2), LoRA and full fine-tuning,
gradient checkpointing, Llama/Qwen2/Qwen3 and SDPA/eager, trees with 0, 1 and several forks, tool results inside
shared prefixes, truncated rows and GRPO groups."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from packed_batches import micro_batch
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.rewards import completion_text
from arpo_trl.training import packed_logps as packed_logps_module
from arpo_trl.training import packing
from arpo_trl.training.grouping import ROW_INDEX, regroup
from arpo_trl.training.packed_logps import pack_length_multiple
from arpo_trl.training.packing import IGNORE, pack_rows

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
M = 4


def length_reward(completions, **kwargs):
    return [len(completion_text(c)) / 100 for c in completions]


def make_trainer(model_dir, tokenizer, dataset, tmp_path, *, lora=False, beta=0.0, checkpointing=False,
                 attention="sdpa", use_cpu=True, **kw):
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=M, max_completion_length=48,
        use_cpu=use_cpu, bf16=False, report_to="none", save_strategy="no", seed=0, beta=beta, log_trees=False,
        gradient_checkpointing=checkpointing, model_init_kwargs={"attn_implementation": attention}, **kw,
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) if lora else None
    trainer = ARPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.current_gradient_accumulation_steps = 1
    if checkpointing:  # what transformers' Trainer does when training starts
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    trainer.model.train()
    return trainer


def _base(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _reference_model(trainer):
    if trainer.ref_model is not None:
        return trainer.ref_model, contextlib.nullcontext()
    return trainer.model, trainer.model.disable_adapter()


def loss_and_grads(trainer, batch: dict, *, packed: bool, old_logps: bool) -> tuple[torch.Tensor, dict]:
    """TRL's `compute_loss` and backward on `batch`, with the old and reference log-probabilities computed by the
    same forward (packed or not) as TRL computes them in `_generate_and_score_completions`."""
    trainer.args.tree_packing = packed
    model, inputs = trainer.model, dict(batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        if old_logps:  # num_iterations 2: TRL's old-logprob pass; shifted so that ratios leave 1 and some clip
            old = trainer._get_per_token_logps_and_entropies(model, ids, mask, width, batch_size=4)[0]
            shift = torch.sin(torch.arange(old.numel(), device=old.device).view_as(old) * 1.3)
            inputs["old_per_token_logps"] = old + 0.15 * shift
        if trainer.beta:
            reference, context = _reference_model(trainer)
            with context:
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    reference, ids, mask, width, batch_size=4)[0]
    model.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def forwarded(trainer) -> float:
    return trainer._metrics["train"]["arpo/tokens_forwarded_per_group"][-1]


def assert_packed_matches_unpacked(trainer, batch: dict, old_logps: bool, what: str) -> None:
    loss, grads = loss_and_grads(trainer, batch, packed=False, old_logps=old_logps)
    unpacked_tokens = forwarded(trainer)
    packed_loss, packed_grads = loss_and_grads(trainer, batch, packed=True, old_logps=old_logps)
    assert forwarded(trainer) < unpacked_tokens, f"{what}: the packed pass forwarded no fewer tokens"
    assert math.isclose(packed_loss.item(), loss.item(), rel_tol=1e-5, abs_tol=1e-7), \
        f"{what}: packed loss {packed_loss.item()} vs unpacked {loss.item()}"
    assert grads.keys() == packed_grads.keys() and grads, what
    for name, grad in grads.items():
        assert torch.allclose(packed_grads[name], grad, rtol=1e-4, atol=1e-6), \
            f"{what}: gradient of {name} differs by {(packed_grads[name] - grad).abs().max().item():.3g}"


SETUPS = [  # (architecture, attention, lora, beta, gradient checkpointing): together every value of each
    ("llama", "sdpa", False, 0.0, False),
    ("llama", "sdpa", True, 0.04, True),
    ("llama", "eager", False, 0.04, True),
    ("qwen3", "sdpa", True, 0.0, False),
    ("qwen3", "sdpa", False, 0.04, False),
    ("qwen2", "eager", True, 0.04, False),
]


@pytest.mark.parametrize("architecture,attention,lora,beta,checkpointing", SETUPS)
def test_packed_loss_and_gradients_equal_unpacked(architecture, attention, lora, beta, checkpointing, model_dirs,
                                                  tokenizer, addition_dataset, tmp_path):
    trainer = make_trainer(model_dirs[architecture], tokenizer, addition_dataset, tmp_path, lora=lora, beta=beta,
                           checkpointing=checkpointing, attention=attention)
    assert trainer._packing_fallback(trainer.model) is None
    assert _base(trainer).is_gradient_checkpointing == checkpointing
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    for step, loss_type in enumerate(LOSS_TYPES):
        trainer.loss_type = loss_type
        for attribution in ("soft", "hard"):
            trees = [("grpo", "several_forks"), ("one_fork", "grpo"), ("several_forks", "one_fork")][step % 3]
            batch = micro_batch(list(trees), vocab, pad, attribution, truncate_row=step % 8, seed=step)
            for old_logps in (False, True):
                what = f"{loss_type}/{attribution}/{trees}/old={old_logps}"
                assert_packed_matches_unpacked(trainer, batch, old_logps, what)


def _causal(query, key, anchor, key_end, nodes):
    """A wrong mask: plain causal over the packed slots, so a branch's tokens see its sibling branches."""
    return key <= query


def test_a_token_seeing_a_sibling_branch_is_caught(model_dirs, tokenizer, addition_dataset, tmp_path, monkeypatch):
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path)
    batch = micro_batch(["several_forks", "grpo"], len(tokenizer), tokenizer.pad_token_id)
    assert_packed_matches_unpacked(trainer, batch, old_logps=True, what="tree mask")
    monkeypatch.setattr(packing, "sees", _causal)
    with pytest.raises(AssertionError, match="packed loss|gradient"):
        assert_packed_matches_unpacked(trainer, batch, old_logps=True, what="causal mask")


def test_a_tree_split_by_the_length_cap_stays_exact(model_dirs, tokenizer, addition_dataset, tmp_path):
    """Packs of at most 24 slots: the micro-batch's trees are split, each pack repeating the ancestors it needs;
    log-probabilities and entropies (entropy bonus on) still equal the unpacked ones."""
    trainer = make_trainer(model_dirs["qwen3"], tokenizer, addition_dataset, tmp_path, tree_packing_max_length=24,
                           entropy_coef=0.01)
    batch = micro_batch(["several_forks", "one_fork"], len(tokenizer), tokenizer.pad_token_id, "hard")
    assert_packed_matches_unpacked(trainer, batch, old_logps=True, what="cap 24")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    results = []
    for packed in (False, True):
        trainer.args.tree_packing = packed
        with torch.no_grad():
            results.append(trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width,
                                                                      compute_entropy=True)[:2])
    (logps, entropies), (packed_logps, packed_entropies) = results
    assert torch.allclose(packed_logps, logps, atol=1e-5) and torch.allclose(packed_entropies, entropies, atol=1e-5)


def _rows(batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
    return [row[m].tolist() for row, m in zip(ids, mask)], batch["prompt_mask"].sum(1).tolist()


def test_packs_hold_each_distinct_prefix_once_and_split_at_the_cap(tokenizer):
    batch = micro_batch(["several_forks"], len(tokenizer), tokenizer.pad_token_id)
    rows, prompt_lengths = _rows(batch)
    width = batch["completion_ids"].size(1)
    whole = pack_rows(rows, prompt_lengths, width, None)
    distinct = len({tuple(row[:k]) for row in rows for k in range(1, len(row) + 1)})
    labelled_parents = {tuple(row[:j]) for row, p in zip(rows, prompt_lengths) for j in range(p, len(row))}
    children = {tuple(row[:j + 1]) for row, p in zip(rows, prompt_lengths) for j in range(p, len(row))}
    assert whole.input_ids.shape[0] == 1
    assert sum(whole.lengths) == distinct + len(children) - len(labelled_parents)  # one copy per extra child
    assert (whole.labels != IGNORE).sum() == len(children)  # one label per distinct (context, next token)
    for k, row in enumerate(rows):  # each needed label sits where its row reads it
        for t in range(len(row) - prompt_lengths[k]):
            assert whole.labels.view(-1)[whole.gather_index[k, t]] == row[prompt_lengths[k] + t]
    split = pack_rows(rows, prompt_lengths, width, 22)
    assert split.input_ids.shape[0] > 1 and sum(split.lengths) > sum(whole.lengths)  # ancestors repeated
    assert max(split.lengths) <= 22  # every pack within the cap (no row here is longer)
    visible = whole.visible()[0, 0]
    assert torch.equal(visible, visible.tril())  # preorder: ancestors come first


def test_the_block_mask_is_the_dense_mask(tokenizer):
    """FlexAttention's mask function, evaluated at every (query, key) of every pack, is the dense mask SDPA reads."""
    batch = micro_batch(["several_forks", "one_fork"], len(tokenizer), tokenizer.pad_token_id)
    packed = pack_rows(*_rows(batch), batch["completion_ids"].size(1), 40)
    assert packed.input_ids.size(0) > 1 and len(set(packed.lengths)) > 1  # padded packs, copies included
    block = packed.block_mask("cpu")
    packs, length = packed.input_ids.shape
    b, q, k = (index.reshape(-1) for index in torch.meshgrid(torch.arange(packs), torch.arange(length),
                                                             torch.arange(length), indexing="ij"))
    dense = block.mask_mod(b, torch.zeros_like(b), q, k).view(packs, 1, length, length)
    assert torch.equal(dense, packed.visible())


def test_packs_rounded_to_whole_blocks_add_only_padding_that_sees_itself(tokenizer):
    batch = micro_batch(["several_forks", "one_fork"], len(tokenizer), tokenizer.pad_token_id)
    rows, width = _rows(batch), batch["completion_ids"].size(1)
    exact, rounded = pack_rows(*rows, width, 40), pack_rows(*rows, width, 40, length_multiple=128)
    packs, length = exact.input_ids.shape
    assert packs > 1 and length < 128 and rounded.input_ids.shape == (packs, 128)
    assert rounded.lengths == exact.lengths and torch.equal(rounded.nodes, exact.nodes)
    expected = torch.zeros(packs, 1, 128, 128, dtype=torch.bool)
    expected[..., :length, :length] = exact.visible()
    expected[..., range(length, 128), range(length, 128)] = True  # padding sees itself, and nothing sees padding
    assert torch.equal(rounded.visible(), expected)
    for name in ("input_ids", "position_ids", "labels"):
        assert torch.equal(getattr(rounded, name)[:, :length], getattr(exact, name)), name
    assert (rounded.labels[:, length:] == IGNORE).all()
    # every label is read from the same (pack, slot), and unread positions from the always-zero slot
    assert torch.equal(rounded.gather_index == packs * 128, exact.gather_index == packs * length)
    read = exact.gather_index != packs * length
    assert torch.equal(rounded.gather_index[read] // 128, exact.gather_index[read] // length)  # the pack
    assert torch.equal(rounded.gather_index[read] % 128, exact.gather_index[read] % length)  # the slot in it


def test_flex_attention_packs_are_whole_blocks_off_the_cpu_only():
    assert pack_length_multiple("flex_attention", torch.device("cuda", 0)) == pack_length_multiple(
        "flex_attention", "cuda") == 128
    assert pack_length_multiple("flex_attention", torch.device("cpu")) == pack_length_multiple("sdpa", "cuda") == 1


@pytest.mark.parametrize("length_multiple", [pytest.param(1, marks=pytest.mark.long), 128])  # 1: 23 s
def test_flex_attention_packs_give_the_unpacked_log_probabilities(length_multiple, model_dirs, tokenizer,
                                                                  addition_dataset, tmp_path, monkeypatch):
    """attn_implementation='flex_attention': the packs' tree goes in as a block mask. PyTorch runs FlexAttention's
    backward on GPUs only, so on this CPU the forward passes are compared (the old-logprob and reference passes; the
    policy pass runs the same forward): packed with the block mask against TRL's unpacked rows under SDPA. Also with
    the packs rounded to whole blocks, as on a GPU."""
    monkeypatch.setattr(packed_logps_module, "pack_length_multiple", lambda attention, device: length_multiple)
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path, attention="flex_attention")
    batch = micro_batch(["several_forks", "grpo"], len(tokenizer), tokenizer.pad_token_id, truncate_row=1)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width, model = batch["completion_ids"].size(1), trainer.model.eval()
    block_masks = []
    build = packing.PackedBatch.block_mask
    monkeypatch.setattr(packing.PackedBatch, "block_mask", lambda self, device: block_masks.append(
        (self.input_ids.size(1), max(self.lengths))) or build(self, device))
    results = []
    for packed, attention in ((True, "flex_attention"), (False, "sdpa")):
        model.set_attn_implementation(attention)
        trainer.args.tree_packing = packed
        with torch.no_grad():
            results.append(trainer._get_per_token_logps_and_entropies(model, ids, mask, width,
                                                                      compute_entropy=True)[:2])
    (packed_logps, packed_entropies), (logps, entropies) = results
    assert block_masks and trainer._packing_fallback(model) is None  # the packs went through FlexAttention
    if length_multiple > 1:  # in whole blocks, padded past the packs' own lengths
        assert all(length % length_multiple == 0 and length > longest for length, longest in block_masks)
    real = batch["completion_mask"].bool()
    assert torch.allclose(packed_logps[real], logps[real], atol=1e-5)
    assert torch.allclose(packed_entropies[real], entropies[real], atol=1e-5)


def test_regroup_keeps_groups_together_and_row_counts(tokenizer):
    rows, group_size, splits = 16, 4, 2
    batch = {"completion_ids": torch.arange(rows)[:, None].repeat(1, 3), "names": [f"r{i}" for i in range(rows)],
             "num_items_in_batch": torch.tensor(7), "old_per_token_logps": None, ROW_INDEX: torch.arange(rows)}
    torch.manual_seed(0)
    order = torch.randperm(rows)
    shuffled = {k: (v[order] if isinstance(v, torch.Tensor) and v.ndim else
                    [v[i] for i in order] if isinstance(v, list) else v) for k, v in batch.items()}
    chunks = [{k: (v[i * 8:(i + 1) * 8] if isinstance(v, list) or (isinstance(v, torch.Tensor) and v.ndim) else v)
               for k, v in shuffled.items()} for i in range(splits)]
    regrouped = regroup(chunks, group_size)
    halves = regroup(chunks, 2 * rows)  # one group larger than a micro-batch: rows in trie (token) order
    assert [c["completion_ids"][:, 0].tolist() for c in halves] == [list(range(8)), list(range(8, 16))]
    assert [len(c["completion_ids"]) for c in regrouped] == [8, 8]
    for chunk in regrouped:  # completion_ids[:, 0] is each row's index in the generation batch, by construction
        assert ROW_INDEX not in chunk  # training_step and compute_loss see GRPOTrainer's keys only
        index = chunk["completion_ids"][:, 0]
        groups = (index // group_size).tolist()
        assert all(groups.count(g) == group_size for g in groups)
        assert chunk["names"] == [f"r{i}" for i in index.tolist()] and chunk["num_items_in_batch"] == 7
    first_groups = [int(order[i]) // group_size for i in range(rows)]
    assert (regrouped[0]["completion_ids"][0, 0] // group_size).item() == first_groups[0]  # TRL's shuffle: order


def test_an_architecture_without_tree_masks_falls_back_with_one_warning(model_dirs, tokenizer, addition_dataset,
                                                                        tmp_path, monkeypatch, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    from arpo_trl.training import compatibility

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert "absolute position" in compatibility.packing_blocker(gpt2)
    monkeypatch.setattr(compatibility, "TREE_MASK_ARCHITECTURES", ("qwen3",))
    trainer = make_trainer(model_dirs["llama"], tokenizer, addition_dataset, tmp_path, beta=0.04)
    batch = micro_batch(["one_fork"], len(tokenizer), tokenizer.pad_token_id)
    with caplog.at_level("WARNING", logger="arpo_trl.training.packed_logps"):
        loss, _ = loss_and_grads(trainer, batch, packed=True, old_logps=True)
        loss_and_grads(trainer, batch, packed=True, old_logps=True)
    warnings = [r for r in caplog.records if "falls back to unpacked rows" in r.getMessage()]
    assert len(warnings) == 1 and "'llama'" in warnings[0].getMessage()
    unpacked_loss, _ = loss_and_grads(trainer, batch, packed=False, old_logps=True)
    assert torch.equal(loss, unpacked_loss)


class LossInputsTrainer(ARPOTrainer):
    def _compute_loss(self, model, inputs):
        rows = list(zip(map(tuple, inputs["prompt_ids"].tolist()), map(tuple, inputs["completion_ids"].tolist())))
        self.loss_rows = getattr(self, "loss_rows", []) + [rows]
        self.loss_width = inputs["prompt_ids"].size(1)  # unpacked, a group forwards M * (prompt + completion width)
        return super()._compute_loss(model, inputs)


def test_training_keeps_groups_in_micro_batches_and_logs_packing_metrics(tool_model_dir, tokenizer,
                                                                         addition_dataset, tmp_path):
    from arpo_trl import PythonTool, arpo_math_reward

    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=M,
        initial_rollouts=2, max_completion_length=48, max_steps=2, num_iterations=2, learning_rate=1e-3,
        logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0, log_trees=False,
    )
    trainer = LossInputsTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward, length_reward], args=args,
                                train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool()])
    trainer.train()
    assert len(trainer.loss_rows) == 4  # one generation, trained on twice (num_iterations 2) from TRL's buffer
    assert trainer.loss_rows[:2] == trainer.loss_rows[2:]
    for rows in trainer.loss_rows:  # one whole group per micro-batch: M rows of one prompt
        assert len(rows) == M and len({prompt for prompt, _ in rows}) == 1
    assert trainer.loss_rows[0][0][0] != trainer.loss_rows[1][0][0]  # the two groups' prompts differ
    logged = trainer.state.log_history[0]
    assert logged["arpo/training_seconds"] > 0
    assert 0 < logged["arpo/tokens_forwarded_per_group"] < M * trainer.loss_width + M * 48


def test_trl_touch_points_of_tree_packing(tiny_model_dir, tokenizer, addition_dataset, tmp_path):
    """What `TreePackedTraining` relies on in TRL 1.16 (as tests/test_trl_touch_points.py does for the trainer)."""
    import inspect

    from test_trl_touch_points import check, parameters
    from transformers import Trainer
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head, split_tensor_dict  # noqa: F401 (regroup splits with it)

    hook = parameters(GRPOTrainer._get_per_token_logps_and_entropies)
    check(hook[:8] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                       "compute_entropy", "compute_aux_loss"], "GRPOTrainer._get_per_token_logps_and_entropies",
          f"parameters start {hook[:8]}")
    check(all(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters[name].default is None
              for name in hook[8:]), "GRPOTrainer._get_per_token_logps_and_entropies",
          "a keyword after compute_aux_loss no longer defaults to None (packing falls back on any set one)")
    check(parameters(GRPOTrainer._prepare_inputs) == ["self", "generation_batch"], "GRPOTrainer._prepare_inputs",
          "signature changed")
    check(parameters(Trainer.training_step)[:4] == ["self", "model", "inputs", "num_items_in_batch"],
          "Trainer.training_step", "signature changed")
    check("shift_labels" in inspect.getsource(add_fused_lm_head), "trl.trainer.utils.add_fused_lm_head",
          "the fused forward no longer takes shift_labels")
    trainer = make_trainer(tiny_model_dir, tokenizer, addition_dataset, tmp_path)
    check(trainer._trl.buffered_inputs is None, "GRPOTrainer._buffered_inputs", "not None after __init__")
