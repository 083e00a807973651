"""A tool is a tag plus a callable `str -> str`: the model writes `<tag>content</tag>`, the sampler
stops at `</tag>`, calls the tool on `content` and appends ` <result>\\n…\\n</result>` as context."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any


class ToolEnvironmentError(RuntimeError):
    """The tool's machinery failed, not the call (e.g. its sandbox cannot start). The sampler raises it instead of
    showing it to the model: a run whose every call fails this way would otherwise train on garbage silently."""


class Tool:
    """A tag tool. Subclass and override `__call__`, or pass `fn`::

        calculator = Tool("calc", lambda expr: str(eval(expr, {"__builtins__": {}})))

    `thread_safe`: calls run on the tool runner's worker threads, several at once, each under `tool_timeout`. A tool
    that must run on the training thread (it uses `signal`, thread-local state or a client that is not thread-safe)
    sets it False: its calls then run there, one at a time, as `GRPOTrainer` runs sync functions (plain sync
    functions passed as tools get False, `FunctionTool`).
    """

    thread_safe: bool = True

    def __init__(self, tag: str, fn: Callable[[str], str] | None = None):
        if not tag or not tag.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"Tool tag must be a non-empty alphanumeric name (e.g. 'python'), got {tag!r}.")
        if tag == "result":
            raise ValueError("Tool tag 'result' is reserved for the inserted tool output.")
        self.tag = tag
        self._fn = fn

    @property
    def close_tag(self) -> str:
        return f"</{self.tag}>"

    def schema(self) -> dict[str, Any]:
        """JSON schema for chat-template function calling (`tool_call_format='chat_template'`): the tag as the name,
        one required string argument. Subclasses override it with their own description and arguments."""
        doc = inspect.getdoc(self._fn) if inspect.isfunction(self._fn) else None
        description = doc.split("\n\n")[0] if doc else f"The {self.tag} tool: takes a text input, returns text."
        return function_schema(self.tag, description, {"input": "The text the tool runs on."})

    def arguments_to_content(self, arguments: Mapping[str, Any]) -> str:
        """The string `__call__` takes, from a chat-template call's arguments: by default the schema's first required
        argument. Raises ValueError for a missing required argument."""
        required = self.schema()["function"]["parameters"].get("required", [])
        missing = [name for name in required if name not in arguments]
        if missing:
            raise ValueError(f"missing the required argument {missing[0]!r}.")
        if not required:
            return json.dumps(dict(arguments))
        value = arguments[required[0]]
        return value if isinstance(value, str) else json.dumps(value)

    def interrupt(self) -> None:
        """Stop the calls in progress, if the tool can (a cancelled rollout calls it); by default nothing."""

    def __call__(self, content: str) -> str:
        if self._fn is None:
            raise NotImplementedError(f"{type(self).__name__} needs `fn` or an overridden __call__.")
        return self._fn(content)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag={self.tag!r})"


def format_result(text: str) -> str:
    """The reference's result block (VRT L422): a leading space, the output on its own lines."""
    return f" <result>\n{text}\n</result>"


def function_schema(name: str, description: str, properties: Mapping[str, str],
                    required: list[str] | None = None) -> dict[str, Any]:
    """An OpenAI-style function schema with string arguments (`properties`: name → description), all required
    unless `required` says otherwise."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": list(properties) if required is None else required,
            },
        },
    }
