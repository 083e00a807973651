"""Run by tests/test_sharded_sync.py under `accelerate launch --num_processes 2` on CPU (gloo) with DeepSpeed ZeRO-3,
FSDP1 or FSDP2: a LoRA model is sharded across the two ranks, `adapter_state_dict` gathers the adapter, the main
process saves it with `save_pretrained(state_dict=...)` as `LoRAAdapterSync` does and reloads it for comparison; with
`--base-url`, `LoRAAdapterSync` itself syncs two versions into a real vLLM server, which then samples from them."""

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from arpo_trl.server.weight_sync import adapter_state_dict, is_sharded  # noqa: E402


def lora_model(path: str):
    torch.manual_seed(0)  # the same adapter on every rank (B random, so that the weights are not all zero)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)


def _unwrap(model):
    return getattr(model, "module", model)  # FSDP1 wraps the module; FSDP2 shards it in place


def shard(mode: str, peft, accelerator):
    """The model sharded across the ranks, and the accelerator `adapter_state_dict` is given."""
    world = torch.distributed.get_world_size()
    optimizer = torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.1)
    if mode == "zero3":
        # DeepSpeed's own initialize: accelerate's CPU DeepSpeed state counts one process, so its batch-size
        # arithmetic fails (the Accelerator still says DEEPSPEED with ZeRO stage 3, which is what the sync reads).
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 3}}
        engine, *_ = deepspeed.initialize(model=peft, optimizer=optimizer, config=config)
        return engine, accelerator
    # FSDP over gloo: accelerate's FSDP plugin refuses CPUs, so the accelerator handed to the sync code is a stand-in
    # that reports FSDP; the sharding itself is torch's (FSDP2 `fully_shard`, or FSDP1 with the original parameters).
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

    if mode == "fsdp1":
        peft = FullyShardedDataParallel(peft, device_id=torch.device("cpu"), use_orig_params=True,
                                        sharding_strategy=ShardingStrategy.FULL_SHARD)
    else:
        for layer in peft.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(peft)
    return peft, SimpleNamespace(distributed_type=DistributedType.FSDP, state=accelerator.state,
                                 unwrap_model=_unwrap)


def hot_load(args, model, accelerator, rank: int) -> dict:
    """Two versions through `LoRAAdapterSync` (gather on every rank, save and hot-load on the main one) into a real
    vLLM server, then a completion from the adapter the sync switched to."""
    from arpo_trl.server.client import VLLMClient
    from arpo_trl.server.weight_sync import LoRAAdapterSync

    world = torch.distributed.get_world_size()
    ranks = SimpleNamespace(  # the rank facts run_on_main_process reads (accelerate's CPU DeepSpeed state has 1)
        distributed_type=accelerator.distributed_type, state=accelerator.state, unwrap_model=accelerator.unwrap_model,
        num_processes=world, is_main_process=rank == 0, process_index=rank)
    client = VLLMClient(args.base_url) if rank == 0 else None
    engine = SimpleNamespace(model_name=None)
    sync = LoRAAdapterSync(client, engine, ranks, lambda: model, Path(args.out) / "sync", f"sharded-{args.mode}")
    sync.sync_weights()
    sync.sync_weights()
    if rank != 0:
        return {}
    choice = client.completion({"model": engine.model_name, "prompt": [1, 2, 3], "max_tokens": 2,
                                "return_token_ids": True})["choices"][0]
    return {"served": engine.model_name, "completion_tokens": len(choice.get("token_ids") or []),
            "sync_folders": sorted(p.name for p in (Path(args.out) / "sync").iterdir())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["zero3", "fsdp1", "fsdp2"], required=True)
    parser.add_argument("--base-url", default=None, help="a vLLM server (with LoRA) to hot-load the adapter into")
    args = parser.parse_args()
    accelerator = Accelerator()
    peft = lora_model(args.model)
    reference = {n: p.detach().clone() for n, p in peft.named_parameters() if p.requires_grad}
    model, accelerator = shard(args.mode, peft, accelerator)
    unwrapped = accelerator.unwrap_model(model)
    full = sum(t.numel() for t in reference.values())  # elements of the adapter, against those on this rank
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.to_local().numel() if hasattr(p, "to_local")
                else p.numel() for p in unwrapped.parameters() if p.requires_grad)
    state = adapter_state_dict(accelerator, model)
    # ZeRO-3: after the gather every parameter is a partition again (the frozen base was never gathered)
    frozen_gathered = [n for n, p in unwrapped.named_parameters()
                       if getattr(p, "ds_status", None) is not None and p.ds_status.name != "NOT_AVAILABLE"]
    rank = torch.distributed.get_rank()
    report = {"rank": rank, "sharded": is_sharded(accelerator), "adapter_full": full,
              "adapter_local": local, "frozen_left_gathered": frozen_gathered, "keys": len(state)}
    if rank == 0:
        report["extra_keys"] = sorted(set(state) - set(reference))[:5]
        report["equal"] = sorted(state) == sorted(reference) and all(
            torch.equal(state[n].float(), reference[n].float()) for n in reference)
        report["only_adapter"] = all("lora_" in n for n in state)
        saved = Path(args.out) / "adapter"
        unwrapped.save_pretrained(saved, state_dict=state)
        # the file PeftModel.from_pretrained / vLLM read (not from_pretrained here: under ZeRO-3 transformers would
        # partition the fresh model, a collective the other rank is not in)
        reloaded = load_file(saved / "adapter_model.safetensors")
        expected = {n.replace(".default", ""): t for n, t in reference.items()}
        report["reloaded_equal"] = (saved / "adapter_config.json").is_file() and sorted(reloaded) == sorted(expected) \
            and all(torch.equal(reloaded[n], expected[n]) for n in expected)
    if args.base_url:
        report.update(hot_load(args, model, accelerator, rank))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
