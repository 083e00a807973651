"""A path that fails while others run (issue 28, point 8): every path task's exception is retrieved (asyncio never
logs "Task exception was never retrieved"), and the first failure is raised with the failing path's context."""

import asyncio
import gc
import logging

import pytest
from test_rollout import AsyncScriptedEngine, ScriptedEngine, _prompts, _sampler, calls_then_answers


class FailingEngine(AsyncScriptedEngine):
    """Fails the second and third requests together (their tasks end in the same turn of the event loop) while the
    other paths' requests are in flight."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests = 0

    async def agenerate(self, prefix, max_new_tokens, stop):
        self.requests += 1
        number = self.requests
        if number in (2, 3):
            await asyncio.sleep(0)
            raise ConnectionError(f"server dropped request {number}")
        return await super().agenerate(prefix, max_new_tokens, stop)


class FailingWaveEngine(ScriptedEngine):
    def generate(self, prefixes, max_new_tokens, stop):
        if len(self.calls) == 1:
            raise ConnectionError("server dropped the second wave")
        return super().generate(prefixes, max_new_tokens, stop)


def test_every_failed_path_task_is_retrieved_and_the_first_names_its_path(tokenizer, caplog):
    sampler = _sampler(tokenizer, calls_then_answers(2), num_generations=4, max_completion_length=120, seed=0,
                       scheduler="events", engine_class=FailingEngine)
    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(ConnectionError) as info:
        sampler.sample(_prompts(tokenizer, 3))
    gc.collect()  # an unretrieved task exception is reported when its task is collected
    assert "never retrieved" not in caplog.text
    assert str(info.value) == "server dropped request 2"  # the first failure, not a later one
    assert any("ARPO path" in note and "group" in note for note in getattr(info.value, "__notes__", [])), \
        getattr(info.value, "__notes__", None)


def test_a_failed_wave_names_its_paths(tokenizer):
    sampler = _sampler(tokenizer, calls_then_answers(2), num_generations=4, max_completion_length=120, seed=0,
                       scheduler="waves", engine_class=FailingWaveEngine)
    with pytest.raises(ConnectionError, match="second wave") as info:
        sampler.sample(_prompts(tokenizer, 2))
    assert any("ARPO paths" in note for note in getattr(info.value, "__notes__", [])), \
        getattr(info.value, "__notes__", None)
