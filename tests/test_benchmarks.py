"""The benchmark scripts on tiny settings: what each report says is checked against what its runs did (their
trees, metrics and evaluation records; the sandbox's own clock), never against a speed."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from arpo_trl.tools.sandbox import _probe_namespaces
from arpo_trl.trees import read_jsonl

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
    printed = capsys.readouterr().out
    expected = {"sum/baseline", "sum/rlimits/cold", "sum/rlimits/pooled", "sum/rlimits/pooled-b2b"}
    assert set(report["runs"]) == expected | ({"sum/namespaces/cold"} if namespaces else set())
    for name, run in report["runs"].items():
        _, isolation, *mode = name.split("/")
        # each variant ran as its name says: the isolation the Sandbox actually used, its pool, pause and calls
        assert run["isolation"] == ("none (python -c)" if isolation == "baseline" else isolation), name
        assert run["pool_size"] == (2 if mode and mode[0].startswith("pooled") else 0), name
        assert run["pause_s"] == (0.1 if mode == ["pooled"] else 0.0) and run["timed_calls"] == 2, name
        assert 0 < run["wall_ms_p50"] <= run["wall_ms_p90"], name
        if isolation == "baseline":
            assert run["inner_ms_p50"] is None and run["inner_ms_mean"] is None
        else:  # the sandbox's own clock runs inside the caller's wall-clock window of each call
            assert 0 < run["inner_ms_p50"] <= run["wall_ms_p50"] and 0 < run["inner_ms_mean"] <= run["wall_ms_mean"]
        base = report["runs"]["sum/baseline"]
        assert run["p50_vs_baseline"] == round(run["wall_ms_p50"] / base["wall_ms_p50"], 2)
        assert f"| {name} | {run['pool_size']} | {run['pause_s']} | {run['wall_ms_p50']} |" in printed


def _addition_questions(path: Path, pairs: list[tuple[int, int]]) -> str:
    """Questions the tiny tool model answers with a `<python>` call (it learnt exactly this prompt)."""
    from tiny import question

    rows = [{"prompt": [{"role": "user", "content": question(a, b)}], "ground_truth": str(a + b)} for a, b in pairs]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _recipe(name: str, path: Path, **overrides) -> str:
    recipe = yaml.safe_load((BENCHMARKS.parent / "recipes" / name).read_text())
    recipe.pop("system_prompt")  # the tiny model learnt the bare question
    recipe.pop("task_config", None)  # the options of the recipe's reasoning-gym task, replaced by a file here
    recipe.update(overrides)
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_arpo_vs_grpo_end_to_end_on_the_tiny_model(tool_model_dir, tmp_path):
    """The real pipeline (train + eval subprocesses per method, pairwise ratios, table, plots) on the tiny model,
    checked against each run's own files: its trees show the method (GRPO: M global paths; ARPO: N global paths
    and forks, τ=1 and β=0 forking at every tool result while the budget lasts; M per group either way), and
    the report's numbers are the ones its metrics, trees and evaluation records hold."""
    bench = load("arpo_vs_grpo")
    m, n, prompts = 4, 2, 2
    train = _recipe("arpo_vs_grpo.yaml", tmp_path / "train.yaml", branch_threshold=1.0, entropy_weight=0.0,
                    dataset_name=_addition_questions(tmp_path / "train.jsonl", [(a, 2 * a + 1) for a in range(8)]))
    heldout = _recipe("eval_quickstart.yaml", tmp_path / "eval.yaml",
                      dataset_name=_addition_questions(tmp_path / "eval.jsonl", [(40 + a, 7) for a in range(3)]))
    report = bench.main(["--model", str(tool_model_dir), "--seeds", "0", "--steps", "1", "--methods", "arpo", "grpo",
                         "--num-generations", str(m), "--initial-rollouts", str(n), "--prompts-per-step",
                         str(prompts), "--max-completion-length", "48", "--eval-questions", "3", "--skip-vllm",
                         "--recipe", train, "--eval-recipe", heldout, "--out", str(tmp_path / "out")])
    assert sorted(r["method"] for r in report["runs"]) == ["arpo", "grpo"]
    own = {}  # per method, the per-step means recomputed from the run's own files
    for run in report["runs"]:
        run_dir = tmp_path / "out" / "seed0" / run["method"]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        [step] = [row for row in metrics if "step_time" in row]
        groups = defaultdict(list)
        for record in read_jsonl(run_dir / "trees.jsonl"):
            groups[record["step"], record["group"]].append(record)
        assert len(groups) == prompts
        for records in groups.values():
            kinds = Counter(r["kind"] for r in records)
            assert len(records) == m, kinds  # exactly M trajectories per prompt
            if run["method"] == "grpo":
                assert kinds == {"global": m} and all(r["parent"] is None for r in records)
            else:
                assert kinds["global"] == n and kinds["branch"] + kinds["fill"] == m - n, kinds
            nodes = {r["node"]: r for r in records}
            for r in records:  # a branch starts inside its parent, in its own group
                assert (r["kind"] == "branch") == (r["parent"] is not None)
                if r["parent"] is not None:
                    assert 0 < r["fork_position"] <= nodes[r["parent"]]["length"]
        forks = sum(r["kind"] == "branch" for records in groups.values() for r in records)
        assert (forks > 0) if run["method"] == "arpo" else forks == 0, (run["method"], forks)
        own[run["method"]] = {
            "forks_per_group": forks / prompts,
            "tokens_generated_per_group": sum(r["own_tokens"] for g in groups.values() for r in g) / prompts,
            "tokens_trained_per_group": sum(s["end"] - s["start"] for g in groups.values() for r in g
                                            for s in r["segments"] if s["kind"] == "model") / prompts,
            "tool_calls_per_group": step["arpo/tool_calls_per_group"], "step_seconds": step["step_time"],
            "rollout_seconds": step["arpo/rollout_seconds"], "reward": step["reward"],
        }
        assert run["mean"] == pytest.approx({**run["mean"], **own[run["method"]]}), run["method"]
        records = json.loads((run_dir / "eval" / "eval_results.json").read_text())["records"]
        correct = [c["correct"] for record in records for c in record["completions"]]
        assert len(correct) == 3 and run["heldout_pass@1"] == pytest.approx(sum(correct) / 3)
    assert own["arpo"]["tool_calls_per_group"] > 0  # the tiny model called <python>, so ARPO had tool results
    ratios, differences = report["ratios"]["arpo/grpo"], report["ratios"]["arpo - grpo"]
    for key in bench.RATIO_KEYS:
        assert ratios[key] == pytest.approx(own["arpo"][key] / own["grpo"][key]), key
    assert differences["reward"] == pytest.approx(own["arpo"]["reward"] - own["grpo"]["reward"])
    arpo = next(r for r in report["runs"] if r["method"] == "arpo")
    grpo = next(r for r in report["runs"] if r["method"] == "grpo")
    assert differences["heldout_pass@1"] == pytest.approx(arpo["heldout_pass@1"] - grpo["heldout_pass@1"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.startswith("| method |")
    assert f"| arpo | {own['arpo']['tool_calls_per_group']:.3g} | {own['arpo']['tokens_generated_per_group']:.3g} |" \
        in table
    for plot in report["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
