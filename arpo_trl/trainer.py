"""`ARPOTrainer`: TRL's `GRPOTrainer` with ARPO's branching tool rollout and shared-prefix attribution.

Only these hooks change (plus, with `use_vllm=True`, the weight-sync object TRL calls before each rollout; which class
of the trainer overrides which TRL hook, in MRO order: docs/architecture.md):
  * generation goes through TRL's `rollout_func` (bound to `_arpo_rollout`), so TRL keeps padding, old and
    reference logps, importance sampling, rewards and metrics; tool-result tokens come back as `env_mask`,
    which TRL turns into `tool_mask` and removes from the loss;
  * `_generate` and `_generate_and_score_completions` apply hard attribution (arpo_trl/training/advantages.py):
    each shared token trained once, through TRL's tool mask (after TRL logged the completion lengths from the true
    one) and (B,T) advantages, which TRL's `_compute_loss` accepts;
  * with AEPO's update options, `EntropyBalancedUpdate` (arpo_trl/training/entropy_balanced_update.py) adjusts the
    advantages and log-probabilities TRL's `_compute_loss` reads, keeping TRL's loss code.
Every use of TRL's undocumented state goes through `TRLState` (arpo_trl/trl_state.py; tests/test_trl_touch_points.py
checks it).
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch
from trl import GRPOTrainer

from arpo_trl.colocate.trainer_mode import ColocateBackend, check_colocate_memory
from arpo_trl.config import ARPOConfig
from arpo_trl.dropin.environments import (
    EnvironmentRollouts,
    TRLToolList,
    placeholder_dataset,
    reward_weights_with_environments,
    setup_environments,
    trl_tool_list,
)
from arpo_trl.dropin.rows import TreeRows
from arpo_trl.generation.backend import GenerationBackend, InProcessBackend, TrainerView
from arpo_trl.generation.distributed import run_on_main_process
from arpo_trl.generation.engine import GenerationEngine, SamplingSettings
from arpo_trl.rewards.math_scoring import configure_math_scoring
from arpo_trl.rollout import RolloutResult
from arpo_trl.rollout.tool_calls import ChatTemplateFormat, make_call_format
from arpo_trl.runtime import BranchingSampler
from arpo_trl.server.trainer_mode import ServerBackend, wants_trl_nccl_sync
from arpo_trl.tools.base import Tool
from arpo_trl.tools.failures import ToolFailureWatch
from arpo_trl.tools.functions import as_tools
from arpo_trl.tools.tags import own_text_from_ids
from arpo_trl.training.advantages import owned_tool_mask, token_advantages
from arpo_trl.training.entropy_balanced_update import EntropyBalancedUpdate
from arpo_trl.training.packed_logps import TreePackedTraining
from arpo_trl.training.time_budget import TimeBudget
from arpo_trl.training.tracking import MetricsFile, RolloutLog, TreePictures, write_trees
from arpo_trl.trees import tree_records
from arpo_trl.trl_state import TRLState

SAMPLER_STATE_FILE = "arpo_sampler_rng_{rank}.json"
logger = logging.getLogger(__name__)


def silence_checkpointing_aliases() -> None:
    """TRL switches activation checkpointing off and on around every generation and old-logp pass through
    transformers' deprecated `gradient_checkpointing_*` aliases: three FutureWarnings per step. Ignore exactly those
    (idempotent: `filterwarnings` replaces an identical filter)."""
    warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing_?\w*` is deprecated", FutureWarning,
                            r"transformers\.modeling_utils")


class ARPOTrainer(TreeRows, TRLToolList, EnvironmentRollouts, EntropyBalancedUpdate, TreePackedTraining, GRPOTrainer):
    """Train a tool-using policy with ARPO.

    Args:
        tools: tools (`PythonTool()`, `SearchTool(...)`, `Tool(tag, fn)`) the model may call by writing
            `<tag>…</tag>`, or, with `tool_call_format='chat_template'`, through the chat template's function
            calling (`Tool.schema()`); plain functions, sync or async, as `GRPOTrainer(tools=…)` takes them
            (`FunctionTool`), in any mix. ARPO's sampler runs them (TRL's own tool loop stays off).
        engine: a `GenerationEngine`; defaults to the one `backend` starts (the config's: in process, a vLLM server,
            or vLLM colocated).
        environment_factory: as `GRPOTrainer`'s; every path owns an environment, a branch continues from a copy of
            its parent's at the fork (docs/environments.md).
        Everything else is `GRPOTrainer`'s (docs/coming_from_grpo.md).
    """

    # TRL 1.16: GRPOTrainer's model card and hub tags read the class attributes _tag_names, _name and _paper
    _tag_names = ["trl", "arpo"]
    _name = "ARPO"
    _paper = {  # TRL's model card names the method and cites it
        "title": "Agentic Reinforced Policy Optimization",
        "id": "2507.19849",
        "citation": textwrap.dedent("""\
            @article{dong2025arpo,
                title   = {{Agentic Reinforced Policy Optimization}},
                author  = {Guanting Dong and others},
                journal = {arXiv preprint arXiv:2507.19849},
                year    = 2025,
            }"""),
    }

    _trajectory_mask: list[list[int]] | None = None  # hard attribution: the tool mask before ownership is applied

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: ARPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        tools: Sequence[Tool | Callable] = (),
        peft_config=None,
        engine: GenerationEngine | None = None,
        environment_factory=None,
        **kwargs,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ARPOConfig(f"{name.split('/')[-1]}-ARPO")
        if not isinstance(args, ARPOConfig):
            raise TypeError(f"ARPOTrainer needs args=ARPOConfig(...), got {type(args).__name__}.")
        if "rollout_func" in kwargs:
            raise ValueError("ARPOTrainer provides its own rollout_func; pass tools= and engine= instead.")
        listed_tools, user_rewards = list(tools), len(reward_funcs) if isinstance(reward_funcs, list) else \
            int(reward_funcs is not None)
        reward_funcs, tools, environments = setup_environments(environment_factory, reward_funcs, as_tools(tools))
        # TRL checks reward_weights against the user's functions, then gives each environment's reward weight 1
        trl_weights = reward_weights_with_environments(args.reward_weights, user_rewards, environments)
        if train_dataset is None and environment_factory is not None:  # the environment owns the data (TRL 1.16)
            train_dataset = placeholder_dataset(environment_factory, args)
        silence_checkpointing_aliases()
        use_vllm, colocate = args.use_vllm, args.use_vllm and args.vllm_mode == "colocate"
        if colocate and torch.cuda.is_available() and not args.use_cpu:  # before the model or vLLM takes memory
            check_colocate_memory(model, args, peft_config, processing_class, train_dataset)
        trl_sync = use_vllm and not colocate and wants_trl_nccl_sync(args, model, peft_config)
        # TRL would build its own VLLMClient (needs `vllm` importable, syncs over NCCL only); our engine and
        # file-based sync replace it, so TRL sees use_vllm=False while it is constructed.
        with TRLState.constructing(args, trl_builds_vllm=trl_sync, reward_weights=trl_weights):
            super().__init__(
                model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                rollout_func=self._arpo_rollout, **kwargs,
            )
        self._trl = TRLState(self)
        self._environments = environments
        self._listed_tools = trl_tool_list(listed_tools, environments)
        self._tools_for_trl = False
        self._trl.set_use_vllm(use_vllm)  # on again: TRL's importance-sampling correction and its per-step sync hook
        self.arpo_tools = list(tools)
        self._tool_failures = ToolFailureWatch(self.arpo_tools, args.max_failed_tool_steps)
        self._rollout_log = RolloutLog()
        configure_math_scoring(timeout=args.reward_timeout, batch_timeout=args.reward_batch_timeout)
        if args.log_trees:
            self.add_callback(TreePictures())
        self.add_callback(MetricsFile())
        self.add_callback(TimeBudget(args.max_minutes, say=self.accelerator.print,
                                     agree=lambda decide: run_on_main_process(self.accelerator, decide, "max_minutes")))
        # the generation backend, chosen once: it starts the engine, installs the weight sync, wraps each rollout
        view = self._backend_view()
        self.backend: GenerationBackend = ColocateBackend(view) if colocate else \
            ServerBackend(view, trl_sync) if use_vllm else InProcessBackend(view)
        self.vllm_weight_sync_mode = self.backend.weight_sync_mode
        if engine is not None and not use_vllm and self._trl.is_sharded() and self.accelerator.num_processes > 1:
            raise NotImplementedError("engine= with sharded parameters (ZeRO-3/FSDP) and several processes: leave "
                                      "engine unset, so that ARPO keeps the ranks' model calls in step.")
        self.engine = engine or self.backend.start_engine()
        self.backend.install_weight_sync()  # server mode's file sync; colocate's is installed as its engine starts
        tokenizer = self._trl.tokenizer
        self.sampler = BranchingSampler(
            self.engine, tokenizer, self.arpo_tools,
            num_generations=args.num_generations, initial_rollouts=args.initial_rollouts,
            branch_factor=args.branch_factor, branch_threshold=args.branch_threshold,
            entropy_weight=args.entropy_weight, entropy_window=args.entropy_window,
            branch_policy=args.branch_policy, max_tool_calls=args.max_tool_calls,
            max_completion_length=args.max_completion_length, tool_timeout=args.tool_timeout,
            max_tool_workers=args.max_tool_workers,
            seed=args.seed_sampler if args.seed_sampler is not None else args.seed + self.accelerator.process_index,
            call_format=make_call_format(args.tool_call_format, tokenizer, self.arpo_tools, args.tool_call_open,
                                         args.tool_call_close, args.chat_template_kwargs),
            scheduler=args.rollout_scheduler if self.engine is not None else "waves",
            speculation=args.rollout_speculation,
            branch_penalty=args.branch_penalty, pre_monitoring_beta=args.pre_monitoring_beta,
            segment_statistic=args.segment_entropy,
        )

    def _sampling(self) -> SamplingSettings:
        return SamplingSettings.from_config(self.args, eos_token_ids=self._trl.eos_token_ids)

    def _backend_view(self) -> TrainerView:
        """All a generation backend sees of this trainer."""
        trl = self._trl
        return TrainerView(
            args=self.args, accelerator=self.accelerator, tokenizer=trl.tokenizer, eos_token_ids=trl.eos_token_ids,
            sampling=self._sampling(), train_dataset=self.train_dataset, sharded=trl.is_sharded(),
            model=lambda: self.model, model_wrapped=lambda: self.model_wrapped, engine=lambda: self.engine,
            sample=lambda *args, **kwargs: self.sampler.sample(*args, **kwargs),
            install_weight_sync=trl.install_weight_sync, weight_sync=lambda: trl.weight_sync,
            check_vespo_sampling_mode=trl.check_vespo_sampling_mode)

    def _arpo_rollout(self, prompts: list, trainer=None) -> dict:
        """TRL's `rollout_func`: `prompts` holds each prompt M times in a row; return M trajectories each."""
        training = self.model.training
        m = self._trl.group_size(training)
        self._trl.check_whole_groups(prompts, m, training)
        distinct, schemas, starts = self._start_environments(self._trl.distinct_prompts(prompts, m), m)
        if isinstance(self.sampler.call_format, ChatTemplateFormat):
            # TRL renders only its own `tools=` (unset: ARPO runs its tools itself), so the schemas are rendered here.
            prompt_ids = self.sampler.call_format.prompt_ids(distinct, schemas)
        else:
            prompt_ids = self._trl.tokenize_prompts(distinct)
        # Evaluation samples whole trajectories, as the reference's validation does (no branching).
        policy = None if training else "none"
        result, trajectories = self.backend.rollout(prompt_ids, m, policy, starts)
        self.environments = None if starts is None else [t.environment for t in trajectories]  # for the rewards
        self._last_rollout = result if training else None  # for the tree log, once TRL has scored it
        # TreeRows: the tree metadata stays in a side table, never in the user's examples; only rewards read it
        # `model_text`: what the rewards score, the completion without its tool calls and results (docs/rewards.md)
        self._tree_rows = [{**self._tree_fields(t), "model_text": own_text_from_ids(
            t.completion_ids, t.calls, self.sampler.rule.writer.decode).text} for t in trajectories]
        self._log_rollout(result, "train" if training else "eval")
        return {  # env_mask: the true one, for TRL's length metrics; hard attribution's is applied in `_generate`
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.completion_ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": [list(t.mask) for t in trajectories],
        }

    @staticmethod
    def _tree_fields(t) -> dict:
        """Per-trajectory tree metadata, passed to reward functions as `arpo_*` keyword arguments."""
        return {
            "node": t.id, "group": t.group, "parent": t.parent, "fork_position": t.fork_position,
            "length": len(t.completion_ids), "tool_calls": t.tool_calls, "tool_failures": t.tool_failures,
            "finish_reason": t.finish_reason, "calls": [asdict(call) for call in t.calls],
        }

    def _generate(self, prompts: list):  # TRL 1.16: GRPOTrainer's hook, (prompts) -> tuple
        # TRL logs the completion lengths inside from the rollout's env_mask, so hard attribution's mask comes after.
        generated = super()._generate(prompts)
        tree = self._tree_rows  # set by `_arpo_rollout`, inside `super()._generate`
        if tree is None:
            return generated
        completion_ids, tool_mask, _ = self._trl.generated_rollout(generated)
        kept = [not (self.args.mask_truncated_completions and self._trl.truncated(ids)) for ids in completion_ids]
        if self.args.advantage_attribution == "hard":  # each shared token trained once
            self._trajectory_mask = tool_mask  # each trajectory's own trained tokens, for grpo/sapo's normalisation
            tool_mask = owned_tool_mask(tree, tool_mask, kept)
            generated = self._trl.with_tool_mask(generated, tool_mask)
        trained = sum(sum(row) for row, k in zip(tool_mask, kept) if k) / max(len({f["group"] for f in tree}), 1)
        self._trl.log_metric("train" if self.model.training else "eval", "arpo/tokens_trained_per_group", trained)
        return generated

    def _save_rng_state(self, output_dir: str) -> None:  # transformers' Trainer hook (under TRL 1.16)
        # Trainer saves the global RNGs (torch: the transformers backend's sampling); the fork decisions use
        # the sampler's own RNG, which must be saved too for a resumed run to grow the same trees.
        super()._save_rng_state(output_dir)
        path = os.path.join(output_dir, SAMPLER_STATE_FILE.format(rank=self.args.process_index))
        with open(path, "w") as f:
            json.dump(self.sampler.state_dict(), f)

    def _load_rng_state(self, checkpoint: str | None) -> None:  # transformers' Trainer hook (under TRL 1.16)
        super()._load_rng_state(checkpoint)
        path = os.path.join(checkpoint or "", SAMPLER_STATE_FILE.format(rank=self.args.process_index))
        if checkpoint is None or not os.path.isfile(path):
            if checkpoint is not None:
                logger.warning("ARPO: %s has no sampler RNG state (%s); fork decisions after resuming will differ "
                               "from the original run.", checkpoint, os.path.basename(path))
            return
        with open(path) as f:
            self.sampler.load_state_dict(json.load(f))

    def _generate_and_score_completions(self, inputs):  # TRL 1.16: GRPOTrainer's hook, (inputs) -> dict
        # Hard attribution needs the group advantages TRL computes, then spreads them per token.
        output = super()._generate_and_score_completions(inputs)
        fields, self._tree_rows = self._tree_rows, None
        rows, _ = self._trl.completion_shape(output)
        if self.args.log_trees and getattr(self, "_last_rollout", None) is not None:
            self._log_trees(self._last_rollout, rows)
            self._last_rollout = None
        trajectory_mask, self._trajectory_mask = self._trajectory_mask, None
        # Evaluation never forks, so every token has one owner and hard attribution changes nothing there; TRL's logs,
        # which the unscored rows are read from, keep generation_batch_size rows, fewer than an eval batch may hold.
        if self.args.advantage_attribution == "hard" and fields is not None and self.model.training:
            self._trl.set_token_advantages(output, token_advantages(self._trl, self.accelerator, self.args.loss_type,
                                                                    output, fields, trajectory_mask))
        return output

    def _log_trees(self, result: RolloutResult, local_rows: int) -> None:
        """Append this step's trees, with the rewards and advantages TRL just computed, to trees.jsonl."""
        if not self.accelerator.is_main_process:
            return
        n = len(result.trajectories)  # server mode: every rank's groups; otherwise the main process's own
        total = local_rows * self.accelerator.num_processes  # TRL logs all ranks' rows, gathered in rank order
        advantages, rewards = self._trl.logged_advantages(total)[:n], self._trl.logged_rewards(total)[:n]
        write_trees(tree_records(result, self._trl.tokenizer, self.state.global_step, rewards, advantages),
                    self.args.output_dir, self.args.report_to)

    def _log_rollout(self, result: RolloutResult, mode: str) -> None:
        """The rollout's `arpo/*` metrics (`RolloutLog`; trained tokens: `_generate`), the colocated engine's too."""
        metrics = self._rollout_log.metrics(result, self.engine, self._trl.weight_sync, bool(self.arpo_tools))
        metrics.update(self.backend.metrics(max(len(result.groups), 1)))
        for key, value in metrics.items():
            self._trl.log_metric(mode, key, value)
        if mode == "train":  # a tool that fails every call is reported; one that keeps failing stops training
            self._tool_failures.observe(result.stats.tools)
