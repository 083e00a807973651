"""A new user's machine: an empty cache, the shipped recipes run in the wrong order, typos. A mistake costs a second
(one `arpo-trl: error:` line, before any model is fetched, converted or loaded), the error names the command that
makes a missing cold-start model, and our own defaults print no deprecation warnings."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

import arpo_trl.data.models
from arpo_trl.cli import main
from arpo_trl.commands.recipes import RECIPES_DIR, ToolArguments
from arpo_trl.commands.train import parse_train_args
from arpo_trl.config import ARPOConfig

QUICKSTART = str(RECIPES_DIR / "quickstart.yaml")
QUICKSTART_SFT = str(RECIPES_DIR / "quickstart_sft.yaml")
EVAL_QUICKSTART = str(RECIPES_DIR / "eval_quickstart.yaml")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty ARPO_TRL_CACHE, and SmolLM2's preparation turned into a failure: a check that reaches it ran too
    late."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("ARPO_TRL_CACHE", str(cache))

    def too_late(*args, **kwargs):
        raise AssertionError("the model was prepared before the user's mistake was reported")

    monkeypatch.setattr(arpo_trl.data.models, "smollm2_path", too_late)
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--config", QUICKSTART, "--model_name_or_path", "smollm2", "--tools", "calculator"],
     "tools: unknown tool 'calculator'"),
    (["train", "--config", QUICKSTART, "--model_name_or_path", "smollm2", "--tools", "python,search"],
     "tools: 'search' needs search_corpus"),
    (["train", "--config", QUICKSTART, "--model_name_or_path", "smollm2", "--reward_funcs", "nope"],
     "reward_funcs: unknown reward 'nope'"),
    (["train", "--config", QUICKSTART, "--model_name_or_path", "smollm2", "--dataset_name", "missing.jsonl",
      "--task_config", "null"],
     "dataset_name: no such file"),
    (["sft", "--config", QUICKSTART_SFT, "--task", "leg_counting", "--task_config", "null"],
     "reasoning-gym task 'leg_counting' has no `expression`"),
    (["sft", "--config", QUICKSTART_SFT, "--chat_template", "nope"], "chat_template: TRL ships no template 'nope'"),
    (["eval", "--config", EVAL_QUICKSTART, "--model_name_or_path", "smollm2", "--tools", "calculator"],
     "tools: unknown tool 'calculator'"),
])
def test_a_mistake_is_reported_before_the_model_is_prepared(empty_cache, capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_code:
        main(argv)
    err = capsys.readouterr().err
    assert exit_code.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("arpo-trl: error:")]
    assert len(errors) == 1 and fragment in errors[0], err
    assert not any(empty_cache.iterdir()), "nothing is fetched or converted for a command that fails on a typo"


def test_several_tools_by_comma_or_by_space():
    assert ToolArguments(tools=["python,search"]).tools == ["python", "search"]
    assert ToolArguments(tools=["python", " search ,browse"]).tools == ["python", "search", "browse"]
    script_args, _, _ = parse_train_args(["--config", QUICKSTART, "--tools", "python,search"])
    assert script_args.tools == ["python", "search"]


def test_train_and_eval_before_the_cold_start_name_the_command_that_makes_it(tmp_path):
    """As a newcomer runs them, in a folder without `runs/`: one stderr line each, the next command in it, and no
    warning about our own defaults before it."""
    # matplotlib (the run's pictures) builds its font cache in the home folder on its first use there and
    # says so on stderr when that takes over 5 s (a loaded machine): built here first, whichever test ran before
    import matplotlib.font_manager  # noqa: F401

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ARPO_TRL_CACHE": str(tmp_path / "cache")}
    for argv, wanted in (
        (["train", "--config", QUICKSTART], "run `arpo-trl sft --config recipes/quickstart_sft.yaml` first"),
        (["eval", "--config", EVAL_QUICKSTART], "run `arpo-trl sft --config recipes/quickstart_sft.yaml` first"),
        (["eval", "--config", EVAL_QUICKSTART, "--adapter", "runs/quickstart"],
         "run `arpo-trl train --config recipes/quickstart.yaml` first"),
    ):
        done = subprocess.run([sys.executable, "-m", "arpo_trl.cli", *argv], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith("arpo-trl: error:") and wanted in lines[0], lines[0]
        assert "arpo-trl quickstart" in lines[0]


def test_our_config_defaults_print_no_deprecation_warning(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = ARPOConfig(**base)
    assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert args.activation_checkpointing and args.gradient_checkpointing  # TRL's default (on) is kept
    assert not ARPOConfig(**base, activation_checkpointing=False).gradient_checkpointing
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not ARPOConfig(**base, gradient_checkpointing=False).activation_checkpointing  # the old name works


def test_progress_bars_are_off_in_a_log_and_back_after(capsys):
    from transformers.utils import logging as transformers_logging

    from arpo_trl.data.assets import quiet_progress_bars

    assert not sys.stderr.isatty()  # capsys: like a log file or a pipe
    transformers_logging.enable_progress_bar()
    with quiet_progress_bars():
        assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled()
