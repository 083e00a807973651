"""The checks `ARPOConfig.__post_init__` runs on its fields: each bad value is a ValueError naming the field, what it
got and what it takes."""

from __future__ import annotations

import logging
import os

import torch

from arpo_trl.dropin.grpo_fields import check_grpo_fields
from arpo_trl.entropy import check_entropy_args, resolve_estimator
from arpo_trl.generation.engine import check_generation_kwargs
from arpo_trl.generation.support import IN_PROCESS_ENGINES
from arpo_trl.preflight import vllm_importable
from arpo_trl.rollout import check_branching_args, default_initial_rollouts
from arpo_trl.rollout.arpo import check_aepo_args
from arpo_trl.rollout.tool_calls import check_call_format
from arpo_trl.runtime import SCHEDULERS, SPECULATION_MODES
from arpo_trl.server.weight_sync import check_sync_mode
from arpo_trl.training.advantages import check_attribution
from arpo_trl.training.entropy_balanced_update import check_entropy_balanced_update

logger = logging.getLogger("arpo_trl.trainer")


def resolve_engine_default(config) -> None:
    """`use_vllm` unset: vLLM colocated on one CUDA process with `vllm` importable, else the in-process engines;
    `vllm_mode` unset: 'server' when a server URL is given, else TRL's default 'colocate'."""
    if config.vllm_mode is None:
        config.vllm_mode = "server" if config.vllm_server_base_url else "colocate"
    if config.use_vllm is not None:
        return
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    config.use_vllm = one_process and torch.cuda.is_available() and vllm_importable()
    if config.use_vllm:
        logger.warning("ARPO: use_vllm unset, one CUDA process and vLLM installed: generating with vLLM colocated in "
                       "the training process (vllm_mode=%r). Set use_vllm=False for the transformers engines.",
                       config.vllm_mode)


def check_arpo_config(config) -> None:
    """Every ARPO field of `config` (an `ARPOConfig` after TRL's own checks); fills `initial_rollouts` when unset."""
    m = config.num_generations
    check_attribution(config)
    if config.initial_rollouts is None:
        config.initial_rollouts = default_initial_rollouts(m, config.branch_policy)
    check_branching_args(m, config.initial_rollouts, config.branch_factor, config.branch_threshold,
                         config.entropy_window, config.branch_policy, config.max_tool_calls,
                         entropy_weight=config.entropy_weight)
    check_aepo_args(config.branch_penalty, config.pre_monitoring_beta)
    check_entropy_balanced_update(config)
    check_entropy_args(config.entropy_estimator, config.entropy_top_k, config.segment_entropy)
    check_call_format(config.tool_call_format)
    check_generation_kwargs(config.generation_kwargs)
    check_grpo_fields(config)
    if not config.tool_call_open or not config.tool_call_close:
        raise ValueError("tool_call_open and tool_call_close must be non-empty markers, e.g. '<tool_call>'.")
    if config.tool_timeout <= 0:
        raise ValueError(f"tool_timeout must be > 0 seconds, got {config.tool_timeout}.")
    if config.rollout_scheduler not in SCHEDULERS:
        raise ValueError(f"rollout_scheduler must be one of {SCHEDULERS}, got {config.rollout_scheduler!r}.")
    if config.in_process_engine not in IN_PROCESS_ENGINES:
        raise ValueError(f"in_process_engine must be one of {IN_PROCESS_ENGINES}, got {config.in_process_engine!r}.")
    if config.rollout_speculation == "branches":  # removed: the slowest mode measured (docs/benchmarks.md)
        raise ValueError("rollout_speculation 'branches' was removed; write 'auto' (the same trees).")
    if config.rollout_speculation not in SPECULATION_MODES:
        raise ValueError(f"rollout_speculation must be one of {SPECULATION_MODES}, got {config.rollout_speculation!r}.")
    if config.max_tool_workers < 1:
        raise ValueError(f"max_tool_workers must be >= 1, got {config.max_tool_workers}.")
    if config.max_failed_tool_steps < 0:
        raise ValueError(f"max_failed_tool_steps must be >= 0 steps (0: never stop), got "
                         f"{config.max_failed_tool_steps}.")
    _check_vllm_fields(config)
    _check_limits(config)
    per_process = config.per_device_train_batch_size * config.steps_per_generation
    if per_process % m != 0:
        # The sampler builds each prompt's tree on one process, so a group must never straddle ranks.
        raise ValueError(
            f"per_device_train_batch_size * steps_per_generation ({per_process}) must be divisible by "
            f"num_generations (M={m}) so that every prompt's M trajectories are generated on one process."
        )
    m_eval = config.num_generations_eval or m
    if config.eval_strategy != "no" and config.per_device_eval_batch_size % m_eval != 0:
        # TRL checks the global eval batch only; ARPO, like for training, needs whole groups on each process.
        raise ValueError(
            f"per_device_eval_batch_size ({config.per_device_eval_batch_size}) must be divisible by "
            f"num_generations_eval ({m_eval}) so that every prompt's trajectories are generated on one process."
        )


def _check_limits(config) -> None:
    if config.max_minutes is not None and not config.max_minutes > 0:
        raise ValueError(f"max_minutes must be > 0 (minutes) or None, got {config.max_minutes}.")
    if config.tree_packing_max_length is not None and config.tree_packing_max_length < 1:
        raise ValueError(f"tree_packing_max_length must be >= 1 or None, got {config.tree_packing_max_length}.")
    if config.max_prompt_length is not None and config.max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 or None, got {config.max_prompt_length}.")
    for name in ("reward_timeout", "reward_batch_timeout"):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(config, name)}.")


def _check_vllm_fields(config) -> None:
    check_sync_mode(config.vllm_weight_sync)
    if config.vllm_request_timeout <= 0:
        raise ValueError(f"vllm_request_timeout must be > 0 seconds, got {config.vllm_request_timeout}.")
    if config.vllm_max_concurrent_requests < 1:
        raise ValueError(f"vllm_max_concurrent_requests must be >= 1, got {config.vllm_max_concurrent_requests}.")
    if not config.use_vllm:
        return
    if config.vllm_mode not in ("server", "colocate"):
        raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {config.vllm_mode!r}.")
    if config.vllm_mode == "colocate":
        if config.vllm_tensor_parallel_size != 1:
            raise ValueError(f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size}: ARPO's colocate mode runs "
                             "vLLM on the trainer's one device (1); for several GPUs use vllm_mode='server'.")
        if config.vllm_weight_sync != "auto":
            raise ValueError(f"vllm_weight_sync={config.vllm_weight_sync!r} is a server-mode setting; colocate mode "
                             "loads the merged weights in process before each rollout. Leave it 'auto'.")
    resolve_estimator(config.entropy_estimator, False, "a vLLM server")
