"""The reference's hierarchical reward, case by case."""

import pytest

from arpo_trl.rewards import (
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    extract_answer,
    f1_score,
    last_boxed,
    validate_format,
)

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
    from arpo_trl.rewards import format_credit

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
