"""The README's "Usage in Python" block runs as written (only `max_steps` lowered), on the real cold-started
SmolLM2-135M, and its model earns reward: what a reader pastes is what is tested."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

import arpo_trl.commands.sft as sft_command
from arpo_trl.data.assets import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2
FORMAT_FAILURE = -1.0  # arpo_math_reward of a completion whose format is wrong (docs/rewards.md)


def _readme_usage():
    spec = importlib.util.spec_from_file_location("bench_readme_usage", ROOT / "benchmarks" / "readme_usage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


readme_usage = _readme_usage()


def cached_cold_start() -> Path:
    """The quickstart's cold start (`quickstart_cold_start`, i.e. recipes/quickstart_sft.yaml), trained once per
    ARPO_TRL_CACHE (~1 min on 2 idle cores, far more on a loaded machine) and kept under a key of everything that
    shapes it: the recipe, the SFT and data code, the library versions. A fresh cache (`.ci/run`) trains it."""
    sources = [ROOT / "recipes" / "quickstart_sft.yaml", *(ROOT / "arpo_trl" / name for name in (
        "commands/sft.py", "data/prompts.py", "data/arithmetic.py", "tools/python.py", "tools/base.py",
        "data/models.py"))]
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sources))
    for package in ("torch", "transformers", "trl", "peft", "datasets"):
        key.update(f"{package}=={importlib.metadata.version(package)};".encode())
    folder = default_cache_dir() / f"quickstart-sft-{key.hexdigest()[:16]}"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted run
        sft_command.quickstart_cold_start(partial)
        partial.rename(folder)  # a half-saved model is never mistaken for a finished one
    return folder


def test_quickstart_cold_start_trains_with_the_recipe_only_when_the_folder_holds_no_model(monkeypatch):
    calls = []

    def fake_sft(argv):
        calls.append(list(argv))
        Path(argv[argv.index("--output_dir") + 1]).mkdir(parents=True)
        (Path(argv[argv.index("--output_dir") + 1]) / "config.json").write_text("{}")

    monkeypatch.setattr(sft_command, "sft", fake_sft)
    recipe = ROOT / "recipes" / "quickstart_sft.yaml"
    default = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    assert default == Path("runs/quickstart-sft")  # where `arpo-trl quickstart` keeps it (README, cli.quickstart)
    assert sft_command.quickstart_cold_start() == default
    assert calls == [["--config", str(recipe), "--output_dir", str(default)]]
    assert sft_command.quickstart_cold_start() == default and len(calls) == 1  # a model there: no second SFT
    assert sft_command.quickstart_cold_start("elsewhere") == Path("elsewhere") and calls[-1][-1] == "elsewhere"


def test_usage_block_is_found_and_its_steps_replaced_exactly_once():
    code = readme_usage.usage_block((ROOT / "README.md").read_text(encoding="utf-8"))
    compile(code, "README.md", "exec")
    assert "ARPOTrainer(" in code and "trainer.train()" in code and "print(" in code
    assert len(re.findall(r"\bmax_steps=\d+", code)) == 1
    assert re.search(r"\bmax_steps=3\b", readme_usage.with_max_steps(code, 3))
    with pytest.raises(ValueError, match="exactly one"):
        readme_usage.with_max_steps(code + "\nmax_steps=5\n", 3)
    with pytest.raises(ValueError, match="no '## Usage in Python' heading"):
        readme_usage.usage_block("## Usage\n\n```python\nprint(1)\n```\n")
    assert readme_usage.usage_block("## Usage in Python\n\ntext\n\n```python\nx = 1\n```\n\n```python\ny\n```\n") \
        == "x = 1\n"


@pytest.mark.slow
def test_readme_usage_block_runs_as_written_and_earns_reward(monkeypatch, capsys):
    """In an empty working folder (conftest) whose runs/quickstart-sft is the cached cold start, which the block's
    `quickstart_cold_start()` then finds (as after `arpo-trl quickstart`); then ARPO for STEPS steps.

    Why the reward assertion does not hang on luck: a seed fixes the rollouts on one machine (docs/differences.md,
    "Seeds"), but not across machines (another CPU rounds the logits differently); the cold start writes the format
    on a large share of completions (the quickstart's step-1 rewards are 0.16-0.60 on three seeds,
    benchmarks/results/quickstart.json; all-malformed steps would log `arpo_math` -1), and the test asks only that
    one of the 16 completions of two steps is well-formed."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    Path("runs").mkdir()
    Path("runs", "quickstart-sft").symlink_to(cached_cold_start(), target_is_directory=True)
    code = readme_usage.with_max_steps(readme_usage.usage_block((ROOT / "README.md").read_text(encoding="utf-8")),
                                       STEPS)
    namespace = readme_usage.run_block(code)

    assert namespace["model"] == Path("runs", "quickstart-sft")
    trainer = namespace["trainer"]
    assert trainer.state.global_step == STEPS
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == STEPS and readme_usage.step_rewards(trainer) == namespace["rewards"]
    printed = capsys.readouterr().out
    first, last = readme_usage.thirds([log["reward"] for log in logs])  # the quickstart benchmark's statistic
    assert f"mean training reward: first third {first:+.2f}, last third {last:+.2f}" in printed
    # Both rewards are logged: ARPO's (-1 for a malformed completion) and the format credit (0 to 0.7).
    math_means = [log["rewards/arpo_math_reward/mean"] for log in logs]
    credit_means = [log["rewards/format_credit_reward/mean"] for log in logs]
    assert all(-1 <= m <= 1.1 for m in math_means) and all(0 <= c <= 0.7 for c in credit_means)
    assert all(log["reward"] == pytest.approx(m + c, abs=1e-4) for log, m, c in zip(logs, math_means, credit_means))
    # The cold-started model writes well-formed answers: some completion scored above the format-failure floor.
    assert max(math_means) > FORMAT_FAILURE, f"every completion was malformed: {logs}"
    with capsys.disabled():  # the margins, for `pytest -s`
        print(f"\nREADME block, {STEPS} steps: rewards {[round(log['reward'], 3) for log in logs]}, arpo_math means "
              f"{[round(m, 3) for m in math_means]}")
    # and it calls the Python tool, which is what ARPO branches on
    assert max(log["arpo/tool_calls_per_trajectory"] for log in logs) > 0, logs
