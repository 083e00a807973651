"""report_to wandb (offline mode) and trackio (local store) on a real 1-step ARPO run, in a subprocess so that
the trackers' environment (WANDB_MODE, TRACKIO_DIR) is set before they are imported."""

import json
import os
import subprocess
import sys
import textwrap

from arpo_trl.tracking import curves

SCRIPT = textwrap.dedent("""
    import sys
    from datasets import Dataset
    from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool
    from arpo_trl.rewards import format_credit_reward
    from transformers import AutoTokenizer

    model, out = sys.argv[1], sys.argv[2]
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 3?"}], "ground_truth": str(a + 3)}
            for a in range(4)]
    args = ARPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
                      max_completion_length=32, max_steps=1, logging_steps=1, use_cpu=True, bf16=False, beta=0.0,
                      report_to=["wandb", "trackio"], run_name="arpo-tracking-test", project="arpo-tests",
                      save_strategy="no")
    trainer = ARPOTrainer(model=model, reward_funcs=[format_credit_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model),
                          tools=[PythonTool(timeout=5)])
    trainer.train()
    trainer.end() if hasattr(trainer, "end") else None
""")


def test_wandb_offline_and_trackio(tool_model_dir, tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true",
           "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1", "WANDB_DISABLE_GIT": "true"}
    (tmp_path / "wandb").mkdir()
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tool_model_dir), str(run)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "wandb wrote no offline run"
    tables = list(runs[0].rglob("tree_nodes_*.table.json"))
    assert tables, "the per-step node table was not logged to wandb"
    table = json.loads(tables[0].read_text())
    assert table["columns"][:4] == ["step", "group", "node", "parent"] and len(table["data"]) == 8
    assert list((tmp_path / "trackio").rglob("*.db")), "trackio stored nothing"
    logged = curves([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
    assert logged["reward"] and logged["arpo/forks_per_group"]
