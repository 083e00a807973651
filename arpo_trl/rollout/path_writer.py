"""What a path's program writes into its path (`arpo.BranchingRule.grow`): the tokens an engine generated,
cut at the tool call's closing tag (also when the tag ends inside a token, or straddles a probe and its
continuation), the call recorded, its result appended (loss mask 0), and the completion budget enforced. The
rule decides; the writer writes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from arpo_trl.generation.engine import Segment
from arpo_trl.rollout.paths import Rollout, ToolCallRecord, Trajectory
from arpo_trl.rollout.tool_calls import CallFormat, ToolCall, observation
from arpo_trl.tools.runner import CallOutcome
from arpo_trl.tools.tags import cut_at_stop

OPEN = object()  # `absorb`: the probe stopped at k tokens inside a segment, which goes on


class PathWriter:
    """Writes into the paths of one rule's rollouts, under its limits (`max_completion_length`, `max_tool_calls`,
    `tool_timeout`) and call format."""

    def __init__(self, tokenizer, call_format: CallFormat, eos_token_id: int, max_completion_length: int,
                 max_tool_calls: int, tool_timeout: float):
        self.tokenizer = tokenizer
        self.call_format = call_format
        self.eos_token_id = eos_token_id
        self.max_completion_length = max_completion_length
        self.max_tool_calls = max_tool_calls
        self.tool_timeout = tool_timeout
        self._max_token_chars: int | None = None

    def append(self, path: Trajectory, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None,
               entropies: Sequence[float] | None = None) -> None:
        path.completion_ids += ids
        path.mask += [mask] * len(ids)
        path.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        path.entropies += list(entropies) if entropies is not None else [math.nan] * len(ids)

    def absorb(self, rollout: Rollout, path: Trajectory, seg: Segment, continued: bool, may_continue: bool):
        """Append generated tokens to the open segment; return the tool call it ends with, `OPEN` if our token cap
        (a probe's k) stopped it, or None once the path is finished. A continued segment is searched as a whole: a tag
        may straddle the probe and its continuation, which the engine (seeing only new text) cannot stop at."""
        start = path.growth.segment_start
        self.append(path, seg.token_ids, 1, seg.logprobs, seg.entropies)
        stops = self.call_format.stop_strings
        found = seg.finish_reason == "stop" or continued
        cut = cut_at_stop(path.completion_ids[start:], self.decode, self.encode, stops) if found else None
        if cut is None and may_continue and seg.finish_reason == "length":
            return OPEN
        if cut is None:
            unclosed = self.call_format.unclosed_call(self.decode(path.completion_ids[start:]))
            if unclosed is not None:  # a call the environment never saw: a format error, as in the reference
                path.calls.append(ToolCallRecord(unclosed, ran=False))
            return self.finish(path, "eos" if seg.finish_reason == "eos" else "length")
        kept, rewritten, stop = cut
        path.cut(start + len(kept))  # what the engine generated past the tag is dropped
        self.append(path, rewritten, 0)
        text = self.decode(path.completion_ids[start:])
        call = self.call_format.parse(text, stop)
        ends = self.not_run_because(path, call)
        path.calls.append(ToolCallRecord(
            call.tool.tag if call and call.tool else "", call.content if call else "",
            len(text) - call.start if call else 0, ran=ends is None))
        if ends == "call_limit":
            self.append(path, [self.eos_token_id], 0)  # reference: EOS after the call limit (VRT L350)
        return call if ends is None else self.finish(path, ends)

    def not_run_because(self, path: Trajectory, call: ToolCall | None) -> str | None:
        """Why a call just written ends its path instead of running (its finish reason), or None."""
        if path.tool_calls >= self.max_tool_calls:
            return "call_limit"
        if call is None:
            return "empty_call"  # reference: an empty call silently ends the path
        return "length" if len(path.completion_ids) >= self.max_completion_length else None

    def finish(self, path: Trajectory, reason: str) -> None:
        path.finish_reason = reason
        self.truncate(path)

    def truncate(self, path: Trajectory) -> None:
        """Enforce the completion budget: cut what overshoots; a path with no room left is finished."""
        limit = self.max_completion_length
        over = len(path.completion_ids) > limit
        if over:
            path.cut(limit)
        if over or (path.active and len(path.completion_ids) >= limit):
            path.finish_reason = "length"

    def append_result(self, rollout: Rollout, path: Trajectory, call: ToolCall, outcome: CallOutcome | None):
        text, failed = observation(call, outcome, self.tool_timeout)
        rollout.stats.count_call(call, outcome, text, failed)
        room = self.max_completion_length - len(path.completion_ids)
        text = text[: (room + 16) * self.longest_token()]  # a huge output: encode no more than can fit
        start = len(path.completion_ids)
        self.append(path, self.encode(self.call_format.render_result(text, call)), 0)
        path.calls[-1] = replace(path.calls[-1], result_start=start, result_end=len(path.completion_ids),
                                 failed=failed, seconds=outcome.seconds if outcome else 0.0)
        path.growth.segment_start = len(path.completion_ids)
        self.truncate(path)

    def longest_token(self) -> int:
        """Characters in the vocabulary's longest token (an upper bound on characters per token)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_chars = max(map(len, vocab), default=64) + 4
        return self._max_token_chars

    def decode(self, ids: Sequence[int]) -> str:
        # transformers' `decode` is `_decode` after checking every id's type in Python, which costs more than the
        # decoding itself; tag cutting decodes each segment several times, so ids (plain ints) go straight through.
        decode = getattr(self.tokenizer, "_decode", None) if isinstance(self.tokenizer, PreTrainedTokenizerBase) \
            else None
        return (decode or self.tokenizer.decode)(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Tokenizers reject lone surrogates, which a tool's str may hold (JSON escapes, surrogateescape).
        return self.tokenizer.encode(text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False)
