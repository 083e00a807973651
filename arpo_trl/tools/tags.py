"""Tool-tag handling on generated tokens: find where a closing tag completes, cut the token ids there
(also when the tag ends inside a token), and extract the call's content."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

Decode = Callable[[Sequence[int]], str]


def first_stop(token_ids: Sequence[int], decode: Decode, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """Smallest `j` such that `decode(token_ids[:j])` contains a stop string, and the earliest such string.

    Binary search: a longer prefix never loses a stop string it already contains (tags are ASCII, so an
    incomplete multi-byte character at the cut cannot create or destroy one)."""
    if not stop_strings or not any(s in decode(token_ids) for s in stop_strings):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(token_ids[:mid]) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    text = decode(token_ids[:lo])
    return lo, min((text.find(s) + len(s), s) for s in stop_strings if s in text)[1]


def cut_at_stop(
    token_ids: Sequence[int], decode: Decode, encode: Callable[[str], list[int]], stop_strings: Sequence[str]
) -> tuple[list[int], list[int], str] | None:
    """Cut generated ids right after the first stop string.

    Returns `(kept, rewritten, tag)`: `kept` are the model's own tokens up to the tag; when the tag ends
    inside a token (e.g. a `>\\n` token), that token is dropped and the rest of the tag is re-encoded as
    `rewritten`, so that `decode(kept + rewritten)` ends exactly at the tag. Where that cannot be done (the
    token also completes a character begun before it, or the tail re-encodes differently on its own, as
    SentencePiece's `▁` prefix makes `>` decode as ` >`), the token is kept whole: `decode(kept)` then runs
    past the tag. `None` if no stop string."""
    found = first_stop(token_ids, decode, stop_strings)
    if found is None:
        return None
    j, tag = found
    text = decode(token_ids[:j])
    end = text.find(tag) + len(tag)
    if end == len(text):
        return list(token_ids[:j]), [], tag
    head = decode(token_ids[: j - 1])
    if text.startswith(head) and len(head) <= end:
        kept, rewritten = list(token_ids[: j - 1]), encode(text[len(head) : end])
        if decode(kept + rewritten) == text[:end]:
            return kept, rewritten, tag
    return list(token_ids[:j]), [], tag


def call_start(segment_text: str, close_tag: str) -> int:
    """Where the call that `close_tag` closes begins: its last opening tag before the first `close_tag` (the
    reference uses `rindex`, so `<python><python>x</python>` calls `x`); -1 when there is none."""
    end = segment_text.find(close_tag)
    return -1 if end < 0 else segment_text.rfind("<" + close_tag[2:], 0, end)


def extract_call(segment_text: str, close_tag: str) -> str:
    """Content between the call's opening tag (`call_start`) and `close_tag`; empty when the segment has no
    opening tag."""
    start = call_start(segment_text, close_tag)
    if start < 0:
        return ""
    return segment_text[start + len(close_tag) - 1 : segment_text.find(close_tag)].strip()


# ---- the reference's text checks, for callers that have only the text (no sampler records) --------------------
def unanswered_tag_call(text: str, tags: Sequence[str]) -> str | None:
    """The reference reward's check: every `<tag>` call is closed and followed by its result, in order. `None` when
    it holds, else the reason."""
    for tag in tags:
        pattern = re.compile(rf"<{tag}>|</{tag}>|<result>|</result>")
        expected = [f"<{tag}>", f"</{tag}>", "<result>", "</result>"]
        sequence = [m.group() for m in pattern.finditer(text) if m.group() in expected]
        calls = [i for i, token in enumerate(sequence) if token == f"<{tag}>"]
        for i in calls:
            if sequence[i : i + 4] != expected:
                return f"<{tag}> call not followed by </{tag}><result></result>"
    return None


# ---- the model's own text: what rewards and evaluation read -------------------------------------------------------
RESULT_MARKERS = ("<result>", "</result>")


class OwnText(NamedTuple):
    """What the model wrote of a completion that rewards and evaluation score: its text outside the tool calls (a
    call's content is the tool's input: code that prints an answer is no answer) and outside the environment's tool
    results.

    `tools`: the tool of each answered call, in order. `error` is set when that text holds a result marker
    (`<result>` or `</result>`): the markers are the environment's, so a model that writes one gets no answer read
    (the reward's format check fails) instead of hiding its text behind one or passing a tool's text off as its
    own."""

    text: str
    tools: tuple[str, ...] = ()
    error: str | None = None


def as_own_text(text: str, tools: Sequence[str] = ()) -> OwnText:
    """`text` as the model's own text (already without tool calls and results), checked for result markers."""
    marker = next((m for m in RESULT_MARKERS if m in text), None)
    error = None if marker is None else (f"{marker} outside the environment's result blocks (written by the model, or "
                                         "a tool output that closed its block early)")
    return OwnText(text, tuple(tools), error)


def own_text_from_ids(completion_ids: Sequence[int], calls: Sequence, decode: Decode) -> OwnText:
    """The model's text from the sampler's records (`ToolCallRecord`s or their dicts): the completion decoded outside
    every recorded result span (`result_start`/`result_end`, token offsets), less each call's last `call_chars`
    characters before its result (the call as the model wrote it, in any call format)."""
    answered = sorted((_field(c, "result_start"), _field(c, "result_end"), _field(c, "call_chars") or 0,
                       _field(c, "tool") or "") for c in calls if _field(c, "result_start") is not None)
    pieces, position = [], 0
    for start, end, call_chars, _ in answered:
        if start < position or end is None or end < start:
            raise ValueError(f"call records: result span [{start}, {end}) overlaps another or is reversed; expected "
                             "ordered, disjoint token offsets of the completion.")
        piece = decode(completion_ids[position:start])
        pieces.append(piece[: max(len(piece) - call_chars, 0)])
        position = end
    pieces.append(decode(completion_ids[position:]))
    return as_own_text("".join(pieces), [tool for *_, tool in answered])


def _field(call, name: str):
    return call.get(name) if isinstance(call, dict) else getattr(call, name, None)


def own_text_from_markers(text: str, tags: Sequence[str] = ("search", "python")) -> OwnText:
    """The model's text when only the text is known (no call records), in the tag format: a result block is the
    environment's ` <result>\\n…\\n</result>` right after a call `<tag>…</tag>` the model wrote (the sampler stops at
    `</tag>`, so the model cannot write the block itself), up to the first `\\n</result>`; a block the length budget
    cut runs to the end. The call and its block are dropped. Tool output that writes `</result>` early leaves the real
    closing marker (or a bogus block) in the model's text: an error, never a forged answer or call. Linear."""
    if not tags:
        return as_own_text(text)
    names = "|".join(re.escape(tag) for tag in tags)
    opener = re.compile(f"</(?P<tag>{names})>" + re.escape(" <result>\n"))
    pieces, tools, position = [], [], 0
    while (match := opener.search(text, position)) is not None:
        tag = match["tag"]
        call = text.rfind(f"<{tag}>", position, match.start())
        if call < 0:  # no call of the model's before it: the marker stays in its text, an error
            break
        pieces.append(text[position:call])
        tools.append(tag)
        end = text.find("\n</result>", match.end() - 1)
        position = len(text) if end < 0 else end + len("\n</result>")
    pieces.append(text[position:])
    return as_own_text("".join(pieces), tools)
