"""Tool-call formats: how the model writes a call, the stop strings that end a segment there, and the text the
environment appends after the call (loss mask 0).

* `TagFormat` (default): `<tag>content</tag>`, answered with ` <result>\\n…\\n</result>` (the ARPO reference's format).
* `ChatTemplateFormat`: the tokenizer's own function calling, Hermes-style by default (Qwen2.5, Qwen3):
  the prompt lists the tools' JSON schemas as rendered by the chat template, the model writes
  `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, and the result is appended exactly as the template
  renders a `{"role": "tool", "content": result}` message followed by the next assistant generation prompt.

A malformed call (invalid JSON, unknown tool, missing argument) is answered with an error message as the tool's
result, as a failing tool is: the model sees its mistake, the trainer never crashes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from arpo_trl.tools.base import Tool, ToolEnvironmentError, format_result
from arpo_trl.tools.environments import EnvironmentMethodTool
from arpo_trl.tools.functions import has_function_tools
from arpo_trl.tools.runner import CallOutcome
from arpo_trl.tools.tags import call_start, extract_call

TOOL_CALL_FORMATS = ("auto", "tags", "chat_template")
_SENTINEL = "ARPO_TOOL_RESULT_7f3a"
# Besides JSONDecodeError (a ValueError), json.loads raises a plain ValueError for integers over 4300 digits and
# RecursionError for deeply nested arrays/objects: all are the model's malformed calls, never the trainer's crash.
_JSON_ERRORS = (ValueError, RecursionError)


@dataclass
class ToolCall:
    """A parsed call: the tool and the string it runs on, or, for a malformed call, the `error` text that is
    appended as its result (a failed call)."""

    tool: Tool | None
    content: str = ""
    error: str | None = None
    start: int = 0  # where the call (its open marker) begins in the segment's text


class CallFormat(Protocol):
    stop_strings: list[str]

    def parse(self, text: str, stop: str) -> ToolCall | None:
        """The call in a segment's `text`, which ends with the stop string `stop`; `None` for an empty call
        (the path ends, as in the reference)."""

    def render_result(self, text: str, call: ToolCall) -> str:
        """What the environment appends after `call` returned `text`."""

    def unclosed_call(self, text: str) -> str | None:
        """For a path's last segment (it ended without a stop string): the tool of a call it opened and never
        closed ("" when the call names no tool yet), or None."""


class TagFormat:
    """`<tag>content</tag>` → ` <result>\\n…\\n</result>`."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = {tool.close_tag: tool for tool in tools}
        self.stop_strings = list(self.tools)

    def parse(self, text: str, stop: str) -> ToolCall | None:
        content = extract_call(text, stop)
        return ToolCall(self.tools[stop], content, start=call_start(text, stop)) if content else None

    def render_result(self, text: str, call: ToolCall) -> str:
        return format_result(text)

    def unclosed_call(self, text: str) -> str | None:
        return next((tool.tag for close, tool in self.tools.items()
                     if text.rfind("<" + close[2:]) > text.rfind(close)), None)


class ChatTemplateFormat:
    """Function calling through `tokenizer`'s chat template: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
    (the markers are configurable). Raises a ValueError at construction when the template cannot serve it: no
    template, `tools` ignored, markers that decoding drops, or tool messages / calls it does not render."""

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], open_marker: str = "<tool_call>",
                 close_marker: str = "</tool_call>", chat_template_kwargs: Mapping[str, Any] | None = None):
        if not open_marker or not close_marker:
            raise ValueError("ChatTemplateFormat needs non-empty open and close markers, e.g. '<tool_call>'.")
        self.tokenizer = tokenizer
        self.tools = {tool.tag: tool for tool in tools}
        self.schemas = [tool.schema() for tool in tools]
        self.open_marker = open_marker
        self.close_marker = close_marker
        self.stop_strings = [close_marker]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._anchors: dict[str, tuple[list[dict], str, str]] = {}
        self._check_template()

    # ---- prompts ------------------------------------------------------------------------------------------
    def prompt_ids(self, conversations: Sequence[Sequence[Mapping[str, Any]]],
                   schemas: Sequence[list[dict]] | None = None) -> list[list[int]]:
        """Token ids of each conversation with the tool schemas (all tools', or `schemas[i]` for conversation i) and
        the assistant generation prompt."""
        if conversations and isinstance(conversations[0], str):
            raise ValueError("tool_call_format='chat_template' renders the tools through the chat template, so the "
                             "prompts must be conversations (lists of {'role', 'content'} messages), not strings.")
        return [
            list(self.tokenizer.apply_chat_template(
                list(c), tools=(self.schemas if schemas is None else schemas[i]) or None, add_generation_prompt=True,
                tokenize=True, return_dict=True, **self.chat_template_kwargs,
            )["input_ids"])
            for i, c in enumerate(conversations)
        ]

    # ---- calls --------------------------------------------------------------------------------------------
    def parse(self, text: str, stop: str) -> ToolCall | None:
        end = text.find(self.close_marker)
        start = text.rfind(self.open_marker, 0, max(end, 0))
        if end < 0 or start < 0:
            return None
        body = text[start + len(self.open_marker) : end].strip()
        return replace(self._parse_json(body), start=start) if body else None

    def _parse_json(self, body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except _JSON_ERRORS as exc:
            return ToolCall(None, error=f"Error: the tool call is not valid JSON ({exc}): {body[:200]}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, error='Error: a tool call must be a JSON object {"name": <tool name>, '
                                        '"arguments": {...}}.')
        tool = self.tools.get(call["name"])
        if tool is None:
            return ToolCall(None, error=f"Error: unknown tool {call['name'][:100]!r}; the tools are: "
                                        f"{', '.join(self.tools) or 'none'}.")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI-style: the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except _JSON_ERRORS:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(tool, error=f"Error: Tool({tool.tag}) arguments must be a JSON object, "
                                        f"got {type(arguments).__name__}.")
        try:
            return ToolCall(tool, tool.arguments_to_content(arguments))
        except ValueError as exc:
            return ToolCall(tool, error=f"Error: Tool({tool.tag}) call is invalid: {exc}")

    def unclosed_call(self, text: str) -> str | None:
        return "" if text.rfind(self.open_marker) > text.rfind(self.close_marker) else None

    def render_result(self, text: str, call: ToolCall) -> str:
        """The rendering of `[…, assistant call, {"role": "tool", "content": text}]` + generation prompt, from the
        call's close marker on (so it starts with the template's end of the assistant turn)."""
        messages, head, tail = self._anchor(call.tool.tag if call.tool is not None else next(iter(self.tools), "tool"))
        full = self._render(messages + [{"role": "tool", "content": text}])
        # A template whose earlier turns depend on the tool content: fall back to substituting the probe's text.
        return full[len(head):] if full.startswith(head) else tail.replace(_SENTINEL, text)

    # ---- the template -------------------------------------------------------------------------------------
    def _render(self, messages: list[dict], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **{**self.chat_template_kwargs, **kwargs})

    def _anchor(self, name: str) -> tuple[list[dict], str, str]:
        """For a call of `name`: the conversation up to the call, its rendering (with a probe tool message) up to
        the call's close marker, and the probe's rest."""
        if name not in self._anchors:
            call = {"type": "function", "function": {"name": name, "arguments": {}}}
            messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
            probe = self._render(messages + [{"role": "tool", "content": _SENTINEL}])
            at = probe.find(_SENTINEL)
            if at < 0:
                raise ValueError(f"The chat template of {self._model_name()} does not render tool messages "
                                 f"({{'role': 'tool'}}); use tool_call_format='tags'.")
            end = probe.rfind(self.close_marker, 0, at)
            if end < 0:
                raise ValueError(f"The chat template of {self._model_name()} does not write assistant tool calls "
                                 f"ending with {self.close_marker!r}; set the tool-call markers to the template's "
                                 f"(tool_call_open / tool_call_close) or use tool_call_format='tags'.")
            end += len(self.close_marker)
            self._anchors[name] = (messages, probe[:end], probe[end:])
        return self._anchors[name]

    def _check_template(self) -> None:
        model = self._model_name()
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"The tokenizer of {model} has no chat template; tool_call_format='chat_template' needs "
                             f"one that renders tools. Use tool_call_format='tags'.")
        for marker in (self.open_marker, self.close_marker):
            ids = self.tokenizer.encode(marker, add_special_tokens=False)
            if marker not in self.tokenizer.decode(ids, skip_special_tokens=True):
                raise ValueError(f"The tool-call marker {marker!r} does not survive decoding with the tokenizer of "
                                 f"{model} (a special token?), so the sampler cannot find calls.")
        if not self.tools:
            return
        user = [{"role": "user", "content": "Hi"}]
        if self._render(user, tools=self.schemas) == self._render(user):
            raise ValueError(f"The chat template of {model} ignores `tools` (it renders the same prompt with and "
                             f"without tool schemas), so the model would never learn the tools exist. Use "
                             f"tool_call_format='tags', or a tokenizer whose template supports tools.")
        self._anchor(next(iter(self.tools)))

    def _model_name(self) -> str:
        return repr(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__)


def make_call_format(name: str, tokenizer: Any, tools: Sequence[Tool], open_marker: str = "<tool_call>",
                     close_marker: str = "</tool_call>",
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> CallFormat:
    """The format named by `ARPOConfig.tool_call_format`; 'auto' is the chat template's function calling when a tool
    is a plain function (as under `GRPOTrainer(tools=…)`), else tags."""
    check_call_format(name)
    if name == "auto":
        name = "chat_template" if has_function_tools(tools) else "tags"
    if name == "tags":
        return TagFormat(tools)
    return ChatTemplateFormat(tokenizer, tools, open_marker, close_marker, chat_template_kwargs)


def check_call_format(name: str) -> None:
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_format must be one of {TOOL_CALL_FORMATS}, got {name!r}: 'tags' for "
                         f"<tag>…</tag> calls, 'chat_template' for the tokenizer's own function calling, 'auto' for "
                         f"the latter when a tool is a plain function.")


def observation(call: ToolCall, outcome: CallOutcome | None, timeout: float) -> tuple[str, bool]:
    """The result text the model reads for a call, and whether the call failed; a malformed call's error is its
    result. A tool that cannot run at all (`ToolEnvironmentError`) is the trainer's error, not an observation."""
    if outcome is None:
        return call.error, True
    tag, text = call.tool.tag, outcome.value
    if outcome.timed_out:
        return f"Error: Tool({tag}) timed out after {timeout:g} s.", True
    if isinstance(outcome.error, ToolEnvironmentError):
        raise RuntimeError(f"Tool({tag}) cannot run: {outcome.error}") from outcome.error
    if outcome.error is not None:  # a tool's failure is the model's observation, never the trainer's crash
        exc = outcome.error
        return f"Error: Tool({tag}) execution failed with message: {type(exc).__name__}: {exc}", True
    if not isinstance(text, str):
        return f"Error: Tool({tag}) returned {type(text).__name__}, not str.", True
    return text, False


def bind_call(call: ToolCall, environment: Any) -> ToolCall:
    """`call` as the path owning `environment` makes it: an environment's tool runs on that path's own environment; a
    call it cannot bind is answered with the reason, as a malformed call is."""
    if environment is None or not isinstance(call.tool, EnvironmentMethodTool) or call.error is not None:
        return call
    try:
        return replace(call, tool=call.tool.bound(environment))
    except ValueError as exc:
        return replace(call, error=f"Error: {exc}")
