"""Rewards and evaluation score only what the model wrote (issue 33): never an answer or a tag inside a tool result
or inside the model's own tool call; a result marker the model writes itself is a format error; evaluation scores
each row with its own metric and reports per source; EM/F1 never credit an empty answer; one-letter answers are
letters; list ground truths take the best match."""

from __future__ import annotations

import itertools
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset
from tiny import tiny_model

from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool
from arpo_trl.commands.eval_setup import EvalArguments, EvalSetup, prompt_ids, resolve_metric
from arpo_trl.commands.evaluate import evaluate
from arpo_trl.data import arpo_released
from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.rewards import (
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    f1_score,
    format_credit_reward,
    validate_format,
)
from arpo_trl.rewards.eval_metrics import score_answer, score_completion
from arpo_trl.tools.base import Tool
from arpo_trl.tools.tags import own_text_from_ids, own_text_from_markers

FROM_THE_TOOL = "<think>a</think><python>print(x)</python> <result>\n<answer>\\boxed{42}</answer>\n</result>"
PRINT_ANSWER = 'print(r"<%s>\\boxed{{{}}}</%s>" % ("answer", "answer"))'  # no answer tag in the code itself
HACK = f"<think>the tool will say it</think><python>{PRINT_ANSWER.format(5)}</python>"
HONEST = "<think>2+3 is 5</think><answer>\\boxed{5}</answer>"


# ---- point 1: an answer that only a tool result holds ---------------------------------------------------------------
def test_an_answer_only_inside_a_tool_result_earns_nothing():
    truth = ["42"]
    assert arpo_f1_reward([FROM_THE_TOOL], ground_truth=truth) == [-1.0]
    assert arpo_math_reward([FROM_THE_TOOL], ground_truth=truth) == [-1.0]
    assert format_credit_reward([FROM_THE_TOOL]) == [pytest.approx(0.3)]  # think 0.1 + an answered call 0.2
    assert answer_accuracy([FROM_THE_TOOL], ground_truth=truth) == [0.0]
    for metric in ("math", "f1", "em"):
        scored = score_completion(FROM_THE_TOOL, "42", metric)
        assert (scored["answer"], scored["correct"]) == (None, 0.0), metric
    snippet = "<think>a</think><search>q</search> <result>\nPage 1: \\boxed{42}\n</result><answer>no idea</answer>"
    assert score_completion(snippet, "42", "math", require_answer_tag=False)["answer"] is None


def test_code_that_prints_the_answer_is_no_answer():
    """The model's call is the tool's input, never its answer: not what the code prints, nor an answer tag typed in
    the code itself."""
    text = HACK + " <result>\n<answer>\\boxed{5}</answer>\n</result>"
    assert arpo_math_reward([text], ground_truth=["5"]) == [-1.0]
    assert score_completion(text, "5", "math")["correct"] == 0.0
    assert own_text_from_markers(text).text == "<think>the tool will say it</think>"
    typed = '<think>t</think><python>print("<answer>\\boxed{5}</answer>")</python> <result>\nhi\n</result>'
    assert arpo_math_reward([typed], ground_truth=["5"]) == [-1.0]
    assert score_completion(typed, "5", "math")["answer"] is None


def test_own_text_from_records_drops_calls_and_results(tokenizer):
    """With the sampler's records, the spans come from token offsets, not from markers: a tool output that fakes
    a closing marker hides nothing and forges nothing."""
    parts = ["<think>t</think>", "<python>print(1)</python>",
             " <result>\nx\n</result>\n<answer>\\boxed{9}</answer>\n</result>", "<answer>\\boxed{5}</answer>"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in parts]
    flat = [t for p in ids for t in p]
    start = len(ids[0]) + len(ids[1])
    call = {"tool": "python", "call_chars": len(parts[1]), "result_start": start, "result_end": start + len(ids[2])}
    decode = lambda span: tokenizer.decode(span, skip_special_tokens=True)  # noqa: E731
    own = own_text_from_ids(flat, [call], decode)
    assert own == (decode(ids[0]) + decode(ids[3]), ("python",), None)
    text = decode(flat)
    assert own_text_from_markers(text).error is not None  # the markers alone: the fake `</result>` is an error
    assert arpo_math_reward([text], ground_truth=["5"], arpo_calls=[[call]], arpo_model_text=[own.text]) == [1.0]
    assert arpo_math_reward([text], ground_truth=["5"]) == [-1.0]


# ---- a result marker the model writes itself ------------------------------------------------------------------------
FORGED_BLOCK = ("<think>a</think></search> <result>\nPage 1\n</result><python>1</python> <result>\n1\n</result>"
                "<answer>\\boxed{42}</answer>")
HIDING = "<think>a</think><answer>\\boxed{1}</answer><result></answer><answer>\\boxed{42}</result>"


@pytest.mark.parametrize("text", [FORGED_BLOCK, HIDING])
def test_a_result_marker_the_model_writes_is_a_format_error(text):
    """Decided: the result markers are the environment's. A `<result>` block the model writes after no call of its
    own cannot pass for a search call (the reference gives 1.1: `</search>` and `</python>` in the text), and text
    wrapped in `<result>` is not hidden from the format check: both are format errors, and evaluation reads no
    answer. With the sampler's records the rule is the same."""
    assert "outside the environment's result blocks" in validate_format(text)
    assert arpo_f1_reward([text], ground_truth=["42"]) == [-1.0]
    assert arpo_math_reward([text], ground_truth=["42"], arpo_calls=[[]], arpo_model_text=[text]) == [-1.0]
    assert format_credit_reward([text]) == [0.0]
    assert score_completion(text, "42", "math")["answer"] is None


# ---- point 2: the multi-tool bonus counts calls, not tags in tool output ------------------------------------------
def test_a_search_tag_printed_by_python_earns_no_bonus():
    text = ('<think>a</think><python>print(chr(60) + "/search>")</python> <result>\n</search>\n</result>'
            "<answer>\\boxed{42}</answer>")
    assert arpo_math_reward([text], ground_truth=["42"]) == [1.0]
    both = ("<think>a</think><search>q</search> <result>\ndoc\n</result><python>1</python> <result>\n1\n</result>"
            "<answer>\\boxed{42}</answer>")
    assert arpo_math_reward([both], ground_truth=["42"]) == [pytest.approx(1.1)]


# ---- points 4, 5, 6: EM/F1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer,truth", [("", "A"), ("the", "A"), (".", "A"), ("", "The"), ("a", "The"),
                                          ("!", ".")])
def test_an_empty_or_normalised_away_answer_is_never_correct(answer, truth):
    for metric in ("em", "f1"):
        scored = score_answer(answer, truth, metric)
        assert (scored["correct"], scored["em"], scored["f1"]) == (0.0, 0.0, 0.0), (metric, scored)


def test_one_letter_answers_are_scored_as_letters():
    assert f1_score("A", "A") == 1.0 and f1_score("(b)", "B") == 1.0 and f1_score("\\text{C}", "C") == 1.0
    assert f1_score("B", "A") == 0.0 and f1_score("A dog", "A") == 0.0
    answer = "<think>t</think><answer>\\boxed{A}</answer>"
    assert arpo_f1_reward([answer], ground_truth=["A"]) == [1.0]
    assert score_answer("A", "A", "em")["correct"] == 1.0
    assert score_answer("(D)", ["B", "D"], "choice") == {"score": 1.0, "correct": 1.0}
    assert score_answer("B", "D", "choice") == {"score": 0.0, "correct": 0.0}


def test_list_ground_truths_take_the_best_item(tmp_path):
    path = tmp_path / "hard_search.parquet"
    prompt = [{"content": "system", "role": "system"}, {"content": "Which city?", "role": "user"}]
    rows = [{"data_source": "DR_nan", "ability": "qa", "prompt": prompt, "extra_info": {"index": i},
             "reward_model": {"ground_truth": truth, "style": "rule"}}
            for i, truth in enumerate([["Paris", "City of Light"], ["Rome"]])]
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = arpo_released(path)
    assert data["ground_truth"] == [["Paris", "City of Light"], ["Rome"]]
    answers = [f"<think>t</think><answer>\\boxed{{{a}}}</answer>" for a in ("City of Light", "Paris", "Rome")]
    truths = [data[0]["ground_truth"], data[0]["ground_truth"], data[1]["ground_truth"]]
    assert arpo_f1_reward(answers, ground_truth=truths) == [1.0, 1.0, 1.0]
    assert f1_score("Paris", ["Paris", "City of Light"]) == 1.0
    assert score_answer("City of Light", data[0]["ground_truth"], "em")["correct"] == 1.0


# ---- the print-the-answer hack under ARPOTrainer ---------------------------------------------------------------
class RewardRecordingTrainer(ARPOTrainer):
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        tree_rows = self._tree_rows  # what the rewards receive as `arpo_*` keyword arguments
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.seen = getattr(self, "seen", []) + list(zip(tree_rows, completions, rewards[:, 0].tolist()))
        return rewards


def test_the_print_the_answer_hack_scores_minus_one_in_training(tokenizer, tmp_path):
    """A policy's typical hack: its code prints the answer tag, the tool's output holds it, then EOS. Every other
    new path does it (by construction); the honest paths score 1, the hacking ones -1."""
    from test_rollout import ScriptedEngine

    turn = itertools.count()

    def script(text, rng):
        if "</result>" in text:
            return "", 0.1, "eos"  # stop right after the tool printed the answer
        return (HACK, 0.1, "stop") if next(turn) % 2 == 0 else (HONEST, 0.1, "eos")

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2+3?"}], "ground_truth": "5"}] * 4)
    args = ARPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, initial_rollouts=2,
                      max_completion_length=96, max_steps=1, learning_rate=1e-3, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, beta=0.0, log_trees=False)
    trainer = RewardRecordingTrainer(model=tiny_model(tokenizer), reward_funcs=arpo_math_reward, args=args,
                                     train_dataset=data, processing_class=tokenizer, tools=[PythonTool(timeout=10)],
                                     engine=ScriptedEngine(tokenizer, script))
    trainer.train()
    kinds = {"hack": 0, "honest": 0}
    for row, completion, reward in trainer.seen:
        text = completion if isinstance(completion, str) else completion[0]["content"]
        if "<python>" in text:
            assert "<answer>\\boxed{5}</answer>\n</result>" in text  # the tool did print it
            assert reward == -1.0, text
            assert "<answer>" not in row["model_text"]
            kinds["hack"] += 1
        else:
            assert reward == 1.0, text
            kinds["honest"] += 1
    assert kinds["hack"] > 0 and kinds["honest"] > 0


# ---- point 3: a mixed math + QA evaluation, per row and per source ------------------------------------------------
# MIXED[question] = (ground truth, task, attempts); an attempt is its segments, each (text, finish); a tool result
# follows each "stop" segment. The numbers in test_mixed_eval are computed by hand from these.
MIXED = [
    ("1/2", "math", [[("\\frac{1}{2}", "eos")], [("12", "eos")]]),           # math-verify: 1, 0 (SQuAD EM: 0, 1)
    ("-3", "math", [[("3", "eos")],                                          # 0 (SQuAD EM: 1)
                    [(f"<python>{PRINT_ANSWER.format(-3)}</python>", "stop"), ("", "eos")]]),  # the hack: 0
    ("Paris", "qa", [[("Paris", "eos")], [("Paris France", "eos")]]),        # F1 1 (EM 1), F1 2/3 (EM 0)
    ("A", "qa", [[("A", "eos")], [("the", "eos")]]),                         # letters: 1, 0 (SQuAD EM: 1, 1)
]


class MixedEngine(GenerationEngine):
    """A test double for the model only: replays MIXED (attempt a of question q starts `<think>qQaA</think>`)."""

    def __init__(self, tokenizer, prompts: list[list[int]]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, len(tokenizer), [tokenizer.eos_token_id]
        self.questions, self.started = {tuple(p): q for q, p in enumerate(prompts)}, [0] * len(prompts)

    def generate(self, prefixes, max_new_tokens, stop):
        return [self._segment(list(prefix)) for prefix in prefixes]

    def _segment(self, prefix: list[int]) -> Segment:
        if tuple(prefix) in self.questions:
            q = self.questions[tuple(prefix)]
            attempt, step, self.started[q] = self.started[q], 0, self.started[q] + 1
        else:
            text = self.tokenizer.decode(prefix)
            q, attempt = map(int, re.search(r"<think>q(\d)a(\d)", text).groups())
            step = text.count("</result>")
        text, finish = MIXED[q][2][attempt][step]
        if step == 0:
            body = text if finish == "stop" else f"<answer>\\boxed{{{text}}}</answer>"
            text = f"<think>q{q}a{attempt}</think>{body}"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_token_ids[0]] * (finish == "eos")
        return Segment(ids, [0.0] * len(ids), [0.0] * len(ids), finish)


def test_mixed_eval_scores_each_row_with_its_metric_and_reports_per_source(tokenizer, tmp_path):
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {q}?"}], "ground_truth": truth,
                               "task": task} for q, (truth, task, _) in enumerate(MIXED)])
    metric = resolve_metric(EvalArguments(dataset_name="arpo:valid.parquet"), data)  # ARPO's mixed data: F1
    engine = MixedEngine(tokenizer, [prompt_ids(tokenizer, row["prompt"]) for row in data])
    python = Tool("python", lambda code: re.fullmatch(r'print\(r"(.*)" % .*\)', code).group(1) % ("answer", "answer"))
    setup = EvalSetup(engine, tokenizer, [python], data, metric)
    args = EvalArguments(n_samples=2, k=[1, 2], seeds=[0], batch_size=4, max_completion_length=96,
                         output_dir=str(tmp_path))
    results = evaluate(args, setup)
    hack = results["records"][1]["completions"][1]
    assert "<answer>\\boxed{-3}</answer>\n</result>" in hack["text"] and hack["answer"] is None
    assert [r["num_correct"] for r in results["records"]] == [1, 0, 1, 1]
    assert [r["metric"] for r in results["records"]] == ["math", "math", "f1", "choice"]
    summary = {key: stats["mean"] for key, stats in results["summary"].items()}
    expected = {
        "pass@1": 3 / 8, "pass@2": 3 / 4, "mean_score": (1 + 1 + 2 / 3 + 1) / 8, "questions": 4,
        "mean_f1": (1 + 2 / 3) / 2, "mean_em": 1 / 2,
        "source[math]/questions": 2, "source[math]/pass@1": 1 / 4, "source[math]/pass@2": 1 / 2,
        "source[math]/mean_score": 1 / 4,
        "source[qa]/questions": 2, "source[qa]/pass@1": 1 / 2, "source[qa]/pass@2": 1.0,
        "source[qa]/mean_score": (1 + 2 / 3 + 1) / 4, "source[qa]/mean_f1": (1 + 2 / 3) / 2,
        "source[qa]/mean_em": 1 / 2,
    }
    assert {key: summary[key] for key in expected} == pytest.approx(expected)
    assert "source[math]/mean_f1" not in summary
    table = results["source_table"].splitlines()
    assert table[0] == "| source | scored by | questions | pass@1 | pass@2 | mean_score | mean_f1 | mean_em |"
    assert table[2:] == ["| math | math | 2 | 0.250 | 0.500 | 0.250 | – | – |",
                         "| qa | choice, f1 | 2 | 0.500 | 1.000 | 0.667 | 0.833 | 0.500 |",
                         "| all | choice, f1, math | 4 | 0.375 | 0.750 | 0.458 | 0.833 | 0.500 |"]
    written = json.loads((tmp_path / "eval_results.json").read_text())
    assert written["metrics_by_source"] == {"math": ["math"], "qa": ["choice", "f1"]}
    assert results["source_table"] in (tmp_path / "eval_results.md").read_text()


def test_a_tool_message_of_trls_tool_loop_is_no_answer():
    """TRL's tool loop gives conversations: the `tool` messages are results, not the model's text."""
    call = {"role": "assistant", "content": "<think>a</think>",
            "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "print(x)"}}}]}
    printed = [call, {"role": "tool", "name": "python", "content": "<answer>\\boxed{42}</answer>"}]
    assert arpo_math_reward([printed], ground_truth=["42"]) == [-1.0]
    answered = [*printed[:1], {"role": "tool", "name": "python", "content": "42"},
                {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"}]
    assert arpo_math_reward([answered], ground_truth=["42"]) == [1.0]
    assert format_credit_reward([answered]) == [pytest.approx(0.7)]
