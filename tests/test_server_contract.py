"""Property test of the completion contract (`arpo_trl.server.responses.read_completion`): a valid vLLM answer,
mutated in one field (deleted, replaced by any JSON value, a list entry dropped or repeated), is either refused
with a `VLLMServerError` naming the field, or still gives a completion the sampler can trust. Never another
exception, never a silent wrong segment."""

from __future__ import annotations

import copy
import math

from fake_vllm import completion_body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arpo_trl.server.responses import LOGPROB_SLACK, CompletionRequest, VLLMServerError, Where, read_completion

WHERE = Where("http://127.0.0.1:1", "POST /v1/completions")
STOP = ["</python>"]
TEXTS = ["<think>add</think><python>print(1+2)</python>", "<answer>\\boxed{3}</answer>", "hello world"]

KEYS = ["token_id:²", "token_id:-1", "token_id:x", "token_id:", "5", "token_id:99999", "token_ids", "tokens"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 500) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", "stop", "length", "abort", "</python>", "token_id:5", "token_id:x", "<html>"])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=6,
)


def _paths(value, path=()):
    """Every place in a JSON value: (container path, key)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield path, key
        yield from _paths(child, (*path, key))


def _request(tokenizer, max_tokens: int, top_k: int) -> CompletionRequest:
    ends = frozenset([tokenizer.eos_token_id, *tokenizer.all_special_ids])
    return CompletionRequest(max_tokens, STOP, top_k, len(tokenizer), ends,
                             lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def _trustworthy(completion, request: CompletionRequest) -> None:
    """What the sampler relies on (docs/server_mode.md#the-server-contract)."""
    ids = completion.token_ids
    assert 1 <= len(ids) <= request.max_tokens
    assert len(completion.logprobs) == len(completion.top_logprobs) == len(ids)
    assert all(isinstance(t, int) and 0 <= t < request.vocab_size for t in ids)
    assert all(math.isfinite(lp) and lp <= LOGPROB_SLACK for lp in completion.logprobs)
    for row in completion.top_logprobs:
        assert min(request.top_k, request.vocab_size) <= len(row) <= request.top_k + 1
        assert all(isinstance(t, int) and not math.isnan(lp) and lp <= LOGPROB_SLACK for t, lp in row.items())
    assert completion.finish_reason in ("stop", "eos", "length")
    if completion.finish_reason == "eos":
        assert ids[-1] in request.end_ids
    if completion.finish_reason == "stop":
        assert any(s in request.decode(ids) for s in request.stop)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.sampled_from(TEXTS), max_tokens=st.integers(1, 40), top_k=st.integers(1, 4))
def test_a_mutated_answer_is_refused_or_still_trustworthy(tokenizer, data, text, max_tokens, top_k):
    request = _request(tokenizer, max_tokens, top_k)
    body = completion_body(tokenizer, text, max_tokens, top_k, STOP, [tokenizer.eos_token_id])
    valid = read_completion(WHERE, copy.deepcopy(body), request)
    _trustworthy(valid, request)
    assert valid.token_ids == body["choices"][0]["token_ids"]

    path, key = data.draw(st.sampled_from(list(_paths(body))), label="field")
    container = body
    for step in path:
        container = container[step]
    how = data.draw(st.sampled_from(["delete", "replace", "drop entry", "repeat entry", "rename key"]),
                    label="mutation")
    target = container[key]
    if how == "delete":
        del container[key]
    elif how == "replace" or not isinstance(target, (list, dict)) or not target:
        container[key] = data.draw(json_values, label="value")
    elif isinstance(target, list):
        index = data.draw(st.integers(0, len(target) - 1))
        target.insert(index, target[index]) if how == "repeat entry" else target.pop(index)
    elif how == "drop entry":
        target.pop(data.draw(st.sampled_from(sorted(target))))
    elif how == "rename key":
        old = data.draw(st.sampled_from(sorted(target)))
        target[data.draw(st.sampled_from(KEYS) | st.text(max_size=10), label="key")] = target.pop(old)
    else:
        target[f"token_id:{len(tokenizer) + 1}"] = -1.0
    try:
        completion = read_completion(WHERE, body, request)
    except VLLMServerError as error:
        assert WHERE.base_url in str(error) and WHERE.endpoint in str(error) and error.field
        return
    _trustworthy(completion, request)


def test_the_fake_servers_answers_are_valid(tokenizer):
    for text in TEXTS:
        for max_tokens in (1, 3, 40):
            request = _request(tokenizer, max_tokens, 3)
            body = completion_body(tokenizer, text, max_tokens, 3, STOP, [tokenizer.eos_token_id])
            _trustworthy(read_completion(WHERE, body, request), request)


def test_a_top_logprob_key_that_is_no_token_id_is_refused(tokenizer):
    request = _request(tokenizer, 5, 3)
    for key in ["token_id:²", "token_id:-1", "token_id:x", "token_id:", "5", "token_id: 5", "<think>"]:
        body = completion_body(tokenizer, TEXTS[0], 5, 3, STOP, [tokenizer.eos_token_id])
        row = body["choices"][0]["logprobs"]["top_logprobs"][2]
        row[key] = row.pop(sorted(row)[-1])
        try:
            read_completion(WHERE, body, request)
        except VLLMServerError as error:
            assert error.field == "choices[0].logprobs.top_logprobs[2] key", error
        else:
            raise AssertionError(f"{key!r} was accepted")
