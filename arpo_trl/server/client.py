"""A small HTTP client for a running vLLM OpenAI server: completions over token ids, LoRA adapter hot-loading,
dev-mode weight reloads, prefix-cache resets and Prometheus metrics.

We do not use TRL's `VLLMClient`: it refuses to construct unless `vllm` is importable in the trainer's own
environment, and its weight sync is NCCL-only (docs/server_mode.md#weight-sync). Every payload here is plain JSON.
"""

from __future__ import annotations

import asyncio
import email.utils
import json as jsonlib
import random
import time
from typing import Any, Literal

import httpx
import requests

from arpo_trl.server.responses import (
    WRONG_SERVER_HINT,
    VLLMServerError,
    Where,
    read_models,
    read_token_ids,
    shown,
    violation,
)

START_HINT = (
    "Start one with `python -m arpo_trl.server serve --model <model> --port <port>` (add `--lora-rank R` "
    "for LoRA weight sync), or `trl vllm-serve --model <model>` on a GPU machine."
)
# Answers worth another try: the server is busy, restarting, or a proxy in front of it is.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What a 4xx answer's text says -> how to fix it.
ERROR_HINTS = {
    "logprobs": "Start the server with --max-logprobs at least entropy_top_k (or -1; our launcher does).",
    "maximum context length": "Raise the server's --max-model-len, or lower max_completion_length.",
    "max_model_len": "Raise the server's --max-model-len, or lower max_completion_length.",
    "does not exist": "Sample from a model the server serves (see GET /v1/models).",
    "Not Found": WRONG_SERVER_HINT,
}
Expect = Literal["json", "any"]

__all__ = ["START_HINT", "VLLMClient", "VLLMServerError", "check_server_tokenizer"]


class _Attempts:
    """Retries of one request: transient faults are tried again after a bounded, jittered exponential backoff (or
    the server's `Retry-After`), at most `max_retries` times and within the request's total deadline; then the last
    fault is raised as one `VLLMServerError`."""

    def __init__(self, client: VLLMClient, timeout: float | None, retry: bool = True):
        self.client = client
        self.started = time.monotonic()
        self.count = 0
        self.max_retries = client.max_retries if retry else 0
        self.deadline = self.started + (timeout or client.request_timeout)

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def delay(self, error: VLLMServerError, retry_after: float | None = None) -> float:
        """Seconds to wait before trying again; raises `error` when no retry is left."""
        self.count += 1
        backoff = min(self.client.retry_backoff * 2 ** (self.count - 1), 10.0) * random.uniform(0.75, 1.0)
        wait = backoff if retry_after is None else retry_after
        if self.count > self.max_retries or time.monotonic() + wait >= self.deadline:
            if self.count > 1 or retry_after is not None:
                spent = time.monotonic() - self.started
                error.args = (f"{error} (gave up after {self.count} attempt{'s' * (self.count > 1)} in {spent:.1f} s"
                              + (f"; the server asked to wait {retry_after:.0f} s more" if retry_after else "")
                              + ")",)
            raise error
        return wait


def _retry_after(response) -> float | None:
    """`Retry-After` in seconds (a number or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(email.utils.parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


class VLLMClient:
    """Talks to one vLLM server at `base_url` (e.g. ``http://127.0.0.1:8000``).

    Args:
        base_url: server root, without ``/v1``.
        request_timeout: seconds one request may take, its retries included (a dead server never hangs us).
        connect_timeout: seconds `wait_until_ready` keeps retrying an unreachable server.
        pool_size: connections kept open (one per concurrent completion request).
        max_retries: how often a transient fault (HTTP 408/429/5xx, a dropped connection) is retried.
        retry_backoff: seconds before the first retry; doubled each time, at most 10 s.
    """

    def __init__(self, base_url: str, request_timeout: float = 600.0, connect_timeout: float = 240.0,
                 pool_size: int = 64, max_retries: int = 4, retry_backoff: float = 0.5):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self._async: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None
        self._session = requests.Session()
        # One pooled connection per concurrent completion request (the engine sends them in parallel).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=pool_size)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def request(self, method: str, path: str, json: dict | None = None, timeout: float | None = None,
                expect: Expect = "any", retry: bool = True) -> Any:
        """One request, transient faults retried (`_Attempts`) unless `retry=False`; a JSON body when
        `expect="json"`, else JSON or text as the server labels it."""
        attempts = _Attempts(self, timeout, retry)
        while True:
            try:
                response = self._session.request(method, self._url(path), json=json, timeout=attempts.remaining())
            except requests.Timeout as error:
                raise self._timed_out(method, path, timeout) from error
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as error:
                wait = attempts.delay(self._disconnected(method, path, error))
            else:
                if response.status_code not in TRANSIENT_STATUS:
                    return self._content(method, path, response, expect)
                wait = attempts.delay(self._http_error(method, path, response), _retry_after(response))
            time.sleep(wait)

    async def arequest(self, method: str, path: str, json: dict | None = None, expect: Expect = "any") -> Any:
        """`request` from asyncio: cancelling the awaiting task closes its connection, so vLLM aborts the request."""
        attempts = _Attempts(self, None)
        while True:
            try:
                response = await self._async_client().request(method, self._url(path), json=json,
                                                               timeout=httpx.Timeout(attempts.remaining(), pool=None))
            except httpx.TimeoutException as error:
                raise self._timed_out(method, path, None) from error
            except httpx.TransportError as error:
                wait = attempts.delay(self._disconnected(method, path, error))
            else:
                if response.status_code not in TRANSIENT_STATUS:
                    return self._content(method, path, response, expect)
                wait = attempts.delay(self._http_error(method, path, response), _retry_after(response))
            await asyncio.sleep(wait)

    def _async_client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (each rollout runs its own), closed by `aclose`."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            limits = httpx.Limits(max_connections=self.pool_size, max_keepalive_connections=self.pool_size)
            self._async = (loop, httpx.AsyncClient(limits=limits))
        return self._async[1]

    async def aclose(self) -> None:
        if self._async is not None and self._async[0] is asyncio.get_running_loop():
            await self._async[1].aclose()
        self._async = None

    def close(self) -> None:
        self._session.close()

    def _where(self, method: str, path: str) -> Where:
        return Where(self.base_url, f"{method} {path.split('?')[0]}")

    def _timed_out(self, method: str, path: str, timeout: float | None) -> VLLMServerError:
        return VLLMServerError(f"vLLM server at {self.base_url} did not answer {method} {path} within "
                               f"{timeout or self.request_timeout:.0f} s (vllm_request_timeout).",
                               base_url=self.base_url, endpoint=f"{method} {path}")

    def _disconnected(self, method: str, path: str, error: Exception) -> VLLMServerError:
        return VLLMServerError(f"Lost the connection to the vLLM server at {self.base_url} during {method} {path} "
                               f"(did it die? check its log): {error}", base_url=self.base_url,
                               endpoint=f"{method} {path}")

    def _http_error(self, method: str, path: str, response) -> VLLMServerError:
        text = response.text
        hint = next((fix for clue, fix in ERROR_HINTS.items() if clue in text), None)
        return VLLMServerError(
            f"vLLM server at {self.base_url} answered {method} {path} with HTTP {response.status_code}: "
            f"{text[:2000]}" + (f"\n{hint}" if hint else ""), base_url=self.base_url, endpoint=f"{method} {path}")

    def _content(self, method: str, path: str, response, expect: Expect) -> Any:
        if response.status_code >= 400:
            raise self._http_error(method, path, response)
        content_type = response.headers.get("content-type", "")
        if "json" not in content_type:
            if expect == "json":
                raise violation(self._where(method, path), "Content-Type", "application/json",
                                f"{content_type or 'none'}: {response.text}", WRONG_SERVER_HINT)
            return response.text
        try:
            return jsonlib.loads(response.content)
        except ValueError as error:
            raise violation(self._where(method, path), "body", f"valid JSON ({error})", response.text,
                            WRONG_SERVER_HINT) from error

    def wait_until_ready(self, timeout: float | None = None, interval: float = 1.0) -> None:
        """Poll `/health` until it answers 200; raise naming the URL and how to start a server otherwise."""
        deadline = time.monotonic() + (self.connect_timeout if timeout is None else timeout)
        last_error: Exception | None = None
        while True:
            try:
                if self._session.get(self._url("/health"), timeout=5).status_code == 200:
                    return
            except requests.RequestException as error:
                last_error = error
            if time.monotonic() >= deadline:
                raise VLLMServerError(
                    f"No vLLM server answered at {self.base_url}/health within "
                    f"{timeout if timeout is not None else self.connect_timeout:.0f} s ({last_error}). {START_HINT}"
                )
            time.sleep(interval)

    def base_model(self) -> str:
        """Name of the served base model (the first model of `/v1/models` without a parent)."""
        models = read_models(self._where("GET", "/v1/models"), self.request("GET", "/v1/models", expect="json"))
        name = next((m["id"] for m in models if not m.get("parent")), None)
        if name is None:
            raise VLLMServerError(f"The vLLM server at {self.base_url} lists no base model in /v1/models: "
                                  f"{shown(models)}", base_url=self.base_url, endpoint="GET /v1/models")
        return name

    def server_info(self) -> dict | None:
        """`/server_info` (vLLM's dev mode: `vllm_config`, `vllm_env`), or None where the server has none."""
        try:
            info = self.request("GET", "/server_info?config_format=json", timeout=60, expect="json", retry=False)
        except VLLMServerError:
            return None
        return info if isinstance(info, dict) else None

    def logprobs_mode(self, info: dict | None = None) -> str | None:
        """The server's `--logprobs-mode` (from `info`, else `server_info()`), or None when it does not say."""
        info = info if info is not None else self.server_info()
        config = info.get("vllm_config") if isinstance(info, dict) else None
        model = config.get("model_config") if isinstance(config, dict) else None
        mode = model.get("logprobs_mode") if isinstance(model, dict) else None
        return mode if isinstance(mode, str) else None

    def completion(self, payload: dict) -> Any:
        """The JSON body of a `/v1/completions` answer (its fields are checked by `responses.read_completion`)."""
        return self.request("POST", "/v1/completions", json=payload, expect="json")

    async def acompletion(self, payload: dict) -> Any:
        return await self.arequest("POST", "/v1/completions", json=payload, expect="json")

    def tokenize(self, text: str, model: str) -> list[int]:
        body = self.request("POST", "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                            expect="json")
        return read_token_ids(self._where("POST", "/tokenize"), body, "tokens")

    def detokenize(self, token_ids: list[int], model: str) -> str:
        body = self.request("POST", "/detokenize", json={"model": model, "tokens": token_ids}, expect="json")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise violation(self._where("POST", "/detokenize"), "prompt", "the text of the tokens (a string)", body)
        return body["prompt"]

    def load_lora_adapter(self, name: str, path: str) -> None:
        try:
            self.request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        except VLLMServerError as error:
            if "HTTP 404" in str(error) and "No adapter found" not in str(error):
                raise VLLMServerError(
                    f"{error}\nThe server does not accept LoRA adapters at run time: start it with `--enable-lora "
                    "--max-lora-rank R` and the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1."
                ) from error
            if "max_lora_rank" in str(error):
                raise VLLMServerError(f"{error}\nRestart the server with a larger `--max-lora-rank`.") from error
            raise

    def unload_lora_adapter(self, name: str) -> None:
        self.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> Any:
        try:
            return self.request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs or {}})
        except VLLMServerError as error:
            if "HTTP 404" in str(error):
                raise VLLMServerError(
                    f"{error}\n/collective_rpc exists only in vLLM's dev mode: start the server with "
                    "VLLM_SERVER_DEV_MODE=1 (our launcher and `trl vllm-serve` set it)."
                ) from error
            raise

    def reset_prefix_cache(self) -> None:
        self.request("POST", "/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        """Prometheus counters and gauges from `/metrics`, summed over label sets (e.g. `vllm:prefix_cache_hits`)."""
        totals: dict[str, float] = {}
        for line in str(self.request("GET", "/metrics")).splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return totals


def tokenizer_probe(tokenizer) -> str:
    """A text whose token ids two tokenizers agree on only if they tokenize alike: ARPO's tags, digits, accents,
    CJK and the tokenizer's special tokens."""
    special = [t for t in (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) if t]
    return "Hello world! 12+34=46 <python>print(sum([1, 2]))</python> <result>\n3\n</result> é ü ß 中文 " + "".join(
        special)


def check_server_tokenizer(client: VLLMClient, tokenizer, model: str) -> None:
    """Fail before training if the server tokenizes differently or has a smaller vocabulary than the trainer:
    its token ids would silently mean other tokens to the policy being trained."""
    probe = tokenizer_probe(tokenizer)
    local = tokenizer.encode(probe, add_special_tokens=False)
    remote = client.tokenize(probe, model)
    last = len(tokenizer) - 1
    try:
        remote_last = client.detokenize([last], model)
    except VLLMServerError as error:
        remote_last = f"<error: {error}>"
    local_last = tokenizer.decode([last])
    if remote != local or remote_last != local_last:
        raise ValueError(
            f"The vLLM server at {client.base_url} serves a tokenizer that does not match the trainer's "
            f"(model {model!r}): probe text -> server {remote[:24]}… vs trainer {local[:24]}…; token id {last} "
            f"(the trainer's last) -> server {remote_last!r} vs trainer {local_last!r}. Serve the same model and "
            "tokenizer as the one being trained."
        )
