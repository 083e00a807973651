"""`WaveScheduler`: the paths' programs driven in waves, for batch engines (transformers in process). The tool calls
of a moment run together, then the requests ready together are generated as one batch, in path order; every result
goes back to its program in path order, so a seed reproduces the trees. The critical path is the sum of each wave's
longest segment."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from arpo_trl.rollout.paths import Rollout, Trajectory
from arpo_trl.rollout.requests import (
    CallRequest,
    CommitRequest,
    GenerateRequest,
    Program,
    Sampler,
    bind,
    interrupt_tools,
    path_context,
)
from arpo_trl.tools.runner import ToolRunner


class WaveScheduler:
    """Ready requests → one `engine.generate` batch per wave; the tool calls of a moment run before it."""

    event_driven = False  # paths join in path order, so a seed fixes the trees with either in-process engine

    def run(self, sampler: Sampler, rollout: Rollout) -> None:
        self.sampler, self.rollout = sampler, rollout
        self.runner = ToolRunner(sampler.max_tool_workers, sampler.tool_timeout)
        self.programs: dict[int, Program] = {}
        self.waiting: dict[int, Trajectory] = {}  # branches waiting for their parent's decision
        answers: list[tuple[Trajectory, object]] = []
        held: list[tuple[Trajectory, Any]] = []  # generation requests waiting for the tool calls of their moment
        scope = getattr(sampler.engine, "rollout_scope", contextlib.nullcontext)  # an engine's cache, kept per rollout
        try:
            with scope():
                while requests := held + self._step(answers):
                    answers, held = self._act(requests)
        except BaseException:
            self.runner.cancel_pending()
            interrupt_tools(sampler)
            raise
        finally:
            self.runner.close()
            del self.sampler, self.rollout, self.runner, self.programs, self.waiting

    def _step(self, answers: list[tuple[Trajectory, object]]) -> list[tuple[Trajectory, Any]]:
        """Send every answer to its program in path order; new paths (forks, fill-ups) join at the end, in order."""
        start = time.perf_counter()
        work = sorted(answers, key=lambda item: item[0].id)
        self._admit(work)
        requests = []
        for path, answer in work:  # `work` grows while it is walked: forks made by earlier steps
            if path.id not in self.programs:  # dropped meanwhile
                continue
            try:
                request = self.programs[path.id].send(answer)
            except StopIteration:
                del self.programs[path.id]
            except Exception as error:
                error.add_note(path_context([path]))
                raise
            else:
                if isinstance(request, CommitRequest):
                    self.waiting[path.id] = path
                else:
                    requests.append((path, request))
            self._admit(work)
        self.rollout.stats.overhead_seconds += time.perf_counter() - start
        if self.waiting and not requests:
            raise RuntimeError(f"paths {sorted(self.waiting)} wait for a fork decision that no path will make")
        return [(path, request) for path, request in requests if path.id in self.programs]

    def _admit(self, work: list[tuple[Trajectory, object]]) -> None:
        """Programs for the paths just started, resumed for those just committed, closed for those dropped."""
        rollout = self.rollout
        for path, _ in rollout.started:
            self.programs[path.id] = self.sampler.grow(rollout, path)
            work.append((path, None))
        for path in rollout.committed:
            if self.waiting.pop(path.id, None) is not None:
                work.append((path, None))
        for path in rollout.cancelled:
            self.waiting.pop(path.id, None)
            program = self.programs.pop(path.id, None)
            if program is not None:
                program.close()
        rollout.started.clear(), rollout.committed.clear(), rollout.cancelled.clear()

    def _align(self, generate: list[tuple[Trajectory, GenerateRequest]]) -> None:
        """A wave lasts as long as its longest request. When it holds short requests (probes, new branches: k
        tokens), every request in it stops there too and goes on in the next wave, so that the fork decisions and
        the branches they start do not wait for long segments (their programs continue them, as a probe's)."""
        limit = self.sampler.max_completion_length
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
        sampler, stats = self.sampler, self.rollout.stats
        generate = sorted(generate, key=lambda item: item[0].id)
        self._align(generate)
        start = time.perf_counter()
        prefixes = [path.prompt_ids + path.completion_ids for path, _ in generate]
        budgets, stops = [r.max_new_tokens for _, r in generate], sampler.call_format.stop_strings
        try:
            if "seed" in getattr(sampler.engine, "request_options", ()):
                segments = sampler.engine.generate(prefixes, budgets, stops, seeds=[path.seed for path, _ in generate])
            else:
                segments = sampler.engine.generate(prefixes, budgets, stops)
        except Exception as error:
            error.add_note(path_context([path for path, _ in generate]))
            raise
        stats.generation_seconds += time.perf_counter() - start
        stats.waves += 1
        stats.requests += len(generate)
        stats.critical_path_tokens += max(len(segment.token_ids) for segment in segments)
        return [(path, segment) for (path, _), segment in zip(generate, segments)]
