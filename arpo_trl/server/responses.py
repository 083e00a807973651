"""What arpo-trl accepts from a vLLM (OpenAI-compatible) server. Every response is untrusted input and is checked
here, once, before anything reaches the sampler: a response that could produce a wrong rollout tree raises a
`VLLMServerError` naming the server, the endpoint, the field, what was expected and what came. The contract is
written out in docs/server_mode.md#the-server-contract.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SHOWN_CHARS = 200  # how much of a bad value an error message quotes
# A logprob is at most 0; servers round, so allow this much above it.
LOGPROB_SLACK = 1e-3
WRONG_SERVER_HINT = (
    "Is `vllm_server_base_url` the root of a vLLM OpenAI server (not a proxy's page, another service or a wrong "
    "port)? Give the root URL, without /v1."
)
NEEDS_VLLM_HINT = (
    "ARPO's server mode needs vLLM >= 0.10 (`return_token_ids`, `return_tokens_as_token_ids`, `stop_reason`); "
    "servers that do not return token ids and per-token top logprobs (e.g. SGLang, TGI, most proxies) cannot be used."
)


class VLLMServerError(RuntimeError):
    """The vLLM server is unreachable, died, answered with an error, or answered with something we cannot use.

    `base_url`, `endpoint` and `field` say where, when known (`field` only for a response that breaks the contract).
    """

    def __init__(self, message: str, *, base_url: str | None = None, endpoint: str | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.base_url = base_url
        self.endpoint = endpoint
        self.field = field


@dataclass(frozen=True)
class Where:
    """The server and the request a response answers, for error messages."""

    base_url: str
    endpoint: str  # e.g. "POST /v1/completions"


class _Missing:
    def __repr__(self) -> str:
        return "nothing (the field is missing)"


MISSING: Any = _Missing()


def shown(value: Any) -> str:
    """`value` as an error message quotes it: JSON where it is JSON, cut to `SHOWN_CHARS`."""
    if isinstance(value, _Missing):
        return repr(value)
    try:
        text = value if isinstance(value, str) and not value.startswith(("{", "[")) else json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text)} characters)"


def violation(where: Where, field: str, expected: str, got: Any, hint: str | None = None) -> VLLMServerError:
    """The one error for a response that breaks the contract."""
    message = (f"The vLLM server at {where.base_url} answered {where.endpoint} with a response arpo-trl cannot use: "
               f"`{field}` should be {expected}, got {shown(got)}.")
    return VLLMServerError(f"{message} {hint}" if hint else message, base_url=where.base_url,
                           endpoint=where.endpoint, field=field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def get(where: Where, obj: Any, path: str, key: str | int, kind: type | tuple[type, ...], expected: str,
        hint: str | None = None) -> Any:
    """`obj[key]`, which must be a `kind` (`path` is `obj`'s own place in the response, for the message)."""
    field = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
    value = obj[key] if isinstance(obj, list) else obj.get(key, MISSING)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise violation(where, field, expected, value, hint)
    return value


def read_models(where: Where, body: Any) -> list[dict]:
    """`/v1/models`: `{"data": [{"id": str, "parent": str | null, ...}, ...]}`."""
    if not isinstance(body, dict):
        raise violation(where, "body", "a JSON object", body, WRONG_SERVER_HINT)
    models = get(where, body, "", "data", list, "a list of models", WRONG_SERVER_HINT)
    for i in range(len(models)):
        entry = get(where, models, "data", i, dict, "a model object")
        get(where, entry, f"data[{i}]", "id", str, "the model's name (a string)")
    return models


def read_token_ids(where: Where, body: Any, key: str) -> list[int]:
    """`/tokenize` (`tokens`): a list of non-negative token ids."""
    if not isinstance(body, dict):
        raise violation(where, "body", "a JSON object", body, WRONG_SERVER_HINT)
    ids = get(where, body, "", key, list, "a list of token ids")
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise violation(where, key, "a list of non-negative integer token ids", ids)
    return ids


FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class CompletionRequest:
    """What one `/v1/completions` request asked for; its answer must agree with it."""

    max_tokens: int
    stop: Sequence[str]
    top_k: int  # `logprobs=k`: each position's top-k logprobs (plus the sampled token's when outside them)
    vocab_size: int  # sampled token ids are below it
    end_ids: frozenset[int]  # tokens that may end a completion with finish_reason "stop" but no stop string
    decode: Callable[[list[int]], str]  # the text the server matched stop strings against


@dataclass
class Completion:
    """A checked completion: one sampled logprob and one top-logprob row (token id -> logprob) per token."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: FinishReason


def read_completion(where: Where, body: Any, request: CompletionRequest) -> Completion:
    """Check a `/v1/completions` answer to a request with `n=1`, `logprobs=k`, `return_token_ids`,
    `return_tokens_as_token_ids` and `include_stop_str_in_output` (docs/server_mode.md#the-server-contract)."""
    if not isinstance(body, dict):
        raise violation(where, "body", "a JSON object", body, WRONG_SERVER_HINT)
    choices = get(where, body, "", "choices", list, "a list with one choice (n=1)", WRONG_SERVER_HINT)
    if len(choices) != 1:
        raise violation(where, "choices", "a list with exactly one choice (the request sent n=1)", choices)
    choice = get(where, choices, "choices", 0, dict, "a choice object")
    ids = _read_ids(where, choice, request)
    logprobs = get(where, choice, "choices[0]", "logprobs", dict, f"an object (the request sent logprobs="
                   f"{request.top_k})", NEEDS_VLLM_HINT)
    path = "choices[0].logprobs"
    sampled = _read_sampled(where, logprobs, path, ids)
    tops = [_read_top_row(where, row, f"{path}.top_logprobs[{i}]", request)
            for i, row in enumerate(_rows(where, logprobs, path, "top_logprobs", len(ids)))]
    for i, (token, top) in enumerate(zip(ids, tops)):
        if token in top and abs(top[token] - sampled[i]) > LOGPROB_SLACK:
            raise violation(where, f"{path}.token_logprobs[{i}]", f"the logprob of token {token} in top_logprobs[{i}] "
                            f"({top[token]})", sampled[i], "The server's arrays are not aligned with its tokens.")
    return Completion(ids, sampled, tops, _finish_reason(where, choice, ids, request))


def _read_ids(where: Where, choice: dict, request: CompletionRequest) -> list[int]:
    ids = get(where, choice, "choices[0]", "token_ids", list, "a list of token ids (the request sent "
              "return_token_ids)", NEEDS_VLLM_HINT)
    bad = next((t for t in ids if not (_is_int(t) and 0 <= t < request.vocab_size)), MISSING)
    if bad is not MISSING:
        raise violation(where, "choices[0].token_ids", f"token ids in the trainer's vocabulary [0, "
                        f"{request.vocab_size})", bad, "Serve the same model and tokenizer as the one being trained.")
    if not ids:
        raise violation(where, "choices[0].token_ids", "at least one token: with max_tokens >= 1, EOS kept in the "
                        "output and include_stop_str_in_output, every valid completion has one", ids,
                        "An empty completion usually means the prompt fills the server's context: raise its "
                        "--max-model-len (or lower max_completion_length).")
    if len(ids) > request.max_tokens:
        raise violation(where, "choices[0].token_ids", f"at most max_tokens={request.max_tokens} tokens",
                        f"{len(ids)} tokens")
    return ids


def _rows(where: Where, logprobs: dict, path: str, key: str, length: int) -> list:
    rows = get(where, logprobs, path, key, list, f"a list with one entry per token ({length})", NEEDS_VLLM_HINT)
    if len(rows) != length:
        raise violation(where, f"{path}.{key}", f"one entry per generated token ({length})", f"{len(rows)} entries",
                        "The server returned logprobs for a different number of tokens than it generated.")
    return rows


def _read_sampled(where: Where, logprobs: dict, path: str, ids: list[int]) -> list[float]:
    values = _rows(where, logprobs, path, "token_logprobs", len(ids))
    for i, value in enumerate(values):
        if not (_is_number(value) and math.isfinite(value) and value <= LOGPROB_SLACK):
            raise violation(where, f"{path}.token_logprobs[{i}]", "the sampled token's logprob (a finite number "
                            "<= 0)", value)
    tokens = logprobs.get("tokens")
    if tokens is not None:  # with return_tokens_as_token_ids, "token_id:<id>" for each sampled token
        expected = [f"token_id:{t}" for t in ids]
        if not isinstance(tokens, list):
            raise violation(where, f"{path}.tokens", "a list of the sampled tokens, \"token_id:<id>\"", tokens)
        if tokens != expected:
            i = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(ids)))
            raise violation(where, f"{path}.tokens[{i}]", f"{shown(expected[i:i + 1])} (the token_ids, as the "
                            "request's return_tokens_as_token_ids asks)", tokens[i:i + 1],
                            "The server's logprobs are not aligned with its tokens, or it ignores "
                            "return_tokens_as_token_ids (vLLM >= 0.10 honours it).")
    return [float(v) for v in values]


def _read_top_row(where: Where, row: Any, field: str, request: CompletionRequest) -> dict[int, float]:
    """One position's top logprobs: keys "token_id:<id>", at least min(k, |V|) and at most k + 1 entries."""
    fewest = min(request.top_k, request.vocab_size)
    expected = (f"an object of at least {fewest} and at most {request.top_k + 1} entries \"token_id:<id>\": logprob "
                f"(the request sent logprobs={request.top_k})")
    hint = (f"Start the server with --max-logprobs {request.top_k} or more (or -1), and use vLLM >= 0.10 "
            "(return_tokens_as_token_ids).")
    if not isinstance(row, dict) or not fewest <= len(row) <= request.top_k + 1:
        raise violation(where, field, expected, row, hint)
    parsed = {}
    for key, value in row.items():
        token = key.removeprefix("token_id:")
        if not (key.startswith("token_id:") and token.isascii() and token.isdigit()):
            raise violation(where, f"{field} key", "\"token_id:<id>\"", key, hint)
        if not (_is_number(value) and not math.isnan(value) and value <= LOGPROB_SLACK):
            raise violation(where, f"{field}[{key!r}]", "a logprob (a number <= 0)", value)
        parsed[int(token)] = float(value)
    return parsed


def _finish_reason(where: Where, choice: dict, ids: list[int], request: CompletionRequest) -> FinishReason:
    """vLLM's finish_reason/stop_reason, checked against the tokens: "stop" with a stop string (which the output
    then contains), "stop" at an end token (the last one), or "length"."""
    reason, field = choice.get("finish_reason", MISSING), "choices[0].finish_reason"
    if reason == "length":
        return "length"
    if reason != "stop":
        hint = "The server aborted the request (shutting down or out of memory? check its log)." \
            if reason == "abort" else None
        raise violation(where, field, "\"stop\" or \"length\"", reason, hint)
    stop_reason, field = choice.get("stop_reason", MISSING), "choices[0].stop_reason"
    if isinstance(stop_reason, str):
        if stop_reason not in request.stop:
            raise violation(where, field, f"one of the request's stop strings {shown(list(request.stop))}",
                            stop_reason)
        if stop_reason not in request.decode(ids):
            raise violation(where, "choices[0].token_ids", f"tokens whose text contains the stop string "
                            f"{stop_reason!r} (the request sent include_stop_str_in_output)", request.decode(ids),
                            NEEDS_VLLM_HINT)
        return "stop"
    if stop_reason is not None and not (_is_int(stop_reason) and stop_reason == ids[-1]):
        raise violation(where, field, f"a stop string, the last token id ({ids[-1]}) or null", stop_reason,
                        NEEDS_VLLM_HINT)
    if ids[-1] not in request.end_ids:
        ends = sorted(request.end_ids)[:8]
        raise violation(where, "choices[0].token_ids", f"a completion ending in an end token, one of {ends} "
                        f"(finish_reason \"stop\" with stop_reason {shown(stop_reason)})", f"last token {ids[-1]}",
                        NEEDS_VLLM_HINT)
    return "eos"
