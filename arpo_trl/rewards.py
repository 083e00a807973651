"""ARPO's hierarchical reward (reference `utils/reward_score/deep_research.py`), as TRL reward functions.

    bad format                                  → -1
    answer score s = 0                           → 0
    s > 0, both `</search>` and `</python>` used → s + 0.1
    s > 0                                        → s

`s` is SQuAD token-F1 of the last `\\boxed{}` inside `<answer>` (`arpo_f1_reward`, the reference) or
math equivalence via `math-verify` (`arpo_math_reward`; the reference scores math by F1 too, which
calls `3\\sqrt{3}-6` and `3\\sqrt{3} - 6` different).

The ground truth comes from the dataset column `ground_truth` (`answer` and `solution` are accepted).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")
MULTI_TOOL_BONUS = 0.1


def completion_text(completion) -> str:
    """A TRL completion is a string, or a list of messages for conversational data."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion if isinstance(message, dict))


def validate_format(text: str, tags: Sequence[str] = ("search", "python"), require_think: bool = True) -> str | None:
    """`None` if `text` has the reference's format, else the reason it does not."""
    if require_think:
        opened, closed = text.count("<think>"), text.count("</think>")
        if opened != closed or opened < 1:
            return f"<think> tags unbalanced or missing ({opened} open, {closed} closed)"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "expected exactly one <answer>…</answer>"
    for tag in tags:  # every call is closed and followed by its result, in order
        pattern = re.compile(rf"<{tag}>|</{tag}>|<result>|</result>")
        expected = [f"<{tag}>", f"</{tag}>", "<result>", "</result>"]
        sequence = [m.group() for m in pattern.finditer(text) if m.group() in expected]
        calls = [i for i, token in enumerate(sequence) if token == f"<{tag}>"]
        for i in calls:
            if sequence[i : i + 4] != expected:
                return f"<{tag}> call not followed by </{tag}><result></result>"
    start, end = text.index("<answer>"), text.index("</answer>")
    answer = text[start:end] if start < end else ""
    if "\\boxed{" not in answer or "}" not in answer:
        return "answer has no \\boxed{}"
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{…}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    match = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return None if match is None else last_boxed(match.group(1))


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """SQuAD token F1, max over the ground truths; yes/no/noanswer must match exactly."""
    truths = [ground_truths] if isinstance(ground_truths, str) else list(ground_truths)
    best = 0.0
    for truth in truths:
        pred, gold = normalize_answer(prediction), normalize_answer(str(truth))
        if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
            continue
        common = Counter(pred.split()) & Counter(gold.split())
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred.split()), overlap / len(gold.split())
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def math_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """1.0 if `math-verify` finds the prediction equivalent to a ground truth, else 0.0."""
    from math_verify import parse, verify

    truths = [ground_truths] if isinstance(ground_truths, str) else list(ground_truths)
    predicted = parse(f"${prediction}$")
    for truth in truths:
        gold = parse(f"${truth}$") or parse(str(truth))
        if gold and predicted and verify(gold, predicted):
            return 1.0
    return 0.0


def hierarchical_reward(
    text: str, ground_truth, score: Callable[[str, object], float], require_think: bool = True
) -> float:
    if validate_format(text, require_think=require_think) is not None:
        return -1.0
    answer = extract_answer(text)
    if answer is None:
        return -1.0
    value = score(answer, ground_truth)
    if value <= 0:
        return 0.0
    bonus = MULTI_TOOL_BONUS if "</search>" in text and "</python>" in text else 0.0
    return value + bonus


def _ground_truths(kwargs: dict, n: int) -> list:
    for column in GROUND_TRUTH_COLUMNS:
        if column in kwargs and kwargs[column] is not None:
            values = list(kwargs[column])
            if len(values) != n:
                raise ValueError(f"Reward column {column!r} has {len(values)} values for {n} completions.")
            return values
    raise ValueError(
        f"ARPO rewards need the dataset column 'ground_truth' (or one of {GROUND_TRUTH_COLUMNS}); the batch "
        f"has columns {sorted(k for k in kwargs if not k.startswith('_'))}."
    )


def arpo_f1_reward(completions: list, **kwargs) -> list[float]:
    """The reference reward: format check, token-F1 of the boxed answer, +0.1 for using both tools."""
    truths = _ground_truths(kwargs, len(completions))
    return [hierarchical_reward(completion_text(c), t, f1_score) for c, t in zip(completions, truths)]


def arpo_math_reward(completions: list, **kwargs) -> list[float]:
    """As `arpo_f1_reward`, but the answer is scored by math equivalence (`math-verify`)."""
    truths = _ground_truths(kwargs, len(completions))
    return [hierarchical_reward(completion_text(c), t, math_score) for c, t in zip(completions, truths)]


def answer_accuracy(completions: list, **kwargs) -> list[float]:
    """1.0 when the last boxed answer is mathematically equal to the ground truth, format aside, else 0.0: an
    accuracy to log next to the reward (give it weight 0 in `reward_weights` to leave training unchanged)."""
    truths = _ground_truths(kwargs, len(completions))
    answers = [extract_answer(completion_text(c)) for c in completions]
    return [math_score(a, t) if a is not None else 0.0 for a, t in zip(answers, truths)]


FORMAT_CREDITS = (("think", 0.1), ("tool_call", 0.2), ("answer", 0.2), ("boxed", 0.2))


def format_credit(text: str) -> float:
    """Graded credit for the pieces of ARPO's format, up to 0.7: balanced <think>, a tool call that got its
    result, one <answer>…</answer>, a \\boxed{} inside it."""
    has_answer = text.count("<answer>") == 1 and text.count("</answer>") == 1
    answer = text[text.find("<answer>") : text.find("</answer>")] if has_answer else ""
    checks = {
        "think": text.count("<think>") == text.count("</think>") >= 1,
        "tool_call": re.search(r"</(python|search)> <result>", text) is not None,
        "answer": has_answer,
        "boxed": "\\boxed{" in answer,
    }
    return sum(credit for name, credit in FORMAT_CREDITS if checks[name])


def format_credit_reward(completions: list, **kwargs) -> list[float]:
    """Shaping for small models (the quickstart): ARPO's reward is -1 for nearly every completion of an untuned
    135M model, so a group's advantages would all be zero; graded format credit gives them a gradient."""
    return [format_credit(completion_text(c)) for c in completions]
