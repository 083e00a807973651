"""A tool that fails every call is reported, and a run where it keeps failing stops.

A failed call is the model's observation, never the trainer's error (a tool's exception becomes its result, as under
`GRPOTrainer`). But when every call of a tool fails, the cause is rarely the model: the tool cannot run where it runs
(a missing dependency, a service down, a sandbox that cannot start). The model then never sees a real result and
training goes on, learning from error messages. So, per training step, a tool whose calls all failed is reported
once per run (its name, the first error with its traceback, and a line that reproduces the call outside training);
after `patience` such steps in a row, training stops with that error (`patience=0`: never).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from arpo_trl.tools.base import Tool
from arpo_trl.tools.functions import FunctionTool

logger = logging.getLogger(__name__)
PATIENCE_FIELD = "max_failed_tool_steps"  # the ARPOConfig field that sets `patience` (its default lives there)


@dataclass
class ToolTally:
    """One tool's calls in a rollout that ran (a malformed call is the model's fault, not the tool's): what
    this module reports when they all failed. Strings only: server mode broadcasts the stats."""

    calls: int = 0
    failures: int = 0
    first_error: str = ""  # the first failed call's result, as the model read it
    first_arguments: str = ""  # what that call ran on (the tag's content, or the JSON arguments)
    traceback: str = ""  # where it raised, when it raised


class ToolFailingError(RuntimeError):
    """A tool failed every call in `patience` training steps in a row."""


class ToolFailureWatch:
    """Fed each training step's per-tool tallies (`RolloutStats.tools`)."""

    def __init__(self, tools: Sequence[Tool], patience: int):
        if patience < 0:
            raise ValueError(f"{PATIENCE_FIELD} must be >= 0 (0: never stop), got {patience}.")
        self.tools = {tool.tag: tool for tool in tools}
        self.patience = patience
        self.streaks: dict[str, int] = {}
        self.reported: set[str] = set()

    def observe(self, tallies: Mapping[str, ToolTally]) -> None:
        """Count the step; report a tool the first time all its calls failed; raise `ToolFailingError` once a tool
        has failed every call for `patience` steps in a row. A step without calls of a tool changes nothing."""
        for name, tally in tallies.items():
            if not tally.calls:
                continue
            if tally.failures < tally.calls:
                self.streaks[name] = 0
                continue
            streak = self.streaks[name] = self.streaks.get(name, 0) + 1
            if self.patience and streak >= self.patience:
                raise ToolFailingError(self.describe(name, tally, f"in each of the last {streak} training steps") +
                                       f" Training stopped; set ARPOConfig({PATIENCE_FIELD}=0) to train on anyway.")
            if name not in self.reported:
                self.reported.add(name)
                until = (f"training stops if it fails every call for {self.patience} steps in a row "
                         f"(ARPOConfig.{PATIENCE_FIELD}; 0: never)") if self.patience else "training goes on"
                logger.warning("%s This is reported once; %s.%s", self.describe(name, tally, "in this step"), until,
                               f"\n{tally.traceback}" if tally.traceback else "")

    def describe(self, name: str, tally: ToolTally, when: str) -> str:
        how = reproduce(self.tools.get(name), name, tally.first_arguments)
        return (f"ARPO: every call of the tool {name!r} failed {when} ({tally.failures} of {tally.calls} in the last "
                f"one), so the model never saw one of its results. The first error, as the model read it: "
                f"{tally.first_error!r}. To reproduce it outside training: {how}.")


def reproduce(tool: Tool | None, name: str, content: str) -> str:
    """A line that makes the failed call outside training."""
    if not isinstance(tool, FunctionTool):
        return f"call the {name!r} tool (`{tool!r}`) on {content!r}"
    try:
        arguments = tool.arguments(content)
    except ValueError:
        return f"call {name}(...) with {content!r}"
    call = f"(**{json.dumps(arguments)})" if arguments else "()"
    owner = getattr(tool.fn, "__self__", None)
    if owner is not None:  # an environment's method: on an environment reset as the step's example resets it
        return f"{type(owner).__name__}().reset(**example); then .{name}{call}"
    module = getattr(tool.fn, "__module__", None)
    function = getattr(tool.fn, "__qualname__", name)
    return f"from {module} import {function.split('.')[0]}; {function}{call}" if module else f"{function}{call}"
