"""`SearchTool`: `<search>query</search>` → the top passages of a pluggable backend.

The reference queries Bing through a paid SERP API and formats snippets as `Page i: <snippet>`; we keep
the format and make the backend pluggable, with a local BM25 index (`bm25s`) over a corpus the user
supplies as the default. `BM25Index` is shared with the browse tool's extractive condenser.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from arpo_trl.tools.base import Tool, function_schema


class SearchBackend(Protocol):
    def search(self, query: str, top_k: int) -> list[str]:
        """Return up to `top_k` passages for `query`, best first."""


class BM25Index:
    """Okapi BM25 (`bm25s`) over a list of texts, English stopwords removed by default: the one BM25 of the tools.
    `BM25Backend` searches a corpus with it; `ExtractiveCondenser` ranks a page's sentences, with the page as the
    collection (so a word frequent on the page weighs little)."""

    def __init__(self, texts: Sequence[str], stopwords: str | None = "en"):
        import bm25s

        self._bm25s = bm25s
        self.stopwords = stopwords
        self.size = len(texts)
        docs = bm25s.tokenize(list(texts), stopwords=stopwords, return_ids=False, show_progress=False)
        self._retriever = bm25s.BM25() if any(docs) else None  # None: nothing but stopwords and punctuation
        if self._retriever is not None:
            self._retriever.index(docs, show_progress=False)

    def scores(self, query: str) -> list[float]:
        """The score of each text for `query`, in order; all zero when no word of the query is in the texts."""
        if self._retriever is None or not query.strip():
            return [0.0] * self.size
        terms = self._bm25s.tokenize([query], stopwords=self.stopwords, return_ids=False, show_progress=False)[0]
        known = [term for term in terms if term in self._retriever.vocab_dict]
        return self._retriever.get_scores(known).tolist() if known else [0.0] * self.size

    def top(self, query: str, k: int) -> list[int]:
        """Indices of at most `k` texts that match `query` (score > 0), best first; ties in text order."""
        scores = self.scores(query)
        return heapq.nsmallest(k, (i for i, score in enumerate(scores) if score > 0), key=lambda i: (-scores[i], i))


class BM25Backend:
    """Okapi BM25 (`BM25Index`) over an in-memory corpus of strings or `{"title": …, "text": …}` records."""

    def __init__(self, corpus: Iterable[str | Mapping[str, str]], stopwords: str | None = "en"):
        self.passages = [self._as_text(doc, i) for i, doc in enumerate(corpus)]
        if not self.passages:
            raise ValueError("BM25Backend needs a non-empty corpus.")
        self.index = BM25Index(self.passages, stopwords)

    @staticmethod
    def _as_text(doc: str | Mapping[str, str], index: int) -> str:
        if isinstance(doc, str):
            return doc
        if isinstance(doc, Mapping) and "text" in doc:
            title = doc.get("title")
            return f"{title}: {doc['text']}" if title else str(doc["text"])
        raise ValueError(f"BM25Backend corpus item {index} must be a string or a mapping with a 'text' key, "
                         f"got {type(doc).__name__}.")

    def search(self, query: str, top_k: int) -> list[str]:
        return [self.passages[i] for i in self.index.top(query, top_k)]


class SearchTool(Tool):
    """Search a backend and format the hits as the reference does: `Page i: <passage>` lines."""

    def __init__(self, backend: SearchBackend, tag: str = "search", top_k: int = 5, max_chars_per_page: int = 1000):
        super().__init__(tag)
        if top_k < 1:
            raise ValueError(f"SearchTool top_k must be >= 1, got {top_k}.")
        self.backend = backend
        self.top_k = top_k
        self.max_chars_per_page = max_chars_per_page

    def schema(self) -> dict[str, Any]:
        return function_schema(self.tag, "Search for passages about a query; returns the best as 'Page i: …' lines.",
                               {"query": "The search query."})

    def __call__(self, query: str) -> str:
        query = query.replace('"', "").strip()  # as the reference: quotes stripped
        hits = self.backend.search(query, self.top_k)
        if not hits:
            return "No search results found."
        return "\n".join(f"Page {i}: {hit[: self.max_chars_per_page]}" for i, hit in enumerate(hits, 1))
