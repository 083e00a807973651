"""`MathScorer`'s verdicts, on a scorer of its own (nothing cached by other tests): which answers are compared as
text instead of parsed, what the cache keeps, and what a `ScoreReport` counts (docs/rewards.md)."""

from __future__ import annotations

import pytest

from arpo_trl.rewards.math_scoring import MathScorer, nesting_depth

SLOW_SUM = "\\sum_{k=1}^{%d} \\frac{1}{k}"  # math-verify spends minutes on it (over 90 s here)


@pytest.fixture(scope="module")
def shared_scorer():
    scorer = MathScorer(workers=2)
    yield scorer
    scorer.close()


@pytest.fixture
def scorer(shared_scorer):
    """The module's scorer with its default limits and an empty cache."""
    shared_scorer.clear_cache()
    shared_scorer.configure(timeout=2.0, batch_timeout=8.0, max_chars=1000, max_depth=40)
    shared_scorer.cache_size = 4096
    return shared_scorer


def record_sent(scorer, monkeypatch) -> list[list[str]]:
    """The answers each call sends to the math-verify workers (those neither capped nor cached)."""
    sent: list[list[str]] = []
    run = scorer._run
    monkeypatch.setattr(scorer, "_run", lambda keys: sent.append(sorted(key[0] for key in keys)) or run(keys))
    return sent


@pytest.mark.parametrize("text,depth", [
    ("3", 0), ("(1)", 1), ("\\frac{1}{2}", 1), ("{[(x)]}", 3), ("(x)(y)", 1), ("((x)((y)))", 3), ("))((", 2),
    ("(x]]]]", 1), ("()()()", 1), ("(())(", 2),
])
def test_nesting_depth(text, depth):
    assert nesting_depth(text) == depth


def test_answers_past_the_length_cap_are_compared_as_text(scorer):
    scorer.configure(max_chars=10)
    spaced = "1 2 3 4   5 6 7 8"  # 17 characters: over twice its 8-character ground truth
    report = scorer.score(["0000000003", "00000000003", spaced, spaced.replace("8", "9")],
                          [["3"], ["3"], ["12345678"], ["12345678"]])
    # 10 characters are parsed (equal to 3); 11 are capped and differ from "3" as text; whitespace aside, the
    # spaced digits equal their ground truth as text, the changed ones do not
    assert report.scores == [1.0, 0.0, 1.0, 0.0]
    assert report.capped == 3 and report.timeouts == report.errors == 0


def test_a_long_ground_truth_lets_an_answer_twice_as_long_be_parsed(scorer):
    scorer.configure(max_chars=10)
    truth = "3" + " " * 9  # 10 characters: answers up to 20 are parsed
    report = scorer.score(["0" * 19 + "3", "0" * 20 + "3"], [[truth], [truth]])
    assert report.scores == [1.0, 0.0] and report.capped == 1


def test_answers_nested_past_the_depth_cap_are_compared_as_text(scorer):
    scorer.configure(max_depth=3)
    report = scorer.score(["(((3)))", "((((3))))", "((((2))))", "(((((2)))))"], [["3"], ["3"], ["((2))"], ["((2))"]])
    # depth 3 is parsed; 4 is capped, unless the ground truth is nested 2 deep (twice that is allowed); 5 is not
    assert report.scores == [1.0, 0.0, 1.0, 0.0]
    assert report.capped == 2


def test_an_answer_without_ground_truths_scores_zero(scorer):
    assert scorer.score(["3", "(3)" * 400], [[], []]).scores == [0.0, 0.0]


def test_hostile_text_is_compared_as_it_was_written(scorer):
    # a lone surrogate (text a policy can emit, not valid UTF-8) in an answer capped by its length (1,801 characters,
    # over twice its ground truth's 601), equal to the ground truth as text, whitespace aside
    truth = "\ud800" + "x" * 600
    spaced = "\ud800" + "  x" * 600
    assert scorer.score([spaced, spaced + "y"], [[truth], [truth]]).scores == [1.0, 0.0]


def test_identical_answers_are_scored_once(scorer, monkeypatch):
    sent = record_sent(scorer, monkeypatch)
    first = scorer.score(["1/2", "0.5", "1/2"], [["0.5"]] * 3)
    second = scorer.score(["0.5", "1/2", "3"], [["0.5"]] * 3)
    assert first.scores == [1.0, 1.0, 1.0] and second.scores == [1.0, 1.0, 0.0]
    assert sent == [["0.5", "1/2"], ["3"]]


def test_the_cache_keeps_the_most_recently_used_answers(scorer, monkeypatch):
    scorer.cache_size = 2
    sent = record_sent(scorer, monkeypatch)
    for answer in ("1", "2", "3"):
        scorer.score([answer], [["1"]])
    assert scorer.score(["2", "3"], [["1"], ["1"]]).scores == [0.0, 0.0]
    assert scorer.score(["1"], [["1"]]).scores == [1.0]
    assert sent == [["1"], ["2"], ["3"], [], ["1"]]  # "1" was the oldest of three


def test_a_number_too_large_to_evaluate_scores_zero_and_stays_capped(scorer, monkeypatch):
    sent = record_sent(scorer, monkeypatch)
    towers = ["9^{9^{9^{9}}}", "(10^{10})!"]
    first = scorer.score([*towers, "2"], [["1"], ["1"], ["2"]])
    assert first.scores == [0.0, 0.0, 1.0]
    assert first.capped == 2 and first.timeouts == first.errors == 0
    again = scorer.score(["1" * 1200, *towers, "2"], [["1"]] * 3 + [["2"]])  # capped by length, then cached
    assert again.scores == [0.0, 0.0, 0.0, 1.0] and again.capped == 3
    assert sent == [sorted([*towers, "2"]), []]


def test_answers_past_the_time_bound_score_zero_and_are_counted(scorer):
    scorer.configure(timeout=0.5)
    report = scorer.score([SLOW_SUM % 40001, SLOW_SUM % 40003, "2"], [["1"], ["1"], ["2"]])
    assert report.scores == [0.0, 0.0, 1.0]
    assert report.timeouts == 2 and report.capped == report.errors == 0
