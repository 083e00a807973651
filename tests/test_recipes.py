"""Every recipe in recipes/ parses with the CLI's parser and passes ARPOConfig's validation (GPU recipes are
parsed with CPU overrides, since bf16 is refused on a CPU)."""

from pathlib import Path

import pytest
import yaml

from arpo_trl.cli import REWARDS, TOOLS, make_parser
from arpo_trl.cold_start import make_parser as make_sft_parser
from arpo_trl.evaluation import make_eval_parser

ALL_RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
EVAL_RECIPES = [p for p in ALL_RECIPES if p.name.startswith("eval_")]
SFT_RECIPES = [p for p in ALL_RECIPES if p.stem.endswith("_sft")]
RECIPES = [p for p in ALL_RECIPES if p not in EVAL_RECIPES + SFT_RECIPES]  # `arpo-trl train` recipes


def _cpu_overrides(recipe: Path, tmp_path) -> list[str]:
    raw = yaml.safe_load(recipe.read_text())
    overrides = ["--output_dir", str(tmp_path)]
    if raw.get("bf16") or not raw.get("use_cpu"):
        overrides += ["--use_cpu", "true", "--bf16", "false"]
    return overrides


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "arpo_paper_reasoning.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_validates(recipe, tmp_path):
    overrides = _cpu_overrides(recipe, tmp_path)
    script_args, config, model_args = make_parser().parse_args_and_config(["--config", str(recipe), *overrides])
    assert all(name in REWARDS or "." in name for name in script_args.reward_funcs)
    assert set(script_args.tools) <= set(TOOLS)
    assert model_args.model_name_or_path and script_args.dataset_name
    assert config.num_generations >= config.initial_rollouts >= 1


@pytest.mark.parametrize("recipe", SFT_RECIPES, ids=lambda p: p.name)
def test_sft_recipe_parses(recipe, tmp_path):
    script_args, config, model_args = make_sft_parser().parse_args_and_config(
        ["--config", str(recipe), *_cpu_overrides(recipe, tmp_path)])
    assert model_args.model_name_or_path and script_args.num_examples > 0 and config.max_steps > 0


@pytest.mark.parametrize("recipe", EVAL_RECIPES, ids=lambda p: p.name)
def test_eval_recipe_parses(recipe, tmp_path):
    (args,) = make_eval_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", str(tmp_path)])
    assert args.dataset_name and args.n_samples >= max(args.k)
