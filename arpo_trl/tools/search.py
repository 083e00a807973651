"""`SearchTool`: `<search>query</search>` → the top passages of a pluggable backend.

The reference queries Bing through a paid SERP API and formats snippets as `Page i: <snippet>`; we keep
the format and make the backend pluggable, with a local BM25 index (`bm25s`) over a corpus the user
supplies as the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from arpo_trl.tools.base import Tool, function_schema


class SearchBackend(Protocol):
    def search(self, query: str, top_k: int) -> list[str]:
        """Return up to `top_k` passages for `query`, best first."""


class BM25Backend:
    """Okapi BM25 over an in-memory corpus of strings or `{"title": …, "text": …}` records."""

    def __init__(self, corpus: Iterable[str | Mapping[str, str]], stopwords: str | None = "en"):
        import bm25s

        self.passages = [self._as_text(doc, i) for i, doc in enumerate(corpus)]
        if not self.passages:
            raise ValueError("BM25Backend needs a non-empty corpus.")
        self._bm25s = bm25s
        self._stopwords = stopwords
        self._retriever = bm25s.BM25()
        self._retriever.index(bm25s.tokenize(self.passages, stopwords=stopwords, show_progress=False),
                              show_progress=False)

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
        tokens = self._bm25s.tokenize([query], stopwords=self._stopwords, show_progress=False)
        if not tokens.vocab:  # only stopwords / punctuation
            return []
        k = min(top_k, len(self.passages))
        docs, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0]) if s > 0]


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
