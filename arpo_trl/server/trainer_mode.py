"""The trainer's vLLM server mode (`use_vllm=True`): which weight sync a setup gets, the engine that talks to the
server (main process only), the file-based weight sync, and the rollout of every rank's prompts on the main process;
`ServerBackend` owns them (docs/server_mode.md)."""

from __future__ import annotations

import logging
import os
import uuid

import torch
from accelerate.utils import gather_object
from peft import PeftModel

from arpo_trl.config import ARPOConfig
from arpo_trl.generation.backend import GenerationBackend, TrainerView, prompt_budget
from arpo_trl.generation.distributed import run_on_main_process
from arpo_trl.preflight import vllm_importable
from arpo_trl.server.client import VLLMClient, check_server_tokenizer
from arpo_trl.server.engine import VLLMServerEngine
from arpo_trl.server.server_check import RunNeeds, check_server_serves
from arpo_trl.server.weight_sync import (
    LoRAAdapterSync,
    NoSync,
    ReloadWeightsSync,
    has_tied_embeddings,
    resolve_sync_mode,
)

logger = logging.getLogger("arpo_trl.trainer")


def is_peft_model(model) -> bool:
    return isinstance(model, PeftModel)


def _resolve_sync_mode(requested: str, *, is_peft: bool, tied: bool) -> str:
    """`resolve_sync_mode` for this machine: is there CUDA, and is `vllm` importable here."""
    return resolve_sync_mode(requested, is_peft=is_peft, cuda=torch.cuda.is_available(),
                             vllm_importable=vllm_importable(), tied=tied)


def wants_trl_nccl_sync(args: ARPOConfig, model, peft_config) -> bool:
    """Whether TRL's own NCCL weight sync serves this server-mode run (then TRL builds its VLLMClient)."""
    if args.vllm_weight_sync not in ("nccl", "auto"):
        return False
    is_peft = peft_config is not None or is_peft_model(model)
    return _resolve_sync_mode(args.vllm_weight_sync, is_peft=is_peft, tied=False) == "nccl"


class ServerBackend(GenerationBackend):
    """A vLLM server: the setup checked and the client made at construction (before any wait for the server), the
    engine on the main process only, the file-based weight sync, and with several processes every rank's prompts
    rolled out on the main process."""

    def __init__(self, trainer: TrainerView, trl_sync: bool):
        super().__init__(trainer)
        self.weight_sync_mode = "nccl" if trl_sync else self.check_setup()
        args = trainer.args
        self.client = VLLMClient(self.url(), args.vllm_request_timeout, args.vllm_server_timeout,
                                 pool_size=args.vllm_max_concurrent_requests)

    def url(self) -> str:
        args = self.trainer.args
        return args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"

    def check_setup(self) -> str:
        """Resolve the weight-sync mode and reject setups it cannot serve, before waiting for any server."""
        trainer = self.trainer
        args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model())
        if trainer.sharded and not is_peft_model(model) and args.vllm_weight_sync != "none":
            raise NotImplementedError(
                "vLLM server mode under DeepSpeed/FSDP syncs LoRA adapters only (gathered from the shards each step): "
                "train with peft_config=LoraConfig(...), use DDP for full fine-tuning, or vllm_weight_sync='nccl' on "
                "CUDA."
            )
        trainer.check_vespo_sampling_mode()
        mode = _resolve_sync_mode(args.vllm_weight_sync, is_peft=is_peft_model(model), tied=has_tied_embeddings(model))
        if args.vllm_weight_sync == "auto":
            logger.warning("ARPO: vllm_weight_sync='auto' chose %r.", mode)
        return mode

    def start_engine(self) -> VLLMServerEngine | None:
        """Only the main process talks to the server; the others receive its rollouts (`rollout`)."""
        trainer, client = self.trainer, self.client
        if not trainer.accelerator.is_main_process:
            return None
        client.wait_until_ready()
        info = client.server_info()
        check_server_serves(client, self.run_needs(), info)
        engine = VLLMServerEngine(client, trainer.tokenizer, sampling=trainer.sampling,
                                  max_concurrency=trainer.args.vllm_max_concurrent_requests)
        check_server_tokenizer(client, trainer.tokenizer, engine.model_name)
        engine.check_server()
        mode = client.logprobs_mode(info)
        if mode not in (None, "processed_logprobs"):
            logger.warning(
                "The vLLM server at %s runs with --logprobs-mode %s: its logprobs are taken before temperature and "
                "top-k/top-p, which biases ARPO's entropy and TRL's importance-sampling correction. Restart it "
                "with --logprobs-mode processed_logprobs (our launcher does).", client.base_url, mode,
            )
        return engine

    def run_needs(self) -> RunNeeds:
        """What this run asks of its server (`server_check`): the trained model, prompt + completion budget, and
        the LoRA rank when adapters are synced."""
        trainer = self.trainer
        args, model = trainer.args, trainer.accelerator.unwrap_model(trainer.model())
        rank = _lora_rank(model) if self.weight_sync_mode == "lora" else None
        prompt_tokens, source = prompt_budget(args, trainer.tokenizer, trainer.train_dataset)
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        return RunNeeds(model=name or None, prompt_tokens=prompt_tokens, prompt_source=source,
                        max_completion_length=args.max_completion_length, lora_rank=rank)

    def install_weight_sync(self) -> None:
        """The file-based sync (TRL's own NCCL sync, when chosen, is TRL's)."""
        if self.weight_sync_mode == "nccl":
            return
        trainer, args = self.trainer, self.trainer.args
        if self.weight_sync_mode == "none":
            trainer.install_weight_sync(NoSync())
            return
        sync_class = {"lora": LoRAAdapterSync, "reload": ReloadWeightsSync}[self.weight_sync_mode]
        sync_dir = args.vllm_sync_dir or os.path.join(args.output_dir, "vllm_sync")
        run_name = f"arpo-{uuid.uuid4().hex[:8]}"  # adapter names must be new on a server shared across runs
        trainer.install_weight_sync(sync_class(self.client, trainer.engine(), trainer.accelerator, trainer.model,
                                               sync_dir, run_name))

    def rollout(self, prompt_ids: list, m: int, policy: str | None, environments=None):
        """With several processes, as TRL does: the main process gathers every rank's prompts, runs the sampler
        against the server and broadcasts the trees; each rank keeps its own prompts' groups (a group never straddles
        ranks)."""
        trainer = self.trainer
        if trainer.accelerator.num_processes == 1:
            return super().rollout(prompt_ids, m, policy, environments)
        per_rank = gather_object([prompt_ids])
        all_prompts = [p for rank in per_rank for p in rank]
        result = run_on_main_process(
            trainer.accelerator, lambda: trainer.sample(all_prompts, num_generations=m, branch_policy=policy),
            "Rollout",
        )
        start = sum(len(rank) for rank in per_rank[: trainer.accelerator.process_index])
        groups = result.groups[start : start + len(prompt_ids)]
        return result, [t for group in groups for t in group]


def _lora_rank(model) -> int | None:
    """The largest rank of the active adapter (`r`, or a larger one in `rank_pattern`)."""
    if not is_peft_model(model):
        return None
    config = model.peft_config[model.active_adapter]
    return max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])
