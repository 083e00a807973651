"""A scripted stand-in for a vLLM OpenAI server (stdlib `http.server` in a thread, on 127.0.0.1 only), answering
the endpoints arpo-trl calls the way vLLM 0.32 does, and misbehaving on cue: `FakeVLLM.faults` holds what the next
`/v1/completions` requests get instead of a valid answer (an HTTP status, a dropped connection, a slow answer, a
raw body, or a mutation of the valid JSON).
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Status:
    """Answer with this HTTP status (and headers) instead."""

    code: int
    body: str = '{"object": "error", "message": "fake fault"}'
    headers: dict = field(default_factory=dict)


@dataclass
class Raw:
    """Answer 200 with this body and content type."""

    body: str
    content_type: str = "application/json"


@dataclass
class Slow:
    """Answer validly, but only after `seconds`."""

    seconds: float


@dataclass
class Mutate:
    """Answer with `change(valid_body)`."""

    change: Callable[[dict], object]


DROP = "drop"  # close the connection without an answer
TRUNCATE = "truncate"  # send the headers and half the body, then close


def completion_body(tokenizer, text: str, max_tokens: int, top_k: int, stop: Sequence[str],
                    eos_ids: Sequence[int]) -> dict:
    """What vLLM answers a token-id completion request that writes `text` then EOS: `logprobs=top_k`,
    `return_token_ids`, `return_tokens_as_token_ids`, `include_stop_str_in_output`."""
    written = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids, finish, stop_reason = [], "length", None
    for token in written[:max_tokens]:
        ids.append(token)
        hit = next((s for s in stop if s in tokenizer.decode(ids, skip_special_tokens=False)), None)
        if hit is not None or token in eos_ids:
            finish = "stop"
            stop_reason = hit if hit is not None else None if token == tokenizer.eos_token_id else token
            break
    vocab = len(tokenizer)
    tops = []
    for token in ids:  # the sampled token has p = 1/2, the next top_k - 1 ids share the other half
        others = [(token + j) % vocab for j in range(1, min(top_k, vocab))]
        row = {f"token_id:{token}": math.log(0.5)}
        row.update({f"token_id:{t}": math.log(0.5 / max(len(others), 1)) for t in others})
        tops.append(row)
    logprobs = {"text_offset": list(range(len(ids))), "token_logprobs": [math.log(0.5)] * len(ids),
                "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops}
    choice = {"index": 0, "text": tokenizer.decode(ids), "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": stop_reason, "token_ids": ids, "prompt_logprobs": None, "prompt_token_ids": None}
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "tiny", "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": len(ids) + 1}}


def tool_user(prompt: str) -> str:
    """The default script: call the python tool once, then answer."""
    return "<answer>\\boxed{3}</answer>" if "<result>" in prompt else "<think>add</think><python>print(1+2)</python>"


class FakeVLLM:
    """`with FakeVLLM(tokenizer) as server:` serves at `server.url` until the block ends; at most `max_requests`
    requests are answered (then HTTP 400), so a retry loop gone wrong cannot run forever."""

    def __init__(self, tokenizer, *, script: Callable[[str], str] = tool_user, max_requests: int = 500):
        self.tokenizer, self.script, self.max_requests = tokenizer, script, max_requests
        self.faults: deque = deque()
        self.models: list = [{"id": "tiny", "parent": None}]  # `/v1/models`' `data` (vLLM adds root, max_model_len)
        self.server_info: object = None  # `/server_info`'s JSON (vLLM's dev mode); None: 404
        self.log: list[str] = []  # "METHOD /path" of every request, in arrival order
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends every Slow answer at once when the server stops
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-vllm", daemon=True)

    def __enter__(self) -> FakeVLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def completions(self) -> int:
        return self.log.count("POST /v1/completions")

    def answer(self, request: dict) -> dict:
        prompt = self.tokenizer.decode(request["prompt"], skip_special_tokens=False)
        return completion_body(self.tokenizer, self.script(prompt), request["max_tokens"], request["logprobs"],
                               request.get("stop") or [], request.get("stop_token_ids") or [])


def _handler(fake: FakeVLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients pool connections

        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: str, content_type: str = "application/json", headers=None) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            self.end_headers()
            self.wfile.write(data)

        def _count(self) -> bool:
            with fake.lock:
                fake.log.append(f"{self.command} {self.path}")
                if len(fake.log) <= fake.max_requests:
                    return True
            self._send(400, '{"message": "fake server: request limit reached"}')
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if not self._count():
                return
            if self.path == "/health":
                self._send(200, "", "text/plain")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": fake.models}))
            elif self.path.startswith("/server_info") and fake.server_info is not None:
                self._send(200, json.dumps(fake.server_info))
            else:
                self._send(404, '{"detail": "Not Found"}')

        def do_POST(self) -> None:  # noqa: N802
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError:  # the client went away while sending
                self.close_connection = True
                return
            if not self._count():
                return
            tokenizer = fake.tokenizer
            if self.path == "/tokenize":
                self._send(200, json.dumps({"tokens": tokenizer.encode(request["prompt"], add_special_tokens=False)}))
            elif self.path == "/detokenize":
                self._send(200, json.dumps({"prompt": tokenizer.decode(request["tokens"])}))
            elif self.path == "/v1/completions":
                with fake.lock:
                    fault = fake.faults.popleft() if fake.faults else None
                self._complete(request, fault)
            else:
                self._send(404, '{"detail": "Not Found"}')

        def _complete(self, request: dict, fault) -> None:
            if fault == DROP:
                self.close_connection = True
                return
            if isinstance(fault, Status):
                self._send(fault.code, fault.body, headers=fault.headers)
                return
            if isinstance(fault, Raw):
                self._send(200, fault.body, fault.content_type)
                return
            body = fake.answer(request)
            if isinstance(fault, Slow) and fake.release.wait(fault.seconds):
                return
            if isinstance(fault, Mutate):
                body = fault.change(body)
            text = json.dumps(body)
            if fault == TRUNCATE:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text[: len(text) // 2].encode())
                self.close_connection = True
                return
            try:
                self._send(200, text)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a Slow answer)
                self.close_connection = True

    return Handler
