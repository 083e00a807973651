"""What a path's program asks its runtime for (`arpo.BranchingRule.grow` yields these, and receives a `Segment` or a
`CallOutcome` back): the rule's side of the contract with whoever runs it."""

from __future__ import annotations

from dataclasses import dataclass

from arpo_trl.rollout.paths import Trajectory
from arpo_trl.rollout.tool_calls import ToolCall


@dataclass
class GenerateRequest:
    """Continue `path` (prompt + completion so far) by at most `max_new_tokens` tokens.

    A probe (the k tokens after a tool result) sets `continues_to`, its path's whole room: a runtime whose engine can
    may answer after the k tokens and decode the segment on in the same engine request, which then answers the
    path's next request (the rest of the segment) without a new one."""

    path: Trajectory
    max_new_tokens: int
    continues_to: int | None = None
    entropy_tokens: int | None = None  # leading tokens whose entropies the rule reads (None: all)


@dataclass
class CallRequest:
    """Run a parsed tool call; a malformed call (`call.error`) is answered with None, never run."""

    path: Trajectory
    call: ToolCall


PathRequest = GenerateRequest | CallRequest
