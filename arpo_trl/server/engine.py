"""`VLLMServerEngine`: the `GenerationEngine` that generates through a running vLLM server, one `/v1/completions`
request per prefix; every answer passes `server.responses` before the sampler sees it."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from arpo_trl.generation.engine import EngineTraits, GenerationEngine, SamplingSettings, Segment, check_budgets
from arpo_trl.server.responses import VLLMServerError, Where
from arpo_trl.server.segments import SegmentReader


class VLLMServerEngine(GenerationEngine):
    """Generates through a running vLLM server (``vllm serve`` / ``trl vllm-serve`` / `arpo_trl.server.launcher`).

    One `/v1/completions` request per prefix (token ids in, token ids out), all in flight at once, so that vLLM
    batches them and its prefix cache serves the prefix a branch shares with its parent: a fork costs only its
    new tokens. Per-token entropy comes from the server's top-`entropy_top_k` (processed) logprobs: by default with
    the tail term (`arpo_trl.entropy`, 'top_k_tail'), or the reference's sum over them ('top_k').
    Sampled-token logprobs are the server's own, so TRL's importance-sampling correction sees the real
    sampler (bf16 servers differ from fp32 trainers by up to ~0.2 nats, docs/server_mode.md#traps).
    No per-request `seed` is sent: on vLLM-CPU it crashes the engine together with chunked prefill (same section).

    `model_name` is the served model or LoRA adapter to sample from; weight sync switches it.
    """

    traits = EngineTraits(event_driven=True)

    def __init__(
        self,
        client,
        tokenizer,
        *,
        model_name: str | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        max_concurrency: int = 64,
    ):
        self.reader = reader = SegmentReader(tokenizer, sampling, Where(client.base_url, "POST /v1/completions"),
                                             "VLLMServerEngine", "a vLLM server")
        self.client, self.tokenizer, extra = client, tokenizer, sampling.generation_kwargs or {}
        self.vocab_size = reader.vocab_size
        self.eos_token_ids = reader.eos_token_ids
        self.entropy_estimator = reader.estimator
        self.entropy_top_k = reader.top_k
        self.model_name = model_name or client.base_model()
        reserved = {"model", "prompt", "max_tokens", "n", "logprobs", "stop", "stop_token_ids", "return_token_ids",
                    "return_tokens_as_token_ids", "include_stop_str_in_output", "skip_special_tokens"}
        if clash := reserved & set(extra):
            raise ValueError(f"generation_kwargs: {sorted(clash)} are set by the ARPO sampler for vLLM requests and "
                             "cannot be overridden.")
        self.sampling = {
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
            "min_p": sampling.min_p or 0.0, "repetition_penalty": sampling.repetition_penalty,
            "stop_token_ids": reader.eos_token_ids, "logprobs": reader.top_k, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "return_token_ids": True, "return_tokens_as_token_ids": True, **extra,
        }
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-request")

    def generate(
        self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop: Sequence[str]
    ) -> list[Segment]:
        check_budgets(prefixes, max_new_tokens)
        futures = [self._pool.submit(self._complete, list(p), b, list(stop)) for p, b in zip(prefixes, max_new_tokens)]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    async def agenerate(self, prefix: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> Segment:
        """One segment, from asyncio: the event-driven scheduler sends each path's request as soon as it is ready."""
        check_budgets([prefix], [max_new_tokens])
        payload = self._payload(list(prefix), max_new_tokens, list(stop))
        return self.reader.read(await self.client.acompletion(payload), max_new_tokens, stop)

    async def aclose(self) -> None:
        await self.client.aclose()

    def _complete(self, prefix: list[int], budget: int, stop: list[str]) -> Segment:
        return self.reader.read(self.client.completion(self._payload(prefix, budget, stop)), budget, stop)

    def _payload(self, prefix: list[int], budget: int, stop: list[str]) -> dict:
        payload = {"model": self.model_name, "prompt": prefix, "max_tokens": budget, "n": 1, **self.sampling}
        if stop:
            payload["stop"] = stop
        return payload

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_server(self) -> None:
        """Startup probe: one short completion must come back with token ids, sampled logprobs and top-k logprobs in
        the shape the sampler needs, so that a wrong server is refused before the first step."""
        prompt = self.tokenizer.encode("Probe: 1 + 2 =", add_special_tokens=False) or list(self.eos_token_ids[:1])
        try:
            self._complete(prompt, 4, [])
        except VLLMServerError as error:
            raise VLLMServerError(f"The vLLM server at {self.client.base_url} failed arpo-trl's startup check (one "
                                  f"short completion with logprobs={self.entropy_top_k}): {error}",
                                  base_url=error.base_url, endpoint=error.endpoint, field=error.field) from error
