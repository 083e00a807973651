"""A probe that goes on (`GenerateRequest.continues_to`, `ColocatedVLLMEngine.agenerate_continuing`): the k tokens
after a tool result decide the fork while the same engine request decodes the segment on, so the path's next
request is answered without a new one. The scheduler's side runs against a scripted engine (a test double for the
model only); the engine's loop driver against an exact stand-in for vLLM's `LLMEngine` (the real one runs in
`tests/test_colocate.py`)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_colocate import _FakeLLM
from test_rollout import AsyncScriptedEngine, _prompts, calls_then_answers

from arpo_trl.colocate.engine import ColocatedVLLMEngine, EngineSteps, _LoopDriver
from arpo_trl.colocate.outputs import first_tokens, generated_tokens
from arpo_trl.generation.engine import EngineTraits, Segment
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool


class ContinuingEngine(AsyncScriptedEngine):
    """The scripted policy, whose probes go on: the whole segment is drawn at the probe's request, the probe answers
    with its first k tokens, and a task gives the rest after a delay. `rests` records (path room, rest length)."""

    traits = EngineTraits(event_driven=True, continues_probes=True)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.probes, self.plain, self.rests, self.rest_cancelled = 0, 0, [], 0

    async def agenerate(self, prefix, max_new_tokens, stop):
        self.plain += 1
        return await super().agenerate(prefix, max_new_tokens, stop)

    async def agenerate_continuing(self, prefix, probe_tokens, max_new_tokens, stop):
        self.probes += 1
        whole = self.segment(list(prefix), max_new_tokens)
        if len(whole.token_ids) <= probe_tokens:
            return whole, None
        k = probe_tokens
        probe = Segment(whole.token_ids[:k], whole.logprobs[:k], whole.entropies[:k], "length")
        rest = Segment(whole.token_ids[k:], whole.logprobs[k:], whole.entropies[k:], whole.finish_reason)

        async def later() -> Segment:
            try:
                await asyncio.sleep(self.token_seconds * len(rest.token_ids) * self.delay_rng.uniform(0.2, 3.0))
            except asyncio.CancelledError:
                self.rest_cancelled += 1
                raise
            self.rests.append((max_new_tokens - k, len(rest.token_ids)))
            return rest

        return probe, asyncio.get_running_loop().create_task(later())


def _sampler(tokenizer, engine_class, script=None, seed=0, tools=None, **kw) -> BranchingSampler:
    engine = engine_class(tokenizer, script or calls_then_answers(3), seed=seed)
    return BranchingSampler(engine, tokenizer, tools or [Tool("python", lambda code: "2")], num_generations=8,
                            max_completion_length=200, seed=seed, scheduler="events", entropy_window=4, **kw)


@pytest.mark.parametrize("policy", ["entropy", "aepo"])
@pytest.mark.parametrize("seed", range(4))
def test_a_probe_that_goes_on_answers_its_paths_next_request_without_a_new_one(tokenizer, policy, seed):
    sampler = _sampler(tokenizer, ContinuingEngine, seed=seed, branch_policy=policy)
    result = sampler.sample(_prompts(tokenizer, 3))
    engine, stats = sampler.engine, result.stats
    assert [len(group) for group in result.groups] == [8, 8, 8]
    assert stats.continued_probes == len(engine.rests) > 0
    assert stats.requests == engine.probes + engine.plain  # a rest is no request of its own
    assert all(0 < length <= room for room, length in engine.rests)  # each rest within the room it was given
    by_id = {t.id: t for t in result.trajectories}
    for path in result.trajectories:
        assert len(path.completion_ids) == len(path.mask) == len(path.logprobs) <= 200 and not path.active
        if path.kind == "branch":  # a fork starts at its parent's tool result, not after the probe
            parent = by_id[path.parent]
            assert path.completion_ids[: path.fork_position] == parent.completion_ids[: path.fork_position]
            assert tokenizer.decode(path.completion_ids[: path.fork_position]).endswith("</result>")


def test_a_failed_rollout_cancels_the_rests_still_decoding(tokenizer):
    """A fork's request fails while its parent's probe decodes on: the rollout fails and the rest is cancelled."""
    def script(text, rng):
        return ("step <python>1</python>", 0.5, "stop") if "</result>" not in text else \
            ("x " * 60 + "<answer>2</answer>", 0.5, "eos")

    class FailingForks(ContinuingEngine):
        async def agenerate(self, prefix, max_new_tokens, stop):
            if "</result>" in self.tokenizer.decode(list(prefix)):  # a fork's first request, from the tool result
                await asyncio.sleep(0.2)
                raise RuntimeError("the fork's request failed")
            return await super().agenerate(prefix, max_new_tokens, stop)

    sampler = _sampler(tokenizer, FailingForks, script=script, branch_threshold=1.0)
    sampler.engine.token_seconds = 0.05  # a rest takes seconds: still decoding when the fork fails
    with pytest.raises(RuntimeError, match="the fork's request failed"):
        sampler.sample(_prompts(tokenizer, 1))
    assert sampler.engine.rest_cancelled > 0 and not sampler.engine.rests


class _Logprob:
    def __init__(self, value: float):
        self.logprob = value


class _StreamingLLM(_FakeLLM):
    """Exact stand-in for vLLM's `LLMEngine` as the driver calls it: one token per request per step; a request of
    `n` tokens finishes at its n-th step. Every step returns each running request's cumulative output (as vLLM does
    for `RequestOutputKind.CUMULATIVE`), extending the lists it returned before, as vLLM's detokenizer does."""

    def __init__(self, lengths: dict[str, int]):
        super().__init__()
        self.lengths = lengths

    def add_request(self, request_id, prompt, params):
        self.added.append(request_id)
        self.running[request_id] = type("Choice", (), {"token_ids": [], "logprobs": [], "finish_reason": None,
                                                        "stop_reason": None})()

    def step(self):
        outputs = []
        for request_id, choice in list(self.running.items()):
            token = len(choice.token_ids) + 10
            choice.token_ids.append(token)
            choice.logprobs.append({token: _Logprob(-0.5)})
            finished = len(choice.token_ids) == self.lengths[request_id]
            if finished:
                choice.finish_reason = "length"
                del self.running[request_id]
            outputs.append(type("Output", (), {"request_id": request_id, "outputs": [choice], "finished": finished,
                                                "prompt_token_ids": [1, 2], "num_cached_tokens": 0})())
        return outputs


class _Owner:
    step = ColocatedVLLMEngine.step

    def __init__(self, lengths):
        self.llm, self.thread = _StreamingLLM(lengths), ThreadPoolExecutor(1)
        self.load = EngineSteps()


def test_the_driver_answers_a_probe_with_its_first_k_tokens_and_the_rest_when_the_request_ends():
    owner = _Owner({"long": 7, "short": 2, "plain": 3, "dropped": 9, "awaited": 9})

    async def scenario():
        driver = _LoopDriver(owner)
        plain = asyncio.ensure_future(driver.submit("plain", [1], None))
        first, final = await driver.submit_probed("long", [1], None, 4)
        assert first.outputs[0].token_ids == [10, 11, 12, 13] and first.outputs[0].finish_reason == "length"
        assert len(first.outputs[0].logprobs) == 4 and not first.finished
        assert (await plain).finished  # the plain request is answered when it ends, once
        whole = await final
        assert whole.finished and whole.outputs[0].token_ids == list(range(10, 17))
        assert first.outputs[0].token_ids == [10, 11, 12, 13]  # a copy: the engine's later steps did not extend it
        ended, none = await driver.submit_probed("short", [1], None, 4)  # it ends before k tokens
        assert none is None and ended.finished and ended.outputs[0].token_ids == [10, 11]
        _, rest = await driver.submit_probed("dropped", [1], None, 2)
        driver.drop("dropped", rest)  # the path ended before asking for its rest: the request is aborted in the engine
        assert rest.cancelled()
        _, final = await driver.submit_probed("awaited", [1], None, 2)

        async def rest_task():
            return await final

        waiter = asyncio.create_task(rest_task())  # as the engine's: cancelling it, as it awaits, cancels `final` too
        waiter.add_done_callback(lambda task: task.cancelled() and driver.drop("awaited", final))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert final.cancelled()
        await driver.close()
        return driver

    driver = asyncio.run(scenario())
    assert owner.llm.aborted == ["dropped", "awaited"] and not owner.llm.running
    assert not driver.waiting and not driver.probes and not driver.adds


def test_closing_the_driver_keeps_an_abort_whose_step_the_engine_thread_has_not_begun():
    owner = _Owner({"held": 1000})
    gate = threading.Event()

    async def scenario():
        driver = _LoopDriver(owner)
        _, final = await driver.submit_probed("held", [1], None, 2)
        owner.thread.submit(gate.wait)  # the engine's thread is busy: the next step waits, not begun
        driver.drop("held", final)
        for _ in range(500):  # until the stepping task has taken the abort into a step it queued
            if not driver.aborts:
                break
            await asyncio.sleep(0.01)
        assert not driver.aborts and not driver.stepping.done()
        driver.loop.call_later(0.05, gate.set)
        await driver.close()  # cancels the stepping task while its step still waits for the thread

    try:
        asyncio.run(scenario())
    finally:
        gate.set()  # a failure must not leave the thread waiting (the interpreter joins it at exit)
    assert owner.llm.aborted == ["held"] and not owner.llm.running


def test_first_tokens_copies_a_cut_and_generated_tokens_refuses_nothing_silently():
    choice = type("Choice", (), {"token_ids": [5, 6, 7], "logprobs": [{5: 0}, {6: 0}, {7: 0}]})()
    output = type("Output", (), {"request_id": "r", "outputs": [choice], "prompt_token_ids": [1],
                                 "num_cached_tokens": 0})()
    cut = first_tokens(output, 2)
    choice.token_ids.append(8)
    assert cut.outputs[0].token_ids == [5, 6] and len(cut.outputs[0].logprobs) == 2
    assert cut.outputs[0].finish_reason == "length" and generated_tokens(output) == 4
    assert generated_tokens(type("Odd", (), {"outputs": "not a list"})()) == -1  # waits for the end, refused there


def test_the_driver_gives_an_engine_failure_to_a_waiting_probe():
    class Broken(_StreamingLLM):
        def step(self):
            raise RuntimeError("engine died")

    owner = _Owner({})
    owner.llm = Broken({})

    async def scenario():
        driver = _LoopDriver(owner)
        with pytest.raises(RuntimeError, match="engine died"):
            await driver.submit_probed("x", [1], None, 3)
        assert not driver.probes and not driver.waiting
        await driver.close()

    asyncio.run(scenario())
