"""report_to wandb (offline mode) and trackio (local store) on a real 1-step ARPO run, in a subprocess so that
the trackers' environment (WANDB_MODE, TRACKIO_DIR) is set before they are imported."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from arpo_trl.training.tracking import curves
from arpo_trl.trees import NODE_COLUMNS, node_table, read_jsonl

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


@pytest.mark.long  # 19 s in a subprocess; what is logged: the other tests here and tests/test_trainer.py
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
    records = read_jsonl(run / "trees.jsonl")  # the step's 2 prompts × M=4 trajectories
    assert len(records) == 8 and table["columns"] == list(NODE_COLUMNS)
    assert table["data"] == node_table(records)[1]  # wandb holds the run's own tree, node by node
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [train] = [row for row in metrics if "reward" in row]
    assert train["step"] == 1 and {"arpo/forks_per_group", "arpo/tool_calls_per_group", "reward"} <= set(train)
    # trackio stored the same step-1 numbers (under TRL's "train/" prefix) as metrics.jsonl
    db = sqlite3.connect(tmp_path / "trackio" / "arpo-tests.db")
    rows = db.execute("SELECT metrics FROM metrics WHERE run_name = ? AND step = 1", ("arpo-tracking-test",))
    stored = {k: v for (blob,) in rows for k, v in json.loads(blob).items()}
    db.close()
    for key, value in train.items():
        if key != "step":
            assert stored[f"train/{key}"] == pytest.approx(value), key
    # the curves are the run's: reward = mean of its trajectories' rewards, forks = branches per group
    logged = curves(metrics)
    assert logged["reward"] == [(1, pytest.approx(sum(r["reward"] for r in records) / 8))]
    assert logged["arpo/forks_per_group"] == [(1, sum(r["kind"] == "branch" for r in records) / 2)]


def test_curves_summary_and_plot_from_a_metrics_file(tmp_path):
    from arpo_trl.training.tracking import plot_curves, run_summary

    rows = [{"step": s, "reward": s / 10, "rewards/arpo_math_reward/mean": -1 + s / 10, "loss": 0.1,
             "arpo/forks_per_group": 1.0, "arpo/tool_calls_per_trajectory": float("nan") if s == 3 else 0.5}
            for s in range(1, 13)] + [{"step": 12, "train_runtime": 99.0}]  # the final summary log has no reward
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    series = curves(rows)
    assert series["reward"] == [(s, s / 10) for s in range(1, 13)]
    assert [s for s, _ in series["arpo/tool_calls_per_trajectory"]] == [s for s in range(1, 13) if s != 3]
    assert series["rewards/arpo_math_reward/mean"][0] == (1, -0.9)
    summary = run_summary(tmp_path)
    assert "| step | reward | arpo/tool_calls_per_trajectory | arpo/forks_per_group |" in summary
    assert "| 3 | 0.300 |  | 1.000 | -0.700 |" in summary and str(tmp_path / "metrics.jsonl") in summary
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_keep_rows_drops_a_cut_last_line_and_refuses_any_other_bad_one(tmp_path):
    from arpo_trl.training.tracking import keep_rows

    path = tmp_path / "metrics.jsonl"
    keep_rows(path, lambda row: True)  # no file yet: nothing to do
    assert not path.exists()
    rows = [json.dumps({"step": s, "reward": s / 10}) for s in range(1, 5)]
    path.write_text("\n".join(rows) + '\n{"step": 5, "rew')  # a killed run's last write
    keep_rows(path, lambda row: row["step"] <= 2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    path.write_text(rows[0] + "\nnot json\n" + rows[1] + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not JSON"):
        keep_rows(path, lambda row: True)
    path.write_text(rows[0] + '\n{"reward": 1}\n' + rows[1] + "\n")
    with pytest.raises(ValueError, match="line 2: expected an object with an integer 'step'"):
        keep_rows(path, lambda row: True)
    assert path.read_text() == rows[0] + '\n{"reward": 1}\n' + rows[1] + "\n"  # refused: the file is untouched
    path.write_text(rows[0] + "\n\n" + rows[1] + "\n  \n" + rows[2] + "\n")  # blank lines, as the readers skip them
    keep_rows(path, lambda row: row["step"] <= 2)
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    path.write_text(rows[0] + '\n{"step": 2, "rew\n\n')  # the cut line is the last that is not blank
    keep_rows(path, lambda row: True)
    assert path.read_text() == rows[0] + "\n"
    text = json.dumps({"step": 1, "completion": "a\u2028b\x85c"}, ensure_ascii=False)  # as trees.jsonl holds text
    path.write_text(text + "\n" + rows[1] + "\n", encoding="utf-8")
    keep_rows(path, lambda row: row["step"] == 1)  # one row per newline, whatever else the text holds
    assert path.read_text(encoding="utf-8") == text + "\n"
