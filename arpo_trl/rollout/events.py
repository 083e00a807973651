"""`EventScheduler`: every path's program advances on its own, for engines with `agenerate` (a vLLM server, the
cached engine). A path's next request goes out as soon as its own tool result or fork decision is ready, tools run as
their calls arrive, and the engine's continuous batching does the batching. The critical path is the longest chain
of requests: a branch's chain continues its parent's at the fork, a fill-up's the chain of the step that started it."""

from __future__ import annotations

import asyncio
import contextlib
import time

from arpo_trl.generation.event_loop import run_coroutine
from arpo_trl.rollout.paths import Rollout, Trajectory
from arpo_trl.rollout.requests import CommitRequest, GenerateRequest, Sampler, bind, interrupt_tools, path_context
from arpo_trl.tools.runner import ToolRunner
from arpo_trl.tools.training_thread import any_runs_here, run_loop_in_thread


class _Activity:
    """Splits wall time into generation in progress, tools alone in progress, and the rest."""

    def __init__(self, stats):
        self.stats, self.generating, self.calling, self.last = stats, 0, 0, time.perf_counter()

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
    """One asyncio task per path; requests and tool calls are awaited as they come."""

    event_driven = True

    def run(self, sampler: Sampler, rollout: Rollout) -> None:
        runner = ToolRunner(sampler.max_tool_workers, sampler.tool_timeout)
        try:
            if any_runs_here(sampler.tools):  # the loop on a thread of its own; this one runs those tools' calls
                return run_loop_in_thread(self._run(sampler, rollout, runner), runner)
            return run_coroutine(self._run(sampler, rollout, runner))  # also inside a running loop (Jupyter)
        finally:
            runner.close()

    async def _run(self, sampler: Sampler, rollout: Rollout, runner: ToolRunner) -> None:
        await _EventRollout(sampler, rollout, runner).run()


class _EventRollout:
    """One rollout under `EventScheduler`: a task per path, started as the sampler's decisions start paths and
    cancelled as they drop them; the rollout ends when every task has, or at the first failure."""

    def __init__(self, sampler: Sampler, rollout: Rollout, runner: ToolRunner):
        self.sampler, self.rollout, self.stats, self.runner = sampler, rollout, rollout.stats, runner
        self.activity = _Activity(rollout.stats)
        self.clock: dict[int, int] = {}  # path id -> tokens on its chain so far
        self.started_at: dict[int, int] = {}  # path id -> tokens on its chain when it started
        self.depth: dict[int, int] = {}  # path id -> requests on its chain so far
        self.tasks: dict[int, asyncio.Task] = {}
        self.rests: dict[int, tuple[asyncio.Task, int]] = {}  # path id -> its probe's request decoding on, its room
        self.dropped: list[asyncio.Task] = []  # rests cancelled with their paths, awaited before the rollout ends
        self.commits: dict[int, asyncio.Event] = {}  # branches waiting for their parent's decision
        self.done: asyncio.Future | None = None

    async def run(self) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.start_new()
        try:
            if self.tasks:
                await self.done
        except BaseException:
            self.runner.cancel_pending()
            interrupt_tools(self.sampler)
            raise
        finally:
            await self._close()
        self._record_chains()

    def start_new(self) -> None:
        """Start a task for each path the sampler started, resume the committed, cancel the dropped."""
        rollout = self.rollout
        for path, creator in rollout.started:
            self.clock[path.id] = self.started_at[path.id] = self.clock.get(creator.id, 0) if creator is not None else 0
            self.depth[path.id] = self.depth.get(creator.id, 0) if creator is not None else 0
            self.tasks[path.id] = task = asyncio.create_task(self._drive(path))
            task.add_done_callback(lambda task, key=path.id: self._finished(key, task))
        rollout.started.clear()
        for path in rollout.committed:
            self.commits.setdefault(path.id, asyncio.Event()).set()
        for path in rollout.cancelled:  # speculative paths the decisions made unnecessary
            if path.id in self.tasks:
                self.tasks[path.id].cancel()
        rollout.committed.clear(), rollout.cancelled.clear()

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
        """Run `path`'s program: send each answer back and await its next request."""
        sampler, stats = self.sampler, self.stats
        program, answer = sampler.grow(self.rollout, path), None
        while True:
            start = time.perf_counter()
            try:
                request = program.send(answer)
            except StopIteration:
                return
            finally:
                self.start_new()
                stats.overhead_seconds += time.perf_counter() - start
            if isinstance(request, GenerateRequest):
                with self.activity.busy("generating"):
                    answer = await self._generate(path, request)
                self.clock[path.id] += len(answer.token_ids)
            elif isinstance(request, CommitRequest):
                answer = await self.commits.setdefault(path.id, asyncio.Event()).wait()
            elif request.call.error is not None:
                answer = None
            else:
                with self.activity.busy("calling"):
                    answer = await asyncio.wrap_future(self.runner.submit(*bind(request.call)))

    async def _generate(self, path: Trajectory, request: GenerateRequest):
        """The segment `request` asks for: a new engine request, or the rest of the one the path's probe left
        decoding (`GenerateRequest.continues_to`)."""
        engine, stops = self.sampler.engine, self.sampler.call_format.stop_strings
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
        if (room := request.continues_to) is not None and callable(getattr(engine, "agenerate_continuing", None)):
            probe, task = await engine.agenerate_continuing(prefix, request.max_new_tokens, room, stops)
            if task is not None:
                self.rests[path.id] = task, room - len(probe.token_ids)
            return probe
        offered = {"seed": path.seed, "entropy_tokens": request.entropy_tokens}
        options = {key: value for key, value in offered.items() if key in getattr(engine, "request_options", ())}
        return await engine.agenerate(prefix, request.max_new_tokens, stops, **options)

    async def _close(self) -> None:
        self.runner.close()
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await asyncio.gather(*self.dropped, return_exceptions=True)  # rests cancelled as their paths ended
        if self.done.done() and not self.done.cancelled():
            self.done.exception()  # retrieved: the rollout was cancelled after a path had failed
        close = getattr(self.sampler.engine, "aclose", None)
        if close is not None:
            await close()

    def _record_chains(self) -> None:
        """The kept paths' chain lengths; the longest is the rollout's critical path."""
        kept = [path for group in self.rollout.groups for path in group if path.committed]
        self.rollout.chains = {path.id: self.clock[path.id] for path in kept}
        if kept:
            longest = max(kept, key=lambda path: self.clock[path.id])
            self.stats.critical_path_tokens, self.stats.critical_path_kind = self.clock[longest.id], longest.kind
        self.stats.latest_fill_up_start_tokens = max(
            (self.started_at[path.id] for path in kept if path.kind == "fill"), default=0)
        self.stats.waves = max((self.depth[path.id] for path in kept), default=0)
