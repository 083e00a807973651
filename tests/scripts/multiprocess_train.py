"""Run by tests/test_multiprocess.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): two steps of
ARPOTrainer with the transformers backend or a vLLM server, each rank writing what it trained on to JSON."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tiny import question  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, VLLMServerError  # noqa: E402


def length_reward(completions, **kwargs):
    return [len(c[0]["content"] if isinstance(c, list) else c) / 100 for c in completions]


class Recorder(ARPOTrainer):
    rollouts: list = []
    trained: list = []

    def _sample_on_main_process(self, prompt_ids, m, policy):
        result, local = super()._sample_on_main_process(prompt_ids, m, policy)
        self.rollouts.append([[t.prompt_ids + t.completion_ids for t in group] for group in result.groups])
        return result, local

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rows = []
        for p, pm, c, cm in zip(output["prompt_ids"].tolist(), output["prompt_mask"].tolist(),
                                output["completion_ids"].tolist(), output["completion_mask"].tolist()):
            rows.append([t for t, k in zip(p, pm) if k] + [t for t, k in zip(c, cm) if k])
        self.trained.append(rows)
        return output


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--fail-at-rollout", type=int, default=None,
                        help="make the main process's sampler raise at this rollout (tests error propagation)")
    parser.add_argument("--ds3-gather", choices=["true", "false"], default="true",
                        help="ds3_gather_for_generation (under DeepSpeed ZeRO-3)")
    parser.add_argument("--rank1-branch-policy", default=None,
                        help="rank 1's sampler uses this branch policy (e.g. 'none': its trees need fewer waves)")
    parser.add_argument("--rank0-extra-wave", action="store_true",
                        help="rank 0 makes one more model call per rollout than its tree needs, so that the ranks' "
                             "wave counts differ whatever the model samples")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [{"prompt": [{"role": "user", "content": question(a, 2 * a + 1)}], "ground_truth": str(3 * a + 1)}
            for a in range(16)]
    server = args.base_url is not None
    config = ARPOConfig(
        output_dir=args.out, per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
        branch_threshold=1.0, max_completion_length=48, max_steps=2, learning_rate=1e-2, logging_steps=1,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=0, beta=0.0,
        use_vllm=server, vllm_mode="server", vllm_server_base_url=args.base_url,
        ds3_gather_for_generation=args.ds3_gather == "true",
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = Recorder(model=args.model, reward_funcs=length_reward, args=config, train_dataset=Dataset.from_list(rows),
                       processing_class=tokenizer, tools=[PythonTool(timeout=5)], peft_config=lora if server else None)
    if args.fail_at_rollout is not None and trainer.accelerator.is_main_process:
        sample, calls = trainer.sampler.sample, []

        def failing_sample(*a, **kw):
            calls.append(1)
            if len(calls) == args.fail_at_rollout:
                raise VLLMServerError(f"injected failure at rollout {len(calls)}")
            return sample(*a, **kw)

        trainer.sampler.sample = failing_sample
    rank = trainer.accelerator.process_index
    if args.rank1_branch_policy is not None and rank == 1:
        trainer.sampler.rule.branch_policy = args.rank1_branch_policy
    if args.rank0_extra_wave and rank == 0:
        sample_trees = trainer.sampler.sample

        def sample_after_an_extra_wave(prompts, *a, **kw):
            trainer.engine.generate([list(prompts[0])], [1], [])  # a model call that rank 1 does not make
            return sample_trees(prompts, *a, **kw)

        trainer.sampler.sample = sample_after_an_extra_wave
    model_calls = []  # batch sizes of the in-process engine's generate calls
    engine = getattr(trainer.engine, "engine", trainer.engine)  # a LockstepEngine's wrapped engine
    if engine is not None and not server:
        generate = engine.generate
        engine.generate = lambda prefixes, *a: model_calls.append(len(prefixes)) or generate(prefixes, *a)
    trainer.train()
    params = {n: p.detach().double().sum().item() for n, p in trainer.model.named_parameters() if p.requires_grad}
    report = {"rank": rank, "world": trainer.accelerator.num_processes, "rollouts": trainer.rollouts,
              "trained": trainer.trained, "params": params, "model_calls": model_calls,
              "idle_calls": getattr(trainer.engine, "idle_calls", None),
              "forks": [e["arpo/forks_per_group"] for e in trainer.state.log_history if "arpo/forks_per_group" in e]}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
