"""What a path's program (`BranchingSampler.grow`) asks its scheduler for, and what every scheduler does alike with
the answers: the requests (generate, call a tool, wait for a fork decision), the sampler as a scheduler sees it, a
call bound to the thread it runs on, the note a path's failure carries, and the tools stopped when a rollout is
cancelled."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from arpo_trl.rollout.paths import Rollout, Trajectory
from arpo_trl.rollout.tool_calls import CallFormat, ToolCall
from arpo_trl.tools.base import Tool
from arpo_trl.tools.training_thread import runs_here


@dataclass
class GenerateRequest:
    """Continue `path` (prompt + completion so far) by at most `max_new_tokens` tokens.

    A probe (the k tokens after a tool result) sets `continues_to`, its path's whole room: an engine that can
    (`agenerate_continuing`) answers after the k tokens and decodes the segment on in the same request, which then
    answers the path's next request (the rest of the segment) without a new one."""

    path: Trajectory
    max_new_tokens: int
    continues_to: int | None = None
    entropy_tokens: int | None = None  # leading tokens whose entropies the sampler reads (None: all)


@dataclass
class CallRequest:
    """Run a parsed tool call; a malformed call (`call.error`) is answered with None, never run."""

    path: Trajectory
    call: ToolCall


@dataclass
class CommitRequest:
    """Resume `path` once it is committed (a branch started before its parent's fork decision); a dropped path's
    program is closed instead."""

    path: Trajectory


PathRequest = GenerateRequest | CallRequest | CommitRequest


Program = Generator[Any, Any, None]


class Sampler(Protocol):
    """What a scheduler drives: `arpo_trl.rollout.BranchingSampler` (named here, not imported: the sampler imports
    the schedulers)."""

    engine: Any
    tools: list[Tool]
    call_format: CallFormat
    max_completion_length: int
    max_tool_workers: int
    tool_timeout: float

    def grow(self, rollout: Rollout, path: Trajectory) -> Program:
        """One path's program: yields `PathRequest`s, receives their results."""


def bind(call: ToolCall) -> tuple[Callable[[], object], bool]:
    """The call, and whether it runs on the rollout's own thread (`ToolRunner.submit`'s `here`)."""
    return (lambda: call.tool(call.content)), runs_here(call.tool)


def path_context(paths: list[Trajectory]) -> str:
    """The note a path's failure carries: which paths were running, where (a rollout runs many in parallel)."""
    described = ", ".join(f"{path.id} (group {path.group}, {path.kind}, {len(path.completion_ids)} completion tokens, "
                          f"{path.tool_calls} tool calls)" for path in paths[:4])
    more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    return f"in ARPO path{'s' if len(paths) > 1 else ''} {described}{more}"


def interrupt_tools(sampler: Sampler) -> None:
    """A cancelled rollout stops the tool calls still running (e.g. kills PythonTool's processes)."""
    for tool in sampler.tools:
        with contextlib.suppress(Exception):
            tool.interrupt()
