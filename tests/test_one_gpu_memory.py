"""benchmarks/one_gpu_memory.py: its arithmetic against hand computation, and the one-GPU recipe against its table;
benchmarks/one_gpu.py: its dry run and its summary of a run's metrics."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def memory():
    return _load("one_gpu_memory")


def test_parameter_counts_match_the_published_sizes(memory):
    for name, arch in memory.MODELS.items():
        assert arch.params() == pytest.approx(memory.PUBLISHED_PARAMS[name], rel=0.01)
    # 3B by hand: 151936 x 2048 embeddings + 36 x (q 2048^2 + 2048, k and v 2048 x 256 + 256, o 2048^2,
    # mlp 3 x 2048 x 11008, norms 2 x 2048) + final norm 2048
    assert memory.MODELS["Qwen2.5-3B-Instruct"].params() == 3_085_938_688


def test_kv_bytes_per_token_and_lora_by_hand(memory):
    small, large = memory.MODELS["Qwen2.5-1.5B-Instruct"], memory.MODELS["Qwen2.5-3B-Instruct"]
    assert small.kv_bytes_per_token(2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert large.kv_bytes_per_token(2) == 2 * 36 * 2 * 128 * 2 == 36_864
    assert large.kv_bytes_per_token(4) == 2 * 36_864  # float32
    # r x (9 hidden + 2 kv dims + 3 intermediate) per layer on q,k,v,o,gate,up,down
    assert large.lora_params(64) == 64 * (9 * 2048 + 2 * 256 + 3 * 11008) * 36 == 119_734_272


def test_an_architecture_is_read_from_config_json(tiny_model_dir):
    from transformers import AutoConfig, Qwen2Config

    from arpo_trl.colocate.memory_plan import KNOWN_ARCHITECTURES, Architecture

    qwen = Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    assert Architecture.from_config(qwen) == KNOWN_ARCHITECTURES["Qwen/Qwen2.5-3B-Instruct"]
    llama = Architecture.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    assert not llama.qkv_bias and llama.params() == sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())


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


def test_one_gpu_runs_arpo_and_trls_peer_by_default_with_chat_calls_in_bfloat16(tmp_path, capsys):
    """The default run: both engines on the recipe with chat-template calls (which TRL's tool loop parses), the
    recipe's bfloat16, three steps, each engine's set-up timed apart from its steps."""
    bench = _load("one_gpu")
    assert bench.main(["--dry-run", "--work", str(tmp_path)]) is None
    assert capsys.readouterr().out.startswith("one_gpu: 2 engine(s) x 3 step(s)")
    for engine in ("colocate", "trl_colocate"):
        recipe = yaml.safe_load((tmp_path / engine / "recipe.yaml").read_text())
        assert recipe["tool_call_format"] == "chat_template" and "<python>" not in recipe["system_prompt"]
        assert recipe["dtype"] == "bfloat16" and recipe["max_steps"] == 3
    gpu = bench.expected_seconds("colocate", 3, True) + bench.expected_seconds("trl_colocate", 3, True)
    assert gpu <= 8 * 60  # the guess it prints: within one 8-minute GPU run
    assert "vLLM in the range TRL 1.16 supports" in bench.__doc__ and "Hugging Face cache" in bench.__doc__


def test_one_gpu_dry_run_derives_each_engines_recipe(tmp_path, capsys):
    bench = _load("one_gpu")
    assert bench.main(["--dry-run", "--work", str(tmp_path), "--steps", "2", "--set", "seed=3",
                       "--engines", *bench.ENGINES]) is None
    printed = capsys.readouterr().out
    assert printed.startswith("one_gpu: 4 engine(s) x 2 step(s)") and "expected ~" in printed
    recipes = {e: yaml.safe_load((tmp_path / e / "recipe.yaml").read_text()) for e in bench.ENGINES}
    assert recipes["colocate"]["vllm_mode"] == "colocate" and recipes["trl_colocate"]["vllm_mode"] == "colocate"
    assert recipes["server"]["vllm_mode"] == "server" and recipes["server"]["vllm_weight_sync"] == "lora"
    assert recipes["server"]["vllm_server_base_url"].startswith("http://127.0.0.1:")
    assert recipes["in_process"]["use_vllm"] is False and not any(k.startswith("vllm_") for k in recipes["in_process"])
    for engine, recipe in recipes.items():
        assert (recipe["max_steps"], recipe["seed"], recipe["output_dir"]) == (2, 3, str(tmp_path / engine / "run"))
    assert "vllm-serve --config" in printed and "trl_peer.py --config" in printed


def test_one_gpu_summary_reads_metrics(tmp_path):
    bench = _load("one_gpu")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "reward": 0.0, "step_time": 10.0, "arpo/tokens_generated_per_group": 100.0},
            {"step": 2, "reward": 1.0, "step_time": 4.0, "arpo/tokens_generated_per_group": 200.0,
             "arpo/prefix_cache_hit_rate": 0.5}, {"train_runtime": 14.0}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4}
    summary = bench.summarize(tmp_path, recipe)
    # the first step (warm-up) apart; 2 groups of 200 tokens in a 4 s step
    assert (summary["first_step_s"], summary["step_s"], summary["tokens_generated_per_step"]) == (10.0, 4.0, 400)
    assert summary["tokens_per_s"] == 100.0 and summary["prefix_cache_hit_rate"] == 0.5 and summary["reward"] == 0.5
