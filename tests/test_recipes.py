"""Every recipe in recipes/ parses with the CLI's parser and passes ARPOConfig's validation (GPU recipes are
parsed with CPU overrides, since bf16 is refused on a CPU)."""

from pathlib import Path

import pytest
import yaml

from arpo_trl.cli import REWARDS, TOOLS, make_parser

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "arpo_paper_reasoning.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_validates(recipe, tmp_path):
    raw = yaml.safe_load(recipe.read_text())
    overrides = ["--output_dir", str(tmp_path)]
    if raw.get("bf16") or not raw.get("use_cpu"):
        overrides += ["--use_cpu", "true", "--bf16", "false"]
    script_args, config, model_args = make_parser().parse_args_and_config(["--config", str(recipe), *overrides])
    assert all(name in REWARDS or "." in name for name in script_args.reward_funcs)
    assert set(script_args.tools) <= set(TOOLS)
    assert model_args.model_name_or_path and script_args.dataset_name
    assert config.num_generations >= config.initial_rollouts >= 1
