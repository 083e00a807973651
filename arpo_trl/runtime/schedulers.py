"""Schedulers: drive the rule's per-path programs (`rollout.BranchingRule.grow`) against an engine and the tools.

A program yields requests (generate, call a tool, wait for a fork decision) and receives their results; the rule
lives there once, and a scheduler only decides when each request runs:

* `EventScheduler` (`events`; engines with `agenerate`, e.g. a vLLM server or the cached engine): every path advances
  on its own. Its next request goes out as soon as its own tool result or fork decision is ready, tools run as their
  calls arrive, and the engine's continuous batching does the batching. No round waits for its slowest path.
* `WaveScheduler` (`waves`; batch engines, e.g. transformers' `generate`): the tool calls of a moment run together,
  then the requests that are ready together are generated as one batch (a wave), in path order.

Both give the same trees for a seed (every draw is keyed by the path, `Trajectory.key`), and both measure the
rollout's critical path: the longest chain of sequentially generated tokens it waited for (waves: the sum of each
wave's longest segment; events: the longest chain of requests, where a branch's chain continues its parent's at the
fork and a fill-up's the chain of the step that started it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Generator
from typing import Any

from arpo_trl.generation.engine import EngineTraits, GenerationEngine
from arpo_trl.generation.event_loop import run_coroutine, run_loop_in_thread
from arpo_trl.rollout.arpo import BranchingRule, CallRequest, GenerateRequest, PathRequest
from arpo_trl.rollout.paths import Rollout, Trajectory
from arpo_trl.rollout.tool_calls import ToolCall
from arpo_trl.runtime.prefetch import MODES as SPECULATION_MODES
from arpo_trl.runtime.prefetch import FillUpPrefetch, Shadow
from arpo_trl.tools.base import Tool
from arpo_trl.tools.runner import ToolRunner

SCHEDULERS = ("auto", "events", "waves")

Program = Generator[Any, Any, None]


def runs_here(tool: Tool | None) -> bool:
    """Whether the tool's calls run on the thread that runs the rollout (the training thread, `Tool.thread_safe`)."""
    return tool is not None and not tool.thread_safe


def bind(call: ToolCall) -> tuple[Callable[[], object], bool]:
    """The call, and whether it runs on the rollout's own thread (`ToolRunner.submit`'s `here`)."""
    return (lambda: call.tool(call.content)), runs_here(call.tool)


def path_context(paths: list[Trajectory]) -> str:
    """The note a path's failure carries: which paths were running, where (a rollout runs many in parallel)."""
    described = ", ".join(f"{path.id} (group {path.group}, {path.kind}, {len(path.completion_ids)} completion tokens, "
                          f"{path.tool_calls} tool calls)" for path in paths[:4])
    more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    return f"in ARPO path{'s' if len(paths) > 1 else ''} {described}{more}"


def interrupt_tools(tools: list[Tool]) -> None:
    """A cancelled rollout stops the tool calls still running (e.g. kills PythonTool's processes)."""
    for tool in tools:
        with contextlib.suppress(Exception):
            tool.interrupt()


def make_scheduler(name: str, traits: EngineTraits, speculation: str = "auto",
                   max_tool_workers: int = 8) -> WaveScheduler | EventScheduler:
    """'events' needs an event-driven engine (`EngineTraits.event_driven`); 'waves' drives any engine; 'auto' picks
    events where it can. `speculation` ('auto' or 'off'): whether the event scheduler runs likely fill-ups ahead of
    the rule (`prefetch.py`)."""
    if speculation not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {speculation!r}.")
    if name == "waves" or (name == "auto" and not traits.event_driven):
        return WaveScheduler(max_tool_workers)
    if name in ("events", "auto"):
        if not traits.event_driven:
            raise ValueError("scheduler='events' needs an event-driven engine (one with `agenerate`, e.g. "
                             "VLLMServerEngine); this one only generates in batches: use scheduler='waves' or 'auto'.")
        return EventScheduler(speculation, wait_for_first_decision=traits.compute_bound,
                              max_tool_workers=max_tool_workers)
    raise ValueError(f"scheduler must be one of ('auto', 'events', 'waves'), got {name!r}.")


# ---- events ---------------------------------------------------------------------------------------------------
class _Activity:
    """Splits wall time into generation in progress, tools alone in progress, and the rest."""

    def __init__(self, stats):
        self.stats = stats
        self.generating = 0
        self.calling = 0
        self.last = time.perf_counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.generating:
            self.stats.generation_seconds += now - self.last
        elif self.calling:
            self.stats.tool_seconds += now - self.last
        self.last = now

    @contextlib.contextmanager
    def busy(self, kind: str):
        self._tick()
        setattr(self, kind, getattr(self, kind) + 1)
        try:
            yield
        finally:
            self._tick()
            setattr(self, kind, getattr(self, kind) - 1)


class EventScheduler:
    """One asyncio task per path; requests and tool calls are awaited as they come, and likely fill-ups run ahead of
    the rule (`prefetch.FillUpPrefetch`; `speculation='off'`: none)."""

    event_driven = True

    def __init__(self, speculation: str = "auto", wait_for_first_decision: bool = False, max_tool_workers: int = 8):
        self.speculation = speculation
        self.wait_for_first_decision = wait_for_first_decision
        self.max_tool_workers = max_tool_workers
        self.prefetch: FillUpPrefetch | None = None  # made for the first rule it drives; its rates carry over

    def run(self, rule: BranchingRule, engine: GenerationEngine, rollout: Rollout) -> None:
        if self.prefetch is None:
            self.prefetch = FillUpPrefetch(rule, self.speculation, self.wait_for_first_decision)
        runner = ToolRunner(self.max_tool_workers, rule.tool_timeout)
        try:
            events = _EventRollout(rule, engine, rollout, runner, self.prefetch).run()
            if any(runs_here(tool) for tool in rule.tools):  # the loop on its own thread; this one runs their calls
                return run_loop_in_thread(events, runner)
            return run_coroutine(events)  # also inside a running loop (Jupyter)
        finally:
            runner.close()


_LIVE = object()  # `_replayed`: the shadow has no more answers, the path goes on live


def _signature(request: PathRequest) -> tuple:
    """What a request asks, for checking that a fill-up's program asks what its shadow asked."""
    if isinstance(request, GenerateRequest):
        return ("generate", len(request.path.completion_ids), request.max_new_tokens, request.continues_to,
                request.entropy_tokens)
    return ("call", request.call.content, request.call.error)


class _EventRollout:
    """One rollout under `EventScheduler`: a task per path, started as the rule's decisions start paths, and a
    task per shadow (a fill-up run ahead, `prefetch.py`); the rollout ends when every path's task has, or at the
    first failure."""

    def __init__(self, rule: BranchingRule, engine: GenerationEngine, rollout: Rollout, runner: ToolRunner,
                 prefetch: FillUpPrefetch):
        self.rule = rule
        self.engine = engine
        self.rollout = rollout
        self.stats = rollout.stats
        self.runner = runner
        self.activity = _Activity(rollout.stats)
        self.clock: dict[int, int] = {}  # path id -> tokens on its chain so far
        self.started_at: dict[int, int] = {}  # path id -> tokens on its chain when it started
        self.depth: dict[int, int] = {}  # path id -> requests on its chain so far
        self.tasks: dict[int, asyncio.Task] = {}
        self.rests: dict[int, tuple[asyncio.Task, int]] = {}  # path id -> its probe's request decoding on, its room
        self.dropped: list[asyncio.Task] = []  # rests cancelled with their paths, awaited before the rollout ends
        self.done: asyncio.Future | None = None
        self.prefetch = prefetch
        self.shadows: dict[tuple, Shadow] = {}  # fill-up key -> its shadow, while the rule has not started it
        self.replays: dict[int, Shadow] = {}  # path id -> the shadow its program replays first
        self.shadow_tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.prefetch.begin()
        self.start_new()
        for g in range(len(self.rollout.groups)):
            self._plan(g, None)
        try:
            if self.tasks:
                await self.done
        except BaseException:
            self.runner.cancel_pending()
            interrupt_tools(self.rule.tools)
            raise
        finally:
            await self._close()
        self.prefetch.learn()
        self._record_critical_path()

    def start_new(self) -> None:
        """Start a task for each path the rule started; a fill-up that ran ahead takes over its shadow."""
        for path, creator in self.rollout.take_started():
            self.clock[path.id] = self.started_at[path.id] = self.clock.get(creator.id, 0) if creator is not None else 0
            self.depth[path.id] = self.depth.get(creator.id, 0) if creator is not None else 0
            if path.kind == "fill" and (shadow := self.shadows.pop(path.key, None)) is not None:
                shadow.adopted = True
                path.environment = shadow.path.environment  # as the shadow's tool calls left it
                self.started_at[path.id] = self.clock[path.id] = shadow.started_at  # its chain began with the shadow
                self.replays[path.id] = shadow
                self.stats.adopted_fill_ups += 1
            self.tasks[path.id] = task = asyncio.create_task(self._drive(path))
            task.add_done_callback(lambda task, key=path.id: self._finished(key, task))

    def _finished(self, key: int, task: asyncio.Task) -> None:
        self.tasks.pop(key, None)
        error = None if task.cancelled() else task.exception()  # retrieved always, even after the first failure
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        elif not self.tasks:
            self.done.set_result(None)

    async def _drive(self, path: Trajectory) -> None:
        try:
            await self._advance(path)
        except Exception as error:
            error.add_note(path_context([path]))
            raise
        finally:
            if (rest := self.rests.pop(path.id, None)) is not None:  # the path ended before asking for it
                rest[0].cancel()
                self.dropped.append(rest[0])

    async def _advance(self, path: Trajectory) -> None:
        """Run `path`'s program: send each answer back and await its next request (a fill-up's shadow's answers
        first, `_replayed`)."""
        stats = self.stats
        program, answer = self.rule.grow(self.rollout, path), None
        replay, replayed = self.replays.pop(path.id, None), 0
        while True:
            start, decisions, ended = time.perf_counter(), path.growth.fork_decisions, False
            try:
                request = program.send(answer)
            except StopIteration:
                ended = True
                return
            finally:
                started = bool(self.rollout.started)  # every step ends with `start_new`, which empties it
                self.start_new()
                if ended or started or path.growth.fork_decisions != decisions:  # what the fill-ups' estimate reads
                    self._plan(path.group, path)
                stats.overhead_seconds += time.perf_counter() - start
            self.prefetch.observe(path, isinstance(request, GenerateRequest) and request.entropy_tokens != 0,
                                  isinstance(request, CallRequest))
            if replay is not None:
                answer = await self._replayed(replay, replayed, path, request)
                if answer is not _LIVE:
                    replayed += 1
                    continue
                replay = None
            answer = await self._answer(path, request)

    async def _answer(self, path: Trajectory, request: PathRequest):
        """Run a path's request: a segment from the engine, or a tool call's outcome (None for a malformed call)."""
        if isinstance(request, GenerateRequest):
            with self.activity.busy("generating"):
                segment = await self._generate(path, request)
            self.clock[path.id] += len(segment.token_ids)
            return segment
        if request.call.error is not None:
            return None
        with self.activity.busy("calling"):
            return await asyncio.wrap_future(self.runner.submit(*bind(request.call)))

    # ---- fill-ups run ahead (prefetch.py) ----------------------------------------------------------------------
    def _plan(self, g: int, creator: Trajectory | None) -> None:
        """Keep running ahead the fill-ups of prompt `g` the estimate wants now, and only those."""
        wanted = self.prefetch.wanted(self.rollout, g)
        for shadow in [s for s in self.shadows.values() if s.group == g and s.index not in wanted]:
            self._drop(shadow)
        for j in wanted:
            if ("fill", g, j) in self.shadows:
                continue
            shadow = self.prefetch.shadow(self.rollout, g, j)
            shadow.started_at = self.clock.get(creator.id, 0) if creator is not None else 0
            self.clock[shadow.path.id] = shadow.started_at
            self.depth[shadow.path.id] = self.depth.get(creator.id, 0) if creator is not None else 0
            self.shadows[shadow.path.key] = shadow
            shadow.task = asyncio.create_task(self._run_shadow(shadow))
            self.shadow_tasks.append(shadow.task)
            self.stats.speculative_fill_ups += 1

    async def _run_shadow(self, shadow: Shadow) -> None:
        """The rule's program for the shadow's path on its scratch rollout, each answer recorded, until the path ends
        or the rule starts the fill-up (the answer in flight then is still recorded)."""
        path = shadow.path
        program, answer = self.rule.grow(shadow.scratch, path), None
        try:
            while not shadow.adopted:
                try:
                    request = program.send(answer)
                except StopIteration:
                    return
                answer = await self._answer(path, request)
                inside = self.clock[path.id] - shadow.started_at  # tokens on its chain since it started
                shadow.answers.append((_signature(request), answer, self.depth[path.id], inside))
                shadow.changed.set()
        except Exception as error:  # a failed request fails the rollout, as a path's would (never swallowed)
            error.add_note(f"in a fill-up run ahead of the rule, {path.key}")
            if not self.done.done():
                self.done.set_exception(error)
        finally:
            shadow.done = True
            shadow.changed.set()

    async def _replayed(self, shadow: Shadow, i: int, path: Trajectory, request: PathRequest):
        """The shadow's i-th answer for the fill-up's i-th request (waited for while the shadow is on it), or `_LIVE`
        once the shadow has no more."""
        while len(shadow.answers) <= i and not shadow.done:
            shadow.changed.clear()
            await shadow.changed.wait()
        if len(shadow.answers) <= i:
            return _LIVE
        signature, answer, depth, inside = shadow.answers[i]
        if signature != _signature(request):
            raise RuntimeError(f"fill-up {path.key} asked {_signature(request)} where its shadow asked {signature}: "
                               "a fill-up's program must not depend on anything but its own path.")
        self.clock[path.id], self.depth[path.id] = shadow.started_at + inside, depth
        return answer

    def _drop(self, shadow: Shadow) -> None:
        """A shadow the rule will not start now (forks took its slot, or the rollout ended): its work is discarded."""
        del self.shadows[shadow.path.key]
        shadow.task.cancel()
        self.stats.discarded_tokens += sum(shadow.path.mask)
        self.stats.discarded_tool_calls += shadow.scratch.stats.tool_calls

    async def _generate(self, path: Trajectory, request: GenerateRequest):
        """The segment `request` asks for: a new engine request, or the rest of the one the path's probe left
        decoding (`GenerateRequest.continues_to`)."""
        engine, stops = self.engine, self.rule.call_format.stop_strings
        if (rest := self.rests.pop(path.id, None)) is not None:
            task, room = rest
            if request.max_new_tokens != room:
                task.cancel()
                raise RuntimeError(f"path {path.id} asked {request.max_new_tokens} tokens after its probe, not {room}.")
            self.stats.continued_probes += 1
            return await task
        self.depth[path.id] += 1
        self.stats.requests += 1
        prefix = path.prompt_ids + path.completion_ids
        if (room := request.continues_to) is not None and engine.traits.continues_probes:
            probe, task = await engine.agenerate_continuing(prefix, request.max_new_tokens, room, stops)
            if task is not None:
                self.rests[path.id] = task, room - len(probe.token_ids)
            return probe
        offered = {"seed": path.seed, "entropy_tokens": request.entropy_tokens}
        options = {key: value for key, value in offered.items() if key in engine.traits.request_options}
        return await engine.agenerate(prefix, request.max_new_tokens, stops, **options)

    async def _close(self) -> None:
        for shadow in list(self.shadows.values()):
            self._drop(shadow)
        self.runner.close()
        for task in [*self.tasks.values(), *self.shadow_tasks]:
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await asyncio.gather(*self.shadow_tasks, return_exceptions=True)
        await asyncio.gather(*self.dropped, return_exceptions=True)  # rests cancelled as their paths ended
        if self.done.done() and not self.done.cancelled():
            self.done.exception()  # retrieved: the rollout was cancelled after a path had failed
        await self.engine.aclose()

    def _record_critical_path(self) -> None:
        """The longest of the kept paths' chains is the rollout's critical path."""
        kept = [path for group in self.rollout.groups for path in group]
        if kept:
            longest = max(kept, key=lambda path: self.clock[path.id])
            self.stats.critical_path_tokens, self.stats.critical_path_kind = self.clock[longest.id], longest.kind
        self.stats.latest_fill_up_start_tokens = max(
            (self.started_at[path.id] for path in kept if path.kind == "fill"), default=0)
        self.stats.waves = max((self.depth[path.id] for path in kept), default=0)


# ---- waves ----------------------------------------------------------------------------------------------------
class WaveScheduler:
    """Ready requests → one `engine.generate` batch per wave; the tool calls of a moment run before it."""

    event_driven = False  # paths join in path order, so a seed fixes the trees with either in-process engine

    def __init__(self, max_tool_workers: int = 8):
        self.max_tool_workers = max_tool_workers

    def run(self, rule: BranchingRule, engine: GenerationEngine, rollout: Rollout) -> None:
        self.rule, self.engine, self.rollout = rule, engine, rollout
        self.runner = ToolRunner(self.max_tool_workers, rule.tool_timeout)
        self.programs: dict[int, Program] = {}
        answers: list[tuple[Trajectory, object]] = []
        held: list[tuple[Trajectory, Any]] = []  # generation requests waiting for the tool calls of their moment
        try:
            with engine.rollout_scope():  # an engine's cache, kept per rollout
                while requests := held + self._step(answers):
                    answers, held = self._act(requests)
        except BaseException:
            self.runner.cancel_pending()
            interrupt_tools(rule.tools)
            raise
        finally:
            self.runner.close()
            del self.rule, self.engine, self.rollout, self.runner, self.programs

    def _step(self, answers: list[tuple[Trajectory, object]]) -> list[tuple[Trajectory, Any]]:
        """Send every answer to its program in path order; new paths (forks, fill-ups) join at the end, in order."""
        start = time.perf_counter()
        work = sorted(answers, key=lambda item: item[0].id)
        self._admit(work)
        requests = []
        for path, answer in work:  # `work` grows while it is walked: forks made by earlier steps
            try:
                request = self.programs[path.id].send(answer)
            except StopIteration:
                del self.programs[path.id]
            except Exception as error:
                error.add_note(path_context([path]))
                raise
            else:
                requests.append((path, request))
            self._admit(work)
        self.rollout.stats.overhead_seconds += time.perf_counter() - start
        return requests

    def _admit(self, work: list[tuple[Trajectory, object]]) -> None:
        """Programs for the paths just started."""
        for path, _ in self.rollout.take_started():
            self.programs[path.id] = self.rule.grow(self.rollout, path)
            work.append((path, None))

    def _align(self, generate: list[tuple[Trajectory, GenerateRequest]]) -> None:
        """A wave lasts as long as its longest request. When it holds short requests (probes: k tokens), every
        request in it stops there too and goes on in the next wave, so that the fork decisions and the branches they
        start do not wait for long segments (their programs continue them, as a probe's)."""
        limit = self.rule.max_completion_length
        short = [r.max_new_tokens for path, r in generate if r.max_new_tokens < limit - len(path.completion_ids)]
        if short:
            for _, request in generate:
                request.max_new_tokens = min(request.max_new_tokens, max(short))

    def _act(self, requests) -> tuple[list[tuple[Trajectory, object]], list[tuple[Trajectory, Any]]]:
        """Run the tool calls of this moment (concurrently) and hold the generation requests, which then join the
        requests of the paths the calls release: one wave instead of two, as a batch engine pays per wave. With no
        call pending, generate the wave. Returns the answers and the requests still held."""
        generate = [(path, r) for path, r in requests if isinstance(r, GenerateRequest)]
        calls = [(path, r) for path, r in requests if isinstance(r, CallRequest)]
        if calls:
            futures = {path.id: self.runner.submit(*bind(r.call)) for path, r in calls if r.call.error is None}
            start = time.perf_counter()
            self.runner.serve(list(futures.values()))  # runs here the calls of tools that are not thread-safe
            self.rollout.stats.tool_seconds += time.perf_counter() - start
            return [(path, futures[path.id].result() if path.id in futures else None) for path, _ in calls], generate
        return self._generate(generate), []

    def _generate(self, generate: list[tuple[Trajectory, GenerateRequest]]) -> list[tuple[Trajectory, object]]:
        stats = self.rollout.stats
        generate = sorted(generate, key=lambda item: item[0].id)
        self._align(generate)
        start = time.perf_counter()
        prefixes = [path.prompt_ids + path.completion_ids for path, _ in generate]
        budgets, stops = [r.max_new_tokens for _, r in generate], self.rule.call_format.stop_strings
        seeded = "seed" in self.engine.traits.request_options
        options = {"seeds": [path.seed for path, _ in generate]} if seeded else {}
        try:
            segments = self.engine.generate(prefixes, budgets, stops, **options)
        except Exception as error:
            error.add_note(path_context([path for path, _ in generate]))
            raise
        stats.generation_seconds += time.perf_counter() - start
        stats.waves += 1
        stats.requests += len(generate)
        stats.critical_path_tokens += max(len(segment.token_ids) for segment in segments)
        return [(path, segment) for (path, _), segment in zip(generate, segments)]
