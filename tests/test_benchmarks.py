"""Smoke tests of the benchmark scripts: a couple of calls each, checking the report's shape, not the timings."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from arpo_trl.tools.sandbox import _probe_namespaces

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sandbox_latency_smoke(tmp_path, capsys):
    namespaces = sys.platform.startswith("linux") and _probe_namespaces(sys.executable)
    only = "sum/rlimits" + (",sum/namespaces/cold" if namespaces else "")
    out = tmp_path / "latency.json"
    report = load("sandbox_latency").main(["--calls", "2", "--warmup", "1", "--pause", "0.1", "--only", only,
                                           "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert "| variant |" in capsys.readouterr().out
    expected = {"sum/baseline", "sum/rlimits/cold", "sum/rlimits/pooled", "sum/rlimits/pooled-b2b"}
    assert set(report["runs"]) == expected | ({"sum/namespaces/cold"} if namespaces else set())
    for name, run in report["runs"].items():
        for key in ("wall_ms_p50", "wall_ms_p90", "wall_ms_mean", "p50_vs_baseline", "mean_vs_baseline"):
            assert run[key] > 0, (name, key)
        inner = [run["inner_ms_p50"], run["inner_ms_mean"]]
        assert all(v is None for v in inner) if name.endswith("baseline") else all(v > 0 for v in inner), name
