"""Hypothesis fuzzing of the tag parser (`arpo_trl.tools.tags`), the tool-call formats (`arpo_trl.rollout.tool_calls`)
and the branching sampler's bookkeeping (`arpo_trl.rollout`), on random tag soup, unicode and token splits.

Tokenizers: the real byte-level BPE of `tiny.py` (canonical encodings glued to raw vocabulary ids, so tags and
multi-byte characters straddle token boundaries), a SentencePiece-style one (`▁` prepended to each encoded text), a
char-level one whose tokens are arbitrary strings and a byte-level one whose tokens are arbitrary byte chunks
(incomplete UTF-8 at every cut). The sampler runs on a scripted engine whose segments are drawn tag soup, with plain
`Tool`s that echo, return empty / huge / unicode / non-str outputs, raise, or miss the deadline.

Run with `--hypothesis-show-statistics` to see how often the sampler tests branch, call tools and hit each finish."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_rollout import CALL, ScriptedEngine, _prompts, _sampler
from tiny import SPECIALS, tool_transcript
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from arpo_trl.generation.engine import EngineTraits, Segment
from arpo_trl.rollout import BRANCH_POLICIES
from arpo_trl.rollout.paths import tree_order
from arpo_trl.rollout.tool_calls import ChatTemplateFormat, TagFormat, ToolCall
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools.base import Tool, format_result
from arpo_trl.tools.tags import cut_at_stop, extract_call, first_stop

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROLLOUTS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TAGS = ["python", "search", "answer"]
TOOL_TAGS = ["python", "search"]  # `answer` stays a plain tag in the sampler tests
TAG_PIECES = [
    "<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>",
    "<tool_call>", "</tool_call>", "<", ">", "</", "/", "python", "search", "</pyth", "on>", ">\n", "\\boxed{7}",
    "print(1)", " ", "\n", "\t", '{"name": "python", "arguments": {"input": "1"}}', "{", "}", '"',
]
UNICODE_PIECES = [
    "é", "e\u0301", "a\u0300\u0301\u0302", "😀", "👩\u200d👩\u200d👧", "🇫🇷", "中文", "ß", "Ω", "\u200b", "\u202e",
    "\ufffd", "\x00", "\U0010ffff", "\u2028", "ﷺ",
]
SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]


def soup(surrogates: bool = False, max_pieces: int = 16) -> st.SearchStrategy[str]:
    """Random tag soup: nested, unclosed, duplicated and split tags mixed with multi-byte text."""
    pieces = [st.sampled_from(TAG_PIECES), st.sampled_from(UNICODE_PIECES), st.text(max_size=5)]
    if surrogates:
        pieces.append(st.sampled_from(SURROGATES))
    return st.lists(st.one_of(pieces), max_size=max_pieces).map("".join)


def _strip_all(text: str, tag: str) -> str:
    while tag in text:  # removing one occurrence can join the halves of another
        text = text.replace(tag, "")
    return text


# ---- toy tokenizers: tokens are arbitrary pieces of text (or bytes) ------------------------------------------------
class PieceTokenizer:
    """`decode` joins the pieces (strings, or bytes decoded as UTF-8 with replacement); `encode` is one token per
    character (per byte). `split` tokenizes a text at the given cuts."""

    def __init__(self, as_bytes: bool):
        self.as_bytes = as_bytes
        self.vocab: list = []
        self.index: dict = {}

    def _id(self, piece) -> int:
        if piece not in self.index:
            self.index[piece] = len(self.vocab)
            self.vocab.append(piece)
        return self.index[piece]

    def split(self, text: str, cuts: Sequence[int]) -> list[int]:
        data = text.encode("utf-8") if self.as_bytes else text
        bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
        return [self._id(data[a:b]) for a, b in zip(bounds, bounds[1:])]

    def decode(self, ids: Sequence[int]) -> str:
        if self.as_bytes:
            return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        if self.as_bytes:
            return [self._id(bytes([b])) for b in text.encode("utf-8")]
        return [self._id(c) for c in text]


def check_cut(ids: Sequence[int], decode, encode, stops: Sequence[str], exact: bool = True) -> None:
    """The documented contract of `first_stop` and `cut_at_stop`. `exact`: the tokenizer re-encodes any text to ids
    that decode back to it after any ids (byte/char level), so only a token that also completes an earlier character
    is kept whole."""
    found = first_stop(ids, decode, stops)
    cut = cut_at_stop(ids, decode, encode, stops)
    if not any(s in decode(ids) for s in stops):
        assert found is None and cut is None
        return
    j, tag = found
    text, head = decode(ids[:j]), decode(ids[: j - 1])
    # the smallest prefix that contains a stop string, and of those in it the one that ends first
    assert 1 <= j <= len(ids) and tag in stops and tag in text
    assert not any(s in head for s in stops)
    end = text.find(tag) + len(tag)
    assert all(text.find(s) + len(s) >= end for s in stops if s in text)
    kept, rewritten, cut_tag = cut
    assert cut_tag == tag
    assert kept == list(ids[: len(kept)])  # the model's own tokens, untouched
    out = decode(kept + rewritten)
    assert out.startswith(text[:end])  # the call is read from the same text, up to the first tag
    if (kept, rewritten) == (list(ids[:j]), []) and out != text[:end]:  # the straddling token kept whole
        assert not exact or not text.startswith(head)
        return
    assert out == text[:end]  # ends exactly at the first tag ...
    assert out.endswith(tag) and not any(s in out[:-1] for s in stops)  # ... which occurs nowhere before
    if end == len(text):
        assert (kept, rewritten) == (list(ids[:j]), [])
    else:  # the tag ends inside token j-1: dropped, the rest of the tag re-encoded
        assert kept == list(ids[: j - 1]) and rewritten == encode(text[len(head) : end]) != []


STOPS = st.lists(st.sampled_from([f"</{t}>" for t in TAGS] + ["</tool_call>", "n>", "\n", "é>", "😀", "ab"]),
                 max_size=3, unique=True)


@FAST
@given(text=soup(surrogates=True), cuts=st.lists(st.integers(0, 400), max_size=12), stops=STOPS)
def test_cut_with_char_level_tokens(text, cuts, stops):
    tok = PieceTokenizer(as_bytes=False)
    check_cut(tok.split(text, cuts), tok.decode, tok.encode, stops)


@FAST
@given(text=soup(), cuts=st.lists(st.integers(0, 400), max_size=12), stops=STOPS)
def test_cut_with_byte_chunk_tokens(text, cuts, stops):
    tok = PieceTokenizer(as_bytes=True)
    check_cut(tok.split(text, cuts), tok.decode, tok.encode, stops)


def bpe_ids(tokenizer) -> st.SearchStrategy[list[int]]:
    """Canonical encodings of soup glued to raw vocabulary ids (single bytes, `>\\n`-like merges, special tokens)."""
    raw = st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=4)
    chunk = st.one_of(soup(max_pieces=6).map(lambda s: tokenizer.encode(s, add_special_tokens=False)), raw)
    return st.lists(chunk, max_size=8).map(lambda chunks: [i for c in chunks for i in c])


@FAST
@given(data=st.data(), stops=STOPS)
def test_cut_with_the_byte_level_bpe(tokenizer, data, stops):
    ids = data.draw(bpe_ids(tokenizer))
    check_cut(ids, lambda i: tokenizer.decode(i, skip_special_tokens=True),
              lambda s: tokenizer.encode(s, add_special_tokens=False), stops)


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer (Llama 2, Mistral v0.1): `▁` marks spaces and is prepended to each encoded
    text, so a tag's tail re-encoded alone (`>` → `▁>`) decodes with a space."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    rng = random.Random(0)
    corpus = [tool_transcript(rng.randint(0, 99), rng.randint(0, 99)) + "\n >\n</search> hello" for _ in range(300)]
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                                 initial_alphabet=sorted(set("".join(TAG_PIECES)))))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@FAST
@given(data=st.data(), stops=STOPS)
def test_cut_with_a_sentencepiece_style_tokenizer(metaspace, data, stops):
    ids = data.draw(bpe_ids(metaspace))
    check_cut(ids, lambda i: metaspace.decode(i, skip_special_tokens=True),
              lambda s: metaspace.encode(s, add_special_tokens=False), stops, exact=False)


def test_a_sentencepiece_tag_tail_is_not_re_encoded_with_a_space(metaspace):
    """Re-encoding `>` alone gives `▁>`, which would turn the call into `<python>1</python >` (no call: the path
    ended silently); the straddling token is kept whole instead."""
    decode = lambda i: metaspace.decode(i, skip_special_tokens=True)  # noqa: E731
    encode = lambda s: metaspace.encode(s, add_special_tokens=False)  # noqa: E731
    straddler = next(i for i in range(len(metaspace)) if decode([i]).startswith(">") and len(decode([i])) > 1)
    ids = encode("<python>1</python") + [straddler]
    kept, rewritten, _ = cut_at_stop(ids, decode, encode, ["</python>"])
    assert (kept, rewritten) == (ids, [])
    assert extract_call(decode(kept + rewritten), "</python>") == "1"


def test_cut_keeps_a_token_that_completes_a_character_whole():
    """The documented exception, pinned: `\\xa9</python>\\n` finishes the `é` begun by the token before."""
    tok = PieceTokenizer(as_bytes=True)
    ids = tok.split("é</python>\n", [1])
    assert cut_at_stop(ids, tok.decode, tok.encode, ["</python>"]) == (ids, [], "</python>")


# ---- extract_call and the formats' parsers ---------------------------------------------------------------------
@FAST
@given(text=soup(surrogates=True), tag=st.sampled_from(TAGS + ["tool_call", "x-y_1"]))
def test_extract_call_on_tag_soup(text, tag):
    open_tag, close = f"<{tag}>", f"</{tag}>"
    content = extract_call(text, close)
    assert content == content.strip() and close not in content and open_tag not in content
    end = text.find(close)
    if end < 0 or open_tag not in text[:end]:
        assert content == ""
    else:
        assert content == text[text.rfind(open_tag, 0, end) + len(open_tag) : end].strip()


@FAST
@given(before=soup(surrogates=True), content=soup(surrogates=True), after=soup(surrogates=True),
       tag=st.sampled_from(TAGS), opens=st.integers(1, 3))
def test_extract_call_is_the_text_between_the_last_opening_and_the_first_closing_tag(before, content, after, tag,
                                                                                        opens):
    open_tag, close = f"<{tag}>", f"</{tag}>"
    before, content = _strip_all(before, close), _strip_all(_strip_all(content, close), open_tag)
    text = before + open_tag * opens + content + close + after
    assert extract_call(text, close) == content.strip()
    fmt = TagFormat([Tool(t, str) for t in TAGS])
    call = fmt.parse(text, close)
    start = len(before) + len(open_tag) * (opens - 1)  # the call begins at its last opening tag
    assert (call is None) if not content.strip() else call == ToolCall(fmt.tools[close], content.strip(), start=start)


@pytest.fixture(scope="module")
def hermes_format(hermes):
    return ChatTemplateFormat(hermes, [Tool("python", str), Tool("search", str)])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | soup(surrogates=True, max_pieces=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
BODIES = st.one_of(
    soup(surrogates=True),
    st.builds(lambda name, args: json.dumps({"name": name, "arguments": args}),
              st.sampled_from(["python", "search", "calc", ""]), JSON),
    st.integers(1, 5000).map(lambda depth: "[" * depth),  # deeper than the recursion limit
    st.integers(1, 5000).map(lambda digits: '{"name": "python", "arguments": {"input": ' + "7" * digits + "}}"),
    JSON.map(json.dumps),
)


@FAST
@given(before=soup(surrogates=True), body=BODIES, after=soup(surrogates=True), opens=st.integers(0, 2))
def test_chat_template_parse_never_raises(hermes_format, before, body, after, opens):
    fmt = hermes_format
    text = before + fmt.open_marker * opens + body + fmt.close_marker + after
    call = fmt.parse(text, fmt.close_marker)
    end = text.find(fmt.close_marker)
    start = text.rfind(fmt.open_marker, 0, end)
    if start < 0 or not text[start + len(fmt.open_marker) : end].strip():
        assert call is None
        return
    assert isinstance(call, ToolCall)
    if call.error is not None:  # a malformed call: the error is the result, the tool (if named) never runs
        assert call.error.startswith("Error: ") and (call.tool is None or call.tool in fmt.tools.values())
    else:
        assert call.tool in fmt.tools.values() and isinstance(call.content, str)


@FAST
@given(before=soup(surrogates=True), name=st.sampled_from(["python", "search", "calc"]), args=JSON,
       value=JSON, openai=st.booleans(), after=soup(surrogates=True))
def test_chat_template_parse_well_formed_calls(hermes_format, before, name, args, value, openai, after):
    fmt = hermes_format
    before = _strip_all(before, fmt.close_marker)
    arguments = {**args, "input": value} if isinstance(args, dict) else {"input": value}
    body = json.dumps({"name": name, "arguments": json.dumps(arguments) if openai else arguments})
    assume(fmt.open_marker not in body and fmt.close_marker not in body)  # a marker inside a JSON string
    call = fmt.parse(before + fmt.open_marker + body + fmt.close_marker + after, fmt.close_marker)
    if name not in fmt.tools:
        assert call.tool is None and call.error.startswith(f"Error: unknown tool {name!r}")
    else:
        value = json.loads(json.dumps(value))  # as the model's JSON reads (escaped surrogate halves pair up)
        expected = value if isinstance(value, str) else json.dumps(value)
        assert call == ToolCall(fmt.tools[name], expected, start=len(before))


@FAST
@given(text=soup(surrogates=False, max_pieces=24))
def test_results_render_around_the_text(hermes_format, text):
    assert TagFormat([Tool("python", str)]).render_result(text, ToolCall(None)) == format_result(text)
    rendered = hermes_format.render_result(text, ToolCall(hermes_format.tools["search"], "q"))
    assert rendered == f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n" \
                       "<|im_start|>assistant\n"


# ---- the sampler ------------------------------------------------------------------------------------------------
def calls(tags: Sequence[str]) -> st.SearchStrategy[str]:
    """A call to one of `tags` (possibly unknown, empty, or after stray tags), in soup."""
    body = st.one_of(soup(max_pieces=4), st.sampled_from(["print(1)", " 1+1 ", "capital of France", "é😀"]))
    return st.builds(lambda before, tag, body: f"{before}<{tag}>{body}</{tag}>", soup(max_pieces=3),
                     st.sampled_from(tags), body)


def hermes_calls() -> st.SearchStrategy[str]:
    """`<tool_call>{json}</tool_call>` with known and unknown tools, missing or odd arguments, broken JSON."""
    value = st.one_of(soup(max_pieces=3), st.integers(), st.lists(st.integers(), max_size=2))
    args = st.dictionaries(st.sampled_from(["input", "input", "code"]), value, max_size=2)
    good = st.builds(lambda name, a: json.dumps({"name": name, "arguments": a}),
                     st.sampled_from(TOOL_TAGS * 2 + ["calc"]), args)
    body = st.one_of(good, good, good, soup(max_pieces=4), good.map(lambda b: b[: len(b) // 2]))
    return st.builds(lambda before, body: f"{before}<tool_call>{body}</tool_call>", soup(max_pieces=2), body)


def segments(call: st.SearchStrategy[str]) -> st.SearchStrategy[tuple]:
    """A segment spec: text chunks (encoded canonically) and raw ids, whether it ends with EOS, and its finish
    reason (None: computed as a real engine does; else the engine lies)."""
    chunk = st.one_of(call, call, call, soup(max_pieces=8), st.lists(st.integers(0, 399), min_size=1, max_size=3))
    lie = st.sampled_from([None] * 12 + ["stop", "eos", "length"])
    return st.tuples(st.lists(chunk, min_size=1, max_size=4), st.sampled_from([False, False, True]), lie)


def busy_segments() -> st.SearchStrategy[tuple]:
    """Segment specs that mostly call a tool (non-empty content, text overhanging the tag) or answer with EOS."""
    body = st.one_of(st.sampled_from(["print(1)", " 1+1 ", "é😀"]), soup(max_pieces=4).map(lambda s: s + "1"))
    call = st.builds(lambda before, tag, body, after: [f"{before}<{tag}>{body}</{tag}>{after}"],
                     soup(max_pieces=3), st.sampled_from(TOOL_TAGS), body, soup(max_pieces=2))
    answer = soup(max_pieces=3).map(lambda text: [f"{text}<answer>\\boxed{{1}}</answer>"])
    return st.one_of(call.map(lambda c: (c, False, None)), call.map(lambda c: (c, False, None)),
                     answer.map(lambda c: (c, True, None)))


class SoupEngine(ScriptedEngine):
    """Segments from a pool of hypothesis-drawn specs (text chunks and raw ids), chosen by a seeded RNG, finished as
    `TransformersEngine` finishes them (first stop string, EOS, budget) unless the spec lies. Each token's logprob is
    unique, so a trajectory's model tokens can be traced back to the segment and index they were sampled at."""

    def __init__(self, tokenizer, pool, seed):
        super().__init__(tokenizer, script=None, seed=seed)
        self.pool = pool
        self.segments: list[tuple[tuple[int, ...], Segment]] = []
        self.origin: dict[float, tuple[int, int]] = {}  # logprob -> (segment, index)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prefixes, max_new_tokens, stop):
        assert len(prefixes) == len(max_new_tokens) and min(max_new_tokens, default=1) >= 1
        return [self._segment(list(prefix), budget, stop) for prefix, budget in zip(prefixes, max_new_tokens)]

    def _segment(self, prefix, budget, stop):
        chunks, eos, lie = self.pool[self.rng.randrange(len(self.pool))]
        ids = [i for c in chunks for i in (self.tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str)
                                           else c)] + [self.tokenizer.eos_token_id] * eos
        ids = ids[:budget]
        eos_at = next((k for k, i in enumerate(ids) if i == self.tokenizer.eos_token_id), None)
        found = first_stop(ids if eos_at is None else ids[: eos_at + 1], self._decode, stop)
        if found is not None:
            ids, finish = ids[: found[0]], "stop"
        elif eos_at is not None:
            ids, finish = ids[: eos_at + 1], "eos"
        else:
            finish = "length"
        logprobs = [-(len(self.origin) + k + 1) / 1024 for k in range(len(ids))]
        self.origin.update({lp: (len(self.segments), k) for k, lp in enumerate(logprobs)})
        segment = Segment(ids, logprobs, [self.rng.uniform(0.0, 3.0) for _ in ids], lie or finish)
        self.segments.append((tuple(prefix), segment))
        return segment


class AsyncSoupEngine(SoupEngine):
    """The same segments served one request at a time after a random delay: requests complete in random order."""

    traits = EngineTraits(event_driven=True)

    async def agenerate(self, prefix, max_new_tokens, stop):
        segment = self._segment(list(prefix), max_new_tokens, stop)
        await asyncio.sleep(self.rng.random() * 0.003)
        return segment


def _raise(content):
    raise RuntimeError(f"kaput ✗ {content[:20]}")


def _slow(content):
    time.sleep(0.1)
    return "late"


def _jitter(content):
    time.sleep(random.random() * 0.01)
    return f"after a while: {content[:10]}"


TOOL_KINDS = st.one_of(
    st.tuples(st.just("const"), st.one_of(st.just(""), soup(max_pieces=8),
                                          st.integers(500, 5000).map(lambda k: "x😀" * k))),
    st.tuples(st.sampled_from(["echo", "raise", "slow", "none", "bytes", "jitter"]), st.just("")),
)


def make_tools(specs: dict[str, tuple[str, str]], outputs: list[str]) -> list[Tool]:
    """Plain tools by behaviour; every string they return is recorded in `outputs`."""
    def recorded(fn):
        def call(content):
            out = fn(content)
            outputs.append(out)
            return out
        return call
    behaviours = {"echo": lambda c: c, "raise": _raise, "slow": _slow, "none": lambda c: None,
                  "bytes": lambda c: c.encode(), "jitter": _jitter}
    return [Tool(tag, recorded(behaviours.get(kind, lambda c, out=out: out))) for tag, (kind, out) in specs.items()]


def split_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def check_trajectory(t, engine, tokenizer, fmt, limits, outputs) -> None:
    """Every token is either sampled by the model (mask 1, traced to its segment) or written by the environment
    (mask 0: the tail of a cut tag, a tool result, the EOS after the call limit)."""
    max_len, max_calls = limits
    n = len(t.completion_ids)
    assert n == len(t.mask) == len(t.logprobs) == len(t.entropies) <= max_len
    assert not t.active and t.finish_reason in {"eos", "length", "call_limit", "empty_call"}
    assert 0 <= t.tool_failures <= t.tool_calls <= max_calls
    before, after = result_block(fmt)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    calls, runs = 0, split_runs(t.mask)
    for r, (a, b, bit) in enumerate(runs):
        if bit == 0:
            assert all(lp == 0.0 and math.isnan(h) for lp, h in zip(t.logprobs[a:b], t.entropies[a:b]))
            continue
        pieces = model_run_pieces(t, engine, a, b)
        ids = [i for seg in pieces for i in seg.token_ids]  # a probe and its continuation are one segment
        if r + 1 == len(runs):  # the path ends with model tokens: the whole segment, a cut one or the budget
            cut = cut_at_stop(ids, engine._decode, encode, fmt.stop_strings)
            cut = cut if pieces[-1].finish_reason == "stop" or len(pieces) > 1 else None
            assert b - a == len(cut[0] if cut else ids) or b == max_len
            continue
        env = t.completion_ids[b : runs[r + 1][1]]  # followed by environment tokens: the segment ended at a tag
        rewritten = tag_cut_before(env, pieces, ids, a, b, t, engine, encode, fmt)
        rest = env[len(rewritten) :]
        if r + 2 < len(runs):  # the model went on: exactly one complete result block
            text = decode(rest)
            assert text.startswith(before) and text.endswith(after)
            result = text[len(before) : len(text) - len(after)]
            assert result in outputs or result.startswith("Error: ")
            calls += 1
        elif t.finish_reason == "call_limit":
            assert rest == [tokenizer.eos_token_id] and t.tool_calls == max_calls
        elif rest:  # a result block, whole (the next segment was empty) or cut by the budget
            text = decode(rest)
            assert text.startswith(before) or (n == max_len and before.startswith(text))
            calls += 1
    assert calls == t.tool_calls


def model_run_pieces(t, engine, a: int, b: int) -> list[Segment]:
    """The engine segments a run of model tokens `[a, b)` is made of: each from its first token on, continuing exactly
    the prefix the engine was given; all but the last whole (a probe that stopped at its token budget)."""
    pieces, pos = [], a
    while pos < b:
        seg_index, first = engine.origin[t.logprobs[pos]]
        prefix, seg = engine.segments[seg_index]
        assert first == 0 and prefix == tuple(t.prompt_ids + t.completion_ids[:pos])
        n = min(b - pos, len(seg.token_ids))
        assert t.completion_ids[pos : pos + n] == seg.token_ids[:n]
        assert t.logprobs[pos : pos + n] == seg.logprobs[:n] and t.entropies[pos : pos + n] == seg.entropies[:n]
        if pos + n < b:
            assert n == len(seg.token_ids) and seg.finish_reason == "length"
        pieces.append(seg)
        pos += n
    return pieces


def tag_cut_before(env, pieces, ids, a, b, t, engine, encode, fmt) -> list[int]:
    """The model run `[a, b)` ends at a tool's tag, its tail possibly re-encoded as the first `env` tokens; returns
    those. When a capped probe ends inside the tag, the closing token came with the continuation (rewritten): any
    segment generated after `[:b]` may be it (paths with equal prefixes are indistinguishable)."""
    options = [ids]
    if pieces[-1].finish_reason == "length":
        prefix = tuple(t.prompt_ids + t.completion_ids[:b])
        options = [ids + list(seg.token_ids) for p, seg in engine.segments if p == prefix] + options
    for option in options:
        cut = cut_at_stop(option, engine._decode, encode, fmt.stop_strings)
        if cut and len(cut[0]) == b - a and env[: len(cut[1])] == cut[1][: len(env)]:
            return cut[1]
    raise AssertionError(f"model tokens {a}:{b} are not cut at a tag followed by its rewritten tail")


def result_block(fmt) -> tuple[str, str]:
    """What a call format writes before and after a tool's output."""
    return tuple(fmt.render_result("\x00", ToolCall(None)).split("\x00"))


def check_rollout(result, sampler, prompts, m, n, policy, outputs) -> None:
    assert [len(g) for g in result.groups] == [m] * len(prompts)
    trajectories = result.trajectories
    by_id = {t.id: t for t in trajectories}
    assert len(by_id) == len(trajectories)
    for g, group in enumerate(result.groups):
        if policy == "aepo":  # AEPO's pre-monitoring chose the group's global samples
            n = result.stats.global_samples[g]
        assert sum(t.kind == "global" for t in group) == n and all(t.group == g for t in group)
        assert [tree_order(t.key) for t in group] == sorted(tree_order(t.key) for t in group)  # parents first
        assert [t.id for t in group] == list(range(g * m, (g + 1) * m))  # numbered in tree order
        assert all(t.prompt_ids == list(prompts[g]) for t in group)
    assert result.stats.forks == sum(t.kind == "branch" for t in trajectories)
    assert result.stats.fill_ups == sum(t.kind == "fill" for t in trajectories)
    if policy == "none":
        assert result.stats.forks == 0
    limits = (sampler.rule.max_completion_length, sampler.rule.max_tool_calls)
    _, after = result_block(sampler.call_format)
    for t in trajectories:
        check_trajectory(t, sampler.engine, sampler.rule.tokenizer, sampler.call_format, limits, outputs)
        if t.kind != "branch":
            continue
        parent, fp = by_id[t.parent], t.fork_position
        assert parent.group == t.group and parent.id < t.id and 1 <= fp <= len(parent.completion_ids)
        for key in ("completion_ids", "mask", "logprobs"):
            assert getattr(t, key)[:fp] == getattr(parent, key)[:fp]
        assert [h if h == h else None for h in t.entropies[:fp]] == [h if h == h else None
                                                                    for h in parent.entropies[:fp]]
        # forked right after a tool result, and the branch samples its own continuation
        assert t.mask[fp - 1] == 0
        assert sampler.rule.tokenizer.decode(t.completion_ids[:fp], skip_special_tokens=False).endswith(after)
        if len(t.completion_ids) > fp and len(parent.completion_ids) > fp and t.mask[fp] == parent.mask[fp] == 1:
            assert t.logprobs[fp] != parent.logprobs[fp]


@st.composite
def sampler_args(draw, busy: bool = False):
    """BranchingSampler arguments; `busy`: room to branch and to call tools (hypothesis favours small values)."""
    m = draw(st.integers(2 if busy else 1, 6))
    policy = draw(st.sampled_from(BRANCH_POLICIES[:2] if busy else BRANCH_POLICIES))
    short, long = st.integers(1, 12), st.integers(40, 200)
    return dict(
        num_generations=m, branch_policy=policy,
        initial_rollouts=m if policy == "none" else draw(st.integers(1, m - 1 if busy else m)),
        branch_factor=draw(st.integers(2 if busy else 1, 4)),
        branch_threshold=draw(st.floats(0.5 if busy else 0.0, 1.0)),
        entropy_weight=draw(st.floats(-2.0, 2.0)), entropy_window=draw(st.integers(1, 6)),
        max_tool_calls=draw(st.integers(1 if busy else 0, 4)),
        max_completion_length=draw(long if busy else st.one_of(short, long, long, long)),
        seed=draw(st.integers(0, 2**16)),
    )


def note_coverage(result) -> None:
    """Hypothesis statistics (`--hypothesis-show-statistics`): how often the interesting paths were taken."""
    for t in result.trajectories:
        event(f"finish: {t.finish_reason}")
    event(f"forks: {min(result.stats.forks, 1)}, tool calls: {min(result.stats.tool_calls, 1)}, "
          f"failures: {min(result.stats.tool_failures, 1)}")


def run_sampler(tokenizer, args, pool, n_prompts, tools, chat_template=False, scheduler="waves"):
    outputs: list[str] = []
    engine = (AsyncSoupEngine if scheduler == "events" else SoupEngine)(tokenizer, pool, seed=args["seed"])
    slow = any(kind == "slow" for kind, _ in tools.values())
    tools = make_tools(tools, outputs)
    call_format = ChatTemplateFormat(tokenizer, tools) if chat_template else None
    sampler = BranchingSampler(engine, tokenizer, tools, tool_timeout=0.02 if slow else 30.0, call_format=call_format,
                               scheduler=scheduler, **args)
    if chat_template:
        prompts = call_format.prompt_ids([[{"role": "user", "content": f"What is {i}+1?"}] for i in range(n_prompts)])
    else:
        prompts = _prompts(tokenizer, n_prompts)
    result = sampler.sample(prompts)
    check_rollout(result, sampler, prompts, args["num_generations"], args["initial_rollouts"], args["branch_policy"],
                  outputs)
    note_coverage(result)


TOOLS = st.fixed_dictionaries({tag: TOOL_KINDS for tag in TOOL_TAGS})


@ROLLOUTS
@given(args=sampler_args(), pool=st.lists(segments(calls(TOOL_TAGS * 2 + ["answer", "other"])), min_size=1, max_size=5),
       n_prompts=st.integers(1, 2), tools=TOOLS)
def test_sampler_bookkeeping_on_tag_soup(tokenizer, args, pool, n_prompts, tools):
    run_sampler(tokenizer, args, pool, n_prompts, tools)


@ROLLOUTS
@given(args=sampler_args(busy=True), pool=st.lists(busy_segments(), min_size=1, max_size=4),
       n_prompts=st.integers(1, 2), tools=TOOLS)
def test_sampler_bookkeeping_with_many_tool_calls(tokenizer, args, pool, n_prompts, tools):
    run_sampler(tokenizer, args, pool, n_prompts, tools)


@settings(ROLLOUTS, max_examples=100)
@given(args=sampler_args(busy=True), pool=st.lists(busy_segments(), min_size=1, max_size=4),
       n_prompts=st.integers(1, 3), tools=TOOLS)
def test_event_driven_sampler_bookkeeping_with_random_completion_order(tokenizer, args, pool, n_prompts, tools):
    """Requests complete in random order and tools take random time: the trees keep every invariant."""
    run_sampler(tokenizer, args, pool, n_prompts, tools, scheduler="events")


@settings(ROLLOUTS, max_examples=100)
@given(args=sampler_args(busy=True), pool=st.lists(segments(hermes_calls()), min_size=1, max_size=4),
       n_prompts=st.integers(1, 2), tools=TOOLS)
def test_sampler_bookkeeping_with_chat_template_calls(hermes, args, pool, n_prompts, tools):
    run_sampler(hermes, args, pool, n_prompts, tools, chat_template=True)


# ---- known bugs in the rollout / tools/runner.py: reproductions, expected to pass once those are fixed -------------
def _one_call_then_answer(text, rng):
    return (CALL, 0.1, "stop") if "</result>" not in text else ("<answer>1</answer>", 0.1, "eos")


def test_a_tool_output_with_a_lone_surrogate_is_an_observation(tokenizer):
    sampler = _sampler(tokenizer, _one_call_then_answer, tools=[Tool("python", lambda code: "a\ud800b")],
                       num_generations=1, branch_policy="none")
    (t,) = sampler.sample(_prompts(tokenizer, 1)).trajectories
    assert (t.tool_calls, t.finish_reason) == (1, "eos")
    assert tokenizer.decode(t.completion_ids, skip_special_tokens=True).endswith("</result><answer>1</answer>")


def test_sample_overrides_are_validated(tokenizer):
    sampler = _sampler(tokenizer, _one_call_then_answer, num_generations=4)
    with pytest.raises(ValueError, match="initial_rollouts"):
        sampler.sample(_prompts(tokenizer, 1), num_generations=2, initial_rollouts=3)
    with pytest.raises(ValueError, match="branch_policy"):
        sampler.sample(_prompts(tokenizer, 1), branch_policy="sometimes")


def test_a_tool_raising_system_exit_fails_at_once(tokenizer):
    def exits(code):
        raise SystemExit(3)

    sampler = _sampler(tokenizer, _one_call_then_answer, tools=[Tool("python", exits)], num_generations=1,
                       branch_policy="none", tool_timeout=60.0)
    start = time.monotonic()
    (t,) = sampler.sample(_prompts(tokenizer, 1)).trajectories
    assert "Error: Tool(python) execution failed with message: SystemExit: 3" in tokenizer.decode(t.completion_ids)
    assert time.monotonic() - start < 30  # not at the 60 s timeout
