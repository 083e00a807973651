"""PythonTool (real subprocesses) and SearchTool over a real BM25 index."""

import os
import subprocess
import time
import uuid

import pytest

from arpo_trl.tools import BM25Backend, BM25Index, PythonTool, SearchTool, Tool


@pytest.fixture(scope="module")
def python_tool():
    return PythonTool(timeout=2, max_output_chars=200)


@pytest.mark.parametrize("code,expected", [
    ("1 + 1", "2"),
    ("x = 3\nx * 2", "6"),
    ("print('a')\nprint('b')", "a\nb"),
    ("x = 5", "(no output)"),
    ("import math\nmath.sqrt(16)", "4.0"),
])
def test_python_tool_outputs(python_tool, code, expected):
    assert python_tool(code) == expected


def test_python_tool_errors_are_text(python_tool):
    out = python_tool("print(1)\nraise ValueError('boom')")
    assert out.startswith("1\nTraceback") and "ValueError: boom" in out and "_bootstrap" not in out
    assert "SyntaxError" in python_tool("def f(:")


def test_python_tool_timeout_kills_everything_the_code_started(python_tool):
    """The call returns at its 2 s timeout, not when the child it started would end (300 s), and the child is
    killed. The child's argument is this test's own, so that no other process on the machine matches it."""
    seconds = f"300.{uuid.uuid4().int % 10**9:09d}"
    start = time.monotonic()
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'])\nwhile True: pass"
    out = python_tool(code)
    assert out.startswith("TimeoutError") and time.monotonic() - start < 60  # far below the child's 300 s
    deadline = time.monotonic() + 30
    while (alive := subprocess.run(["pgrep", "-f", f"^sleep {seconds}$"], capture_output=True).returncode == 0) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, "the child the code started outlived the call"


def test_python_tool_limits_output_and_memory(python_tool):
    out = python_tool("print('x' * 10**7)")
    assert len(out) < 400 and "too much output" in out
    assert "MemoryError" in python_tool("b = bytearray(8 * 2**30)")
    assert python_tool("import os\nos._exit(3)") == "Process exited with status 3."
    assert "Process killed by SIGSEGV" in python_tool("import ctypes\nctypes.string_at(0)")


def test_python_tool_runs_in_a_scratch_dir_without_trainer_secrets(python_tool):
    os.environ["ARPO_FAKE_SECRET"] = "hunter2"
    try:
        out = python_tool("import os\nprint(os.getcwd() == os.environ['HOME'])\n"
                          "print(os.environ.get('ARPO_FAKE_SECRET'))")
    finally:
        del os.environ["ARPO_FAKE_SECRET"]
    assert out.splitlines() == ["True", "None"]


def test_search_tool_over_bm25():
    corpus = ["Paris is the capital of France.", {"title": "Berlin", "text": "Capital of Germany."},
              "Bananas are yellow."]
    tool = SearchTool(BM25Backend(corpus), top_k=2)
    out = tool('"capital of Germany"')
    assert out.splitlines()[0] == "Page 1: Berlin: Capital of Germany."
    assert tool("the of") == "No search results found."
    with pytest.raises(ValueError, match="corpus item 1"):
        BM25Backend(["ok", 3])


def test_bm25_index_scores_and_top():
    index = BM25Index(["The cat sat.", "A dog barked.", "Cat and cat again.", "The cat sat."])
    scores = index.scores("cat")
    assert scores[1] == 0.0 and scores[2] > scores[0] == scores[3] > 0  # the rarer word counts, repeats count
    assert index.top("cat", 3) == [2, 0, 3] and index.top("cat", 1) == [2]  # ties in text order
    assert index.scores("the of") == [0.0] * 4 and index.top("the of", 5) == [] and index.top("", 5) == []
    assert BM25Index(["the of", "a"]).scores("cat") == [0.0, 0.0]  # nothing but stopwords to index


def test_tool_tags_are_validated():
    assert Tool("calc", str.upper)("x") == "X"
    for bad in ["", "a b", "<x>", "result"]:
        with pytest.raises(ValueError):
            Tool(bad, str)
