"""Where the test suite's time goes: seconds by test file and by kind, from pytest's JUnit XML reports.

    python benchmarks/test_durations.py --run default --label after          # runs the default tier, then reports
    python benchmarks/test_durations.py --junit before.xml full.xml --label before full   # reports existing runs
    python benchmarks/test_durations.py --junit ci.xml --label ci --reports earlier.json  # + an earlier report's runs

`--run default|full` runs `python -m pytest -q [--full] --junitxml ...` in this checkout (HF_HUB_OFFLINE=1) and
times it; `--junit` reads reports that a run wrote (e.g. `.ci/run` with `PYTEST_ADDOPTS=--junitxml=FILE`). A test's
seconds are its setup, call and teardown (pytest's default `junit_duration_report`), so a session fixture's build is
charged to the first test that uses it.

Kinds, from the test's markers (as the run recorded them in its report; for an older report, read statically
from tests/) and its source: `smollm2` (marker `slow`: the real
SmolLM2-135M), `vllm server` (`vllm`), `colocate` (`colocate`), `long` (`long`: end-to-end runs and the remaining
parametrizations of the full tier), the first of these that applies; and for the unmarked: `sandbox` (the Python
tool's sandbox, hostile tool code and outputs), `tiny-model training` (the test's source builds a trainer, runs
`train` or `sft`, or launches a training subprocess), `logic` (everything else: rules, parsers, records, and tiny-model
generation without training). An older report's markers are today's, read from tests/.
Prints one JSON object and a markdown table; writes the JSON to `--out`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER_KINDS = {"colocate": "colocate", "vllm": "vllm server", "slow": "smollm2", "long": "long"}  # first wins
SANDBOX_FILES = {"test_sandbox", "test_tool_threads", "test_tools", "test_hostile_outputs"}
TRAINING_SIGNS = ("ARPOTrainer(", ".train(", '"train"', "accelerate", "GRPOTrainer(", "sft(")


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The full-tier markers a decorator list (or a `pytestmark` value, or a `pytest.param`) names."""
    found = set()
    for decorator in decorators:
        for node in ast.walk(decorator):
            if isinstance(node, ast.Attribute) and node.attr in MARKER_KINDS and getattr(node.value, "attr", "") \
                    == "mark":
                found.add(node.attr)
    return found


def test_kinds(tests: Path) -> dict[tuple[str, str], tuple[set[str], set[str]]]:
    """(file stem, test name) -> (markers on every case, markers on some parametrized cases only, the source with
    its decorators)."""
    kinds = {}
    for path in sorted(tests.glob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        module = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                module |= _marks([node.value])
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                whole = {m for d in node.decorator_list if not _is_parametrize(d) for m in _marks([d])}
                some = {m for d in node.decorator_list if _is_parametrize(d) for m in _marks([d])}
                source = "\n".join(ast.get_source_segment(text, part) or "" for part in [*node.decorator_list, node])
                kinds[path.stem, node.name] = (module | whole, some, source)
    return kinds


def _is_parametrize(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"


def kind_of(file: str, name: str, kinds: dict, recorded: set[str] | None = None) -> str:
    """The kind of one test case; `recorded`: the markers the run wrote into its report (tests/conftest.py), which
    a report written before they were recorded lacks (then they are read from the source)."""
    whole, some, source = kinds.get((file, name.split("[")[0]), (set(), set(), ""))
    marks = recorded if recorded is not None else whole or (
        some if some and _case_is_marked(name, source) else set())
    for marker, kind in MARKER_KINDS.items():
        if marker in marks:
            return kind
    if file in SANDBOX_FILES:
        return "sandbox"
    return "tiny-model training" if any(sign in (source or "") for sign in TRAINING_SIGNS) else "logic"


def _case_is_marked(name: str, source: str) -> bool:
    """Whether a parametrized case's id is one of the values wrapped in `pytest.param(..., marks=...)`."""
    case = name.partition("[")[2].rstrip("]")
    return any(f"pytest.param({value}" in source.replace('"', "").replace("'", "")
               for value in (case, case.split("-")[0]))


def read_junit(path: Path, kinds: dict) -> list[dict]:
    rows = []
    for case in ET.parse(path).iter("testcase"):
        file = case.get("classname", "").removeprefix("tests.").split(".")[0]
        outcome = "skipped" if case.find("skipped") is not None else (
            "failed" if case.find("failure") is not None or case.find("error") is not None else "passed")
        recorded = next((set(filter(None, p.get("value", "").split(","))) for p in case.iter("property")
                         if p.get("name") == "markers"), None)
        rows.append({"file": file, "name": case.get("name"), "seconds": float(case.get("time", 0.0)),
                     "outcome": outcome, "kind": kind_of(file, case.get("name"), kinds, recorded)})
    return rows


def summarize(rows: list[dict]) -> dict:
    by_file, by_kind = defaultdict(float), defaultdict(float)
    for row in rows:
        by_file[row["file"]] += row["seconds"]
        by_kind[row["kind"]] += row["seconds"]
    counts = defaultdict(int)
    for row in rows:
        counts[row["outcome"]] += 1
    return {"tests": len(rows), "outcomes": dict(counts), "seconds": round(sum(by_file.values()), 1),
            "by_file": {k: round(v, 1) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])},
            "by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "slowest": [{k: row[k] for k in ("file", "name", "seconds", "kind")}
                        for row in sorted(rows, key=lambda r: -r["seconds"])[:15]]}


def run_tier(tier: str, junit: Path) -> float:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(["--full"] if tier == "full" else [])]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode not in (0, 1):
        raise SystemExit(f"pytest exited {done.returncode}: {' '.join(cmd)}")
    return round(time.monotonic() - start, 1)


def table(report: dict) -> str:
    runs = report["runs"]
    labels = list(runs)
    lines = [f"| by kind | {' | '.join(labels)} |", "|---" * (len(labels) + 1) + "|"]
    kinds = sorted({k for run in runs.values() for k in run["by_kind"]},
                   key=lambda k: -max(run["by_kind"].get(k, 0) for run in runs.values()))
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{runs[label]['by_kind'].get(kind, 0):.0f} s" for label in labels)
                     + " |")
    lines.append("| **tests (sum)** | " + " | ".join(f"{runs[label]['seconds']:.0f} s" for label in labels) + " |")
    lines += ["", f"| by file (top 20) | {' | '.join(labels)} |", "|---" * (len(labels) + 1) + "|"]
    files = sorted({f for run in runs.values() for f in run["by_file"]},
                   key=lambda f: -max(run["by_file"].get(f, 0) for run in runs.values()))[:20]
    for file in files:
        lines.append(f"| {file} | " + " | ".join(f"{runs[label]['by_file'].get(file, 0):.0f} s" for label in labels)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", type=Path, nargs="*", default=[], help="JUnit XML files of earlier runs.")
    parser.add_argument("--run", choices=["default", "full"], nargs="*", default=[], help="Tiers to run now.")
    parser.add_argument("--label", nargs="*", default=[], help="A name per --junit file, then per --run tier.")
    parser.add_argument("--reports", type=Path, nargs="*", default=[],
                        help="Earlier JSON reports of this script: their runs come first, under their own labels.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "test_durations.json")
    args = parser.parse_args(argv)
    sources = [*args.junit, *args.run]
    if not sources and not args.reports:
        parser.error("give --junit files, --run tiers or --reports")
    if args.label and len(args.label) != len(sources):
        parser.error(f"--label: {len(sources)} names expected (one per --junit file, then per --run tier)")
    kinds = test_kinds(ROOT / "tests")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"commit": commit, "machine": f"{os.cpu_count()} CPUs", "load_avg_start": os.getloadavg()[0],
              "runs": {}}
    for earlier in args.reports:
        for label, run in json.loads(earlier.read_text())["runs"].items():
            report["runs"][label] = {**run, "report": str(earlier)}
    for index, source in enumerate(sources):
        label = args.label[index] if args.label else str(source)
        if isinstance(source, Path):
            suites = [float(suite.get("time", 0.0)) for suite in ET.parse(source).iter("testsuite")]
            report["runs"][label] = {"junit": str(source), "wall_s": round(sum(suites), 1),  # pytest's own clock
                                     **summarize(read_junit(source, kinds))}
            continue
        with tempfile.TemporaryDirectory() as folder:
            junit = Path(folder) / "junit.xml"
            wall = run_tier(source, junit)
            report["runs"][label] = {"tier": source, "wall_s": wall, **summarize(read_junit(junit, kinds))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({label: {k: v for k, v in run.items() if k not in ("by_file", "slowest")}
                      for label, run in report["runs"].items()}, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
