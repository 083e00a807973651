"""The one place ARPOTrainer touches TRL's undocumented state (part of the trainer: no other module uses it)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch
from trl import GRPOTrainer

from arpo_trl.config import ARPOConfig

TRL_CHECKED = "1.16.0"  # the TRL release every touch point of `TRLState` was read against


class TRLState:
    """The one place ARPOTrainer reads or writes TRL's undocumented state: private attributes of `GRPOTrainer`
    (and of transformers' `Trainer` below it) and public ones TRL's docs do not describe. Each line names the TRL
    release it was read against (`TRL_CHECKED`); tests/test_trl_touch_points.py fails, naming the touch point, when a
    TRL upgrade moves one. That test also checks what ARPOTrainer uses outside this class: the private hooks it
    overrides (`GRPOTrainer._generate_and_score_completions`, `GRPOTrainer._generate`, `Trainer._save_rng_state`,
    `Trainer._load_rng_state`), the model-card class attributes and `trl.models.utils.unwrap_model_for_generation`'s
    keywords."""

    def __init__(self, trainer: GRPOTrainer):
        self._trainer = trainer

    @staticmethod
    @contextlib.contextmanager
    def constructing(args: ARPOConfig, trl_builds_vllm: bool, reward_weights: list[float] | None = None
                     ) -> Iterator[None]:
        """Around `GRPOTrainer.__init__`: TRL builds its own vLLM backend only when TRL syncs the weights (NCCL);
        `reward_weights`, when given, are the weights TRL reads instead of `args.reward_weights` (the user's own
        config is left as it was)."""
        # TRL 1.16: GRPOTrainer.__init__ warns about rollout_func unless os.environ["TRL_EXPERIMENTAL_SILENCE"] == "1"
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        # TRL 1.16: GRPOTrainer.__init__ builds vllm_generation (a VLLMClient: needs `vllm`, NCCL) iff args.use_vllm,
        # and reads args.reward_weights once, into self.reward_weights
        use_vllm, args.use_vllm = args.use_vllm, trl_builds_vllm
        weights = args.reward_weights
        if reward_weights is not None:
            args.reward_weights = reward_weights
        try:
            yield
        finally:
            args.use_vllm, args.reward_weights = use_vllm, weights

    def set_use_vllm(self, value: bool) -> None:
        # TRL 1.16: GRPOTrainer.use_vllm (args.use_vllm at __init__) gates the sync hook and importance sampling
        self._trainer.use_vllm = value

    def install_weight_sync(self, sync) -> None:
        # TRL 1.16: GRPOTrainer._generate calls vllm_generation.sync_weights() before rollout_func when use_vllm and
        # state.global_step != _last_loaded_step, then stores global_step there (-1: sync before step 0 too)
        self._trainer.vllm_generation = sync
        self._trainer._last_loaded_step = -1

    @property
    def weight_sync(self):
        # TRL 1.16: GRPOTrainer.vllm_generation exists only when TRL built it or install_weight_sync set it
        return getattr(self._trainer, "vllm_generation", None)

    def check_vespo_sampling_mode(self) -> None:
        """TRL's own check, which its __init__ skipped because it saw use_vllm=False."""
        trainer = self._trainer
        # TRL 1.16: GRPOTrainer.loss_type, vllm_importance_sampling_correction and _mode are args' values
        if trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_correction and \
                trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask'.")

    def is_sharded(self) -> bool:
        # transformers' Trainer under TRL 1.16: is_deepspeed_enabled / is_fsdp_enabled, set in Trainer.__init__
        return self._trainer.is_deepspeed_enabled or self._trainer.is_fsdp_enabled

    @property
    def tokenizer(self):
        # TRL 1.16: GRPOTrainer._tokenizer is processing_class, or processing_class.tokenizer for a processor
        return self._trainer._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        # TRL 1.16: GRPOTrainer.eos_token_ids: the tokenizer's EOS plus every EOS id of the model's generation_config
        return self._trainer.eos_token_ids

    def group_size(self, training: bool) -> int:
        # TRL 1.16: GRPOTrainer.num_generations, and num_generations_eval (args' value, else num_generations)
        return self._trainer.num_generations if training else self._trainer.num_generations_eval

    @staticmethod
    def distinct_prompts(prompts: list, group_size: int) -> list:
        # TRL 1.16: rollout_func(prompts, trainer) gets each prompt group_size times in a row (RepeatSampler), although
        # its docstring says "no duplication"
        return prompts[::group_size]

    @staticmethod
    def check_whole_groups(prompts: list, group_size: int, training: bool) -> None:
        """A batch must hold whole groups; an evaluation started by hand is not checked by the config."""
        if prompts != [p for p in prompts[::group_size] for _ in range(group_size)]:
            mode, suffix = ("train", "") if training else ("eval", "_eval")
            raise ValueError(f"This {mode} batch of {len(prompts)} rows does not hold whole groups of one prompt's "
                             f"trajectories: per_device_{mode}_batch_size must be divisible by "
                             f"num_generations{suffix} ({group_size}).")

    def tokenize_prompts(self, prompts: list) -> list[list[int]]:
        # TRL 1.16: GRPOTrainer._tokenize_prompts(prompts) -> (prompt_ids, images, multimodal_fields), chat template on
        prompt_ids, _, _ = self._trainer._tokenize_prompts(prompts)
        return prompt_ids

    @staticmethod
    def generated_rollout(generated: tuple) -> tuple[list[list[int]], list[list[int]], dict]:
        # TRL 1.16: GRPOTrainer._generate returns (prompt_ids, completion_ids, tool_mask, completions, logprobs,
        # extra_fields, images, tool_images); with a rollout_func, tool_mask is its env_mask (logged as the completion
        # lengths inside _generate) and extra_fields its other keys
        return generated[1], generated[2], generated[5]

    @staticmethod
    def with_tool_mask(generated: tuple, tool_mask: list[list[int]]) -> tuple:
        # TRL 1.16: _generate_and_score_completions takes the loss's tool_mask from _generate's third item
        return (*generated[:2], tool_mask, *generated[3:])

    def truncated(self, completion_ids: list[int]) -> bool:
        # TRL 1.16: with mask_truncated_completions, _generate_and_score_completions drops the rows whose last
        # completion token is neither an EOS id nor the pad id
        return completion_ids[-1] not in (*self.eos_token_ids, self.tokenizer.pad_token_id)

    @staticmethod
    def rows_in_loss(output: dict) -> torch.Tensor:
        # TRL 1.16: output["completion_mask"] is (B, T), zeroed for the rows mask_truncated_completions drops
        return output["completion_mask"].bool().any(1)

    @staticmethod
    def loss_mask(output: dict, tool_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) the tokens the loss trains: `mask` in TRL's `_compute_loss`, whose mask.sum(-1) grpo and sapo divide
        each row by; with `tool_mask`, that mask in place of the output's own."""
        # TRL 1.16: _compute_loss's mask is output["completion_mask"] * output["tool_mask"] (when present)
        completion_mask = output["completion_mask"]
        tool_mask = output.get("tool_mask") if tool_mask is None else tool_mask.to(completion_mask.device)
        return completion_mask if tool_mask is None else completion_mask * tool_mask

    @staticmethod
    def completion_shape(output: dict) -> tuple[int, int]:
        # TRL 1.16: _generate_and_score_completions' output["completion_ids"] is this rank's (B, T) padded tensor
        rows, width = output["completion_ids"].shape
        return rows, width

    @staticmethod
    def advantages(output: dict) -> torch.Tensor:
        # TRL 1.16: _generate_and_score_completions' output["advantages"] is this rank's (B,) group advantages
        return output["advantages"]

    @staticmethod
    def set_token_advantages(output: dict, advantages: torch.Tensor) -> None:
        # TRL 1.16: GRPOTrainer._compute_loss unsqueezes 1-D advantages only, so (B, T) ones are used as they are
        output["advantages"] = advantages

    def logged_advantages(self, last: int) -> list[float]:
        # TRL 1.16: GRPOTrainer._logs["advantages"] is a deque of per-sample advantages, every rank's, in rank order
        return list(self._trainer._logs["advantages"])[-last:]

    def logged_rewards(self, last: int) -> list[float]:
        """Each of the last `last` samples' weighted reward, as TRL's `reward` metric sums it (NaN: every reward
        function returned None, as TRL leaves such a row out of its reward statistics)."""
        weights = self._trainer.reward_weights.tolist()
        return [math.nan if all(map(math.isnan, row)) else sum(w * v for w, v in zip(weights, row) if not math.isnan(v))
                for row in self._logged_reward_rows(last)]

    def unscored(self, last: int) -> list[bool]:
        """Each of the last `last` samples: whether every reward function returned None (TRL: advantage 0)."""
        return [all(map(math.isnan, row)) for row in self._logged_reward_rows(last)]

    def _logged_reward_rows(self, last: int) -> list[tuple[float, ...]]:
        trainer = self._trainer
        # TRL 1.16: GRPOTrainer._logs["rewards"][name] is a deque of per-sample rewards (NaN: unscored), every rank's in
        # rank order, for each name of reward_func_names, whose order is reward_weights' (a tensor)
        per_func = [list(trainer._logs["rewards"][name])[-last:] for name in trainer.reward_func_names]
        if any(len(rows) < last for rows in per_func):  # the deques keep generation_batch_size rows
            raise RuntimeError(f"TRL's reward logs hold {min(map(len, per_func))} rows, fewer than the {last} "
                               "asked for (they keep generation_batch_size rows).")
        return list(zip(*per_func))

    @property
    def buffered_inputs(self) -> list[dict] | None:
        # TRL 1.16: GRPOTrainer._prepare_inputs shuffles a new generation batch row by row, splits it into
        # steps_per_generation micro-batches and keeps them in _buffered_inputs (None before the first generation)
        return self._trainer._buffered_inputs

    @buffered_inputs.setter
    def buffered_inputs(self, batches: list[dict]) -> None:
        self._trainer._buffered_inputs = batches

    def log_metric(self, mode: str, key: str, value: float) -> None:
        # TRL 1.16: GRPOTrainer._metrics[mode][key] (mode "train"/"eval") is a list TRL averages into its next log()
        self._trainer._metrics[mode][key].append(float(value))
