"""Every recipe in recipes/ parses with the CLI's parser and passes ARPOConfig's validation (GPU recipes are
parsed with CPU overrides, since bf16 is refused on a CPU)."""

from pathlib import Path

import pytest
import yaml

from arpo_trl.commands.evaluate import make_eval_parser
from arpo_trl.commands.recipes import REWARDS, TOOLS
from arpo_trl.commands.sft import make_parser as make_sft_parser
from arpo_trl.commands.train import make_parser

ALL_RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
EVAL_RECIPES = [p for p in ALL_RECIPES if p.name.startswith("eval_")]
SFT_RECIPES = [p for p in ALL_RECIPES if p.stem.endswith("_sft") and not p.stem.endswith("_trl_sft")]
TRL_SFT_RECIPES = [p for p in ALL_RECIPES if p.stem.endswith("_trl_sft")]  # for `trl sft`
RECIPES = [p for p in ALL_RECIPES if p not in EVAL_RECIPES + SFT_RECIPES + TRL_SFT_RECIPES]  # `arpo-trl train`
ACCELERATE_CONFIGS = sorted((Path(__file__).parents[1] / "recipes" / "accelerate").glob("*.yaml"))


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
    assert model_args.model_name_or_path and script_args.num_examples > 0
    assert config.max_steps > 0 or config.num_train_epochs > 0


@pytest.mark.parametrize("recipe", EVAL_RECIPES, ids=lambda p: p.name)
def test_eval_recipe_parses(recipe, tmp_path):
    (args,) = make_eval_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", str(tmp_path)])
    assert args.dataset_name and args.n_samples >= max(args.k)


@pytest.mark.parametrize("recipe", TRL_SFT_RECIPES, ids=lambda p: p.name)
def test_trl_sft_recipe_parses_with_trls_own_parser(recipe, tmp_path):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    script_args, config, model_args = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(recipe), *_cpu_overrides(recipe, tmp_path)])
    assert script_args.dataset_name and model_args.model_name_or_path and config.num_train_epochs > 0


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    assert loaded.num_processes == 8 and loaded.distributed_type.value in ("MULTI_GPU", "DEEPSPEED")
