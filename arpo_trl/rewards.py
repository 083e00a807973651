"""ARPO's hierarchical reward (reference `utils/reward_score/deep_research.py`), as TRL reward functions.

    bad format                                  → -1
    answer score s = 0                           → 0
    s > 0, both `</search>` and `</python>` used → s + 0.1
    s > 0                                        → s

`s` is SQuAD token-F1 of the last `\\boxed{}` inside `<answer>` (`arpo_f1_reward`, the reference) or
math equivalence via `math-verify` (`arpo_math_reward`; the reference scores math by F1 too, which
calls `3\\sqrt{3}-6` and `3\\sqrt{3} - 6` different).

The ground truth comes from the dataset column `ground_truth` (`answer` and `solution` are accepted).

Tool calls: under `ARPOTrainer` the rewards are told each completion's calls as the sampler recorded them (the
`arpo_calls` keyword argument: `ToolCallRecord`s as dicts), so the format check and the multi-tool bonus work for
every call format (`tags`, `chat_template`): a call is well-formed when the environment answered it. Without
`arpo_calls` (text-only callers, e.g. TRL's own `GRPOTrainer`), the reference's text check over `<tag>` and `<result>`
tags applies.

Completions are hostile input (docs/rewards.md): the text checks here are linear in the completion's length, and
math equivalence runs through `arpo_trl.scoring.MathScorer` — length and nesting caps before parsing, a time limit
per answer and per call, from any thread, printing nothing. Under `GRPOTrainer`, the math rewards log how many
answers hit a bound as `rewards/<reward>/timeouts` and `rewards/<reward>/capped`.
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from arpo_trl.scoring import ScoreReport, default_scorer
from arpo_trl.tags import answered_tag_call, unanswered_tag_call

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")
MULTI_TOOL_BONUS = 0.1
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_BRACES = re.compile("[{}]")
logger = logging.getLogger(__name__)
_warned = threading.Event()


def completion_text(completion) -> str:
    """A TRL completion is a string, or a list of messages for conversational data."""
    if isinstance(completion, str):
        return completion
    return "".join(_content(message) for message in completion if isinstance(message, dict))


def _content(message: dict) -> str:
    """A message's text; reasoning a response parser split off (`reasoning_content`, as TRL's tool loop does for
    Qwen templates, or `thinking`) goes back inside `<think>…</think>`, where the format check looks for it."""
    content = message.get("content") or ""
    text = content if isinstance(content, str) else str(content)
    reasoning = message.get("reasoning_content") or message.get("thinking")
    return f"<think>{reasoning}</think>{text}" if isinstance(reasoning, str) else text


Calls = Sequence[dict] | None  # a completion's `ToolCallRecord`s as dicts, or None: read the text


def _answered(call: dict) -> bool:
    """`ToolCallRecord.answered`, on the dict form the trainer passes."""
    return call.get("result_start") is not None


def validate_format(text: str, tags: Sequence[str] = ("search", "python"), require_think: bool = True,
                    calls: Calls = None) -> str | None:
    """`None` if `text` has the reference's format, else the reason it does not. With the sampler's `calls`, every
    call must have been answered; without, every `<tag>` call in the text must be followed by its result."""
    if calls is not None:
        unanswered = [c for c in calls if not _answered(c)]
        if unanswered:
            return (f"a {unanswered[0].get('tool') or 'tool'} call was not answered (past the call limit, empty, or "
                    "never closed)")
        tags = ()
    if require_think:
        opened, closed = text.count("<think>"), text.count("</think>")
        if opened != closed or opened < 1:
            return f"<think> tags unbalanced or missing ({opened} open, {closed} closed)"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "expected exactly one <answer>…</answer>"
    error = unanswered_tag_call(text, tags)
    if error is not None:
        return error
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
    for brace in _BRACES.finditer(text, i):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[i + 1 : brace.start()]
    return None


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{}` inside the first `<answer>…</answer>` (linear: a regex search is quadratic in the
    number of unclosed `<answer>` tags)."""
    start = text.find("<answer>")
    end = text.find("</answer>", start + len("<answer>")) if start >= 0 else -1
    return None if end < 0 else last_boxed(text[start + len("<answer>") : end])


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _truth_list(ground_truths) -> list[str]:
    if isinstance(ground_truths, str) or not isinstance(ground_truths, Sequence):
        return [str(ground_truths)]
    return [str(t) for t in ground_truths]


def f1_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """SQuAD token F1, max over the ground truths; yes/no/noanswer must match exactly."""
    best = 0.0
    for truth in _truth_list(ground_truths):
        pred, gold = normalize_answer(prediction), normalize_answer(truth)
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
    """1.0 if `math-verify` finds the prediction equivalent to a ground truth, else 0.0 (also past the scoring
    bounds of `arpo_trl.scoring.default_scorer()`)."""
    return default_scorer().score([prediction], [_truth_list(ground_truths)]).scores[0]


def math_scores(predictions: Sequence[str], ground_truths: Sequence) -> ScoreReport:
    """`math_score` for a batch, scored in parallel within the default scorer's bounds; with its bound counters."""
    return default_scorer().score(list(predictions), [_truth_list(t) for t in ground_truths])


def formatted_answer(text: str, require_think: bool = True, calls: Calls = None) -> str | None:
    """The boxed answer of a completion in the reference's format, or None (the -1 of the reward)."""
    valid = validate_format(text, require_think=require_think, calls=calls) is None
    return extract_answer(text) if valid else None


def tools_used(text: str, calls: Calls = None) -> set[str]:
    """The tools a completion called: from the sampler's `calls` (answered ones), else the reference's closing tags."""
    if calls is not None:
        return {c.get("tool") for c in calls if _answered(c)}
    return {tag for tag in ("search", "python") if f"</{tag}>" in text}


def tiered(text: str, value: float, calls: Calls = None) -> float:
    """The reward of a well-formatted completion whose answer scored `value`."""
    if value <= 0:
        return 0.0
    return value + (MULTI_TOOL_BONUS if {"search", "python"} <= tools_used(text, calls) else 0.0)


def hierarchical_reward(
    text: str, ground_truth, score: Callable[[str, object], float], require_think: bool = True, calls: Calls = None
) -> float:
    answer = formatted_answer(text, require_think, calls)
    return -1.0 if answer is None else tiered(text, score(answer, ground_truth), calls)


def _log_bounds(name: str, report: ScoreReport, kwargs: dict) -> None:
    """Count the answers that hit a scoring bound as TRL metrics (`log_metric`), and warn once, without the text."""
    log_metric = kwargs.get("log_metric")
    if callable(log_metric):
        log_metric(f"rewards/{name}/timeouts", float(report.timeouts))
        log_metric(f"rewards/{name}/capped", float(report.capped))
    if report.timeouts and not _warned.is_set():
        _warned.set()
        scorer = default_scorer()
        logger.warning("%s: %d answer(s) took longer than the math scoring bound (%g s per answer, %g s per call) "
                       "and scored 0; counted in rewards/%s/timeouts. Logged once.", name, report.timeouts,
                       scorer.timeout, scorer.batch_timeout, name)


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


def _calls(kwargs: dict, n: int) -> list[Calls]:
    """Each completion's recorded calls (`arpo_calls`, from ARPOTrainer), or None for each: read the text."""
    calls = kwargs.get("arpo_calls")
    if calls is None:
        return [None] * n
    if len(calls) != n:
        raise ValueError(f"Reward argument 'arpo_calls' has {len(calls)} entries for {n} completions.")
    return list(calls)


def arpo_f1_reward(completions: list, **kwargs) -> list[float]:
    """The reference reward: format check, token-F1 of the boxed answer, +0.1 for using both tools."""
    truths, calls = _ground_truths(kwargs, len(completions)), _calls(kwargs, len(completions))
    texts = [completion_text(c) for c in completions]
    return [hierarchical_reward(text, t, f1_score, calls=k) for text, t, k in zip(texts, truths, calls)]


def arpo_math_reward(completions: list, **kwargs) -> list[float]:
    """As `arpo_f1_reward`, but the answer is scored by math equivalence (`math-verify`, bounded: see
    `arpo_trl.scoring`)."""
    truths, calls = _ground_truths(kwargs, len(completions)), _calls(kwargs, len(completions))
    texts = [completion_text(c) for c in completions]
    answers = [formatted_answer(text, calls=k) for text, k in zip(texts, calls)]
    values = _score_answers("arpo_math_reward", answers, truths, kwargs)
    return [-1.0 if a is None else tiered(text, v, k) for text, a, v, k in zip(texts, answers, values, calls)]


def answer_accuracy(completions: list, **kwargs) -> list[float]:
    """1.0 when the last boxed answer is mathematically equal to the ground truth, format aside, else 0.0: an
    accuracy to log next to the reward (give it weight 0 in `reward_weights` to leave training unchanged)."""
    truths = _ground_truths(kwargs, len(completions))
    answers = [extract_answer(completion_text(c)) for c in completions]
    return _score_answers("answer_accuracy", answers, truths, kwargs)


def _score_answers(name: str, answers: list[str | None], truths: list, kwargs: dict) -> list[float]:
    """Math scores of the answers that exist (0.0 for None), as one bounded batch."""
    present = [i for i, a in enumerate(answers) if a is not None]
    report = math_scores([answers[i] for i in present], [truths[i] for i in present])
    _log_bounds(name, report, kwargs)
    values = [0.0] * len(answers)
    for i, value in zip(present, report.scores):
        values[i] = value
    return values


FORMAT_CREDITS = (("think", 0.1), ("tool_call", 0.2), ("answer", 0.2), ("boxed", 0.2))


def format_credit(text: str, calls: Calls = None) -> float:
    """Graded credit for the pieces of ARPO's format, up to 0.7: balanced <think>, a tool call that got its
    result, one <answer>…</answer>, a \\boxed{} inside it."""
    has_answer = text.count("<answer>") == 1 and text.count("</answer>") == 1
    answer = text[text.find("<answer>") : text.find("</answer>")] if has_answer else ""
    checks = {
        "think": text.count("<think>") == text.count("</think>") >= 1,
        "tool_call": any(map(_answered, calls)) if calls is not None
        else answered_tag_call(text, ("python", "search")),
        "answer": has_answer,
        "boxed": "\\boxed{" in answer,
    }
    return sum(credit for name, credit in FORMAT_CREDITS if checks[name])


def format_credit_reward(completions: list, **kwargs) -> list[float]:
    """Shaping for small models (the quickstart): ARPO's reward is -1 for nearly every completion of an untuned
    135M model, so a group's advantages would all be zero; graded format credit gives them a gradient."""
    return [format_credit(completion_text(c), k) for c, k in zip(completions, _calls(kwargs, len(completions)))]
