"""Every CLI path given a user mistake ends with one `error:` line naming the field and the fix, exit code 2, before
anything slow; a machine without a GPU gets the CPU and float32 when the recipe does not choose."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from arpo_trl import preflight
from arpo_trl.cli import main
from arpo_trl.commands.train import parse_train_args
from arpo_trl.preflight import accelerator_available


def _dataset(path: Path, rows: int = 4) -> Path:
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a}+{a}?"}],
                                        "ground_truth": str(2 * a)}) + "\n" for a in range(rows)))
    return path


def _recipe(tmp_path: Path, model_dir, **overrides) -> Path:
    recipe = {
        "model_name_or_path": str(model_dir), "dataset_name": str(_dataset(tmp_path / "train.jsonl")),
        "reward_funcs": ["arpo_math"], "tools": ["python"], "output_dir": str(tmp_path / "run"), "use_cpu": True,
        "bf16": False, "report_to": "none", "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 16, "max_steps": 1, "save_strategy": "no",
    }
    recipe.update(overrides)
    recipe = {k: v for k, v in recipe.items() if v is not None}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def one_error_line(capsys, run, *fragments: str) -> str:
    with pytest.raises(SystemExit) as exit_code:
        run()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exit_code.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def not_a_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    return str(blocker / "run")  # a folder cannot be made under a file (root ignores permissions, this not)


@pytest.mark.parametrize("mistake,fragments", [
    ({"model_name_or_path": "/no/such/model"}, ["model_name_or_path: no such model folder '/no/such/model'"]),
    ({"model_name_or_path": "nobody-xyz/not-a-cached-model"}, ["model_name_or_path: 'nobody-xyz/not-a-cached-model' "
                                                              "is neither a local model folder nor a model"]),
    ({"dataset_name": "CORRUPT"}, ["dataset_name: cannot read", ".jsonl"]),
    ({"dataset_name": "EMPTY"}, ["dataset_name:", "is empty"]),
    ({"dataset_name": "NO_ROWS"}, ["dataset_name:", "has no rows"]),
    ({"dataset_name": "nobody-xyz/no-such-dataset"}, ["dataset_name: cannot load the hub dataset"]),
    ({"max_prompt_length": 5}, ["max_prompt_length: 4 of 4 prompts are longer than 5 tokens", "raise"]),
    ({"max_completion_length": 4090}, ["max_prompt_length:", "the model's context", "lower max_completion_length"]),
    ({"python_timeout": 0.0001}, ["tools: the 'python' tool cannot run code here", "python_timeout (0.0001)"]),
    ({"tools": ["search"], "search_corpus": "BINARY"}, ["search_corpus: cannot read"]),
    ({"output_dir": "NOT_A_FOLDER"}, ["output_dir: cannot write to", "choose a folder"]),
    ({"use_cpu": False, "bf16": True}, ["bf16/fp16: this machine has no GPU", "bf16: false"]),
])
def test_train_mistakes(tool_model_dir, tmp_path, capsys, not_a_folder, mistake, fragments):
    if "bf16" in mistake and accelerator_available():
        pytest.skip("a GPU machine supports bf16")
    files = {"CORRUPT": ("bad.jsonl", b'{"prompt": "no closing brace\n'), "EMPTY": ("empty.jsonl", b""),
             "NO_ROWS": ("empty.json", b"[]"), "BINARY": ("corpus.txt", b"\xff\xfe\x00bad")}
    for key, value in mistake.items():
        if isinstance(value, str) and value in files:
            name, data = files[value]
            (tmp_path / name).write_bytes(data)
            mistake[key] = str(tmp_path / name)
        elif value == "NOT_A_FOLDER":
            mistake[key] = not_a_folder
    recipe = _recipe(tmp_path, tool_model_dir, **mistake)
    one_error_line(capsys, lambda: main(["train", "--config", str(recipe)]), "arpo-trl: error:", *fragments)


def test_cpu_and_float32_are_picked_without_a_gpu(tool_model_dir, tmp_path, capsys, monkeypatch):
    if accelerator_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(preflight, "_said_cpu", False)  # as in a new process, whatever an earlier test said
    recipe = _recipe(tmp_path, tool_model_dir, use_cpu=None, bf16=None)
    _, args, _ = parse_train_args(["--config", str(recipe)])
    assert args.use_cpu and not args.bf16 and not args.fp16
    _, again, _ = parse_train_args(["--config", str(recipe)])
    assert again.use_cpu
    err = capsys.readouterr().err
    assert err.count("no GPU found") == 1  # said once per process
    _, chosen, _ = parse_train_args(["--config", str(recipe), "--use_cpu", "false", "--bf16", "false"])
    assert not chosen.use_cpu  # what the recipe says wins


def test_train_without_a_gpu_says_so_once_and_runs(tool_model_dir, tmp_path):
    """As a user runs it: a subprocess, a minimal recipe without use_cpu / bf16."""
    if accelerator_available():
        pytest.skip("this machine has a GPU")
    recipe = _recipe(tmp_path, tool_model_dir, use_cpu=None, bf16=None, tools=[], num_generations=2,
                     per_device_train_batch_size=2, max_completion_length=8)
    done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", "train", "--config", str(recipe)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("no GPU found: running on the CPU in float32") == 1
    assert any((tmp_path / "run" / name).exists() for name in ("adapter_model.safetensors", "model.safetensors"))


def test_missing_model_as_a_user_sees_it(tmp_path):
    recipe = _recipe(tmp_path, "/no/such/model")
    done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", "train", "--config", str(recipe)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("arpo-trl: error: model_name_or_path: no such model")
    assert "Traceback" not in done.stderr


def test_sft_mistakes(tmp_path, capsys, not_a_folder, tool_model_dir):
    base = ["sft", "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    one_error_line(capsys, lambda: main([*base, "--model_name_or_path", "/no/such/model", "--output_dir",
                                         str(tmp_path / "sft")]), "arpo-trl: error: model_name_or_path:")
    one_error_line(capsys, lambda: main([*base, "--model_name_or_path", str(tool_model_dir), "--output_dir",
                                         not_a_folder]), "arpo-trl: error: output_dir: cannot write")


def test_eval_mistakes(tmp_path, capsys, not_a_folder, tool_model_dir):
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "none.json").write_text("[]")
    good = str(_dataset(tmp_path / "eval.jsonl"))
    cases = [
        (["--model_name_or_path", "/no/such/model", "--dataset_name", good], "model_name_or_path: no such model"),
        (["--model_name_or_path", str(tool_model_dir), "--dataset_name", str(tmp_path / "bad.jsonl")],
         "dataset_name: cannot read"),
        (["--model_name_or_path", str(tool_model_dir), "--dataset_name", str(tmp_path / "none.json")],
         "has no rows"),
        (["--model_name_or_path", str(tool_model_dir), "--dataset_name", good, "--output_dir", not_a_folder],
         "output_dir: cannot write"),
    ]
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"tools": [], "n_samples": 1}))
    for argv, fragment in cases:
        one_error_line(capsys, lambda argv=argv: main(["eval", "--config", str(config), *argv]), "arpo-trl: error:",
                       fragment)


def test_quickstart_checks_the_arpo_flags_before_the_cold_start(capsys, not_a_folder):
    one_error_line(capsys, lambda: main(["quickstart", "--no_such_field", "1"]), "arpo-trl: error:",
                   "no_such_field")
    one_error_line(capsys, lambda: main(["quickstart", "--output_dir", not_a_folder]),
                   "arpo-trl: error: output_dir: cannot write")


def test_view_and_plot_mistakes(tmp_path, capsys, not_a_folder):
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe not json\n")
    for argv in (["view", str(tmp_path / "missing.jsonl")], ["view", str(tmp_path / "bad.jsonl")],
                 ["plot", str(tmp_path / "bad.jsonl"), "--out", not_a_folder]):
        one_error_line(capsys, lambda argv=argv: main(argv), f"arpo-trl {argv[0]}: error:")


def test_vllm_serve_mistakes(tmp_path, capsys, tool_model_dir):
    one_error_line(capsys, lambda: main(["vllm-serve", "--model", "/no/such/model"]),
                   "arpo-trl: error: model: no such model folder")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_error_line(capsys, lambda: main(["vllm-serve", "--model", str(tool_model_dir), "--port", str(port)]),
                       f"arpo-trl: error: port: 127.0.0.1:{port} is not available", "another --port")
