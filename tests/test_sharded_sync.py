"""LoRA weight sync when the model is sharded: two CPU processes (gloo) under DeepSpeed ZeRO-3 (its CPU accelerator),
FSDP1 and FSDP2 (torch's own: accelerate's FSDP plugin refuses CPUs, see the script). The adapter is gathered from
the shards, saved, reloaded equal; with a vLLM server, `LoRAAdapterSync` hot-loads it and the server samples from it.

Not covered here: `ARPOTrainer.train()` itself under ZeRO-3/FSDP (accelerate's CPU DeepSpeed state counts one
process, and its FSDP plugin needs a GPU), so the sync runs from the script, outside the trainer loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "sharded_adapter.py"
MODES = ["zero3", "fsdp1", "fsdp2"]


def _launch(mode: str, model_dir, out: Path, *extra: str) -> list[dict]:
    if mode == "zero3":
        pytest.importorskip("deepspeed")
        launcher = ["--use_deepspeed", "--zero_stage", "3"]
    else:
        launcher = ["--multi_gpu"]
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", *launcher, "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", str(SCRIPT), "--mode", mode, "--model", str(model_dir), "--out", str(out),
           *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["sharded"]
        assert 0 <= report["adapter_local"] < report["adapter_full"], report  # each rank holds a part only
        assert report["frozen_left_gathered"] == []  # ZeRO-3: every parameter partitioned again after the gather
    main = reports[0]
    assert main["equal"] and main["only_adapter"] and main["reloaded_equal"], main
    return reports


@pytest.mark.parametrize("mode", [mode if mode == "fsdp1" else pytest.param(mode, marks=pytest.mark.long)
                                  for mode in MODES])  # one sharding in the default tier
def test_lora_adapter_is_gathered_from_shards(mode, tool_model_dir, tmp_path):
    _launch(mode, tool_model_dir, tmp_path)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["zero3", "fsdp2"])
def test_sharded_lora_sync_hot_loads_into_the_server(mode, vllm_server, tool_model_dir, tmp_path):
    main = _launch(mode, tool_model_dir, tmp_path, "--base-url", vllm_server.base_url)[0]
    assert main["served"] == f"sharded-{mode}-v2" and main["completion_tokens"] == 2
    assert main["sync_folders"] == [f"sharded-{mode}-v2"]  # the first version was unloaded and deleted
