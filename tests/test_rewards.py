"""The reference's hierarchical reward, case by case."""

import logging
import threading

import pytest

from arpo_trl.rewards import (
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    completion_text,
    extract_answer,
    f1_score,
    format_credit,
    format_credit_reward,
    formatted_answer,
    hierarchical_reward,
    last_boxed,
    math_score,
    validate_format,
)
from arpo_trl.rewards import reward_functions as rewards
from arpo_trl.rewards.math_scoring import ScoreReport

GOOD = "<think>t</think><answer>The answer is \\boxed{Paris}</answer>"
BOTH_TOOLS = ("<think>a</think><search>q</search> <result>\nr\n</result><python>1</python> <result>\n1\n</result>"
              "<answer>\\boxed{Paris France}</answer>")


@pytest.mark.parametrize("text,reward", [
    (GOOD, 1.0),
    ("<think>t</think><answer>\\boxed{London}</answer>", 0.0),
    ("<answer>\\boxed{Paris}</answer>", -1.0),  # no <think>
    ("<think>t</think>Paris", -1.0),  # no <answer>
    ("<think>t</think><answer>Paris</answer>", -1.0),  # no \boxed
    ("<think>t</think><answer>\\boxed{a}</answer><answer>\\boxed{a}</answer>", -1.0),
    ("<think>t</think><python>1</python><answer>\\boxed{Paris}</answer>", -1.0),  # call without result
    (BOTH_TOOLS, pytest.approx(2 * 0.5 * 1 / 1.5 + 0.1)),  # F1 of 'paris france' vs 'paris' = 2/3, + bonus
])
def test_reference_reward_table(text, reward):
    assert arpo_f1_reward([text], ground_truth=["Paris"]) == [reward]


def test_conversational_completions_and_missing_column():
    assert arpo_f1_reward([[{"role": "assistant", "content": GOOD}]], answer=["paris"]) == [1.0]
    with pytest.raises(ValueError, match="ground_truth"):
        arpo_f1_reward([GOOD], question=["q"])


def test_f1_and_boxed_helpers():
    assert f1_score("The Eiffel Tower", "eiffel tower") == 1.0
    assert f1_score("yes", "no") == 0.0
    assert f1_score("x y z w", ["q", "x y"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("<answer>\\boxed{42}</answer>") == "42"
    assert validate_format(GOOD) is None
    assert "think" in validate_format("<answer>\\boxed{1}</answer>")


def test_math_verify_equivalence_where_f1_fails():
    text = "<think>t</think><answer>\\boxed{3\\sqrt{3}-6}</answer>"
    assert arpo_f1_reward([text], ground_truth=["3\\sqrt{3} - 6"]) == [0.0]  # the reference's F1 quirk
    assert arpo_math_reward([text], ground_truth=["3\\sqrt{3} - 6"]) == [1.0]
    assert arpo_math_reward(["<think>t</think><answer>\\boxed{\\frac{1}{2}}</answer>"], ground_truth=["0.5"]) == [1.0]
    assert arpo_math_reward(["<think>t</think><answer>\\boxed{7}</answer>"], ground_truth=["8"]) == [0.0]


def test_format_credit_is_graded():
    assert format_credit("hello") == 0.0
    assert format_credit("<think>a</think>") == pytest.approx(0.1)
    assert format_credit("<think>a</think><python>print(1)</python> <result>\n1\n</result>") == pytest.approx(0.3)
    full = "<think>a</think><python>print(1)</python> <result>\n1\n</result><answer>\\boxed{1}</answer>"
    assert format_credit(full) == pytest.approx(0.7)
    assert format_credit("<answer>1</answer>") == pytest.approx(0.2)


def test_answer_accuracy_ignores_format():
    texts = ["<answer>\\boxed{0.5}</answer>", "<think>x</think><answer>\\boxed{1/2}</answer>",
             "<answer>\\boxed{3}</answer>", "no answer at all"]
    assert answer_accuracy(texts, ground_truth=["1/2"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_a_yes_no_answer_must_match_exactly():
    # SQuAD's rule: yes / no / noanswer earn no partial credit, as the prediction or as the ground truth
    for short in ("yes", "no", "noanswer"):
        assert f1_score(short, f"{short} indeed") == 0.0
        assert f1_score(f"{short} indeed", short) == 0.0
        assert f1_score(short.upper(), short) == 1.0
    assert f1_score("Paris", ["no", "paris"]) == 1.0  # a later ground truth still counts


def test_f1_weighs_precision_and_recall_alike():
    assert f1_score("paris", "paris france") == pytest.approx(2 / 3)  # precision 1, recall 1/2
    assert f1_score("paris france", "paris") == pytest.approx(2 / 3)  # precision 1/2, recall 1


def test_the_tool_bonus_needs_a_right_answer_and_both_tools():
    wrong_with_both_tools = BOTH_TOOLS.replace("Paris France", "London")
    python_only = "<think>a</think><python>1</python> <result>\n1\n</result><answer>\\boxed{Paris}</answer>"
    assert arpo_f1_reward([wrong_with_both_tools, python_only], ground_truth=["Paris"] * 2) == [0.0, 1.0]


def test_math_reward_tiers():
    texts = ["<answer>\\boxed{2}</answer>", "<think>t</think><answer>\\boxed{2}</answer>",
             BOTH_TOOLS.replace("Paris France", "2"), "<think>t</think><answer>\\boxed{3}</answer>"]
    assert arpo_math_reward(texts, ground_truth=["2"] * 4) == [-1.0, 1.0, pytest.approx(1.1), 0.0]


def test_math_score_of_one_answer():
    assert math_score("\\frac{1}{2}", ["3", "0.5"]) == 1.0  # any of the ground truths
    assert math_score("7", "8") == 0.0


@pytest.mark.parametrize("text,reason", [
    ("<think>t</think><answer>\\boxed{a}</answer></answer>", "expected exactly one <answer>…</answer>"),
    ("<think>t</think><answer>\\boxed{Paris</answer>", "answer has no \\boxed{}"),  # an unclosed box
    ("<think>t</think><answer>{Paris}</answer>", "answer has no \\boxed{}"),
])
def test_format_errors_name_the_broken_piece(text, reason):
    assert validate_format(text) == reason
    assert arpo_f1_reward([text], ground_truth=["Paris"]) == [-1.0]


def test_think_is_required_unless_turned_off():
    bare = "<answer>\\boxed{Paris}</answer>"
    assert formatted_answer(bare) is None
    assert formatted_answer(bare, require_think=False) == "Paris"
    assert hierarchical_reward(bare, "Paris", f1_score) == -1.0
    assert hierarchical_reward(bare, "Paris", f1_score, require_think=False) == 1.0


@pytest.mark.parametrize("text,answer", [
    ("<answer>\\boxed{1}</answer> then <answer>\\boxed{2}</answer>", "1"),  # the first answer block
    ("<answer>\\boxed{1}</answer>\\boxed{2}</answer>", "1"),  # which ends at its first closing tag
    ("\\boxed{1}</answer><answer>\\boxed{2}</answer>", "2"),  # a stray closing tag before it is skipped
    ("<answer>\\boxed{3} and no closing tag", None),
    ("no opening tag \\boxed{4}</answer>", None),
])
def test_extract_answer_reads_the_first_answer_block(text, answer):
    assert extract_answer(text) == answer


def test_format_credit_needs_a_closed_answer_with_the_box_inside():
    assert format_credit("<answer>\\boxed{1}") == 0.0  # unclosed: neither the answer nor the box counts
    assert format_credit("<answer>1</answer> \\boxed{1}") == pytest.approx(0.2)  # a box outside the answer
    conversational = [{"role": "assistant", "content": "<answer>1</answer>"}]
    assert format_credit_reward(["<think>a</think>", conversational]) == [pytest.approx(0.1), pytest.approx(0.2)]


def test_completion_text_joins_messages_and_tolerates_odd_content():
    messages = [{"role": "assistant", "content": "<think>a</think>"}, {"role": "tool", "content": None},
                {"role": "assistant", "content": "<answer>\\boxed{Paris}</answer>"},
                {"role": "assistant", "content": 42}]
    assert completion_text(messages) == "<think>a</think><answer>\\boxed{Paris}</answer>42"


def test_reward_column_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"^Reward column 'ground_truth' has 1 values for 2 completions\.$"):
        arpo_f1_reward([GOOD, GOOD], ground_truth=["Paris"])
    with pytest.raises(ValueError, match=r"the batch has columns \['question'\]\.$"):  # private keys left out
        arpo_f1_reward([GOOD], question=["q"], _internal=1)


class BoundScorer:
    """Stands in for the bounded math scorer (`arpo_trl.rewards.math_scoring.MathScorer`): scores 0, and reports
    `timeouts` answers past its time bound and one capped."""

    timeout, batch_timeout = 2.0, 8.0

    def __init__(self, timeouts: int):
        self.timeouts = timeouts

    def score(self, predictions, truths) -> ScoreReport:
        return ScoreReport(scores=[0.0] * len(predictions), timeouts=self.timeouts, capped=1)


def test_scoring_bounds_are_logged_as_metrics_and_timeouts_warned_once(monkeypatch, caplog):
    monkeypatch.setattr(rewards, "_warned", threading.Event())
    metrics = {}
    log = metrics.__setitem__
    text = "<think>t</think><answer>\\boxed{2}</answer>"
    monkeypatch.setattr(rewards, "default_scorer", lambda: BoundScorer(timeouts=0))
    with caplog.at_level(logging.WARNING, logger="arpo_trl.rewards"):
        arpo_math_reward([text], ground_truth=["2"], log_metric=log)
    assert metrics == {"rewards/arpo_math_reward/timeouts": 0.0, "rewards/arpo_math_reward/capped": 1.0}
    assert caplog.records == []  # no timeout, no warning

    monkeypatch.setattr(rewards, "default_scorer", lambda: BoundScorer(timeouts=2))
    metrics.clear()
    with caplog.at_level(logging.WARNING, logger="arpo_trl.rewards"):
        answer_accuracy([text, text], ground_truth=["2", "2"], log_metric=log)
        answer_accuracy([text], ground_truth=["2"])  # warned once only
    assert metrics == {"rewards/answer_accuracy/timeouts": 2.0, "rewards/answer_accuracy/capped": 1.0}
    assert [record.getMessage() for record in caplog.records] == [
        "answer_accuracy: 2 answer(s) took longer than the math scoring bound (2 s per answer, 8 s per call) and "
        "scored 0; counted in rewards/answer_accuracy/timeouts. Logged once."]


def test_reasoning_split_off_by_a_response_parser_counts_as_think():
    """TRL's tool loop parses Qwen-template turns into `reasoning_content` + `content`; the format check still sees
    the <think> block (without it every such completion scored -1)."""
    from arpo_trl.rewards import arpo_math_reward, completion_text

    turn = [{"role": "assistant", "reasoning_content": "step", "content": "<answer>\\boxed{4}</answer>"}]
    assert completion_text(turn) == "<think>step</think><answer>\\boxed{4}</answer>"
    assert arpo_math_reward([turn], ground_truth=["4"], arpo_calls=[[]]) == [1.0]
    assert arpo_math_reward([[{"role": "assistant", "content": "<answer>\\boxed{4}</answer>"}]],
                            ground_truth=["4"], arpo_calls=[[]]) == [-1.0]
