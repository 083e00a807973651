"""Plain Python functions as tools, as `GRPOTrainer(tools=[multiply])` takes them: sync or async callables with type
hints and a Google-style docstring. The JSON schema comes from transformers' `get_json_schema` (TRL and the chat
templates use the same helper), so a function renders in the prompt exactly as under `GRPOTrainer`.

A `FunctionTool` is an ordinary `Tool` to the sampler: a sync function runs on the training thread, one call at a time,
as `GRPOTrainer` calls it (`thread_safe=False`; `signal.alarm`, thread-local state and clients that are not thread-safe
work as there); an async one on the tool runner's worker threads, its coroutine on the one event loop of all async
calls, as TRL runs them. Each call has `tool_timeout`; its result is appended with loss mask 0, and the sampler may
fork after it. A malformed call (an unknown or missing argument, arguments that are not a JSON object) is answered
with an error message as the result and counted as a failed call, as TRL does; it never stops training.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from arpo_trl.tools.base import Tool


class FunctionTool(Tool):
    """A function called by name with keyword arguments. With `tool_call_format='chat_template'` the model writes
    `{"name": "multiply", "arguments": {"a": 3, "b": 4}}`; with tags, `<multiply>{"a": 3, "b": 4}</multiply>` (a
    function of one parameter also takes the bare text: `<shout>hello</shout>`)."""

    def __init__(self, fn: Callable[..., Any]):
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            schema = get_json_schema(fn)
        except (DocstringParsingException, TypeHintParsingException) as exc:
            raise ValueError(f"Tool function {name!r}: {exc} (TRL's tools need type hints and a Google-style "
                             f"docstring, https://huggingface.co/docs/transformers/en/chat_extras#passing-tools).") \
                from exc
        super().__init__(schema["function"]["name"])
        self.fn = fn
        self._schema = schema
        self.thread_safe = is_async_callable(fn)  # TRL: sync tools on the training thread, async ones on a loop thread
        self._signature = inspect.signature(fn)
        self._parameters = list(schema["function"]["parameters"].get("properties", {}))

    def schema(self) -> dict[str, Any]:
        return self._schema

    def arguments_to_content(self, arguments: Mapping[str, Any]) -> str:
        """The arguments as a JSON object, after checking them against the signature (ValueError names the fault)."""
        self._bind(arguments)
        return json.dumps(dict(arguments))

    def __call__(self, content: str) -> str:
        arguments = self.arguments(content)
        self._bind(arguments)
        result = self.fn(**arguments)
        if inspect.isawaitable(result):  # as TRL: every async call on one event loop, which lives as long as we do
            result = asyncio.run_coroutine_threadsafe(_await(result), _async_tool_loop()).result()
        return result if isinstance(result, str) else str(result)  # TRL appends `str(result)` too

    def arguments(self, content: str) -> dict[str, Any]:
        """The keyword arguments a call's content holds (ValueError if it holds none)."""
        try:
            arguments = json.loads(content)
        except (ValueError, RecursionError):
            arguments = None
        if isinstance(arguments, dict):
            return arguments
        if len(self._parameters) == 1:  # tag calls of a one-parameter function may pass the bare text
            return {self._parameters[0]: content}
        raise ValueError(f"the arguments must be a JSON object with the keys {self._parameters}, got "
                         f"{content[:200]!r}.")

    def _bind(self, arguments: Mapping[str, Any]) -> None:
        takes_any = any(p.kind is p.VAR_KEYWORD for p in self._signature.parameters.values())
        unknown = [name for name in arguments if name not in self._signature.parameters]
        if unknown and not takes_any:
            raise ValueError(f"got an unexpected keyword argument {unknown[0]!r}; {self.tag} takes {self._parameters}.")
        try:
            self._signature.bind(**arguments)
        except TypeError as exc:
            raise ValueError(f"{exc}; {self.tag} takes {self._parameters}.") from None

    def __repr__(self) -> str:
        return f"FunctionTool({self.tag!r})"


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _async_tool_loop() -> asyncio.AbstractEventLoop:
    """The event loop async tools run on, in a daemon thread of its own (TRL's `GRPOTrainer-AsyncLoop`): a client
    an async tool opens once (an HTTP session) is bound to it and stays usable across calls and steps."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="arpo-async-tools", daemon=True).start()
        return _LOOP


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose `__call__` is one (TRL's `is_async_callable`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _await(awaitable):
    return await awaitable


def as_tools(tools: Sequence[Tool | Callable[..., Any]]) -> list[Tool]:
    """What `ARPOTrainer(tools=…)` accepts, as `Tool`s: our `Tool` instances as they are, plain functions (sync or
    async, what `GRPOTrainer(tools=…)` takes) wrapped in a `FunctionTool`."""
    out = []
    for tool in tools:
        if isinstance(tool, Tool):
            out.append(tool)
        elif callable(tool):
            out.append(FunctionTool(tool))
        else:
            raise TypeError(f"tools: expected arpo_trl.Tool instances or functions (sync or async, as GRPOTrainer "
                            f"takes), got {type(tool).__name__}.")
    return out


def has_function_tools(tools: Sequence[Tool]) -> bool:
    return any(isinstance(tool, FunctionTool) for tool in tools)
