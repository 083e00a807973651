"""The benchmark scripts on tiny settings: what each report says is checked against what its runs did (their
trees, metrics and evaluation records; the sandbox's own clock), never against a speed."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from types import ModuleType, SimpleNamespace

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


def _as_json(value) -> str:
    """Reports compared as JSON text: a ratio undefined on both sides (0/0, e.g. a peak RSS that did not grow) is NaN,
    and NaN != NaN in a dict comparison."""
    return json.dumps(value, sort_keys=True)


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "step_time" in row]


@pytest.mark.long  # 5 min: 16 training subprocesses; the report's parts have their own tests below
def test_arpo_vs_grpo_end_to_end_on_the_tiny_models(tool_model_dir, qwen_chat_model_dir, tmp_path):
    """The real pipeline on tiny models: ARPO and GRPO with tag calls, ARPO with chat-template calls, TRL's own
    GRPOTrainer(tools=…) (its train subprocess, `benchmarks/trl_peer.py`) and AEPO with every option; two settings
    (the second ARPO's only, `--second-row-methods`) and two seeds (TRL's peer, 5x slower a step, the first only,
    `--peer-seeds`); the main row's runs and each cold-start model evaluated in a subprocess. The report is checked
    against each run's own files: trees show the method (GRPO: M global paths; ARPO: N global, τ=1 and β=0 forking
    at every tool result while the budget lasts; AEPO: the global samples its pre-monitoring chose), and every
    mean, pass@1 and bootstrap estimate is the one its metrics and evaluation records give."""
    bench = load("arpo_vs_grpo")
    train_file = _addition_questions(tmp_path / "train.jsonl", [(a, 2 * a + 1) for a in range(8)])
    train = _recipe("arpo_vs_grpo.yaml", tmp_path / "train.yaml", branch_threshold=1.0, entropy_weight=0.0,
                    dataset_name=train_file, model_name_or_path=str(tool_model_dir), max_completion_length=48)
    chat = _recipe("arpo_vs_grpo_chat.yaml", tmp_path / "chat.yaml", dataset_name=train_file,
                   model_name_or_path=str(qwen_chat_model_dir), max_completion_length=24, max_tool_calls=1)
    heldout = _recipe("eval_multi_call.yaml", tmp_path / "eval.yaml", batch_size=4,
                      dataset_name=_addition_questions(tmp_path / "eval.jsonl", [(40 + a, 7) for a in range(3)]))
    out = tmp_path / "out"
    methods = ["--methods", "arpo", "grpo", "arpo_chat", "trl_grpo", "aepo", "--cold-start", "recipe"]
    report = bench.main([*methods, "--seeds", "0", "1", "--peer-seeds", "0", "--steps", "1", "--settings", "4:2", "2:1",
                         "--second-row-methods", "arpo", "--eval-questions", "3", "--eval-samples", "2",
                         "--eval-backend", "transformers", "--bootstrap", "200", "--recipe", train,
                         "--chat-recipe", chat, "--eval-recipe", heldout,
                         "--out", str(out), "--results", str(tmp_path / "published")])
    plan = Counter((r["setting"], r["method"]) for r in report["runs"])
    assert plan == {("M4N2", m): 2 for m in ("arpo", "grpo", "arpo_chat", "aepo")} | {("M4N2", "trl_grpo"): 1,
                                                                                    ("M2N1", "arpo"): 2}
    for run in report["runs"]:
        run_dir = Path(run["dir"])
        assert run_dir == out / run["setting"] / f"seed{run['seed']}" / run["method"]
        [step] = _steps(run_dir)
        m = int(run["setting"][1:].split("N")[0])
        if run["method"] == "trl_grpo":  # TRL's loop, logged in TRL's own keys, converted per group of M
            assert not (run_dir / "trees.jsonl").exists()
            assert step["arpo/tool_calls_per_group"] == pytest.approx(step["tools/call_frequency"] * m)
            assert step["arpo/tokens_generated_per_group"] == pytest.approx(step["completions/mean_length"] * m)
        else:
            groups = defaultdict(list)
            for record in read_jsonl(run_dir / "trees.jsonl"):
                groups[record["group"]].append(record)
            for records in groups.values():
                kinds = Counter(r["kind"] for r in records)
                assert len(records) == m, kinds  # exactly M trajectories per prompt
                if run["method"] == "aepo":  # one prompt per step: pre-monitoring's m is this group's
                    assert kinds["global"] == step["arpo/global_samples_per_group"]
                else:
                    assert kinds == {"global": m} if run["method"] == "grpo" else kinds["global"] == m // 2
        expected = {ours: step[key] for key, ours in bench.PER_STEP.items() if key in step}
        assert {k: v for k, v in run["mean"].items() if k in expected} == pytest.approx(expected), run["method"]
        assert run["mean"]["peak_rss_mb"] > 0
        if run["method"] != "trl_grpo":  # distinct completions of the group, from its trees
            distinct = len({json.dumps(r["segments"]) for r in read_jsonl(run_dir / "trees.jsonl")})
            assert run["mean"]["distinct_completions_per_group"] == distinct
        if run["setting"] == "M2N1":  # only the main row is evaluated
            assert "eval" not in run and not (run_dir / "eval").exists()
            continue
        evaluation = json.loads((run_dir / "eval" / "eval_results.json").read_text())
        records = evaluation["records"]
        assert [len(r["completions"]) for r in records] == [2, 2, 2]
        assert run["eval"]["format_valid_rate"] == evaluation["summary"]["format_valid_rate"]["mean"]
        assert run["eval"]["pass@1"] == pytest.approx(sum(r["num_correct"] for r in records) / 6)
    arpo_tags = [r for r in report["runs"] if r["method"] == "arpo"]
    assert any(r["mean"]["forks_per_group"] > 0 for r in arpo_tags)  # the tiny tool model called <python>
    assert set(report["cold_start"]) == {"tags", "chat_template"}
    for fmt in report["cold_start"]:
        assert (out / f"cold_start_recipe_{fmt}" / "eval_results.json").is_file()
    summary = report["summary"]["M4N2"]["arpo"]
    mine = [r for r in arpo_tags if r["setting"] == "M4N2"]
    assert summary["reward"] == pytest.approx(sum(r["mean"]["reward"] for r in mine) / 2)
    comparisons = dict(report["comparisons"])
    against_cold = {f"M4N2 {m} vs cold start" for m in ("arpo", "grpo", "arpo_chat", "trl_grpo", "aepo")}
    assert set(comparisons) == {"M4N2 arpo vs grpo", "M4N2 arpo_chat vs trl_grpo", "M4N2 arpo vs trl_grpo",
                                "M4N2 aepo vs grpo", "M4N2 aepo vs arpo"} | against_cold
    for name in sorted(against_cold):  # each run's questions against its format's cold start's, paired
        method = name.split()[1]
        cold = report["cold_start"][bench.METHODS[method][0]]["per_question"]
        mine = [r["eval"]["per_question"] for r in report["runs"] if r["method"] == method and "eval" in r]
        gain = comparisons.pop(name)["heldout_pass@1"]  # per seed its pass@1 minus the cold start's; t over seeds
        assert gain["estimate"] == pytest.approx(sum(sum(q) - sum(cold) for q in mine) / 6)
        seeds = 1 if method == "trl_grpo" else 2  # TRL's peer at --peer-seeds only: one seed, its questions' interval
        assert (gain["seeds"], gain["interval"]) == (seeds, "t" if seeds == 2 else "units") and len(gain["per_seed"]) \
            == seeds
    crossed = comparisons["M4N2 arpo vs trl_grpo"]["heldout_gain@1"]  # tag calls against chat calls: gains compared
    assert crossed["estimate"] == pytest.approx(
        comparisons["M4N2 arpo vs trl_grpo"]["heldout_pass@1"]["estimate"]
        - statistics.fmean(report["cold_start"]["tags"]["per_question"])
        + statistics.fmean(report["cold_start"]["chat_template"]["per_question"]))
    assert "heldout_gain@1" not in comparisons["M4N2 arpo vs grpo"]
    for name, values in comparisons.items():
        setting, method, _, base = name.split()
        runs = {(r["method"], r["seed"]): r for r in report["runs"] if r["setting"] == setting}
        seeds = sorted({s for m, s in runs if m == method} & {s for m, s in runs if m == base})  # paired seeds
        tokens = values["tokens_generated_per_group"]  # per seed the ratio of its runs' means; their mean
        ratios = {str(s): runs[method, s]["mean"]["tokens_generated_per_group"]
                  / runs[base, s]["mean"]["tokens_generated_per_group"] for s in seeds}
        assert tokens["per_seed"] == pytest.approx(ratios) and tokens["seeds"] == len(seeds)
        if len(seeds) > 1:  # one seed: the bootstrap over its steps' units
            assert tokens["estimate"] == pytest.approx(statistics.fmean(ratios.values()))
        passed = values["heldout_pass@1"]
        assert passed["per_seed"] == pytest.approx({str(s): runs[method, s]["eval"]["pass@1"] - runs[base, s]["eval"][
            "pass@1"] for s in seeds}) and passed["seeds"] == len(seeds)
        if len(seeds) > 1:
            assert passed["estimate"] == pytest.approx(statistics.fmean(passed["per_seed"].values()))
        for value in values.values():
            assert value["low"] <= value["high"]
        if method == "arpo_chat":  # the random chat model makes no calls: no ratio of zeros
            assert "tool_calls_per_group" not in values
    forks = report["fork_probabilities"]  # τ = 1, β = 0: every decision drew P = 1 and matches forking at random
    assert {"arpo"} <= set(forks["M4N2"]) <= {"arpo", "aepo"} and set(forks["M2N1"]) == {"arpo"}
    for setting, by_method in forks.items():
        recorded = sum(len(r.get("decisions", [])) for run in report["runs"] if (run["setting"], run["method"]) == (
            setting, "arpo") for r in read_jsonl(Path(run["dir"]) / "trees.jsonl"))
        pooled = by_method["arpo"]["pooled"]
        assert sum(stats["decisions"] for stats in pooled.values()) == recorded > 0
        assert all(set(s["quantiles"].values()) == {1.0} and s["changed_share"] == s["mean_abs_shift"] == 0
                   for s in pooled.values())
    table = (out / "results.md").read_text()
    assert "Fork probabilities" in table and "| M4N2 | arpo | first |" in table
    assert "| M4N2 | trl_grpo |" in table and "| M4N2 arpo_chat vs trl_grpo |" in table and "(2 seeds)" in table
    for plot in report["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    published = json.loads((tmp_path / "published" / "results.json").read_text())
    assert published == json.loads((out / "results.json").read_text())
    assert published["commit"] and len(published["load_end"]) == 3
    assert _as_json(published["comparisons"]) == _as_json(report["comparisons"])
    again = bench.main([*methods, "--report-only", "--seeds", "0", "1", "--peer-seeds", "0", "1", "--steps", "1",
                        "--settings", "4:2", "2:1", "--bootstrap", "200", "--recipe", train, "--chat-recipe", chat,
                        "--out", str(out)])
    assert _as_json(again["comparisons"]) == _as_json(report["comparisons"])
    assert again["cold_start"] == report["cold_start"]
    parts = []  # each seed's runs in a results file of its own, as seed pairs run in separate sessions are published
    for seed in (0, 1):
        parts.append(tmp_path / f"seed{seed}.json")
        parts[-1].write_text(json.dumps(published | {"runs": [r for r in published["runs"] if r["seed"] == seed]}))
    recorded = [*methods, "--report-only", "--seeds", "0", "1", "--peer-seeds", "0", "1", "--steps", "1", "--settings",
                "4:2", "2:1", "--bootstrap", "200", "--recipe", train, "--chat-recipe", chat,
                "--out", str(tmp_path / "merged")]
    merged = bench.main([*recorded, "--runs-from", *map(str, parts)])
    assert _as_json(merged["comparisons"]) == _as_json(report["comparisons"])
    assert _as_json(merged["fork_probabilities"]) == _as_json(report["fork_probabilities"])
    assert [source["file"] for source in merged["runs_from"]] == [str(part) for part in parts]
    with pytest.raises(SystemExit, match=r"\('M4N2', 0, 'arpo'\) is recorded in both"):
        bench.main([*recorded, "--runs-from", str(parts[0]), str(parts[0])])
    # Seed 0 as a file written before runs kept their cold start; seed 1 from a machine whose tag cold start scored 1:
    # each run is measured against its own file's cold start, and the "before RL" row pools the two.
    first, other = (json.loads(part.read_text()) for part in parts)
    for run in first["runs"] + other["runs"]:
        run.get("eval", {}).pop("cold_start_per_question", None)
    tags = report["cold_start"]["tags"]
    other["cold_start"]["tags"] = tags | {"pass@1": 1.0, "per_question": [1.0] * len(tags["per_question"])}
    parts[0].write_text(json.dumps(first))
    parts[1].write_text(json.dumps(other))
    pooled = bench.main([*recorded, "--runs-from", *map(str, parts)])
    assert pooled["cold_start"]["tags"]["evaluations"] == [tags["pass@1"], 1.0]
    assert pooled["cold_start"]["tags"]["pass@1"] == pytest.approx((tags["pass@1"] + 1) / 2)
    assert pooled["cold_start"]["chat_template"] == report["cold_start"]["chat_template"]  # the same in both files
    gain = pooled["comparisons"]["M4N2 arpo vs cold start"]["heldout_pass@1"]["per_seed"]
    runs = {r["seed"]: r for r in report["runs"] if (r["setting"], r["method"]) == ("M4N2", "arpo")}
    assert gain == pytest.approx({"0": runs[0]["eval"]["pass@1"] - tags["pass@1"],
                                  "1": runs[1]["eval"]["pass@1"] - 1})
    assert "mean of 2 machines' evaluations" in (tmp_path / "merged" / "results.md").read_text()
    other["config"]["steps"] = 2  # another experiment
    parts[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="report them separately"):
        bench.main([*recorded, "--runs-from", *map(str, parts)])


@pytest.mark.long  # the flags' path to the trainer: test_each_ablation_trains_arpo_with_its_one_setting_changed
def test_arpo_vs_grpo_stacks_reach_their_runs(tool_model_dir, tmp_path):
    """`--stacks`: each method trains on each stack in its own folder and the report compares them. The flags reach
    the trainer: a base run forwards all M rows in full (per group, M × (prompt + longest completion)), a packed run
    the group's tree once (≤ prompt + each trajectory's tokens after its fork), for the same seed's prompt."""
    bench = load("arpo_vs_grpo")
    assert bench.stack_flags("arpo", "base") == ["--tree_packing", "false", "--in_process_engine", "waves"]
    assert bench.stack_flags("trl_grpo", "packed_cached") == ["--use_transformers_continuous_batching", "true"]
    assert bench.stack_flags("grpo", "default") == []
    train_file = _addition_questions(tmp_path / "train.jsonl", [(a, 2 * a + 1) for a in range(8)])
    train = _recipe("arpo_vs_grpo.yaml", tmp_path / "train.yaml", branch_threshold=1.0, entropy_weight=0.0,
                    dataset_name=train_file, model_name_or_path=str(tool_model_dir), max_completion_length=32)
    out = tmp_path / "out"
    report = bench.main(["--methods", "arpo", "grpo", "--cold-start", "recipe", "--stacks", "base", "packed_cached",
                         "--seeds", "0",
                         "--steps", "1", "--settings", "4:2", "--eval-questions", "0", "--bootstrap", "50",
                         "--recipe", train, "--out", str(out)])
    labels = {"arpo@base", "grpo@base", "arpo@packed_cached", "grpo@packed_cached"}
    assert {r["method"] for r in report["runs"]} == labels
    prompt = {}
    for run in report["runs"]:
        assert Path(run["dir"]) == out / "M4N2" / "seed0" / run["method"]
        records = [r for r in read_jsonl(Path(run["dir"]) / "trees.jsonl") if r["group"] == 0]
        mean = run["mean"]
        assert mean["peak_rss_mb"] > 0 and mean["training_seconds"] > 0 and mean["prefill_tokens_per_group"] > 0
        if run["method"].endswith("@base"):  # exactly the prompt's length
            prompt[run["method"]] = mean["tokens_forwarded_per_group"] / 4 - max(r["length"] for r in records)
        else:  # at most the prompt's length
            prompt[run["method"]] = mean["tokens_forwarded_per_group"] - sum(r["length"] - (r["fork_position"] or 0)
                                                                              for r in records)
    for method in ("arpo", "grpo"):
        assert prompt[f"{method}@packed_cached"] <= prompt[f"{method}@base"] == int(prompt[f"{method}@base"]) > 0
    assert set(report["comparisons"]) == {f"M4N2 {a} vs {b}" for a, b in [
        ("arpo@base", "grpo@base"), ("arpo@packed_cached", "grpo@packed_cached"), ("arpo@packed_cached", "arpo@base"),
        ("grpo@packed_cached", "grpo@base"), ("arpo@packed_cached", "grpo@base")]}
    assert "| M4N2 arpo@packed_cached vs grpo@base |" in (out / "results.md").read_text()


def test_trl_peer_reads_calls_from_trl_messages_and_shares_the_python_schema():
    peer = load("trl_peer")
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
    completion = [{"role": "assistant", "content": "<think>x</think>", "tool_calls": [call, call]},
                  {"role": "tool", "content": "1"}, {"role": "tool", "content": "1"},
                  {"role": "assistant", "content": "", "tool_calls": [call]}]  # the last call hit the limit
    calls = peer.trl_calls(completion)
    assert [c["result_start"] is not None for c in calls] == [True, True, False]
    from arpo_trl.rewards import arpo_math_reward

    answered = completion[:3] + [{"role": "assistant", "content": "<answer>\\boxed{1}</answer>"}]
    reward = peer.with_trl_calls(arpo_math_reward)
    assert reward([answered, completion], ground_truth=["1", "1"]) == [1.0, -1.0]
    from arpo_trl.tools.python import PythonTool

    tool, seconds = PythonTool(timeout=5), []
    python = peer.python_function(tool, seconds)
    assert python("print(6 * 7)").strip() == "42" and len(seconds) == 1
    tool.close()


def test_trl_peer_recipe_drops_the_arpo_only_fields(tmp_path):
    peer = load("trl_peer")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"branch_policy": "entropy", "initial_rollouts": 8, "max_tool_calls": 3,
                                      "tool_call_format": "chat_template", "num_generations": 16, "beta": 0.0}))
    argv = peer.grpo_recipe(["--config", str(recipe), "--seed", "1"])
    assert argv[0] == "--config" and argv[2:] == ["--seed", "1"]
    assert yaml.safe_load(Path(argv[1]).read_text()) == {"max_tool_calling_iterations": 3, "num_generations": 16,
                                                         "beta": 0.0}


def test_merged_adapter_is_the_adapted_model(tiny_model_dir, tokenizer, tmp_path):
    """Held-out evaluation through vLLM serves each run as one merged model: the same logits as base + LoRA."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    merged_dir = load("arpo_vs_grpo").merge_adapter(str(tiny_model_dir), tmp_path / "adapter", tmp_path / "merged")
    ids = torch.tensor([tokenizer.encode("What is 3+4? <python>print(3+4)</python>")])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)(ids).logits
        assert torch.allclose(merged, reference(ids).logits, atol=1e-5)
        assert not torch.allclose(merged, base, atol=1e-3)  # the adapter did change the model
    assert (merged_dir / "tokenizer_config.json").is_file()


@pytest.mark.long  # 80 s of training runs; packing's maths: tests/test_tree_packing.py
def test_packed_training_reports_what_its_runs_measured(tmp_path, capsys):
    """benchmarks/packed_training.py on the tiny Llama: every configuration ran, packing forwarded fewer tokens per
    group than unpacked rows for both methods, and the report's ratios are those of its runs."""
    bench = load("packed_training")
    report = bench.main(["--settings", "4:2", "--seeds", "0", "1", "--steps", "1", "--layers", "1", "--tiny",
                         "--bootstrap", "20", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(report))
    summary = report["summary"]["M4N2"]
    assert set(summary) == {"arpo_packed", "arpo_unpacked", "grpo_packed", "grpo_unpacked"}
    for method in ("arpo", "grpo"):
        assert summary[f"{method}_packed"]["tokens_forwarded_per_group"] < \
            summary[f"{method}_unpacked"]["tokens_forwarded_per_group"]
    ratio = report["comparisons"]["arpo_packed / arpo_unpacked (M4N2)"]["tokens_forwarded_per_group"]
    forwarded = {(r["config"], r["seed"]): r["steps"][0]["tokens_forwarded_per_group"] for r in report["runs"]}
    per_seed = {str(s): forwarded["arpo_packed", s] / forwarded["arpo_unpacked", s] for s in (0, 1)}
    assert ratio["per_seed"] == pytest.approx(per_seed) and ratio["interval"] == "t"
    assert ratio["estimate"] == pytest.approx(sum(per_seed.values()) / 2)
    assert "| M4N2 | arpo_packed |" in capsys.readouterr().out
    again = bench.main(["--runs-from", str(tmp_path / "results.json"), "--out", str(tmp_path / "again")])
    assert _as_json(again["comparisons"]) == _as_json(report["comparisons"])
    assert again["runs"] == report["runs"]


def test_prefill_batching_replays_the_joins_its_rollouts_made(tool_model_dir, capsys):
    """benchmarks/prefill_batching.py on the tiny Llama: the replay groups every recorded step's joins as the engine
    did in its rollout (the same forwards), never into more forwards than requests, and prefills each request once."""
    bench = load("prefill_batching")
    report = bench.main(["--model", str(tool_model_dir), "--prompts", "2", "--num-generations", "4",
                         "--initial-rollouts", "2", "--max-tokens", "40"])
    for policy in ("entropy", "none"):
        run = report["policies"][policy]
        assert run["requests_prefilled"] == sum(map(len, run["joins"])) == run["forwards"]["one_by_one"] > 0
        assert run["forwards"]["batched"] == run["rollout_prefill_forwards"] <= run["requests_prefilled"]
        assert all(new >= 1 and start >= 0 for call in run["joins"] for start, new in call)
        assert run["seconds"]["batched"] > 0 and run["seconds"]["one_by_one"] > 0
    assert "| entropy |" in capsys.readouterr().out


def test_packed_head_times_both_ways_on_the_same_steps(tiny_model_dir, capsys):
    """benchmarks/packed_head.py on the tiny Llama: every row count timed both ways, with logits that agree."""
    report = load("packed_head").main(["--model", str(tiny_model_dir), "--rows", "1,3", "--context", "9",
                                       "--steps", "2"])
    assert [step["rows"] for step in report["decode_steps"]] == [1, 3]
    for step in report["decode_steps"]:
        assert step["plain_ms"] > 0 and step["packed_ms"] > 0 and step["pack_seconds"] >= 0
        assert step["max_logit_difference"] < 1e-4
    assert "| 3 |" in capsys.readouterr().out


def test_fork_decision_statistics_measure_how_far_entropy_moved_p():
    """P's quantiles, its mean distance from τ, and the share of decisions (u < P) that forking at random (u < τ)
    would have decided the other way, on hand-counted decisions."""
    bench = load("arpo_vs_grpo")
    pairs = [(0.5, 0.1), (0.7, 0.6), (0.3, 0.4), (0.5, 0.9)]  # the 2nd forked (random not), the 3rd not (random did)
    stats = bench.decision_statistics(pairs, tau=0.5)
    assert stats["decisions"] == 4 and stats["changed_share"] == 0.5
    assert stats["mean_abs_shift"] == pytest.approx(0.1) and stats["quantiles"]["p50"] == pytest.approx(0.5)


def test_arpo_vs_grpo_curves_smooth_with_a_trailing_mean():
    bench = load("arpo_vs_grpo")
    assert bench.trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert bench.trailing_mean([], 10) == []


def test_each_ablation_trains_arpo_with_its_one_setting_changed(tmp_path, monkeypatch):
    """`arpo_*` methods: the recipe's ARPO with one flag after the others; the train command's parser keeps the last."""
    from arpo_trl.commands.train import parse_train_args

    bench = load("arpo_vs_grpo")
    sent = []

    def run(*argv, log, watch=None):  # the command it would run, instead of running it
        sent.append(argv[3:])
        log.parent.mkdir(parents=True, exist_ok=True)
        return {}

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "cold_start_model", lambda args, fmt: "model")
    args = bench.parse_args(["--cold-start", "recipe", "--out", str(tmp_path)])
    expected = {"arpo_tau1": ("branch_threshold", 1.0), "arpo_beta1": ("entropy_weight", 1.0),
                "arpo_hard": ("advantage_attribution", "hard"), "arpo_n4": ("initial_rollouts", 4)}
    assert set(expected) == set(bench.ABLATIONS) and all(bench.METHODS[m] == ("tags", "entropy") for m in expected)
    for method, (field, value) in expected.items():
        bench.train(args, method, (16, 8), 0)
        _, training_args, _ = parse_train_args(list(sent[-1]))
        assert getattr(training_args, field) == value and training_args.branch_policy == "entropy"
        assert training_args.num_generations == 16 and (method == "arpo_n4" or training_args.initial_rollouts == 8)
    assert ("arpo_hard", "grpo") in bench.PAIRS and ("arpo_hard", "arpo") in bench.PAIRS


def test_timed_steps_read_a_run_s_own_steps_and_skip_a_line_being_written(tmp_path):
    bench = load("arpo_vs_grpo")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "step_time": 3.5, "reward": 0.1}\n{"step": 1, "loss": 2}\n{"step": 2, "step_ti')
    assert bench.timed_steps(metrics, since=0) == [3.5]
    assert bench.timed_steps(metrics, since=metrics.stat().st_mtime + 1) == []  # a run before this one wrote it
    assert bench.timed_steps(tmp_path / "missing.jsonl", since=0) == []
    metrics.write_text('{"step": 1, "step_ti\n{"step": 2, "step_time": 4.0}\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl, line 1: not JSON"):
        bench.timed_steps(metrics, since=0)


def test_the_forecast_is_rescaled_by_this_machine_s_step_time_while_a_run_trains(tmp_path, monkeypatch):
    """A real subprocess logs its steps as a training run does; the watch says the rescaled forecast after the first
    step, while the process still runs (it waits for that), and again once the run is done."""
    bench = load("arpo_vs_grpo")
    monkeypatch.setattr(bench, "WATCH_SECONDS", 0.05)
    args = bench.parse_args(["--methods", "arpo", "grpo", "--seeds", "4", "--eval-questions", "0", "--out",
                             str(tmp_path)])
    assert bench.expected_seconds(args) == 2 * 60 * 18.0  # two runs of 60 steps, 18 s each on the calibration CPU
    run_dir, seen = tmp_path / "M16N8" / "seed4" / "arpo", tmp_path / "seen"
    run_dir.mkdir(parents=True)
    said = []
    forecast = bench.Forecast(args, say=lambda text: (said.append(text), seen.touch()))
    watch = forecast.watch(run_dir, "arpo", (16, 8))
    script = f"""
import json, pathlib, time
metrics, seen = pathlib.Path({str(run_dir / "metrics.jsonl")!r}), pathlib.Path({str(seen)!r})
with metrics.open("a") as file:
    file.write(json.dumps({{"step": 1, "step_time": 54.0}}) + "\\n")
for _ in range(6000):  # until the watch has said it (at most 60 s)
    if seen.exists():
        break
    time.sleep(0.01)
with metrics.open("a") as file:
    file.write(json.dumps({{"step": 2, "step_time": 90.0}}) + "\\n")
"""
    bench.run("-c", script, watch=watch)
    assert said == ["arpo_vs_grpo: arpo's first step took 54 s; this machine runs at 3.0x the forecast's time "
                    f"({bench.CALIBRATION}): ~1.8 h left at that rate"]
    watch(finished=True)  # (54 + 90) / (2 * 18) = 4
    assert said[1] == ("arpo_vs_grpo: arpo took 72 s a step over its 2; this machine runs at 4.0x the forecast's time "
                       f"({bench.CALIBRATION}): ~2.4 h left at that rate")
    watch(finished=True)
    assert len(said) == 2  # nothing new to count


def test_a_failing_watch_stops_the_command_it_watches(tmp_path):
    bench = load("arpo_vs_grpo")

    def watch():
        raise RuntimeError("watch failed")

    with pytest.raises(RuntimeError, match="watch failed"):  # not after the child's 10 minutes: it was killed
        bench.run("-c", "import time; time.sleep(600)", watch=watch)


def test_rollout_throughput_policies_make_their_samplers_and_refuse_the_removed_variants(tokenizer):
    from test_rollout import AsyncScriptedEngine

    make = load("rollout_throughput").make_sampler
    args = SimpleNamespace(num_generations=8, initial_rollouts=4, max_tokens=32, seed=0)
    engine = AsyncScriptedEngine(tokenizer, lambda text, rng: ("", 0.0, "stop"))
    assert make(engine, tokenizer, args, "entropy").rule.initial_rollouts == 4
    assert make(engine, tokenizer, args, "none").rule.initial_rollouts == 8
    assert make(engine, tokenizer, args, "entropy").scheduler.speculation == "auto"
    assert make(engine, tokenizer, args, "entropy:off").scheduler.speculation == "off"
    for policy in ("entropy:certain-fills", "entropy:late-fills", "entropy:fast"):
        with pytest.raises(ValueError, match="unknown variant"):
            make(engine, tokenizer, args, policy)


def test_rollout_throughput_splits_the_colocated_prefill_by_request_kind():
    """A branch's first request sends its parent's tokens after the tool result: among the requests with those
    tokens, the branches' are the cheapest (the parent's computed the blocks they then find cached)."""
    from arpo_trl.rollout.paths import Trajectory

    split = load("rollout_throughput").prompt_tokens_computed_by_kind
    prompt, done = [1, 2, 3], [4, 5, 6, 7]
    parent = Trajectory(0, 0, prompt, "global", completion_ids=done + [8, 9])
    branch = Trajectory(1, 0, prompt, "branch", parent=0, fork_position=4, completion_ids=done + [10])
    fill = Trajectory(2, 0, prompt, "fill", completion_ids=[11])
    fork_point = hash(tuple(prompt + done))
    log = [(3, 0, hash(tuple(prompt))), (3, 2, hash(tuple(prompt))),  # the global path's and the fill-up's starts
           (7, 3, fork_point), (7, 6, fork_point),  # the parent's continuation (4 computed), the branch's (1)
           (9, 8, hash(tuple(prompt + done + [8, 9])))]  # a later continuation of the parent
    result = SimpleNamespace(trajectories=[parent, branch, fill])
    assert split(log, result) == {"prompt_tokens_computed_start": 4, "prompt_tokens_computed_fork": 1,
                                  "prompt_tokens_computed_continuation": 5}
    # two siblings at that fork point, and a branch of the branch after its own tool result
    sibling = Trajectory(3, 0, prompt, "branch", parent=0, fork_position=4, completion_ids=done + [12])
    nested = Trajectory(4, 0, prompt, "branch", parent=1, fork_position=5, completion_ids=done + [10, 13])
    deeper = hash(tuple(prompt + done + [10]))
    log += [(7, 5, fork_point), (8, 2, deeper), (8, 7, deeper)]  # the sibling (2); the branch's request, its branch's
    result = SimpleNamespace(trajectories=[parent, branch, fill, sibling, nested])
    assert split(log, result) == {"prompt_tokens_computed_start": 4, "prompt_tokens_computed_fork": 1 + 2 + 1,
                                  "prompt_tokens_computed_continuation": 5 + 6}


def test_rollout_throughput_cost_fit_recovers_a_known_cost_and_removes_the_fork_prefill():
    fit = load("rollout_throughput").colocate_cost_fit
    per_step, per_token = 0.02, 0.0015  # seconds
    def run(steps, tokens, forks=0):
        walls = [per_step * s + per_token * t for s, t in zip(steps, tokens)]
        return {"engine_steps_all": steps, "tokens_computed_all": tokens, "wall_s_all": walls,
                "wall_s": statistics.mean(walls), "prompt_tokens_computed_fork": forks}
    runs = {"vllm-colocate/entropy": run([140, 150], [14000, 15000], forks=800),
            "vllm-colocate/none": run([130, 132], [17000, 17400]), "transformers/none": run([1], [1])}
    report = fit(runs, ["entropy", "none"])
    assert report["rollouts"] == 4 and report["residual_rms_s"] == 0.0
    assert report["ms_per_step"] == 20.0 and report["ms_per_computed_token"] == 1.5
    arpo, grpo = runs["vllm-colocate/entropy"]["wall_s"], runs["vllm-colocate/none"]["wall_s"]
    assert report["arpo_vs_grpo_without_fork_prefill"] == {"entropy": round((arpo - 800 * per_token) / grpo, 3)}


def test_test_durations_sums_a_junit_report_by_file_and_by_kind(tmp_path):
    """A JUnit report of five cases: seconds by file and by kind (markers, a parametrized case marked `long` alone,
    the sandbox's file, a test that builds a trainer), and outcomes."""
    bench = load("test_durations")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import pytest\n\n\n@pytest.mark.vllm\ndef test_served():\n    pass\n\n\n"
        "@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.long)])\n"
        "def test_cases(x):\n    pass\n\n\n"
        "def test_trains():\n    ARPOTrainer(model=None)\n")
    (tests / "test_sandbox.py").write_text("def test_hostile():\n    pass\n")
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_served" time="30.0"/>'
        '<testcase classname="tests.test_a" name="test_cases[1]" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_cases[2]" time="4.0"/>'
        '<testcase classname="tests.test_a" name="test_trains" time="2.0"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_sandbox" name="test_hostile" time="3.0"><skipped/></testcase>'
        '<testcase classname="tests.test_a" name="test_cases[3]" time="0.5">'
        '<properties><property name="markers" value="colocate,long"/></properties></testcase>'
        "</testsuite></testsuites>")
    rows = bench.read_junit(junit, bench.test_kinds(tests))
    assert [row["kind"] for row in rows] == ["vllm server", "logic", "long", "tiny-model training", "sandbox",
                                             "colocate"]  # the last: as the run recorded its markers
    rows = rows[:-1]
    summary = bench.summarize(rows)
    assert summary["by_file"] == {"test_a": 37.5, "test_sandbox": 3.0} and summary["seconds"] == 40.5
    assert summary["by_kind"]["long"] == 4.0 and summary["outcomes"] == {"passed": 3, "failed": 1, "skipped": 1}
    table = bench.table({"runs": {"before": summary, "after": bench.summarize(rows[:2])}})
    assert "| vllm server | 30 s | 30 s |" in table and "| **tests (sum)** | 40 s | 32 s |" in table
