"""`ARPOTrainer`: TRL's `GRPOTrainer` with ARPO's branching tool rollout and shared-prefix attribution.

Only two hooks change:
  * generation goes through TRL's `rollout_func` (bound to `_arpo_rollout`), so TRL keeps padding, old and
    reference logps, importance sampling, rewards and metrics; tool-result tokens come back as `env_mask`,
    which TRL turns into `tool_mask` and removes from the loss;
  * `_generate_and_score_completions` replaces the (B,) advantages by (B,T) ones for hard attribution,
    which TRL's `_compute_loss` accepts.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

import torch
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from arpo_trl.advantages import hard_advantages, owner_mask, token_owners
from arpo_trl.config import ARPOConfig
from arpo_trl.engines import GenerationEngine, TransformersEngine
from arpo_trl.rollout import BranchingSampler, RolloutResult
from arpo_trl.tools.base import Tool


class ARPOTrainer(GRPOTrainer):
    """Train a tool-using policy with ARPO.

    Args:
        tools: tag tools (`PythonTool()`, `SearchTool(...)`, `Tool(tag, fn)`) the model may call by writing
            `<tag>…</tag>`. They are ARPO's tools, not TRL's JSON function-calling `tools`.
        engine: a `GenerationEngine`; defaults to a `TransformersEngine` over the model being trained.
        Everything else is `GRPOTrainer`'s.
    """

    _tag_names = ["trl", "arpo"]

    def __init__(
        self,
        model,
        reward_funcs,
        args: ARPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        tools: Sequence[Tool] = (),
        peft_config=None,
        engine: GenerationEngine | None = None,
        **kwargs,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ARPOConfig(f"{name.split('/')[-1]}-ARPO")
        if not isinstance(args, ARPOConfig):
            raise TypeError(f"ARPOTrainer needs args=ARPOConfig(...), got {type(args).__name__}.")
        if "rollout_func" in kwargs:
            raise ValueError("ARPOTrainer provides its own rollout_func; pass tools= and engine= instead.")
        if not all(isinstance(tool, Tool) for tool in tools):
            raise TypeError("ARPOTrainer tools must be arpo_trl.Tool instances (tag + callable), e.g. PythonTool().")
        if args.use_vllm:
            raise NotImplementedError("ARPOTrainer does not support use_vllm yet; use the transformers backend.")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL-experimental
        super().__init__(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
            rollout_func=self._arpo_rollout, **kwargs,
        )
        self.arpo_tools = list(tools)
        self.engine = engine or self._transformers_engine()
        self.sampler = BranchingSampler(
            self.engine, self._tokenizer, self.arpo_tools,
            num_generations=args.num_generations, initial_rollouts=args.initial_rollouts,
            branch_factor=args.branch_factor, branch_threshold=args.branch_threshold,
            entropy_weight=args.entropy_weight, entropy_window=args.entropy_window,
            branch_policy=args.branch_policy, max_tool_calls=args.max_tool_calls,
            max_completion_length=args.max_completion_length, tool_timeout=args.tool_timeout,
            max_tool_workers=args.max_tool_workers,
            seed=args.seed_sampler if args.seed_sampler is not None else args.seed + self.accelerator.process_index,
        )

    def _transformers_engine(self) -> TransformersEngine:
        args = self.args
        return TransformersEngine(
            None, self._tokenizer, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty, entropy_top_k=args.entropy_top_k,
            eos_token_ids=self.eos_token_ids, generation_kwargs=args.generation_kwargs,
            model_context=lambda: unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=args.ds3_gather_for_generation
            ),
        )

    def _arpo_rollout(self, prompts: list, trainer=None) -> dict:
        """TRL's `rollout_func`: `prompts` holds each prompt M times in a row; return M trajectories each."""
        training = self.model.training
        m = self.num_generations if training else self.num_generations_eval
        prompt_ids, _, _ = self._tokenize_prompts(prompts[::m])
        # Evaluation samples whole trajectories, as the reference's validation does (no branching).
        result = self.sampler.sample(prompt_ids, num_generations=m, branch_policy=None if training else "none")
        trajectories = result.trajectories
        fields = [self._tree_fields(t) for t in trajectories]
        env_mask = [list(t.mask) for t in trajectories]
        if self.args.advantage_attribution == "hard":  # a shared token is trained once, in its owner's row
            owners = self._owners(fields, max(len(row) for row in env_mask))
            keep = owner_mask(owners, [t.id for t in trajectories]).tolist()
            env_mask = [[bit * kept for bit, kept in zip(row, keep[i])] for i, row in enumerate(env_mask)]
        self._log_rollout(result, env_mask, "train" if training else "eval")
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.completion_ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": env_mask,
            **{f"arpo_{key}": [f[key] for f in fields] for key in fields[0]},
        }

    @staticmethod
    def _tree_fields(t) -> dict:
        """Per-trajectory tree metadata, passed to reward functions as `arpo_*` keyword arguments."""
        return {
            "node": t.id, "group": t.group, "parent": t.parent, "fork_position": t.fork_position,
            "length": len(t.completion_ids), "tool_calls": t.tool_calls, "tool_failures": t.tool_failures,
            "finish_reason": t.finish_reason,
        }

    @staticmethod
    def _owners(fields: list[dict], width: int) -> torch.Tensor:
        return token_owners(
            [f["node"] for f in fields], [f["parent"] for f in fields], [f["fork_position"] for f in fields],
            [f["length"] for f in fields], width,
        )

    def _generate_and_score_completions(self, inputs):
        # Hard attribution needs the group advantages TRL computes, then spreads them per token.
        output = super()._generate_and_score_completions(inputs)
        if self.args.advantage_attribution == "hard" and "arpo_node" in inputs[0]:
            fields = [{k[len("arpo_"):]: row[k] for k in row if k.startswith("arpo_")} for row in inputs]
            owners = self._owners(fields, output["completion_ids"].shape[1])
            output["advantages"] = hard_advantages(output["advantages"], owners, [f["group"] for f in fields])
        return output

    def _log_rollout(self, result: RolloutResult, env_mask: list[list[int]], mode: str) -> None:
        stats, trajectories, groups = result.stats, result.trajectories, max(len(result.groups), 1)
        metrics = {
            "arpo/forks_per_group": stats.forks / groups,
            "arpo/fill_ups_per_group": stats.fill_ups / groups,
            "arpo/rounds": stats.rounds,
            "arpo/tool_calls_per_trajectory": statistics.fmean(t.tool_calls for t in trajectories),
            "arpo/tool_calls_per_group": stats.tool_calls / groups,
            "arpo/tool_failures_per_group": stats.tool_failures / groups,
            "arpo/tokens_generated_per_group": sum(t.own_tokens() for t in trajectories) / groups,
            "arpo/tokens_trained_per_group": sum(map(sum, env_mask)) / groups,
        }
        if stats.fork_deltas:
            metrics["arpo/fork_delta_entropy_mean"] = statistics.fmean(stats.fork_deltas)
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))
