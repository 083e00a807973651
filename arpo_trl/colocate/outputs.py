"""What arpo-trl accepts from the colocated vLLM engine: a `RequestOutput` is turned into the `/v1/completions` answer
a server would have sent for the same request, and checked by the same contract (`server.responses.read_completion`),
so that the in-process and the server paths cannot drift apart in what they let through to the sampler."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from arpo_trl.server.responses import VLLMServerError, Where, violation

WHERE = Where("in process (vllm_mode='colocate')", "LLMEngine.step")


def completion_body(output: Any) -> dict:
    """The `/v1/completions` body (n=1, logprobs=k, return_token_ids, return_tokens_as_token_ids) of a finished
    vLLM `RequestOutput`. Anything not shaped like one is refused here, naming the field."""
    choices = getattr(output, "outputs", None)
    if not isinstance(choices, list) or len(choices) != 1:
        raise violation(WHERE, "outputs", "a list with exactly one completion (the request asked n=1)", choices)
    choice = choices[0]
    ids = list(getattr(choice, "token_ids", None) or [])
    rows = getattr(choice, "logprobs", None)
    if rows is None:
        raise violation(WHERE, "outputs[0].logprobs", "one top-logprob row per token (the request asked logprobs=k)",
                        rows)
    sampled, tops = [], []
    for i, (token, row) in enumerate(zip(ids, rows)):
        if not hasattr(row, "items"):
            raise violation(WHERE, f"outputs[0].logprobs[{i}]", "a mapping token id -> Logprob", row)
        entry = row.get(token)
        sampled.append(getattr(entry, "logprob", None))
        tops.append({f"token_id:{key}": getattr(value, "logprob", None) for key, value in row.items()})
    return {"choices": [{
        "token_ids": ids,
        "logprobs": {"token_logprobs": sampled, "top_logprobs": tops if len(rows) == len(ids) else list(rows),
                     "tokens": [f"token_id:{t}" for t in ids]},
        "finish_reason": getattr(choice, "finish_reason", None),
        "stop_reason": getattr(choice, "stop_reason", None),
    }]}


def cached_tokens(output: Any) -> int:
    """Prompt tokens vLLM's prefix cache served for this request (`RequestOutput.num_cached_tokens`)."""
    value = getattr(output, "num_cached_tokens", None)
    prompt = getattr(output, "prompt_token_ids", None) or []
    if not isinstance(value, int) or not 0 <= value <= len(prompt):
        raise VLLMServerError(f"The colocated vLLM engine reported {value!r} cached prompt tokens for a prompt of "
                              f"{len(prompt)} (expected an integer in [0, {len(prompt)}]).",
                              base_url=WHERE.base_url, endpoint=WHERE.endpoint, field="num_cached_tokens")
    return value


def generated_tokens(output: Any) -> int:
    """How many tokens an unfinished (cumulative) output holds so far; -1 if it is not shaped like one."""
    choices = getattr(output, "outputs", None)
    ids = getattr(choices[0], "token_ids", None) if isinstance(choices, list) and len(choices) == 1 else None
    return len(ids) if isinstance(ids, list | tuple) else -1


def first_tokens(output: Any, k: int) -> SimpleNamespace:
    """An unfinished output cut to its first `k` tokens, as a request of `max_tokens=k` would have finished ('length'):
    a probe's answer while its request decodes on. Copied now: vLLM extends the lists it returned at later steps."""
    choice = output.outputs[0]
    rows = None if choice.logprobs is None else list(choice.logprobs[:k])
    cut = SimpleNamespace(token_ids=list(choice.token_ids[:k]), logprobs=rows,
                          finish_reason="length", stop_reason=None)
    return SimpleNamespace(request_id=output.request_id, outputs=[cut], finished=False,
                           prompt_token_ids=output.prompt_token_ids, num_cached_tokens=output.num_cached_tokens)
