"""Smoke tests of the benchmark scripts: a couple of calls each, checking the report's shape, not the timings."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


def test_arpo_vs_grpo_end_to_end_on_the_tiny_model(tool_model_dir, tmp_path):
    """The real pipeline (train + eval subprocesses per method, pairwise ratios, table, plots) on the tiny model."""
    bench = load("arpo_vs_grpo")
    report = bench.main(["--model", str(tool_model_dir), "--seeds", "0", "--steps", "1", "--methods", "arpo", "grpo",
                         "--num-generations", "4", "--initial-rollouts", "2", "--prompts-per-step", "1",
                         "--max-completion-length", "32", "--eval-questions", "2", "--skip-vllm",
                         "--out", str(tmp_path)])
    assert {r["method"] for r in report["runs"]} == {"arpo", "grpo"}
    for run in report["runs"]:
        assert len(run["steps"]) == 1 and run["mean"]["rollout_seconds"] > 0 and 0 <= run["heldout_pass@1"] <= 1
    grpo = next(r for r in report["runs"] if r["method"] == "grpo")
    arpo = next(r for r in report["runs"] if r["method"] == "arpo")
    ratios = report["ratios"]["arpo/grpo"]
    assert "step_seconds" in ratios
    for key in bench.RATIO_KEYS:
        if grpo["mean"][key]:
            assert ratios[key] == pytest.approx(arpo["mean"][key] / grpo["mean"][key])
        else:
            assert key not in ratios
    assert (tmp_path / "results.md").read_text().startswith("| method |")
    assert all(Path(p).is_file() for p in report["plots"])


def test_arpo_vs_grpo_ratios_are_pairwise_medians():
    bench = load("arpo_vs_grpo")

    def run(method, seed, calls):
        steps = [{"tool_calls_per_group": calls, "reward": 0.5}]
        return {"method": method, "seed": seed, "steps": steps, "mean": {"tool_calls_per_group": calls}}

    runs = [run("grpo", 0, 4.0), run("arpo", 0, 2.0), run("grpo", 1, 10.0), run("arpo", 1, 6.0),
            run("grpo", 2, 8.0), run("arpo", 2, 8.0)]
    assert bench.pairwise(runs, ["arpo", "grpo"]) == {"arpo/grpo": {"tool_calls_per_group": 0.6},
                                                      "arpo - grpo": {"reward_second_half": 0.0}}
    assert bench.summarize(runs, ["arpo", "grpo"])["arpo"]["tool_calls_per_group"] == 6.0
