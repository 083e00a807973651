"""Condensers for `BrowseTool`: a page cut to a token budget (`TokenCounter`: tokens of a tokenizer, or words).

* `ExtractiveCondenser` (the default): the page's sentences that best match the goal under BM25 (the shared
  `BM25Index` of the search tool, with the page's sentences as the collection), in page order.
* `ModelCondenser`: a causal LM summarises, following the reference's summariser
  (`evaluation/src/tools/search_tool_sds.py`) in spirit: goal + page → the relevant evidence, answer after
  `**Final Information**`. It runs in-process with transformers instead of a vLLM server, decodes greedily by
  default, and sees the goal but not the previous reasoning (a tool only receives its call's content). Pages longer
  than its input budget are first cut extractively around the goal (the reference's snippet-centred window).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from arpo_trl.tools.pages import Page
from arpo_trl.tools.search import BM25Index


# ---- token budgets -------------------------------------------------------------------------------------------
class TokenCounter:
    """Counts and cuts text in tokens of `tokenizer` (a transformers tokenizer, or anything with
    `encode(text, add_special_tokens=False)` and `decode(ids)`), or in whitespace-separated words without one."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def clip(self, text: str, budget: int) -> str:
        """A prefix of `text` (up to decoding) with `count(result) <= budget`; `text` itself if it fits."""
        if budget <= 0:
            return ""
        if self.tokenizer is None:
            words = list(islice(re.finditer(r"\S+", text), budget + 1))
            return text if len(words) <= budget else text[: words[budget - 1].end()]
        return self._clip_tokens(text, budget)

    def _clip_tokens(self, text: str, budget: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= budget:
            return text
        n = budget
        while n > 0:  # decode → encode need not round-trip to the same length: re-count and shrink
            cut = self.tokenizer.decode(ids[:n]).rstrip("\ufffd")
            over = self.count(cut) - budget
            if over <= 0:
                return cut
            n -= over
        return ""


# ---- condensers ----------------------------------------------------------------------------------------------
class Condenser(Protocol):
    def __call__(self, page: Page, goal: str, budget: int, counter: TokenCounter) -> str:
        """The page's text relevant to `goal` (the lead when empty) in at most `budget` tokens of `counter`."""


@dataclass(frozen=True)
class Sentence:
    text: str
    new_paragraph: bool


_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "st", "sr", "jr", "vs", "etc", "e.g", "i.e", "no", "vol", "fig", "approx",
    "c", "ca", "inc", "ltd", "co", "gen", "col", "lt", "mt", "ft", "jan", "feb", "mar", "apr", "aug", "sept",
    "sep", "oct", "nov", "dec",
}
_SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


def _ends_with_abbreviation(piece: str) -> bool:
    last = piece.rsplit(None, 1)[-1].rstrip(".").lower() if piece.strip() else ""
    return last in _ABBREVIATIONS or bool(re.fullmatch(r"[a-z]|([a-z]\.)+[a-z]", last))


def _chunks(sentence: str, max_words: int) -> list[str]:
    words = sentence.split()
    return [" ".join(words[i: i + max_words]) for i in range(0, len(words), max_words)] or [sentence]


def split_sentences(text: str, max_words: int = 60) -> list[Sentence]:
    """Sentences per line (a line is a paragraph); abbreviations and initials do not end a sentence; a run of
    more than `max_words` words without an end (a list, a table row) is cut into chunks."""
    out: list[Sentence] = []
    for paragraph in text.split("\n"):
        pieces: list[str] = []
        for piece in _SENTENCE_BREAK.split(paragraph.strip()):
            if pieces and _ends_with_abbreviation(pieces[-1]):
                pieces[-1] += " " + piece
            elif piece.strip():
                pieces.append(piece)
        chunks = [chunk for piece in pieces for chunk in _chunks(piece.strip(), max_words)]
        out += [Sentence(chunk, i == 0) for i, chunk in enumerate(chunks)]
    return out


class ExtractiveCondenser:
    """Keep whole sentences: without a goal the lead (the page's first sentences); with one, the sentences
    ranked by BM25 against the goal (ties and unmatched sentences in page order), packed greedily into the
    budget, then put back in page order. Skipped stretches are marked `…`. A first pick longer than the whole
    budget is cut."""

    def __call__(self, page: Page, goal: str, budget: int, counter: TokenCounter) -> str:
        sentences = split_sentences(page.text)
        if not sentences or budget <= 0:
            return ""
        scores = BM25Index([s.text for s in sentences]).scores(goal)
        ranked = sorted(range(len(sentences)), key=lambda i: (-scores[i], i))
        gap_cost = counter.count("…") + 1
        costs = [counter.count(s.text) + gap_cost for s in sentences]
        chosen = self._pack(ranked, costs, budget, contiguous=max(scores) <= 0)
        return counter.clip(self._join(sentences, chosen or ranked[:1]), budget)

    @staticmethod
    def _pack(ranked: list[int], costs: list[int], budget: int, contiguous: bool) -> list[int]:
        chosen, used = [], 0
        for i in ranked:
            if used + costs[i] <= budget:
                chosen.append(i)
                used += costs[i]
            elif contiguous:
                break
        return sorted(chosen)

    @staticmethod
    def _join(sentences: list[Sentence], chosen: list[int]) -> str:
        parts: list[str] = []
        for previous, i in zip([None, *chosen], chosen):
            if previous is not None:
                parts.append(" … " if i != previous + 1 else "\n" if sentences[i].new_paragraph else " ")
            parts.append(sentences[i].text)
        return "".join(parts)


SUMMARY_PROMPT = """**Task Instruction:**

You are reading a web page for someone who is answering a question step by step. Extract the information on \
the page that serves their **Goal**: the facts, names, numbers and dates that help, stated as on the page. If \
the page has nothing relevant, say so in one sentence.

**Goal:** {goal}

**Web Page:** {title} ({url})
{text}

Write only the helpful information, beginning with `**Final Information**`."""
DEFAULT_GOAL = "Summarise the main facts of this page."
FINAL_MARKER = "**Final Information**"


class ModelCondenser:
    """Summarise with a causal LM (`AutoModelForCausalLM`) the user names: the goal and the page (first cut
    extractively to `max_input_tokens` of the summariser's tokenizer) in a chat-template prompt modelled on the
    reference's summariser; the text after `**Final Information**` (or the whole reply), cut to the budget.
    An empty reply falls back to the extractive condenser. Greedy decoding unless `generation_kwargs` say
    otherwise; calls are serialised (the tool runs in a thread pool)."""

    def __init__(self, model_name_or_path: str, max_new_tokens: int = 512, device: str | None = None,
                 max_input_tokens: int = 3000, dtype: Any = "auto", generation_kwargs: Mapping[str, Any] | None = None):
        if max_new_tokens < 1 or max_input_tokens < 1:
            raise ValueError("ModelCondenser needs max_new_tokens >= 1 and max_input_tokens >= 1.")
        self.model_name_or_path = model_name_or_path
        self.max_new_tokens = max_new_tokens
        self.max_input_tokens = max_input_tokens
        self.generation_kwargs = dict(generation_kwargs or {})
        self.tokenizer, self.model = self._load(model_name_or_path, device, dtype)
        self._extractive = ExtractiveCondenser()
        self._lock = threading.Lock()

    @staticmethod
    def _load(name: str, device: str | None, dtype: Any) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise OSError(f"ModelCondenser could not load a causal LM and its tokenizer from {name!r} (a local "
                          f"folder with config.json, weights and tokenizer files, or a Hub id that is cached when "
                          f"HF_HUB_OFFLINE=1): {exc}") from exc
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return tokenizer, model.to(device).eval()

    def __call__(self, page: Page, goal: str, budget: int, counter: TokenCounter) -> str:
        if budget <= 0:
            return ""
        evidence = self._extractive(page, goal, self.max_input_tokens, TokenCounter(self.tokenizer))
        reply = self.generate(self.prompt(page, goal, evidence))
        summary = reply.split(FINAL_MARKER, 1)[-1].strip().strip("`").strip()
        if not summary:
            return self._extractive(page, goal, budget, counter)
        return counter.clip(summary, budget)

    def prompt(self, page: Page, goal: str, text: str) -> str:
        content = SUMMARY_PROMPT.format(goal=goal or DEFAULT_GOAL, title=page.title, url=page.url, text=text)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
        return content + "\n\n" + FINAL_MARKER + "\n"

    def generate(self, prompt: str) -> str:
        import torch

        templated = bool(getattr(self.tokenizer, "chat_template", None))
        inputs = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=not templated).to(self.model.device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": False, "pad_token_id": pad,
                  **self.generation_kwargs}
        with self._lock, torch.no_grad():
            output = self.model.generate(**inputs, **kwargs)
        return self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
