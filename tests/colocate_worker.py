"""Runs inside the colocate environment (`python -m arpo_trl.server setup --colocate`): real `ARPOTrainer` steps with
`vllm_mode='colocate'` on vLLM-CPU, and writes what `tests/test_colocate.py` checks to a JSON file.

    python tests/colocate_worker.py forks MODEL_DIR OUT.json   # the tiny tool model: forks and the prefix cache
    python tests/colocate_worker.py sync MODEL_DIR OUT.json    # SmolLM2: vLLM's logprobs after a sync
"""

from __future__ import annotations

import json
import random
import sys

import torch
from datasets import Dataset
from peft import LoraConfig

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
from arpo_trl.rewards import completion_text

LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def length_reward(completions, **kwargs):
    """Rewards that differ within every group (rows alternate), so that each step changes the adapter."""
    return [len(completion_text(c)) / 100 + row % 2 for row, c in enumerate(completions)]


def _args(out_dir: str, **overrides) -> ARPOConfig:
    values = dict(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
                  max_completion_length=64, max_steps=2, learning_rate=3e-2, logging_steps=1, use_cpu=True,
                  bf16=False, report_to="none", save_strategy="no", gradient_checkpointing=False, seed=0,
                  use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_mode="token_mask")
    return ARPOConfig(**{**values, **overrides})


def _addition_rows(n: int) -> list[dict]:
    rng = random.Random(2)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "ground_truth": str(a + b)}
            for a, b in pairs]


def _steps(trainer) -> list[dict]:
    return [{k: v for k, v in entry.items() if k.startswith(("arpo/", "sampling/"))}
            for entry in trainer.state.log_history if "arpo/forks_per_group" in entry]


class RecordingTrainer(ARPOTrainer):
    """Keeps each rollout's trees (as the sampler returned them) and the requests' prefix-cache hits."""

    def _arpo_rollout(self, prompts, trainer=None):
        start = len(self.engine.counters.log)
        output = super()._arpo_rollout(prompts, trainer)
        result = self._last_rollout
        self.rollouts.append({
            "groups": [[{"id": t.id, "parent": t.parent, "fork_position": t.fork_position,
                         "prefix": len(t.prompt_ids) + (t.fork_position or 0),
                         "prefix_key": hash(tuple(t.prompt_ids + t.completion_ids[: t.fork_position or 0]))}
                         for t in group] for group in result.groups],
            "requests": self.engine.counters.log[start:],
            "continued_probes": result.stats.continued_probes, "engine_requests": result.stats.requests,
        })
        return output


def forks(model_dir: str, out: dict) -> None:
    """The GPU recipe's path on vLLM-CPU: the policy in bfloat16 under bf16 training, and top-k logprobs on each
    segment's first k tokens only (`split_logprobs`, the GPU's setting)."""
    # k = 4: a probe shorter than the tool model's answers, so that probes go on as their segments' requests
    args = _args(out["dir"], branch_threshold=1.0, num_generations=8, initial_rollouts=2, log_trees=True,
                 per_device_train_batch_size=16, entropy_window=4, bf16=True,
                 model_init_kwargs={"dtype": torch.bfloat16})
    trainer = RecordingTrainer(model=model_dir, reward_funcs=[arpo_math_reward, length_reward], args=args,
                               train_dataset=Dataset.from_list(_addition_rows(16)), tools=[PythonTool(timeout=5)],
                               peft_config=LORA)
    trainer.engine.split_logprobs = True
    trainer.rollouts, trainer.engine.counters.keep_log = [], True
    trainer.train()
    trees = _tree_records(out["dir"])
    out.update(steps=_steps(trainer), rollouts=trainer.rollouts, block_size=trainer.engine.llm.vllm_config
               .cache_config.block_size, weight_syncs=trainer._trl.weight_sync.syncs,
               compute_bound=trainer.engine.compute_bound,
               fill_ups_wait=trainer.sampler.scheduler.wait_for_first_decision,
               policy_dtype=str(next(trainer.model.parameters()).dtype),
               engine_dtype=trainer.engine.llm.vllm_config.model_config.dtype.__str__(),
               entropies=[(record["segments"], record["entropies"]) for record in trees])


def _tree_records(run_dir: str) -> list[dict]:
    from arpo_trl.trees import read_jsonl

    return read_jsonl(f"{run_dir}/trees.jsonl")


def _vllm_logprobs(engine, ids: list[int]) -> list[float]:
    """vLLM's log-probability of each token of `ids` after the first (prompt logprobs of one request)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = engine.call(lambda: engine._run_batch([("probe", ids, params)]))["probe"]
    return [row[token].logprob for row, token in zip(output.prompt_logprobs[1:], ids[1:])]


def _trainer_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def sync(model_dir: str, out: dict) -> None:
    try:  # vLLM-CPU has no sleep mode: refused in one line, before vLLM starts
        ARPOTrainer(model=model_dir, reward_funcs=[arpo_math_reward], args=_args(out["dir"],
                    vllm_enable_sleep_mode=True), train_dataset=Dataset.from_list(_addition_rows(2)))
    except ValueError as error:
        out["sleep_refusal"] = str(error)
    args = _args(out["dir"], max_completion_length=32, learning_rate=1e-2, max_steps=1)
    trainer = ARPOTrainer(model=model_dir, reward_funcs=[arpo_math_reward, length_reward], args=args,
                          train_dataset=Dataset.from_list(_addition_rows(2)), tools=[PythonTool(timeout=5)],
                          peft_config=LORA)
    tokenizer, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model).eval()
    ids = tokenizer.encode("The capital of France is Paris. 12 + 30 = 42, and <python>print(7 * 6)</python>")
    trainer._trl.weight_sync.sync_weights()
    out["before"] = {"vllm": _vllm_logprobs(trainer.engine, ids), "trainer": _trainer_logprobs(model, ids)}
    trainer.train()
    model.eval()
    trainer._trl.weight_sync.before_rollout()
    trainer._trl.weight_sync.sync_weights()
    out["after"] = {"vllm": _vllm_logprobs(trainer.engine, ids), "trainer": _trainer_logprobs(model, ids)}
    out["steps"] = _steps(trainer)


if __name__ == "__main__":
    scenario, model_dir, path = sys.argv[1:4]
    result: dict = {"dir": str(path) + ".run"}
    {"forks": forks, "sync": sync}[scenario](model_dir, result)
    with open(path, "w") as f:
        json.dump(result, f)
