"""ARPO's hierarchical reward (reference `utils/reward_score/deep_research.py`), as TRL reward functions.

    bad format                                  → -1
    answer score s = 0                           → 0
    s > 0, both `</search>` and `</python>` used → s + 0.1
    s > 0                                        → s

`s` is SQuAD token-F1 of the last `\\boxed{}` inside `<answer>` (`arpo_f1_reward`, the reference) or
math equivalence via `math-verify` (`arpo_math_reward`; the reference scores math by F1 too, which
calls `3\\sqrt{3}-6` and `3\\sqrt{3} - 6` different).

The ground truth comes from the dataset column `ground_truth` (`answer` and `solution` are accepted).

Only what the model wrote is scored (`own_text`, the one rule for rewards and evaluation): the answer, the format
and the tool-use bonus are read from the completion without its tool results. Under `ARPOTrainer` the rewards are
told each completion's calls as the sampler recorded them (`arpo_calls`: `ToolCallRecord`s as dicts) and the model's
own text (`arpo_model_text`: the completion decoded outside the recorded result spans), so the checks work for every
call format (`tags`, `chat_template`): a call is well-formed when the environment answered it. Without them
(text-only callers, e.g. TRL's own `GRPOTrainer`), result blocks are found by their markers
(`arpo_trl.tools.tags.own_text_from_markers`) and the reference's text check over `<tag>` and `<result>` tags applies.
A result marker in the model's own text is a format error (docs/rewards.md). The reference reads the whole decoded
completion, tool output included (docs/differences.md).

Completions are hostile input (docs/rewards.md): the text checks here are linear in the completion's length, and
math equivalence runs through `arpo_trl.rewards.math_scoring.MathScorer` — length and nesting caps before parsing, a
time limit per answer and per call, from any thread, printing nothing. Under `GRPOTrainer`, the math rewards log how
many answers hit a bound as `rewards/<reward>/timeouts` and `rewards/<reward>/capped`.
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from arpo_trl.rewards.math_scoring import ScoreReport, default_scorer
from arpo_trl.tools.tags import OwnText, as_own_text, own_text_from_markers, unanswered_tag_call

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")
MULTI_TOOL_BONUS = 0.1
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_BRACES = re.compile("[{}]")
_CHOICE = re.compile(r"\(?([A-Za-z])\)?[.:]?")
_TEXT_WRAPPER = re.compile(r"^\\(?:text|mathrm|textbf)\{(.*)\}$")
TOOL_TAGS = ("search", "python")
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


def own_text(text: str, calls: Calls = None, model_text: str | None = None) -> OwnText:
    """What the model wrote of the completion `text`: `model_text` when the caller decoded it from the sampler's
    records (`arpo_trl.tools.tags.own_text_from_ids`), else `text` without the result blocks its markers show."""
    if model_text is None:
        return own_text_from_markers(text, TOOL_TAGS)
    if not isinstance(model_text, str):
        raise ValueError(f"Reward argument 'arpo_model_text': expected a string per completion, got "
                         f"{type(model_text).__name__}.")
    return as_own_text(model_text, [c.get("tool") or "" for c in calls or () if _answered(c)])


def validate_format(text: str, tags: Sequence[str] = TOOL_TAGS, require_think: bool = True,
                    calls: Calls = None, own: OwnText | None = None) -> str | None:
    """`None` if `text` has the reference's format, else the reason it does not. The think, answer and boxed checks
    read the model's own text (`own`, default `own_text(text)`). With the sampler's `calls`, every call must have
    been answered; without, every `<tag>` call in the text must be followed by its result."""
    own = own or own_text_from_markers(text, tags)
    if own.error is not None:
        return own.error
    body = own.text
    if calls is not None:
        unanswered = [c for c in calls if not _answered(c)]
        if unanswered:
            return (f"a {unanswered[0].get('tool') or 'tool'} call was not answered (past the call limit, empty, or "
                    "never closed)")
        tags = ()
    if require_think:
        opened, closed = body.count("<think>"), body.count("</think>")
        if opened != closed or opened < 1:
            return f"<think> tags unbalanced or missing ({opened} open, {closed} closed)"
    if body.count("<answer>") != 1 or body.count("</answer>") != 1:
        return "expected exactly one <answer>…</answer>"
    error = unanswered_tag_call(text, tags)
    if error is not None:
        return error
    start, end = body.index("<answer>"), body.index("</answer>")
    answer = body[start:end] if start < end else ""
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


def choice_letter(text: str) -> str | None:
    """The letter of a multiple-choice answer (`B`, `(b)`, `B.`, `\\text{B}`), upper-cased; None for anything
    else."""
    text = text.strip()
    wrapped = _TEXT_WRAPPER.match(text)
    match = _CHOICE.fullmatch((wrapped.group(1) if wrapped else text).strip())
    return match.group(1).upper() if match else None


def is_choice(truth: str) -> bool:
    """A one-letter ground truth (`A`…`Z`, as multiple-choice data gives it) is scored as a letter."""
    return len(truth.strip()) == 1 and truth.strip().isalpha()


def _qa_score(prediction: str, truth: str, f1: bool) -> float:
    """Token F1 (`f1`) or exact match of one prediction and one ground truth. A one-letter truth compares letters;
    an answer or truth that normalises to nothing compares as written (case and spaces aside), so an empty answer
    is never right. The reference normalises both (docs/differences.md)."""
    if is_choice(truth):
        return float(choice_letter(prediction) == truth.strip().upper())
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if not pred or not gold:
        return float(bool(prediction.strip()) and prediction.strip().casefold() == truth.strip().casefold())
    if not f1 or ((pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold):
        return float(pred == gold)
    overlap = sum((Counter(pred.split()) & Counter(gold.split())).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred.split()), overlap / len(gold.split())
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """SQuAD token F1, max over the ground truths; yes/no/noanswer must match exactly (see `_qa_score`)."""
    return max((_qa_score(prediction, truth, f1=True) for truth in _truth_list(ground_truths)), default=0.0)


def exact_match(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """SQuAD exact match (after `normalize_answer`), max over the ground truths (see `_qa_score`)."""
    return max((_qa_score(prediction, truth, f1=False) for truth in _truth_list(ground_truths)), default=0.0)


def choice_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """1.0 when the prediction's letter is a ground truth's letter, else 0.0."""
    letter = choice_letter(prediction)
    return float(letter is not None and any(letter == choice_letter(t) for t in _truth_list(ground_truths)))


def math_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
    """1.0 if `math-verify` finds the prediction equivalent to a ground truth, else 0.0 (also past the scoring
    bounds of `arpo_trl.rewards.math_scoring.default_scorer()`)."""
    return default_scorer().score([prediction], [_truth_list(ground_truths)]).scores[0]


def math_scores(predictions: Sequence[str], ground_truths: Sequence) -> ScoreReport:
    """`math_score` for a batch, scored in parallel within the default scorer's bounds; with its bound counters."""
    return default_scorer().score(list(predictions), [_truth_list(t) for t in ground_truths])


def formatted_answer(text: str, require_think: bool = True, calls: Calls = None,
                     own: OwnText | None = None) -> str | None:
    """The boxed answer the model wrote, in the reference's format, or None (the -1 of the reward)."""
    own = own or own_text(text, calls)
    valid = validate_format(text, require_think=require_think, calls=calls, own=own) is None
    return extract_answer(own.text) if valid else None


def tools_used(text: str, calls: Calls = None, own: OwnText | None = None) -> set[str]:
    """The tools a completion called: from the sampler's `calls` (answered ones), else the calls whose result blocks
    `own_text` removed (a tag inside a tool's output is no call)."""
    if calls is not None:
        return {c.get("tool") for c in calls if _answered(c)}
    return set((own or own_text(text)).tools)


def tiered(text: str, value: float, calls: Calls = None, own: OwnText | None = None) -> float:
    """The reward of a well-formatted completion whose answer scored `value`."""
    if value <= 0:
        return 0.0
    return value + (MULTI_TOOL_BONUS if {"search", "python"} <= tools_used(text, calls, own) else 0.0)


def hierarchical_reward(
    text: str, ground_truth, score: Callable[[str, object], float], require_think: bool = True, calls: Calls = None,
    model_text: str | None = None,
) -> float:
    own = own_text(text, calls, model_text)
    answer = formatted_answer(text, require_think, calls, own)
    return -1.0 if answer is None else tiered(text, score(answer, ground_truth), calls, own)


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


def _per_completion(kwargs: dict, key: str, n: int) -> list:
    """Reward argument `key` from ARPOTrainer (`arpo_calls`: the recorded calls; `arpo_model_text`: the model's
    own text), one entry per completion; None for each when absent: the rewards then read the text's markers."""
    values = kwargs.get(key)
    if values is None:
        return [None] * n
    if len(values) != n:
        raise ValueError(f"Reward argument {key!r} has {len(values)} entries for {n} completions.")
    return list(values)


def completion_own_text(completion, calls: Calls = None, model_text: str | None = None) -> OwnText:
    """`own_text` of a TRL completion: of a conversation (TRL's tool loop), the model's own turns; its `tool`
    messages are results (their tools count as answered calls when there are no records)."""
    if model_text is not None or isinstance(completion, str):
        return own_text(completion_text(completion), calls, model_text)
    turns = [m for m in completion if isinstance(m, dict)]
    own = own_text(completion_text([m for m in turns if m.get("role") != "tool"]), calls)
    return own._replace(tools=own.tools + tuple(m.get("name") or "" for m in turns if m.get("role") == "tool"))


def _own_texts(completions: list, kwargs: dict) -> tuple[list[str], list[Calls], list[OwnText]]:
    """The completions' texts, their recorded calls and what the model wrote of each."""
    n = len(completions)
    texts, calls = [completion_text(c) for c in completions], _per_completion(kwargs, "arpo_calls", n)
    owns = [completion_own_text(c, k, m) for c, k, m in zip(completions, calls,
                                                            _per_completion(kwargs, "arpo_model_text", n))]
    return texts, calls, owns


def arpo_f1_reward(completions: list, **kwargs) -> list[float]:
    """The reference reward: format check, token-F1 of the boxed answer, +0.1 for using both tools."""
    truths = _ground_truths(kwargs, len(completions))
    texts, calls, owns = _own_texts(completions, kwargs)
    answers = [formatted_answer(x, calls=k, own=o) for x, k, o in zip(texts, calls, owns)]
    return [-1.0 if a is None else tiered(x, f1_score(a, t), k, o)
            for x, a, t, k, o in zip(texts, answers, truths, calls, owns)]


def arpo_math_reward(completions: list, **kwargs) -> list[float]:
    """As `arpo_f1_reward`, but the answer is scored by math equivalence (`math-verify`, bounded: see
    `arpo_trl.rewards.math_scoring`)."""
    truths = _ground_truths(kwargs, len(completions))
    texts, calls, owns = _own_texts(completions, kwargs)
    answers = [formatted_answer(x, calls=k, own=o) for x, k, o in zip(texts, calls, owns)]
    values = _score_answers("arpo_math_reward", answers, truths, kwargs)
    return [-1.0 if a is None else tiered(x, v, k, o) for x, a, v, k, o in zip(texts, answers, values, calls, owns)]


def answer_accuracy(completions: list, **kwargs) -> list[float]:
    """1.0 when the last boxed answer the model wrote is mathematically equal to the ground truth, format aside,
    else 0.0: an accuracy to log next to the reward (give it weight 0 in `reward_weights` to leave training
    unchanged)."""
    truths = _ground_truths(kwargs, len(completions))
    _, _, owns = _own_texts(completions, kwargs)
    answers = [None if o.error else extract_answer(o.text) for o in owns]
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


def format_credit(text: str, calls: Calls = None, own: OwnText | None = None) -> float:
    """Graded credit for the pieces of ARPO's format in the model's own text, up to 0.7: balanced <think>, a tool
    call that got its result, one <answer>…</answer>, a \\boxed{} inside it; 0 when it writes a result marker."""
    own = own or own_text(text, calls)
    if own.error is not None:
        return 0.0
    body = own.text
    has_answer = body.count("<answer>") == 1 and body.count("</answer>") == 1
    answer = body[body.find("<answer>") : body.find("</answer>")] if has_answer else ""
    checks = {
        "think": body.count("<think>") == body.count("</think>") >= 1,
        "tool_call": bool(tools_used(text, calls, own)),
        "answer": has_answer,
        "boxed": "\\boxed{" in answer,
    }
    return sum(credit for name, credit in FORMAT_CREDITS if checks[name])


def format_credit_reward(completions: list, **kwargs) -> list[float]:
    """Shaping for small models (the quickstart): ARPO's reward is -1 for nearly every completion of an untuned
    135M model, so a group's advantages would all be zero; graded format credit gives them a gradient."""
    texts, calls, owns = _own_texts(completions, kwargs)
    return [format_credit(x, k, o) for x, k, o in zip(texts, calls, owns)]
