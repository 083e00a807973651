"""benchmarks/one_gpu_memory.py: its arithmetic against hand computation, and the one-GPU recipe against its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def memory():
    spec = importlib.util.spec_from_file_location("bench_one_gpu_memory", ROOT / "benchmarks" / "one_gpu_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_parameter_counts_match_the_published_sizes(memory):
    for arch in memory.MODELS.values():
        assert memory.param_count(arch) == pytest.approx(arch.published_params, rel=0.01)
    # 3B by hand: 151936 x 2048 embeddings + 36 x (q 2048^2 + 2048, k and v 2048 x 256 + 256, o 2048^2,
    # mlp 3 x 2048 x 11008, norms 2 x 2048) + final norm 2048
    assert memory.param_count(memory.MODELS["Qwen2.5-3B-Instruct"]) == 3_085_938_688


def test_kv_bytes_per_token_and_lora_by_hand(memory):
    small, large = memory.MODELS["Qwen2.5-1.5B-Instruct"], memory.MODELS["Qwen2.5-3B-Instruct"]
    assert memory.kv_bytes_per_token(small) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert memory.kv_bytes_per_token(large) == 2 * 36 * 2 * 128 * 2 == 36_864
    # r x (9 hidden + 2 kv dims + 3 intermediate) per layer on q,k,v,o,gate,up,down
    assert memory.lora_param_count(large, 64) == 64 * (9 * 2048 + 2 * 256 + 3 * 11008) * 36 == 119_734_272


def test_plans_are_consistent(memory, tmp_path):
    report = memory.main(["--out", str(tmp_path)])
    assert (tmp_path / "one_gpu_memory.json").is_file() and "Estimate" in (tmp_path / "one_gpu_memory.md").read_text()
    for plan in report["plans"]:
        card = plan["card_gib"] * memory.GIB
        share = int(plan["vllm_gpu_memory_utilization"] * card)
        assert plan["vllm_weights"] + plan["vllm_fixed"] + plan["kv_bytes"] == share
        assert plan["kv_tokens"] == plan["kv_bytes"] // plan["kv_bytes_per_token"]
        assert plan["rollout_phase"] <= plan["usable_gib"] * memory.GIB
        assert plan["fits"], plan["model"]


def test_the_one_gpu_recipe_uses_the_24gb_settings(memory):
    recipe = yaml.safe_load((ROOT / "recipes" / "qwen2.5-3b_lora_colocate.yaml").read_text())
    shape = memory.Shape()
    plan = memory.plan_card("Qwen2.5-3B-Instruct", memory.MODELS["Qwen2.5-3B-Instruct"], 24, shape)
    assert recipe["model_name_or_path"] == "Qwen/Qwen2.5-3B-Instruct" and recipe["vllm_mode"] == "colocate"
    assert recipe["vllm_gpu_memory_utilization"] == plan["vllm_gpu_memory_utilization"]
    assert recipe["per_device_train_batch_size"] == plan["per_device_train_batch_size"]
    assert recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] == shape.rows_per_rollout
    assert (recipe["max_prompt_length"], recipe["max_completion_length"], recipe["lora_r"]) == (
        shape.prompt_tokens, shape.completion_tokens, shape.lora_r)
    assert recipe["lora_target_modules"] == list(memory.LORA_TARGETS)
