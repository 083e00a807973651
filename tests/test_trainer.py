"""ARPOTrainer end to end on CPU: a tiny model that calls `<python>`, real PythonTool subprocesses, TRL's loss."""

import json
import math
import re

import pytest
import torch
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.rewards import completion_text, validate_format
from arpo_trl.trees import read_jsonl


def length_reward(completions, **kwargs):
    """Shaping so that a group's rewards always differ: the ARPO reward of a 107k-parameter model is mostly -1, and
    even lengths can tie by chance, so every other row also gets +1 (groups are contiguous and of even size here).
    A test that training moves the weights must not depend on what the random model happened to write."""
    return [length_shaping(completion_text(c), row) for row, c in enumerate(completions)]


def length_shaping(text: str, row: int) -> float:
    """`length_reward` of the completion `text` at position `row` of its batch (a step's records keep that order)."""
    return len(text) / 100 + row % 2


REWARDS = [arpo_math_reward, length_reward]


class RecordingTrainer(ARPOTrainer):
    """Keeps what TRL hands to the loss, the rows it was computed from (with the `arpo_*` tree fields the reward
    functions receive from the side table) and the rewards, to check masks and advantages against the trees."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.tree_rows = [{**row, **{f"arpo_{k}": v for k, v in tree.items()}}
                          for row, tree in zip(inputs, self._tree_rows)]
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.recorded_rewards = getattr(self, "recorded_rewards", []) + [rewards.detach().clone()]
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.recorded = getattr(self, "recorded", []) + [output]
        self.recorded_rows = getattr(self, "recorded_rows", []) + [self.tree_rows]
        return output


def group_advantages(rewards_per_func: torch.Tensor, m: int) -> torch.Tensor:
    """GRPO's advantages by hand: weighted reward sum, minus the group mean, over the group's (Bessel) std + 1e-4."""
    rewards = rewards_per_func.sum(1).view(-1, m)
    return ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()


def owner(rows: list[dict], i: int, t: int) -> int:
    """The node that generated token t of row i: walk up while t lies in the part copied from the parent."""
    by_node = {row["arpo_node"]: row for row in rows}
    node = rows[i]["arpo_node"]
    while by_node[node]["arpo_parent"] is not None and t < by_node[node]["arpo_fork_position"]:
        node = by_node[node]["arpo_parent"]
    return node


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
        max_completion_length=48, max_steps=2, learning_rate=5e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", seed=0, beta=0.0, gradient_checkpointing=False,
    )
    base.update(kw)
    return ARPOConfig(**base)


def masked_spans(ids: list[int], bits: list[int], value: int) -> list[list[int]]:
    spans, current = [], []
    for token, bit in zip(ids, bits):
        if bit == value:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    return spans + ([current] if current else [])


def check_masks(trainer, tokenizer, before, hard=False):
    """Loss mask = model tokens, both ways: every loss-masked span is a tool result block (or the EOS after the call
    limit), and there are as many such blocks as the sampler ran tool calls, so no result is trained. (The model
    may write result tags itself; those are its own tokens.) With hard attribution a row trains only the tokens it
    generated itself, from its fork position on: the copied prefix is masked, and each call's result is counted
    once, in the row that made the call."""
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before), "no trainable weight changed"
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"arpo/forks_per_group", "arpo/tool_calls_per_group", "arpo/tokens_generated_per_group"} <= logged
    logs = [entry for entry in trainer.state.log_history if "arpo/tool_calls_per_group" in entry]
    assert len(logs) == len(trainer.recorded)  # one rollout per step, logged every step
    tool_calls = 0
    for output, rows, log in zip(trainer.recorded, trainer.recorded_rows, logs):
        loss_mask = output["completion_mask"] * output["tool_mask"]
        blocks_in_batch = 0
        for i, (ids, bits) in enumerate(zip(output["completion_ids"].tolist(), loss_mask.tolist())):
            length = rows[i]["arpo_length"]
            assert sum(output["completion_mask"][i].tolist()) == length
            start = (rows[i]["arpo_fork_position"] or 0) if hard else 0
            assert not any(bits[:start]), "a copied prefix is trained only in its owner's row"
            ids, bits = ids[start:length], bits[start:length]
            spans, blocks = masked_spans(ids, bits, 0), 0
            for k, span in enumerate(spans):  # every masked span is a result block (or the EOS after the call limit)
                # a closing tag that ended inside a token: its rewritten tail is the environment's too (mask 0),
                # followed by the result (which the token budget may cut anywhere, even inside its opening tag)
                text = re.sub(r"^[\w/]*>(?= <|$)", "", tokenizer.decode(span))
                whole = re.fullmatch(r" <result>\n.*\n</result>(<\|im_end\|>)?|<\|im_end\|>", text, re.DOTALL)
                at_end = k == len(spans) - 1 and ids[len(ids) - len(span):] == span
                # cut by the token budget (the cut may fall just after a `</result>` that the tool's output quotes)
                if at_end and not whole and (rows[i]["arpo_finish_reason"] == "length" or not text.endswith(
                        ("</result>", "<|im_end|>"))):
                    assert text.startswith(" <result>\n") or " <result>\n".startswith(text), text
                    blocks += text != ""  # "": a closing tag's tail with no call behind it (no opening tag)
                    continue
                blocks += text.startswith(" <result>\n")
                assert whole, text
            if not hard:  # the row's every call (its own and those in a copied prefix) has its masked result
                assert blocks == rows[i]["arpo_tool_calls"], (blocks, rows[i]["arpo_tool_calls"])
            blocks_in_batch += blocks
        if hard:  # each call the sampler ran has its masked result exactly once, in its owner's row
            groups = len({row["arpo_group"] for row in rows})
            assert blocks_in_batch == round(log["arpo/tool_calls_per_group"] * groups)
        tool_calls += blocks_in_batch
        assert loss_mask.sum() > 0
    assert tool_calls > 0, "the tiny tool model should have called <python>"
    return tool_calls


def check_loss_ignores_tool_tokens(trainer):
    """TRL's loss on a recorded batch: moving the old log-probs of tool-result tokens (tool mask 0) changes neither
    the loss nor any gradient; moving one model token's changes both."""
    def split(batch):  # (environment tokens, trained tokens) of a batch
        return ((batch["completion_mask"] * (1 - batch["tool_mask"])).bool(),
                (batch["completion_mask"] * batch["tool_mask"]).bool())

    with_tools = [batch for batch in trainer.recorded if all(part.any() for part in split(batch))]
    assert with_tools, "no recorded batch has both tool-result and model tokens"
    inputs = dict(with_tools[-1])
    env, trained = split(inputs)
    advantages = inputs["advantages"] if inputs["advantages"].dim() == 2 else inputs["advantages"][:, None]
    row, col = (trained & (advantages.expand_as(trained) != 0)).nonzero()[0].tolist()
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        old = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].shape[1])[0]

    def loss_and_grads(old_logps):
        model.zero_grad()
        loss = trainer.compute_loss(model, {**inputs, "old_per_token_logps": old_logps})
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    loss, grads = loss_and_grads(old)
    env_loss, env_grads = loss_and_grads(old + 3.0 * env)
    assert torch.equal(loss, env_loss) and all(torch.equal(a, b) for a, b in zip(grads, env_grads))
    bump = torch.zeros_like(old)
    bump[row, col] = 0.5
    model_loss, model_grads = loss_and_grads(old + bump)
    assert not torch.equal(loss, model_loss) and any(not torch.equal(a, b) for a, b in zip(grads, model_grads))
    model.zero_grad()


def test_end_to_end_full_finetune_with_python_tool(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    trainer = RecordingTrainer(
        model=str(tool_model_dir), reward_funcs=REWARDS, args=_args(tmp_path),
        train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)],
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    check_masks(trainer, tokenizer, before)
    check_loss_ignores_tool_tokens(trainer)
    prefilled = [e["arpo/prefill_tokens_per_group"] for e in trainer.state.log_history if "arpo/waves" in e]
    assert len(prefilled) == 2 and sum(prefilled) * 2 == trainer.engine.counters.prefill_tokens  # 2 groups per step
    decoding = [e["arpo/engine_decode_seconds"] for e in trainer.state.log_history if "arpo/waves" in e]
    assert len(decoding) == 2 and all(s > 0 for s in decoding)  # the cached engine: each rollout's own share
    assert math.isclose(sum(decoding), trainer.engine.counters.seconds["decode"], rel_tol=1e-6)
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
        for row, r in enumerate(rows):  # reward = length shaping + ARPO's reward, recomputed from the record's text
            text = "".join(seg["text"] for seg in r["segments"])
            arpo_part = r["reward"] - length_shaping(text, row)
            if validate_format(text) is not None:
                assert arpo_part == pytest.approx(-1.0, abs=1e-6)
            else:
                assert min(abs(arpo_part - v) for v in (0.0, 1.0)) < 1e-6
        for group in sorted({r["group"] for r in rows}):  # advantage = GRPO's, from the group's logged rewards
            mine = [r for r in rows if r["group"] == group]
            expected = group_advantages(torch.tensor([[r["reward"]] for r in mine], dtype=torch.float64), m)
            assert [r["advantage"] for r in mine] == pytest.approx(expected.tolist(), abs=1e-4)
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
    check_hard_advantages(trainer)
    check_loss_ignores_tool_tokens(trainer)
    forks = [e["arpo/forks_per_group"] for e in trainer.state.log_history if "arpo/forks_per_group" in e]
    assert sum(forks) > 0, "τ=1 forks at every tool result while the budget lasts"
    for entry in trainer.state.log_history:  # each generated token trained exactly once
        if "arpo/tokens_trained_per_group" in entry:
            assert entry["arpo/tokens_trained_per_group"] == entry["arpo/tokens_generated_per_group"]


def check_hard_advantages(trainer):
    """The (B, T) advantages TRL's loss got, rebuilt by hand from the recorded tree (node, parent, fork position)
    and GRPO's group advantages of the recorded rewards: each token gets the mean advantage of the group's rows
    that share it (hold the same owner at that position), 0 past a row's end."""
    m = trainer.args.num_generations
    shared = 0
    for output, rows, rewards in zip(trainer.recorded, trainer.recorded_rows, trainer.recorded_rewards):
        group_adv = group_advantages(rewards.double(), m)
        ids = output["completion_ids"].tolist()
        expected = torch.zeros(output["completion_ids"].shape, dtype=torch.float64)
        for i, row in enumerate(rows):
            if row["arpo_parent"] is not None:  # a branch copies its parent's first fork_position tokens
                parent = next(j for j, r in enumerate(rows) if r["arpo_node"] == row["arpo_parent"])
                assert ids[i][: row["arpo_fork_position"]] == ids[parent][: row["arpo_fork_position"]]
            for t in range(row["arpo_length"]):
                sharing = [j for j, other in enumerate(rows) if other["arpo_group"] == row["arpo_group"]
                           and t < other["arpo_length"] and owner(rows, j, t) == owner(rows, i, t)]
                expected[i, t] = group_adv[sharing].mean()
                shared += len(sharing) > 1
        torch.testing.assert_close(output["advantages"].double(), expected, atol=1e-5, rtol=1e-5)
    assert shared > 0, "τ=1 branches share prefixes, so some tokens average several advantages"


def test_trainer_rejects_bad_setup(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    from trl import GRPOConfig

    grpo = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                      bf16=False, report_to="none")
    with pytest.raises(TypeError, match="ARPOConfig"):
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=grpo,
                    train_dataset=addition_dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="Tool function 'print': .*type hint"):  # a function as TRL takes it: no
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path),
                    train_dataset=addition_dataset, processing_class=tokenizer, tools=[print])
    with pytest.raises(TypeError, match="tools: expected arpo_trl.Tool instances or functions"):
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path),
                    train_dataset=addition_dataset, processing_class=tokenizer, tools=["python"])


def test_model_card_names_arpo_and_cites_the_paper(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=arpo_math_reward, args=_args(tmp_path),
                          train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool()])
    trainer.create_model_card(model_name="tiny-arpo", dataset_name="addition")
    card = (tmp_path / "README.md").read_text()
    assert "ARPO" in card and "2507.19849" in card and "Agentic Reinforced Policy Optimization" in card
    assert "arpo" in card and "trl" in card  # tags
