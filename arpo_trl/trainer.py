"""`ARPOTrainer`: TRL's `GRPOTrainer` with ARPO's branching tool rollout and shared-prefix attribution.

Only two hooks change (plus, with `use_vllm=True`, the weight-sync object TRL calls before each rollout):
  * generation goes through TRL's `rollout_func` (bound to `_arpo_rollout`), so TRL keeps padding, old and
    reference logps, importance sampling, rewards and metrics; tool-result tokens come back as `env_mask`,
    which TRL turns into `tool_mask` and removes from the loss;
  * `_generate_and_score_completions` replaces the (B,) advantages by (B,T) ones for hard attribution,
    which TRL's `_compute_loss` accepts;
  * with AEPO's update options, `EntropyBalancedUpdate` (arpo_trl/entropy_balanced_update.py) adjusts the
    advantages and log-probabilities TRL's `_compute_loss` reads, keeping TRL's loss code.
Every use of TRL's undocumented state goes through `TRLState` (arpo_trl/trl_state.py; tests/test_trl_touch_points.py
checks it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import statistics
import textwrap
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import asdict

import torch
from accelerate.utils import gather_object
from peft import PeftModel
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from arpo_trl.advantages import hard_advantages, owner_mask, token_owners
from arpo_trl.config import ARPOConfig
from arpo_trl.distributed import run_on_main_process
from arpo_trl.engines import GenerationEngine, SamplingSettings, TransformersEngine, VLLMServerEngine
from arpo_trl.entropy_balanced_update import EntropyBalancedUpdate
from arpo_trl.generation.cached_engine import CachedTransformersEngine, cache_budget
from arpo_trl.rollout import BranchingSampler, RolloutResult
from arpo_trl.scoring import configure_math_scoring
from arpo_trl.server.client import VLLMClient, check_server_tokenizer
from arpo_trl.server.weight_sync import (
    LoRAAdapterSync,
    NoSync,
    ReloadWeightsSync,
    has_tied_embeddings,
    resolve_sync_mode,
)
from arpo_trl.tags import own_text_from_ids
from arpo_trl.time_budget import TimeBudget
from arpo_trl.tool_calls import ChatTemplateFormat, make_call_format
from arpo_trl.tools.base import Tool
from arpo_trl.tracking import TREES_FILE, MetricsFile, TreePictures
from arpo_trl.trees import node_table, select, tree_html, tree_records, write_jsonl
from arpo_trl.trl_state import TRLState

SAMPLER_STATE_FILE = "arpo_sampler_rng_{rank}.json"
logger = logging.getLogger(__name__)


def silence_checkpointing_aliases() -> None:
    """TRL switches activation checkpointing off and on around every generation and old-logp pass through
    transformers' deprecated `gradient_checkpointing_*` aliases: three FutureWarnings per step. Ignore exactly those
    (idempotent: `filterwarnings` replaces an identical filter)."""
    warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing_?\w*` is deprecated", FutureWarning,
                            r"transformers\.modeling_utils")


def is_peft_model(model) -> bool:
    return isinstance(model, PeftModel)


def _resolve_sync_mode(requested: str, *, is_peft: bool, tied: bool) -> str:
    """`resolve_sync_mode` for this machine: is there CUDA, and is `vllm` importable here."""
    return resolve_sync_mode(requested, is_peft=is_peft, cuda=torch.cuda.is_available(),
                             vllm_importable=importlib.util.find_spec("vllm") is not None, tied=tied)


class ARPOTrainer(EntropyBalancedUpdate, GRPOTrainer):
    """Train a tool-using policy with ARPO.

    Args:
        tools: tools (`PythonTool()`, `SearchTool(...)`, `Tool(tag, fn)`) the model may call by writing
            `<tag>…</tag>`, or, with `tool_call_format='chat_template'`, through the chat template's function
            calling (`Tool.schema()`). They are ARPO's tools, not TRL's `tools=` (TRL's own tool loop stays off).
        engine: a `GenerationEngine`; defaults to a `TransformersEngine` over the model being trained.
        Everything else is `GRPOTrainer`'s.
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
        silence_checkpointing_aliases()
        use_vllm = args.use_vllm
        trl_sync = use_vllm and self._wants_trl_nccl_sync(args, model, peft_config)
        # TRL would build its own VLLMClient (needs `vllm` importable, syncs over NCCL only); our engine and
        # file-based sync replace it, so TRL sees use_vllm=False while it is constructed.
        with TRLState.constructing(args, trl_builds_vllm=trl_sync):
            super().__init__(
                model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                rollout_func=self._arpo_rollout, **kwargs,
            )
        self._trl = TRLState(self)
        self._trl.use_vllm = use_vllm  # on again: TRL's importance-sampling correction and its per-step sync hook
        self.arpo_tools = list(tools)
        configure_math_scoring(timeout=args.reward_timeout, batch_timeout=args.reward_batch_timeout)
        if args.log_trees:
            self.add_callback(TreePictures())
        self.add_callback(MetricsFile())
        self.add_callback(TimeBudget(args.max_minutes, say=self.accelerator.print,
                                     agree=lambda decide: run_on_main_process(self.accelerator, decide, "max_minutes")))
        self.vllm_client = None
        sync_mode = self._check_server_setup() if use_vllm and not trl_sync else None
        self.vllm_weight_sync_mode = "nccl" if trl_sync else sync_mode
        if use_vllm:
            self.vllm_client = VLLMClient(self._server_url(), args.vllm_request_timeout, args.vllm_server_timeout,
                                          pool_size=args.vllm_max_concurrent_requests)
        self.engine = engine or (self._server_engine() if use_vllm else self._transformers_engine())
        if sync_mode is not None:
            self._trl.install_weight_sync(self._file_weight_sync(sync_mode))
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
            speculative_fill_ups=args.speculative_fill_ups,
            branch_penalty=args.branch_penalty, pre_monitoring_beta=args.pre_monitoring_beta,
        )

    @staticmethod
    def _wants_trl_nccl_sync(args: ARPOConfig, model, peft_config) -> bool:
        if args.vllm_weight_sync not in ("nccl", "auto"):
            return False
        is_peft = peft_config is not None or is_peft_model(model)
        return _resolve_sync_mode(args.vllm_weight_sync, is_peft=is_peft, tied=False) == "nccl"

    def _server_url(self) -> str:
        args = self.args
        return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"

    def _check_server_setup(self) -> str:
        """Resolve the weight-sync mode and reject setups it cannot serve, before waiting for any server."""
        args, model = self.args, self.accelerator.unwrap_model(self.model)
        if self._trl.is_sharded() and not is_peft_model(model) and args.vllm_weight_sync != "none":
            raise NotImplementedError(
                "vLLM server mode under DeepSpeed/FSDP syncs LoRA adapters only (gathered from the shards each step): "
                "train with peft_config=LoraConfig(...), use DDP for full fine-tuning, or vllm_weight_sync='nccl' on "
                "CUDA."
            )
        self._trl.check_vespo_sampling_mode()
        mode = _resolve_sync_mode(args.vllm_weight_sync, is_peft=is_peft_model(model), tied=has_tied_embeddings(model))
        if args.vllm_weight_sync == "auto":
            logger.warning("ARPO: vllm_weight_sync='auto' chose %r.", mode)
        return mode

    def _server_engine(self) -> VLLMServerEngine | None:
        """Only the main process talks to the server; the others receive its rollouts
        (`_sample_on_main_process`)."""
        if not self.accelerator.is_main_process:
            return None
        self.vllm_client.wait_until_ready()
        args = self.args
        engine = VLLMServerEngine(
            self.vllm_client, self._trl.tokenizer, sampling=self._sampling(),
            max_concurrency=args.vllm_max_concurrent_requests,
        )
        check_server_tokenizer(self.vllm_client, self._trl.tokenizer, engine.model_name)
        engine.check_server()
        mode = self.vllm_client.logprobs_mode()
        if mode not in (None, "processed_logprobs"):
            logger.warning(
                "The vLLM server at %s runs with --logprobs-mode %s: its logprobs are taken before temperature and "
                "top-k/top-p, which biases ARPO's entropy and TRL's importance-sampling correction. Restart it "
                "with --logprobs-mode processed_logprobs (our launcher does).", self.vllm_client.base_url, mode,
            )
        return engine

    def _file_weight_sync(self, mode: str):
        args = self.args
        if mode == "none":
            return NoSync()
        sync_class = {"lora": LoRAAdapterSync, "reload": ReloadWeightsSync}[mode]
        sync_dir = args.vllm_sync_dir or os.path.join(args.output_dir, "vllm_sync")
        run_name = f"arpo-{uuid.uuid4().hex[:8]}"  # adapter names must be new on a server shared across runs
        return sync_class(self.vllm_client, self.engine, self.accelerator, lambda: self.model, sync_dir, run_name)

    def _sampling(self) -> SamplingSettings:
        return SamplingSettings.from_config(self.args, eos_token_ids=self._trl.eos_token_ids)

    def _transformers_engine(self) -> TransformersEngine:
        args = self.args
        # TRL's continuous-batching knob selects the event-driven engine with a persistent KV cache
        engine_class, extra = TransformersEngine, {}
        if args.use_transformers_continuous_batching:
            engine_class = CachedTransformersEngine
            extra = {"max_cached_tokens": cache_budget(args.transformers_continuous_batching_config)}
        return engine_class(
            None, self._trl.tokenizer, sampling=self._sampling(), **extra,
            model_context=lambda: unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ),
        )

    def _arpo_rollout(self, prompts: list, trainer=None) -> dict:
        """TRL's `rollout_func`: `prompts` holds each prompt M times in a row; return M trajectories each."""
        training = self.model.training
        m = self._trl.group_size(training)
        distinct = self._trl.distinct_prompts(prompts, m)
        if isinstance(self.sampler.call_format, ChatTemplateFormat):
            # TRL renders only its own `tools=` (unset: ARPO runs its tools itself), so the schemas are rendered here.
            prompt_ids = self.sampler.call_format.prompt_ids(distinct)
        else:
            prompt_ids = self._trl.tokenize_prompts(distinct)
        # Evaluation samples whole trajectories, as the reference's validation does (no branching).
        policy = None if training else "none"
        if self._trl.use_vllm and self.accelerator.num_processes > 1:
            result, trajectories = self._sample_on_main_process(prompt_ids, m, policy)
        else:
            result = self.sampler.sample(prompt_ids, num_generations=m, branch_policy=policy)
            trajectories = result.trajectories
        self._last_rollout = result if training else None  # for the tree log, once TRL has scored it
        fields = [self._tree_fields(t) for t in trajectories]
        env_mask = [list(t.mask) for t in trajectories]
        if self.args.advantage_attribution == "hard":  # a shared token is trained once, in its owner's row
            owners = self._owners(fields, max(len(row) for row in env_mask))
            keep = owner_mask(owners, [t.id for t in trajectories]).tolist()
            env_mask = [[bit * kept for bit, kept in zip(row, keep[i])] for i, row in enumerate(env_mask)]
        self._log_rollout(result, env_mask, len(trajectories) // m, "train" if training else "eval")
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.completion_ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": env_mask,
            **{f"arpo_{key}": [f[key] for f in fields] for key in fields[0]},
            "arpo_model_text": [own_text_from_ids(t.completion_ids, t.calls, self.sampler._decode).text
                                for t in trajectories],  # what the rewards score: no tool results (issue 33)
        }

    def _sample_on_main_process(self, prompt_ids: list, m: int, policy: str | None):
        """Server mode with several processes: as TRL does, the main process gathers every rank's prompts,
        runs the sampler against the server and broadcasts the trees; each rank keeps its own prompts' groups
        (a group never straddles ranks)."""
        per_rank = gather_object([prompt_ids])
        all_prompts = [p for rank in per_rank for p in rank]
        result = run_on_main_process(
            self.accelerator, lambda: self.sampler.sample(all_prompts, num_generations=m, branch_policy=policy),
            "Rollout",
        )
        start = sum(len(rank) for rank in per_rank[: self.accelerator.process_index])
        groups = result.groups[start : start + len(prompt_ids)]
        return result, [t for group in groups for t in group]

    @staticmethod
    def _tree_fields(t) -> dict:
        """Per-trajectory tree metadata, passed to reward functions as `arpo_*` keyword arguments."""
        return {
            "node": t.id, "group": t.group, "parent": t.parent, "fork_position": t.fork_position,
            "length": len(t.completion_ids), "tool_calls": t.tool_calls, "tool_failures": t.tool_failures,
            "finish_reason": t.finish_reason, "calls": [asdict(call) for call in t.calls],
        }

    @staticmethod
    def _owners(fields: list[dict], width: int) -> torch.Tensor:
        return token_owners(
            [f["node"] for f in fields], [f["parent"] for f in fields], [f["fork_position"] for f in fields],
            [f["length"] for f in fields], width,
        )

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
        rows, width = self._trl.completion_shape(output)
        if self.args.log_trees and getattr(self, "_last_rollout", None) is not None:
            self._log_trees(self._last_rollout, rows)
            self._last_rollout = None
        if self.args.advantage_attribution == "hard" and "arpo_node" in inputs[0]:
            fields = [{k[len("arpo_"):]: row[k] for k in row if k.startswith("arpo_")} for row in inputs]
            owners = self._owners(fields, width)
            advantages = hard_advantages(self._trl.advantages(output), owners, [f["group"] for f in fields])
            self._trl.set_token_advantages(output, advantages)
        return output

    def _log_trees(self, result: RolloutResult, local_rows: int) -> None:
        """Append this step's trees, with the rewards and advantages TRL just computed, to trees.jsonl."""
        if not self.accelerator.is_main_process:
            return
        n = len(result.trajectories)  # server mode: every rank's groups; otherwise the main process's own
        total = local_rows * self.accelerator.num_processes  # TRL logs all ranks' rows, gathered in rank order
        advantages, rewards = self._trl.logged_advantages(total)[:n], self._trl.logged_rewards(total)[:n]
        records = tree_records(result, self._trl.tokenizer, self.state.global_step, rewards, advantages)
        write_jsonl(records, os.path.join(self.args.output_dir, TREES_FILE))
        if "wandb" in (self.args.report_to or []) and importlib.util.find_spec("wandb"):
            import wandb

            if wandb.run is not None:
                columns, rows = node_table(records)
                wandb.log({"arpo/tree_nodes": wandb.Table(columns=columns, data=rows),
                           "arpo/tree": wandb.Html(tree_html(select(records, group=0)))}, commit=False)

    def _log_rollout(self, result: RolloutResult, env_mask: list[list[int]], local_groups: int, mode: str) -> None:
        """Tree statistics of the whole rollout (all ranks' prompts in server mode); trained tokens are local."""
        stats, trajectories, groups = result.stats, result.trajectories, max(len(result.groups), 1)
        metrics = {
            "arpo/forks_per_group": stats.forks / groups,
            "arpo/fill_ups_per_group": stats.fill_ups / groups,
            "arpo/discarded_tokens_per_group": stats.discarded_tokens / groups,
            "arpo/waves": stats.waves,
            "arpo/critical_path_tokens": stats.critical_path_tokens,
            "arpo/tool_calls_per_trajectory": statistics.fmean(t.tool_calls for t in trajectories),
            "arpo/tool_calls_per_group": stats.tool_calls / groups,
            "arpo/tool_failures_per_group": stats.tool_failures / groups,
            "arpo/tokens_generated_per_group": sum(t.own_tokens() for t in trajectories) / groups,
            "arpo/tokens_trained_per_group": sum(map(sum, env_mask)) / max(local_groups, 1),
            "arpo/rollout_seconds": stats.seconds,
            "arpo/generation_seconds": stats.generation_seconds,
            "arpo/tool_seconds": stats.tool_seconds,
            "arpo/sampler_overhead_seconds": stats.overhead_seconds,
        }
        sync = self._trl.weight_sync
        if getattr(sync, "last_seconds", None) is not None:  # set by a sync before this rollout only
            metrics["arpo/weight_sync_seconds"], sync.last_seconds = sync.last_seconds, None
        if stats.global_samples:  # AEPO's pre-monitoring
            metrics["arpo/global_samples_per_group"] = statistics.fmean(stats.global_samples.values())
        if stats.fork_deltas:
            metrics["arpo/fork_delta_entropy_mean"] = statistics.fmean(stats.fork_deltas)
        for key, value in metrics.items():
            self._trl.log_metric(mode, key, value)
