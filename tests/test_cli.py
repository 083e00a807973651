"""`arpo-trl train --config recipe.yaml`: a real run from YAML on the tiny tool model, and one-line errors for
user mistakes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from arpo_trl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _dataset(path: Path, rows: int = 8, answer_column: str = "ground_truth") -> Path:
    from tiny import question

    with open(path, "w") as f:
        for a in range(rows):
            row = {"prompt": [{"role": "user", "content": question(a, a + 2)}], answer_column: str(2 * a + 2)}
            f.write(json.dumps(row) + "\n")
    return path


def _recipe(tmp_path: Path, model_dir, **overrides) -> Path:
    recipe = {
        "model_name_or_path": str(model_dir), "dataset_name": str(_dataset(tmp_path / "train.jsonl")),
        "reward_funcs": ["arpo_math", "test_trainer.length_reward"], "tools": ["python"],
        "output_dir": str(tmp_path / "run"), "use_cpu": True, "bf16": False, "report_to": "none",
        "per_device_train_batch_size": 8, "num_generations": 4, "initial_rollouts": 2, "max_completion_length": 32,
        "max_steps": 1, "logging_steps": 1, "save_strategy": "no", "beta": 0.0,
        "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
    }
    recipe.update(overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_train_from_yaml_recipe_saves_the_adapter(tool_model_dir, tmp_path, capsys):
    main(["train", "--config", str(_recipe(tmp_path, tool_model_dir)), "--branch_threshold", "1.0"])
    run = tmp_path / "run"
    assert (run / "adapter_model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "| step | reward |" in printed and str(run / "trees.jsonl") in printed  # the run summary
    # the run folder's trees, viewed and drawn by the CLI
    with pytest.raises(SystemExit) as exit_code:
        main(["view", str(run / "trees.jsonl"), "--group", "0"])
    assert exit_code.value.code == 0 and "node 0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_code:
        main(["plot", str(run / "trees.jsonl"), "--out", str(tmp_path / "pictures")])
    assert exit_code.value.code == 0
    assert (tmp_path / "pictures" / "entropy_around_tools.png").is_file()
    with pytest.raises(SystemExit) as exit_code:
        main(["view", str(run / "trees.jsonl"), "--step", "7"])
    assert exit_code.value.code == 2 and "no step 7" in capsys.readouterr().err


def test_search_and_browse_tools_over_the_offline_wiki():
    from arpo_trl.commands.builders import build_tools
    from arpo_trl.commands.recipes import ARPOScriptArguments

    search, browse = build_tools(ARPOScriptArguments(tools=["search", "browse"], search_corpus="wiki"))
    assert "Paris" in search("capital of France")
    assert browse("France | capital").startswith("Page: France")


def test_train_on_a_reasoning_gym_task(tool_model_dir, tmp_path):
    """A full fine-tune on reasoning-gym questions: the saved weights are trained ones, every rollout's prompt is one
    of the task's seeded questions, and each reward is ARPO's score against that question's own answer."""
    from safetensors.torch import load_file
    from test_trainer import length_shaping

    from arpo_trl.data import named_dataset
    from arpo_trl.rewards import arpo_math_reward
    from arpo_trl.trees import read_jsonl

    spec = "reasoning_gym:basic_arithmetic:16"
    recipe = _recipe(tmp_path, tool_model_dir, dataset_name=spec, use_peft=False, seed=3, max_steps=2)
    main(["train", "--config", str(recipe)])
    run = tmp_path / "run"
    trained, original = load_file(run / "model.safetensors"), load_file(tool_model_dir / "model.safetensors")
    assert trained.keys() == original.keys()
    assert any(not torch.equal(trained[name], original[name]) for name in trained), "the saved model is untrained"
    task = named_dataset(spec, seed=3)
    answers = {row["prompt"][-1]["content"]: row["ground_truth"] for row in task}
    records = read_jsonl(run / "trees.jsonl")
    assert {r["step"] for r in records} == {0, 1} and len(records) == 2 * 8
    truth = {}
    for r in records:
        if r["prompt"] is not None:  # the group's first record names its prompt: one of the task's questions
            matches = [q for q in answers if q in r["prompt"]]
            assert len(matches) == 1, f"not one of the task's questions: {r['prompt']!r}"
            truth[r["step"], r["group"]] = answers[matches[0]]
    assert len(truth) == 4 and len({q for q in truth.values()}) > 1
    for step in (0, 1):
        for row, r in enumerate(r for r in records if r["step"] == step):  # a step's records keep the batch order
            text = "".join(seg["text"] for seg in r["segments"])
            expected = arpo_math_reward([text], ground_truth=[truth[step, r["group"]]])[0] + length_shaping(text, row)
            assert r["reward"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("overrides,extra,message", [
    ({"reward_funcs": ["nope"]}, [], "reward_funcs: unknown reward 'nope'"),
    ({"reward_funcs": ["no_such_module.f"]}, [], "reward_funcs: cannot import 'no_such_module.f'"),
    ({"tools": ["shell"]}, [], "tools: unknown tool 'shell'"),
    ({"tools": ["search"]}, [], "tools: 'search' needs search_corpus"),
    ({"dataset_name": "missing.jsonl"}, [], "dataset_name: no such file"),
    ({"dataset_name": "reasoning_gym:no_such_task"}, [], "reasoning-gym has no task 'no_such_task'"),
    ({"max_stepz": 3}, [], "Unknown arguments from config file: \\['--max_stepz'"),
    ({}, ["--max_steps", "abc"], "invalid int value: 'abc'"),
    ({"branch_threshold": 2.0}, [], "branch_threshold"),
    ({"model_name_or_path": None}, [], "model_name_or_path: required"),
    ({"resume_from_checkpoint": "runs/nope/checkpoint-3"}, [], "resume_from_checkpoint: no checkpoint folder"),
    ({"python_isolation": "docker"}, [], "python_\\*: Sandbox isolation must be one of"),
    ({"python_pool_size": -1}, [], "python_\\*: Sandbox pool_size must be an integer >= 0"),
    ({"task_config": {"max_terms": 3}}, [],
     "task_config: only 'arithmetic' and 'reasoning_gym:<task>' datasets take options"),
    ({"dataset_name": "arithmetic:4"}, ["--task_config", '{"max_termz": 3}'],
     "task_config: the arithmetic task has no option 'max_termz'"),
    ({"dataset_name": "reasoning_gym:basic_arithmetic:4"}, ["--task_config", "{max_terms: 3}"],
     "argument --task_config.*invalid _json_object value"),
    ({"dataset_name": "reasoning_gym:basic_arithmetic:4"}, ["--task_config", '{"max_termz": 3}'],
     "task_config: reasoning-gym task 'basic_arithmetic' refused"),
    ({"task_config": {"max_terms": 3}, "dataset_name": "missing.jsonl"}, ["--task_config", "null"],
     "dataset_name: no such file"),  # `null` clears the recipe's options: the next check speaks
])
def test_user_mistakes_get_one_line(tool_model_dir, tmp_path, capsys, overrides, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(_recipe(tmp_path, tool_model_dir, **overrides)), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("arpo-trl: error: ")
    assert re.search(message, err[-1]), err[-1]


def test_dataset_without_ground_truth_and_model_without_chat_template(tool_model_dir, tokenizer, tmp_path, capsys):
    data = _dataset(tmp_path / "bad.jsonl", answer_column="label")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(_recipe(tmp_path, tool_model_dir, dataset_name=str(data)))])
    assert "needs `prompt` and one of ['ground_truth', 'answer', 'solution']" in capsys.readouterr().err
    plain = tmp_path / "no-template"
    shutil.copytree(tool_model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        main(["train", "--config", str(_recipe(tmp_path, plain))])
    assert "has no chat template" in capsys.readouterr().err


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("arpo-trl")
    result = subprocess.run([str(script), "train", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--branch_threshold" in result.stdout and "--reward_funcs" in result.stdout


@pytest.mark.parametrize("command", ["train", "sft", "eval", "memory-plan"])
def test_stored_help_is_what_the_live_parser_prints(command):
    """The shipped `--help` texts are the parsers' own (rewrite them with `python -m arpo_trl.commands.help_texts`
    after a config change); under other transformers/TRL versions they are not used."""
    from arpo_trl.commands.help_texts import live_help, stored_help

    stored = stored_help(command)
    assert stored is not None, "a help file is missing or was written with other versions than those installed"
    assert stored == live_help(command), f"{command}: run `python -m arpo_trl.commands.help_texts`"


def test_help_imports_neither_torch_nor_trl_and_other_versions_get_the_live_help(tmp_path, monkeypatch, capsys):
    probe = ("import sys\nfrom arpo_trl.cli import main\ntry:\n    main(['quickstart', '--help'])\n"
             "except SystemExit as e:\n    assert e.code == 0\n"
             "print(sorted(m for m in ('torch', 'trl', 'transformers', 'datasets') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--branch_threshold" in done.stdout, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    from arpo_trl.commands import help_texts

    assert help_texts.help_command(["quickstart", "--max_steps", "2", "-h"]) == "train"
    assert help_texts.help_command(["view", "--help"]) is None and help_texts.help_command(["train"]) is None
    (tmp_path / "train.txt").write_text("written with transformers==0.0 trl==0.0\nstale text\n")
    monkeypatch.setattr(help_texts, "FOLDER", tmp_path)
    assert help_texts.stored_help("train") is None and help_texts.stored_help("sft") is None  # stale, missing
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "stale text" not in printed and "--branch_threshold" in printed


def test_memory_plan_help_and_a_missing_card_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory-plan", "--help"])
    assert exit_info.value.code == 0 and "--gpu-gib GPU_GIB" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["memory-plan", "--config", str(ROOT / "recipes" / "qwen2.5-3b_lora_colocate.yaml")])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --gpu-gib" in capsys.readouterr().err


def test_train_under_accelerate_launch_two_processes(tool_model_dir, tmp_path):
    """`accelerate launch -m arpo_trl.cli train` (2 CPU processes, gloo): one run folder, by the main process."""
    import os

    recipe = _recipe(tmp_path, tool_model_dir, branch_threshold=1.0)
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "arpo_trl.cli", "train", "--config", str(recipe)]
    import arpo_trl

    # the recipe's reward `test_trainer.length_reward` from tests/, and the arpo_trl this test imported, whatever the
    # working folder and however the package is installed
    path = [str(Path(__file__).parent), str(Path(arpo_trl.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    run = tmp_path / "run"
    assert (run / "adapter_model.safetensors").is_file()
    records = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["step"] for r in records} == {0}  # the main process's 2 prompts × M=4
    assert done.stdout.count("| step | reward |") == 1  # the summary is printed once


def test_quickstart_pipeline_end_to_end_within_max_minutes(tool_model_dir, tmp_path, capsys, monkeypatch):
    """`arpo-trl quickstart` on the tiny model: the cold start, then ARPO on its output, each stage timed; a budget
    the cold start has used up leaves ARPO exactly its first step (the measurement), and the run still finishes."""
    import arpo_trl.commands.recipes as recipes_module

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    sft_out = tmp_path / "sft"
    (recipes / "quickstart_sft.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": str(tool_model_dir), "task": "arithmetic", "num_examples": 8,
        "system_prompt": "python_short", "max_steps": 1, "per_device_train_batch_size": 4, "use_cpu": True,
        "bf16": False, "report_to": "none", "save_strategy": "no", "output_dir": str(sft_out)}))
    shutil.copy(_recipe(tmp_path, sft_out, max_steps=3), recipes / "quickstart.yaml")
    monkeypatch.setattr(recipes_module, "RECIPES_DIR", recipes)
    main(["quickstart", "--max_minutes", "0.0001"])
    printed = capsys.readouterr().out
    assert (sft_out / "model.safetensors").is_file()
    # durations print as "N s" or "N.N min" (a loaded or cold machine takes longer): the test reads either
    duration = r"(\d+ s|[\d.]+ min)"
    assert re.search(rf"ARPO: step 1 took {duration}; 3 steps take about {duration}; max_minutes=[\d.]+ fits 1 of "
                     r"them\.", printed), printed
    assert "ARPO: stopping after step 1 of 3" in printed
    assert re.search(r"Quickstart stage times: model fetch \+ conversion \d+ s, cold-start SFT \d+ s, ARPO \d+ s; "
                     r"total [\d.]+ min\.", printed)
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert {json.loads(line)["step"] for line in (tmp_path / "run" / "trees.jsonl").read_text().splitlines()} == {0}
