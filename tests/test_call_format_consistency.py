"""The same run in both tool-call formats (`tags`, `chat_template`) counts the same tool calls everywhere they are
read: the sampler's records, the tree records, `arpo-trl eval`'s metrics and the rewards (format check, multi-tool
bonus, format credit). Before the calls were recorded as data, every reader matched `<tag>`/`<result>` text, so with
`chat_template` they silently saw no tool calls.

A scripted engine (the model only is a test double) writes the same calls in either format; the tokenizer (Hermes
chat template), the sampler, `PythonTool`, a `SearchTool` over a tiny BM25 corpus, the readers and the rewards are
the real ones."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from datasets import Dataset

from arpo_trl import ARPOTrainer, arpo_math_reward
from arpo_trl.commands.eval_setup import EvalArguments, EvalSetup
from arpo_trl.commands.evaluate import evaluate
from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.rewards import format_credit_reward
from arpo_trl.rollout.tool_calls import make_call_format
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import BM25Backend, PythonTool, SearchTool
from arpo_trl.tools.tags import own_text_from_ids
from arpo_trl.trees.records import tree_records

FORMATS = ("tags", "chat_template")
ARGUMENT = {"python": "code", "search": "query"}  # the tools' schema arguments (chat_template calls)
MAX_TOOL_CALLS = 2
# Per case, the segments of a trajectory: ("text", tool, input) ends with that call, ("text", None, None) with EOS.
CASES = {
    "both": ("42", [("<think>compute, then check</think>", "python", "print(6*7)"),
                    ("", "search", "answer to everything"),
                    ("<answer>\\boxed{42}</answer>", None, None)]),
    "failing": ("7", [("<think>look it up</think>", "search", "offline archive"),  # the backend raises
                      ("<answer>\\boxed{7}</answer>", None, None)]),
    # the third call is past max_tool_calls: not run, the path ends there (after an answer it wrote first)
    "limit": ("2", [("<think>loop</think>", "python", "print(1)"),
                    ("", "python", "print(2)"),
                    ("<answer>\\boxed{2}</answer>", "search", "one more")]),
    "plain": ("5", [("<think>easy</think><answer>\\boxed{5}</answer>", None, None)]),
}
RESPONSE_END = {"tags": "</result>", "chat_template": "</tool_response>"}


def write_call(fmt: str, tool: str, content: str) -> str:
    if fmt == "tags":
        return f"<{tool}>{content}</{tool}>"
    return "<tool_call>" + json.dumps({"name": tool, "arguments": {ARGUMENT[tool]: content}}) + "</tool_call>"


class FormatEngine(GenerationEngine):
    """Replays CASES in format `fmt`. The case is named in the question, the step is the number of tool responses
    so far. A segment's entropy sits on its first token ([h, 0, …]: the sampler sums the first k), so both formats
    see the same entropies and grow the same trees. A segment cut by its token budget (a probe) is continued by
    the next request for that prefix (paths of one case share prefixes: each gets one continuation)."""

    def __init__(self, tokenizer, fmt: str):
        self.tokenizer, self.fmt, self.vocab_size = tokenizer, fmt, 1000
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.rest: dict[tuple[int, ...], list[tuple[list[int], list[float], str]]] = defaultdict(list)

    def generate(self, prefixes, max_new_tokens, stop):
        return [self.segment(list(prefix), budget) for prefix, budget in zip(prefixes, max_new_tokens)]

    def segment(self, prefix: list[int], budget: int) -> Segment:
        if self.rest.get(tuple(prefix)):
            ids, entropies, finish = self.rest[tuple(prefix)].pop()
        else:
            ids, entropies, finish = self.next_segment(self.tokenizer.decode(prefix))
        if len(ids) > budget:
            self.rest[tuple(prefix + ids[:budget])].append((ids[budget:], entropies[budget:], finish))
            ids, entropies, finish = ids[:budget], entropies[:budget], "length"
        return Segment(ids, [-0.5] * len(ids), entropies, finish)

    def next_segment(self, text: str) -> tuple[list[int], list[float], str]:
        case = re.search(r"case=(\w+)", text).group(1)
        completion = text.split("<|im_start|>assistant\n", 1)[1]
        step = completion.count(RESPONSE_END[self.fmt])
        words, tool, content = CASES[case][1][step]
        if tool is not None:
            words += write_call(self.fmt, tool, content)
        ids = self.tokenizer.encode(words, add_special_tokens=False) + [self.tokenizer.eos_token_id] * (tool is None)
        return ids, [0.4 + 0.5 * step] + [0.0] * (len(ids) - 1), "stop" if tool else "eos"


class FlakyBM25(BM25Backend):
    def search(self, query: str, top_k: int) -> list[str]:
        if "offline" in query:
            raise ConnectionError("the archive is offline")
        return super().search(query, top_k)


@pytest.fixture(scope="module")
def tools():
    corpus = ["The answer to everything is 42.", "Paris is the capital of France.", "Loops repeat steps."]
    python = PythonTool(timeout=10)
    yield [python, SearchTool(FlakyBM25(corpus), top_k=1)]
    python.close()


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": f"case={case}: what is the answer?"}] for case in CASES]


def sample(hermes, tools, fmt: str, **kw):
    call_format = make_call_format(fmt, hermes, tools)
    sampler = BranchingSampler(FormatEngine(hermes, fmt), hermes, tools, max_tool_calls=MAX_TOOL_CALLS,
                               max_completion_length=1024, call_format=call_format, seed=3,
                               segment_statistic="sum", **kw)  # FormatEngine's [h, 0, …]: the same sum in both
    if fmt == "chat_template":
        prompts = call_format.prompt_ids(conversations())
    else:
        prompts = [hermes.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"] for c in conversations()]
    return sampler.sample(prompts)


@pytest.fixture(scope="module")
def rollouts(hermes, tools):
    """Each format's rollout: 4 trajectories per case, 2 of them global, branching on ΔH."""
    return {fmt: sample(hermes, tools, fmt, num_generations=4, initial_rollouts=2, branch_threshold=0.6)
            for fmt in FORMATS}


def shape(result) -> list[tuple]:
    return [(t.group, t.kind, t.parent, t.finish_reason, t.tool_calls, t.tool_failures,
             [(c.tool, c.arguments, c.ran, c.answered, c.failed) for c in t.calls]) for t in result.trajectories]


EXPECTED_CALLS = {  # per case: (tool, arguments, ran, answered, failed) of each call
    "both": [("python", "print(6*7)", True, True, False), ("search", "answer to everything", True, True, False)],
    "failing": [("search", "offline archive", True, True, True)],
    "limit": [("python", "print(1)", True, True, False), ("python", "print(2)", True, True, False),
              ("search", "one more", False, False, False)],
    "plain": [],
}


def test_the_sampler_records_the_same_calls_in_both_formats(rollouts, hermes):
    tags, chat = rollouts["tags"], rollouts["chat_template"]
    assert shape(tags) == shape(chat)
    assert any(t.kind == "branch" for t in tags.trajectories)  # the trees did branch, alike in both formats
    for fmt, result in rollouts.items():
        assert [len(group) for group in result.groups] == [4] * len(CASES)
        for t in result.trajectories:
            case = list(CASES)[t.group]
            assert [(c.tool, c.arguments, c.ran, c.answered, c.failed) for c in t.calls] == EXPECTED_CALLS[case]
            assert (t.tool_calls, t.tool_failures) == ({"both": 2, "failing": 1, "limit": 2, "plain": 0}[case],
                                                       int(case == "failing"))
            assert t.finish_reason == ("call_limit" if case == "limit" else "eos"), fmt
            text = hermes.decode(t.completion_ids)  # the script's calls, each written once
            markers = ["<tool_call>"] if fmt == "chat_template" else ["<python>", "<search>"]
            opened = sum(text.count(marker) for marker in markers)
            assert opened == len(t.calls) and text.count("<answer>") == 1
    assert (tags.stats.tool_calls, tags.stats.tool_failures) == (chat.stats.tool_calls, chat.stats.tool_failures)


def test_tree_records_show_the_same_calls_and_results(rollouts, hermes):
    seen = {}
    for fmt, result in rollouts.items():
        records = tree_records(result, hermes, step=0)
        seen[fmt] = [(r["node"], r["tool_calls"], r["tool_failures"], [(c["tool"], c["failed"]) for c in r["calls"]],
                      sum(s["kind"] == "result" for s in r["segments"])) for r in records]
        for record, t in zip(records, result.trajectories):
            results = [s for s in record["segments"] if s["kind"] == "result"]
            answered = [c for c in record["calls"] if c["result_start"] is not None]
            assert [(s["start"], s["end"]) for s in results] == [(c["result_start"], c["result_end"]) for c in answered]
            assert all(RESPONSE_END[fmt] in s["text"] for s in results)
            assert len(results) == t.tool_calls
    assert seen["tags"] == seen["chat_template"]
    assert {calls for *_, calls in seen["tags"]} == {0, 1, 2}


def completions_and_calls(result, hermes) -> tuple[list[str], list[list[dict]], list[str]]:
    """What ARPOTrainer gives the rewards: the decoded completions and `arpo_calls` (from `_tree_fields`)."""
    texts = [hermes.decode(t.completion_ids, skip_special_tokens=True) for t in result.trajectories]
    calls = [ARPOTrainer._tree_fields(t)["calls"] for t in result.trajectories]
    truths = [CASES[list(CASES)[t.group]][0] for t in result.trajectories]
    return texts, calls, truths


REWARD = {"both": 1.1, "failing": 1.0, "limit": -1.0, "plain": 1.0}  # 1.1: correct, with both tools
CREDIT = {"both": 0.7, "failing": 0.7, "limit": 0.7, "plain": 0.5}  # think 0.1, tool call 0.2, answer 0.2, boxed 0.2


@pytest.mark.parametrize("fmt", FORMATS)
def test_rewards_read_the_calls_in_both_formats(rollouts, hermes, fmt):
    texts, calls, truths = completions_and_calls(rollouts[fmt], hermes)
    cases = [list(CASES)[t.group] for t in rollouts[fmt].trajectories]
    rewards = arpo_math_reward(texts, ground_truth=truths, arpo_calls=calls)
    assert rewards == pytest.approx([REWARD[case] for case in cases])
    decode = lambda ids: hermes.decode(ids, skip_special_tokens=True)  # noqa: E731
    owns = [own_text_from_ids(t.completion_ids, t.calls, decode).text for t in rollouts[fmt].trajectories]
    assert not any(marker in own for own in owns for marker in ("<result>", "<tool_response>"))
    assert arpo_math_reward(texts, ground_truth=truths, arpo_calls=calls, arpo_model_text=owns) == rewards  # as trained
    assert format_credit_reward(texts, arpo_calls=calls) == pytest.approx([CREDIT[case] for case in cases])


def test_text_only_rewards_miss_chat_template_calls(rollouts, hermes):
    """The old failure mode, still what text-only callers (e.g. TRL's GRPOTrainer) get: the reference's tag checks
    see the `tags` run's calls but none of the `chat_template` run's."""
    by_case = {}
    for fmt, result in rollouts.items():
        texts, calls, truths = completions_and_calls(result, hermes)
        first = {t.group: i for i, t in reversed(list(enumerate(result.trajectories)))}  # one path per case
        pick = [first[g] for g in range(len(CASES))]
        by_case[fmt] = (arpo_math_reward([texts[i] for i in pick], ground_truth=[truths[i] for i in pick]),
                        format_credit_reward([texts[i] for i in pick]),
                        arpo_math_reward([texts[i] for i in pick], ground_truth=[truths[i] for i in pick],
                                         arpo_calls=[calls[i] for i in pick]))
    text_reward, text_credit, aware = by_case["tags"]
    assert text_reward == aware == pytest.approx([1.1, 1.0, -1.0, 1.0])  # tags: the text checks agree
    assert text_credit == pytest.approx([0.7, 0.7, 0.7, 0.5])
    text_reward, text_credit, aware = by_case["chat_template"]
    assert aware == pytest.approx([1.1, 1.0, -1.0, 1.0])
    # text-only: no bonus for both tools, and the call past the limit goes unnoticed (its answer scores 1)
    assert text_reward == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert text_credit == pytest.approx([0.5, 0.5, 0.5, 0.5])  # no tool-call credit


def run_eval(hermes, tools, fmt: str, output_dir) -> dict:
    data = Dataset.from_list([{"prompt": conversation, "ground_truth": CASES[case][0]}
                              for conversation, case in zip(conversations(), CASES)])
    setup = EvalSetup(FormatEngine(hermes, fmt), hermes, tools, data, "math")
    args = EvalArguments(n_samples=2, k=[1], seeds=[0], batch_size=2, max_completion_length=1024,
                         max_tool_calls=MAX_TOOL_CALLS, tool_call_format=fmt, output_dir=str(output_dir))
    return evaluate(args, setup)


def test_evaluation_counts_the_same_calls_in_both_formats(hermes, tools, tmp_path):
    results = {fmt: run_eval(hermes, tools, fmt, tmp_path / fmt) for fmt in FORMATS}
    for fmt, result in results.items():
        (metrics,) = result["per_seed"]
        assert metrics["tool_calls_per_trajectory"] == (2 + 1 + 2 + 0) / 4, fmt
        assert metrics["tool_failures_per_trajectory"] == 1 / 4 and metrics["tool_failure_rate"] == 1 / 5
        assert (metrics["tool_use_rate/python"], metrics["tool_use_rate/search"]) == (2 / 4, 2 / 4)
        assert metrics["format_valid_rate"] == 3 / 4 and metrics["pass@1"] == 1.0
        assert (metrics["finish_reason/eos"], metrics["finish_reason/call_limit"]) == (3 / 4, 1 / 4)
        by_case = {record["question"].split(":")[0]: record["completions"] for record in result["records"]}
        assert {case: [c["calls_by_tool"] for c in completions] for case, completions in by_case.items()} == {
            "case=both": [{"python": 1, "search": 1}] * 2, "case=failing": [{"python": 0, "search": 1}] * 2,
            "case=limit": [{"python": 2, "search": 0}] * 2, "case=plain": [{"python": 0, "search": 0}] * 2}
        assert all("not answered" in c["format_error"] for c in by_case["case=limit"])
    counted = ("questions", "trajectories", "pass@1", "mean_score", "answered_rate", "format_valid_rate",
               "tool_calls_per_trajectory", "tool_failures_per_trajectory", "tool_failure_rate",
               "tool_use_rate/python", "tool_use_rate/search", "finish_reason/eos", "finish_reason/call_limit")
    tags, chat = (results[fmt]["per_seed"][0] for fmt in FORMATS)
    assert {k: tags[k] for k in counted} == {k: chat[k] for k in counted}
    assert tags["tokens_generated"] != chat["tokens_generated"]  # the formats did write different text
