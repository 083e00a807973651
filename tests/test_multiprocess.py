"""`accelerate launch --num_processes 2` on CPU (gloo): both backends train without deadlock, every prompt gets
exactly M trajectories, DDP keeps the ranks' weights equal, and in server mode every rank trains on exactly its
slice of the trees the main process sampled and broadcast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# minutes of two-rank training; the default tier's two-process run is tests/test_cli.py's accelerate launch
pytestmark = pytest.mark.long

SCRIPT = Path(__file__).parent / "scripts" / "multiprocess_train.py"


def _run(model_dir, out: Path, *extra: str, backend: tuple[str, ...] = ("--multi_gpu",)) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", *backend, "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), "--model", str(model_dir),
           "--out", str(out), *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    # A session of its own, so that a hang (ranks waiting in mismatched collectives) ends with every rank killed
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the ranks hung (killed after 480 s): {stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def _launch(model_dir, out: Path, *extra: str, backend: tuple[str, ...] = ("--multi_gpu",)) -> list[dict]:
    result = _run(model_dir, out, *extra, backend=backend)
    errors = [line for line in result.stderr.splitlines() if "Error" in line and "[rank" in line]  # a rank's own
    assert result.returncode == 0, "\n".join(errors[:20]) + result.stdout[-3000:] + result.stderr[-5000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2]
    assert reports[0]["params"] == reports[1]["params"], "DDP should keep both ranks' weights identical"
    for report in reports:
        assert len(report["trained"]) == 2 and all(len(rows) == 8 for rows in report["trained"])  # 2 prompts × M=4
    return reports



def test_two_processes_transformers_backend(tool_model_dir, tmp_path):
    reports = _launch(tool_model_dir, tmp_path)
    for step in range(2):  # the ranks sampled different prompts (their own shards), each in groups of M
        rows0, rows1 = reports[0]["trained"][step], reports[1]["trained"][step]
        assert rows0 != rows1


@pytest.mark.parametrize("gather", ["true", "false"])
def test_two_processes_zero3_keep_their_model_calls_in_step(tool_model_dir, tmp_path, gather):
    """DeepSpeed ZeRO-3 on CPU: every forward pass, and every gather of the parameters for generation, is a collective.
    Rank 1 does not branch, so its trees need fewer waves than rank 0's; and rank 0 makes one model call more per
    rollout, so that the wave counts differ even when the model calls no tool (how many it calls depends on the
    machine's floating point). Without keeping step the ranks' collectives mismatch ("Received data size doesn't
    match expected size") or hang. Both ways of ds3_gather_for_generation."""
    config = tmp_path / "ds3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
                                  "gradient_clipping": "auto"}))
    reports = _launch(tool_model_dir, tmp_path / "out", "--rank1-branch-policy", "none", "--rank0-extra-wave",
                      "--ds3-gather", gather, backend=("--use_deepspeed", "--deepspeed_config_file", str(config)))
    assert len(reports[0]["model_calls"]) == len(reports[1]["model_calls"])
    assert reports[0]["idle_calls"] + reports[1]["idle_calls"] > 0, "the ranks' wave counts did not differ"


@pytest.mark.vllm
def test_two_processes_vllm_server(vllm_server, tool_model_dir, tmp_path):
    reports = _launch(tool_model_dir, tmp_path, "--base-url", vllm_server.base_url)
    assert reports[0]["rollouts"] == reports[1]["rollouts"], "every rank receives the main process's trees"
    assert sum(reports[0]["forks"]) > 0
    for step, groups in enumerate(reports[0]["rollouts"]):
        assert [len(g) for g in groups] == [4, 4, 4, 4]  # 2 ranks × 2 prompts, exactly M each
        for rank, report in enumerate(reports):
            mine = [seq for group in groups[2 * rank : 2 * rank + 2] for seq in group]
            assert report["trained"][step] == mine


@pytest.mark.vllm
def test_main_process_rollout_failure_reaches_every_rank(vllm_server, tool_model_dir, tmp_path):
    """If the main process's rollout fails (server died, bad answer), the other ranks, waiting in the broadcast,
    raise too instead of hanging."""
    result = _run(tool_model_dir, tmp_path, "--base-url", vllm_server.base_url, "--fail-at-rollout", "2")
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert "injected failure at rollout 2" in log
    assert "Rollout failed on the main process: VLLMServerError" in log  # raised on rank 1
    assert not (tmp_path / "rank0.json").exists() and not (tmp_path / "rank1.json").exists()
