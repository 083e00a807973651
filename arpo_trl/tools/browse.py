"""`BrowseTool`: `<browse>URL or page title | what to look for</browse>` → the page, condensed to a token budget.

Content format (what the model writes between the tags):

* `<browse>https://en.wikipedia.org/wiki/Albert_Einstein</browse>`: open a URL;
* `<browse>Albert Einstein</browse>`: open a page by title (the offline `PageStore`);
* `<browse>Albert Einstein | when did he receive the Nobel Prize?</browse>`: everything after the first `|`
  (or, without a `|`, after the first line break) is the *goal*: what to look for on the page.

The result is `Page: <title>\\nURL: <url>\\n<condensed text>`, at most `max_tokens` tokens in all (tokens of the
tokenizer given, else whitespace-separated words). A page that cannot be opened gives a message for the model
instead (`No page titled 'X'. Closest: A, B, C.`, `HTTP 404 …`, `Timed out …`), never a traceback.

Pieces: a `PageBackend` opens pages (`arpo_trl.tools.pages`: `PageStore` for offline pages, `HTTPBackend` for
the web), and a condenser cuts them to the budget (`arpo_trl.tools.condense`: `ExtractiveCondenser`, the default,
or `ModelCondenser`, a causal LM that summarises).

Unlike the reference, whose deep-search evaluation fetches and summarises every search result's page (at evaluation
only: docs/reference.md#tools), opening a page is a tool of its own, which the model calls with its own goal, in
training and evaluation alike: search stays cheap (snippets, as in training) and reading is a choice. Its output is
bounded by a token budget; `ModelCondenser`'s differences from the reference's summariser: `arpo_trl.tools.condense`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from arpo_trl.tools.base import Tool, function_schema
from arpo_trl.tools.condense import Condenser, ExtractiveCondenser, TokenCounter
from arpo_trl.tools.pages import USAGE, BrowseError, Page, PageBackend


def _unwrap(ref: str) -> str:
    """Drop one pair of quotes, backticks or angle/square brackets around the whole reference."""
    pairs = {'"': '"', "'": "'", "`": "`", "<": ">", "[": "]"}
    if len(ref) >= 2 and pairs.get(ref[0]) == ref[-1]:
        return ref[1:-1].strip()
    return ref


def parse_request(content: str) -> tuple[str, str]:
    """`"ref | goal"` → `(ref, goal)`: split at the first `|`, else at the first line break; whitespace
    collapsed, one pair of quotes/brackets around the ref dropped. The goal may be empty."""
    text = content.strip()
    ref, _, goal = text.partition("|") if "|" in text else text.partition("\n")
    return _unwrap(" ".join(ref.split())), " ".join(goal.split())


class BrowseTool(Tool):
    """`<browse>URL or title | goal</browse>` → `Page: <title>\\nURL: <url>\\n<condensed text>`, at most
    `max_tokens` tokens of `tokenizer` (whitespace words without one) in all, error messages included::

        BrowseTool(PageStore.wiki(), max_tokens=300, tokenizer=tokenizer)           # offline Wikipedia leads
        BrowseTool(HTTPBackend(), ModelCondenser("Qwen/Qwen3-8B", device="cuda"))   # the web, LM summaries
    """

    def __init__(self, backend: PageBackend, condenser: Condenser | None = None, max_tokens: int = 512,
                 tokenizer: Any = None, tag: str = "browse"):
        super().__init__(tag)
        if max_tokens < 1:
            raise ValueError(f"BrowseTool max_tokens must be >= 1, got {max_tokens}.")
        self.backend = backend
        self.condenser = condenser if condenser is not None else ExtractiveCondenser()
        self.max_tokens = max_tokens
        self.counter = TokenCounter(tokenizer)

    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.tag, "Open a web page by URL or title and return its text relevant to a goal, condensed.",
            {"ref": "The URL or page title to open.", "goal": "What to look for on the page (optional)."},
            required=["ref"],
        )

    def arguments_to_content(self, arguments: Mapping[str, Any]) -> str:
        if "ref" not in arguments:
            raise ValueError("missing the required argument 'ref'.")
        goal = str(arguments.get("goal") or "").strip()
        return f"{arguments['ref']} | {goal}" if goal else str(arguments["ref"])

    def __call__(self, content: str) -> str:
        ref, goal = parse_request(content)
        try:
            if not ref:
                raise BrowseError(f"Empty browse request. {USAGE}")
            page = self.backend.fetch(ref)
        except BrowseError as exc:
            return self.counter.clip(str(exc), self.max_tokens)
        return self.render(page, goal)

    def render(self, page: Page, goal: str = "") -> str:
        """The result text for an opened page."""
        header = f"Page: {page.title}\nURL: {page.url}\n"
        room = self.max_tokens - self.counter.count(header)
        body = self.condenser(page, goal, room, self.counter) if room > 0 else ""
        return self.counter.clip(header + (body or "(no readable text)"), self.max_tokens)
