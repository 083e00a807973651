"""`arpo-trl eval`: the pass@k estimator, answer scoring per metric, exact metrics from a scripted engine, a real run
from YAML on a tiny random model (with and without a LoRA adapter), and one-line errors for user mistakes."""

from __future__ import annotations

import json
import math
import re
import statistics
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from datasets import Dataset

from arpo_trl.cli import main
from arpo_trl.commands.eval_setup import RESULTS_FILE, EvalArguments, EvalSetup, check_args
from arpo_trl.commands.evaluate import evaluate, make_eval_parser
from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.rewards.eval_metrics import pass_at_k, score_answer, score_completion, tool_call_counts
from arpo_trl.rollout.paths import ToolCallRecord
from arpo_trl.tools.base import Tool

RECIPE = Path(__file__).parents[1] / "recipes" / "eval_quickstart.yaml"


# ---- pass@k ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,c,k,expected", [
    (5, 0, 1, Fraction(0)),
    (5, 2, 1, Fraction(2, 5)),
    (5, 2, 2, Fraction(7, 10)),       # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, Fraction(11, 12)),     # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (16, 1, 4, Fraction(1, 4)),       # 1 - C(15,4)/C(16,4) = 1 - 1365/1820
    (4, 1, 4, Fraction(1)),           # n - c < k: every draw of k holds the correct one
    (5, 5, 3, Fraction(1)),
    (3, 0, 3, Fraction(0)),
    (1, 1, 1, Fraction(1)),
])
def test_pass_at_k_exact_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_k_grows_with_k():
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values) and values[-1] == (1.0 if c else 0.0)


@pytest.mark.parametrize("n,c,k", [(2, 0, 3), (2, 3, 1), (2, 1, 0), (0, 0, 1), (2, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


# ---- scoring -----------------------------------------------------------------------------------------------------
def test_math_scoring_uses_math_verify_equivalence():
    assert score_answer("\\frac{1}{2}", "0.5", "math") == {"score": 1.0, "correct": 1.0}
    assert score_answer("5.0", "5", "math")["correct"] == 1.0
    assert score_answer("4", "5", "math") == {"score": 0.0, "correct": 0.0}
    assert score_answer(None, "5", "math") == {"score": 0.0, "correct": 0.0}


def test_f1_and_em_scoring_are_squad_style():
    assert score_answer("The Eiffel Tower", "eiffel tower", "f1") == {"score": 1.0, "correct": 1.0, "f1": 1.0,
                                                                      "em": 1.0}
    partial = score_answer("Paris France", "Paris", "f1")  # precision 1/2, recall 1 -> F1 2/3, no exact match
    assert partial["score"] == pytest.approx(2 / 3) and partial["correct"] == 0.0 and partial["em"] == 0.0
    assert score_answer("Paris France", "Paris", "em") == {"score": 0.0, "correct": 0.0, "f1": pytest.approx(2 / 3),
                                                           "em": 0.0}
    assert score_answer("new york city", ["NYC", "New York City"], "em")["correct"] == 1.0
    assert score_answer("no", "yes", "f1")["f1"] == 0.0
    with pytest.raises(ValueError, match="metric: unknown metric 'auto'"):
        score_answer("1", "1", "auto")


def test_score_completion_extracts_the_answer_and_checks_the_format():
    good = "<think>add</think><python>print(2+3)</python> <result>\n5\n</result><answer>\\boxed{5}</answer>"
    scored = score_completion(good, "5", "math")
    assert scored["answer"] == "5" and scored["correct"] == 1.0 and scored["format_error"] is None
    loose = "The answer is \\boxed{5}."
    assert score_completion(loose, "5", "math")["answer"] is None
    assert score_completion(loose, "5", "math", require_answer_tag=False)["correct"] == 1.0
    assert "think" in score_completion(loose, "5", "math")["format_error"]
    calls = [ToolCallRecord("python", "a", result_start=3, result_end=5), ToolCallRecord("search", "q", result_start=8,
             result_end=9, failed=True), ToolCallRecord("python", "b", ran=False)]
    assert tool_call_counts(calls, ["python", "search"]) == {"python": 1, "search": 1}  # the last one did not run
    unanswered = [{"tool": "python", "result_start": None}]
    assert "python call was not answered" in score_completion(good, "5", "math", calls=unanswered)["format_error"]
    assert score_completion(good, "5", "math", calls=[])["format_error"] is None


# ---- exact metrics from a scripted engine --------------------------------------------------------------------------
# SCRIPT[question][attempt]: the segments one trajectory generates (a tool result follows each "stop" segment).
# Seed 0 draws attempts 0-1 of each question, seed 1 attempts 2-3.
SCRIPT = {
    0: [  # ground truth 5
        [("<think>q0a0</think><python>print(5)</python>", "stop"), ("<answer>\\boxed{5}</answer>", "eos")],
        [("<think>q0a1</think><answer>\\boxed{4}</answer>", "eos")],
        [("<think>q0a2</think><answer>\\boxed{5.0}</answer>", "eos")],
        [("<think>q0a3</think><answer>\\boxed{6}</answer>", "eos")],
    ],
    1: [  # ground truth 7
        [("<think>q1a0</think><python>fail()</python>", "stop"), ("<answer>\\boxed{6}</answer>", "eos")],
        [("<think>q1a1</think><search>seven</search>", "stop"), ("<python>print(7)</python>", "stop"),
         ("<answer>\\boxed{7}</answer>", "eos")],
        [("<think>q1a2 still thinking", "length")],
        [("<think>q1a3</think><answer>\\boxed{8}</answer>", "eos")],
    ],
}


class ScriptedEngine(GenerationEngine):
    """A test double for the model only: replays SCRIPT; the sampler, tools and scoring are the real ones."""

    def __init__(self, tokenizer, prompts: list[list[int]]):
        self.tokenizer, self.vocab_size = tokenizer, len(tokenizer)
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.questions = {tuple(p): q for q, p in enumerate(prompts)}
        self.started = dict.fromkeys(range(len(prompts)), 0)
        self.calls = 0

    def generate(self, prefixes, max_new_tokens, stop):
        self.calls += 1
        return [self._segment(list(prefix), budget) for prefix, budget in zip(prefixes, max_new_tokens)]

    def _segment(self, prefix: list[int], budget: int) -> Segment:
        if tuple(prefix) in self.questions:  # a new trajectory
            q = self.questions[tuple(prefix)]
            attempt, step = self.started[q], 0
            self.started[q] += 1
        else:
            text = self.tokenizer.decode(prefix)
            q, attempt = map(int, re.search(r"<think>q(\d)a(\d)", text).groups())
            step = text.count("<result>")
        segment, finish = SCRIPT[q][attempt][step]
        ids = self.tokenizer.encode(segment, add_special_tokens=False) + ([self.eos_token_ids[0]] * (finish == "eos"))
        assert len(ids) <= budget
        return Segment(ids, [0.0] * len(ids), [0.0] * len(ids), finish)


def _python(code: str) -> str:
    if "fail" in code:
        raise RuntimeError("boom")
    return code.removeprefix("print(").removesuffix(")")


def test_scripted_engine_gives_exact_pass_at_k_and_tool_statistics(tokenizer, tmp_path):
    from arpo_trl.commands.eval_setup import prompt_ids

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {q}?"}], "ground_truth": gt}
                              for q, gt in (("2+3", "5"), ("3+4", "7"))])
    engine = ScriptedEngine(tokenizer, [prompt_ids(tokenizer, row["prompt"]) for row in data])
    setup = EvalSetup(engine, tokenizer, [Tool("python", _python), Tool("search", lambda q: "doc")], data, "math")
    args = EvalArguments(n_samples=2, k=[1, 2], seeds=[0, 1], batch_size=1, max_completion_length=256,
                         output_dir=str(tmp_path))
    results = evaluate(args, setup)
    seed0, seed1 = results["per_seed"]
    # seed 0: q0 1/2 correct, q1 1/2; seed 1: q0 1/2 (5.0 == 5), q1 0/2
    assert (seed0["pass@1"], seed0["pass@2"], seed1["pass@1"], seed1["pass@2"]) == (0.5, 1.0, 0.25, 0.5)
    assert results["summary"]["pass@1"] == {"mean": 0.375, "std": pytest.approx(statistics.stdev([0.5, 0.25]))}
    assert results["summary"]["pass@2"] == {"mean": 0.75, "std": pytest.approx(math.sqrt(0.125))}
    assert seed0["tool_calls_per_trajectory"] == 1.0 and seed0["tool_failures_per_trajectory"] == 0.25
    assert seed0["tool_failure_rate"] == 0.25
    assert seed0["tool_use_rate/python"] == 0.75 and seed0["tool_use_rate/search"] == 0.25
    assert seed0["finish_reason/eos"] == 1.0 and seed0["format_valid_rate"] == 1.0 and seed0["answered_rate"] == 1.0
    assert seed1["tool_calls_per_trajectory"] == 0.0 and seed1["tool_use_rate/python"] == 0.0
    assert (seed1["finish_reason/eos"], seed1["finish_reason/length"]) == (0.75, 0.25)
    assert seed1["format_valid_rate"] == 0.75 and seed1["answered_rate"] == 0.75
    assert "finish_reason/length" not in seed0 and results["summary"]["finish_reason/length"]["mean"] == 0.125
    expected_tokens = [sum(len(tokenizer.encode(text, add_special_tokens=False)) + (finish == "eos")
                       for attempt in SCRIPT[q][2 * s : 2 * s + 2] for text, finish in attempt)
                       for s in (0, 1) for q in (0, 1)]
    assert seed0["tokens_generated"] == sum(expected_tokens[:2])
    assert seed1["tokens_generated"] == sum(expected_tokens[2:])
    assert engine.calls == 2 + 3 + 1 + 1  # batch_size 1: rounds per question until every path ended
    records = json.loads((tmp_path / RESULTS_FILE).read_text())["records"]
    assert [(r["seed"], r["index"], r["num_correct"]) for r in records] == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
    failed = records[1]["completions"][0]
    assert (failed["tool_calls"], failed["tool_failures"], failed["answer"]) == (1, 1, "6")
    assert "Error: Tool(python) execution failed" in failed["text"]
    assert records[1]["completions"][1]["calls_by_tool"] == {"python": 1, "search": 1}
    assert (tmp_path / "eval_results.md").read_text().startswith("| metric | seed 0 | seed 1 | mean ± std |")


# ---- the command on a tiny random model ----------------------------------------------------------------------------
def _dataset(path: Path, rows: int = 3, answer_column: str = "ground_truth") -> Path:
    from tiny import question

    with open(path, "w") as f:
        for a in range(rows):
            f.write(json.dumps({"prompt": [{"role": "user", "content": question(a, 2)}], answer_column: str(a + 2)})
                    + "\n")
    return path


def _recipe(tmp_path: Path, model_dir, **overrides) -> Path:
    recipe = {
        "model_name_or_path": str(model_dir), "dataset_name": str(_dataset(tmp_path / "eval.jsonl")),
        "n_samples": 2, "k": [1, 2], "seeds": [0, 1], "metric": "math", "tools": ["python"],
        "max_completion_length": 12, "batch_size": 2, "device": "cpu", "output_dir": str(tmp_path / "eval"),
    }
    recipe.update(overrides)
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_eval_command_writes_results_and_prints_the_table(tiny_model_dir, tmp_path, capsys):
    main(["eval", "--config", str(_recipe(tmp_path, tiny_model_dir)), "--temperature", "1.0"])
    out = capsys.readouterr().out
    assert "| metric | seed 0 | seed 1 | mean ± std |" in out and "| pass@2 |" in out
    results = json.loads((tmp_path / "eval" / RESULTS_FILE).read_text())
    assert set(results) >= {"config", "model", "metric", "summary", "per_seed", "records", "table"}
    assert results["config"]["temperature"] == 1.0 and results["metric"] == "math"
    assert [m["seed"] for m in results["per_seed"]] == [0, 1]
    assert {"pass@1", "pass@2", "mean_score", "format_valid_rate", "answered_rate", "tool_calls_per_trajectory",
            "tool_failures_per_trajectory", "tool_use_rate/python", "tokens_generated", "wall_time_s",
            "questions", "trajectories"} <= set(results["summary"])
    assert all(set(stats) == {"mean", "std"} for stats in results["summary"].values())
    assert results["summary"]["questions"] == {"mean": 3, "std": 0.0}
    assert results["summary"]["trajectories"] == {"mean": 6, "std": 0.0}
    assert len(results["records"]) == 6 and all(len(r["completions"]) == 2 for r in results["records"])
    first = results["records"][0]
    assert first["question"] == "What is 0+2?" and first["ground_truth"] == "2"
    assert {"text", "answer", "score", "correct", "format_error", "tool_calls", "finish_reason",
            "tokens"} <= set(first["completions"][0])
    assert all(0 < c["tokens"] <= 12 for r in results["records"] for c in r["completions"])


def test_eval_with_a_lora_adapter_finds_its_base_model(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    recipe = _recipe(tmp_path, tiny_model_dir, model_name_or_path=None, adapter=str(adapter), seeds=[3],
                     n_samples=1, k=[1], num_samples=2)
    main(["eval", "--config", str(recipe)])
    results = json.loads((tmp_path / "eval" / RESULTS_FILE).read_text())
    assert results["model"] == str(tiny_model_dir) and len(results["records"]) == 2


@pytest.mark.parametrize("overrides,extra,message", [
    ({"metric": "bleu"}, [], r"metric: unknown metric 'bleu'"),
    ({"k": [1, 3]}, [], r"k: pass@3 needs n_samples >= 3 .*n_samples=2"),
    ({"k": [0]}, [], r"k: every k of pass@k must be >= 1"),
    ({"seeds": []}, [], r"seeds"),
    ({"backend": "tgi"}, [], r"backend: unknown backend 'tgi'"),
    ({"tools": ["shell"]}, [], r"tools: unknown tool 'shell'"),
    ({"dataset_name": "missing.jsonl"}, [], r"dataset_name: no such file"),
    ({"model_name_or_path": None}, [], r"model_name_or_path: required"),
    ({"adapter": "no/such/adapter"}, [], r"adapter: 'no/such/adapter' is not a PEFT adapter folder"),
    ({"device": "nope"}, [], r"device: cannot use 'nope'"),
    ({"tool_call_format": "chat_template"}, [], r"ignores `tools`.*tool_call_format='tags'"),
    ({"tool_call_format": "json"}, [], r"tool_call_format must be one of"),
    ({"n_samplez": 3}, [], r"Unknown arguments from config file: \['--n_samplez'"),
    ({}, ["--n_samples", "two"], r"invalid int value: 'two'"),
    ({"backend": "vllm_server", "vllm_server_base_url": "http://127.0.0.1:9", "vllm_server_timeout": 0.5}, [],
     r"No vLLM server answered at http://127.0.0.1:9/health"),
])
def test_user_mistakes_get_one_line(tiny_model_dir, tmp_path, capsys, overrides, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--config", str(_recipe(tmp_path, tiny_model_dir, **overrides)), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("arpo-trl: error: ")
    assert re.search(message, err[-1]), err[-1]


def test_dataset_without_ground_truth_column(tiny_model_dir, tmp_path, capsys):
    data = _dataset(tmp_path / "bad.jsonl", answer_column="label")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--config", str(_recipe(tmp_path, tiny_model_dir, dataset_name=str(data)))])
    assert exit_info.value.code == 2
    assert "needs `prompt` and one of ['ground_truth', 'answer', 'solution']" in capsys.readouterr().err


def test_auto_metric_is_the_rows_then_the_datasets():
    """metric='auto': each row's own `metric` field wins, then a one-letter ground truth ('choice'), then its `task`
    (math → math-verify, qa → F1), then the dataset's metric (`arpo_trl.data.dataset_metric`, else 'math'). A named
    metric scores every row; a `metric` column outside METRICS is a one-line error."""
    from arpo_trl.commands.builders import UserInputError
    from arpo_trl.commands.eval_setup import resolve_metric
    from arpo_trl.rewards.eval_metrics import row_metric

    plain = Dataset.from_list([{"prompt": "q", "ground_truth": "a"}])
    for named in ("two_hop_qa:8", "paper:hotpotqa", "paper:2WikiMultihopQA", "arpo:hard_search.parquet"):
        assert resolve_metric(EvalArguments(dataset_name=named), plain) == "f1", named  # the default would be math
    assert resolve_metric(EvalArguments(dataset_name="paper:aime24"), plain) == "math"
    assert resolve_metric(EvalArguments(dataset_name="x.jsonl"), plain) == "math"
    assert resolve_metric(EvalArguments(dataset_name="two_hop_qa", metric="em"), plain) == "em"
    with pytest.raises(UserInputError, match=r"metric: the dataset's `metric` column asks for \['bleu'\]"):
        resolve_metric(EvalArguments(dataset_name="x.jsonl"),
                       Dataset.from_list([{"prompt": "q", "ground_truth": "a", "metric": "bleu"}]))
    assert row_metric({"ground_truth": "5", "task": "math", "metric": "em"}, "f1") == "em"
    assert row_metric({"ground_truth": "5", "task": "math"}, "f1") == "math"  # ARPO's mixed data: math rows
    assert row_metric({"ground_truth": "Paris", "task": "qa"}, "math") == "f1"
    assert row_metric({"ground_truth": "C", "task": "qa"}, "f1") == "choice"
    assert row_metric({"ground_truth": ["B", "D"]}, "f1") == "choice"
    assert row_metric({"ground_truth": "Paris", "task": "hotpotqa"}, "f1") == "f1"
    assert row_metric({"ground_truth": "12"}, "math") == "math"
    with pytest.raises(ValueError, match="a row asks for 'bleu'"):
        row_metric({"ground_truth": "a", "metric": "bleu"}, "f1")


def test_quickstart_eval_recipe_parses_and_passes_the_checks():
    (args,) = make_eval_parser().parse_args_and_config(["--config", str(RECIPE)])
    check_args(args)
    assert args.model_name_or_path == "runs/quickstart-sft"
    assert args.dataset_name == "arithmetic"
    assert args.system_prompt == "python_short"
    assert args.n_samples >= max(args.k) and args.k == [1, 2] and args.max_completion_length <= 128
