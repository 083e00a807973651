"""Exact invariants of the branching sampler, driven by a scripted engine (a test double for the model only:
tokenizer, tag cutting, tools and bookkeeping are the real ones)."""

import math
import random
import threading
import time

import pytest

from arpo_trl.engines import Segment
from arpo_trl.rollout import BranchingSampler
from arpo_trl.tags import cut_at_stop, extract_call
from arpo_trl.tools import PythonTool, Tool, ToolEnvironmentError

CALL = "<python>print(1+1)</python>"


class ScriptedEngine:
    """`script(completion_text, rng) -> (text, per-token entropy, finish)`; ids are the text's real tokens."""

    def __init__(self, tokenizer, script, vocab_size=1000, seed=0):
        self.tokenizer, self.script, self.vocab_size = tokenizer, script, vocab_size
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.rng = random.Random(seed)
        self.calls: list[list[list[int]]] = []

    def generate(self, prefixes, max_new_tokens, stop):
        self.calls.append([list(p) for p in prefixes])
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            text = self.tokenizer.decode(prefix, skip_special_tokens=False).split("<|im_start|>assistant\n")[-1]
            new, entropy, finish = self.script(text, self.rng)
            ids = self.tokenizer.encode(new, add_special_tokens=False)
            if finish == "eos":
                ids.append(self.tokenizer.eos_token_id)
            if len(ids) > budget:
                ids, finish = ids[:budget], "length"
            out.append(Segment(ids, [-0.5] * len(ids), [entropy] * len(ids), finish))
        return out


def _prompts(tokenizer, n=2):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i}+1?"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        for i in range(n)
    ]


def calls_then_answers(max_calls):
    def script(text, rng):
        calls = text.count("</result>")
        if calls < max_calls and rng.random() < 0.8:
            return f"step {calls} {CALL}", rng.uniform(0.0, 2.0), "stop"
        return "<answer>\\boxed{2}</answer>", rng.uniform(0.0, 2.0), "eos"
    return script


def _sampler(tokenizer, script, tools=None, **kw):
    engine = ScriptedEngine(tokenizer, script, seed=kw.pop("engine_seed", 0))
    return BranchingSampler(engine, tokenizer, tools if tools is not None else [Tool("python", lambda c: "2")], **kw)


@pytest.mark.parametrize("policy", ["entropy", "random", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_exactly_m_per_prompt_and_branch_prefixes(tokenizer, policy, seed):
    m = 8
    sampler = _sampler(tokenizer, calls_then_answers(3), num_generations=m, branch_policy=policy,
                       max_completion_length=200, seed=seed, engine_seed=seed)
    result = sampler.sample(_prompts(tokenizer, 3))
    assert [len(g) for g in result.groups] == [m, m, m]
    by_id = {t.id: t for t in result.trajectories}
    for t in result.trajectories:
        assert not t.active
        assert len(t.completion_ids) == len(t.mask) == len(t.logprobs) == len(t.entropies) <= 200
        # per-token entropies are kept for the model's tokens only (the entropy-around-tools plot)
        assert [math.isnan(h) for h in t.entropies] == [bit == 0 for bit in t.mask]
        if t.kind == "branch":
            parent = by_id[t.parent]
            assert parent.group == t.group
            assert t.completion_ids[: t.fork_position] == parent.completion_ids[: t.fork_position]
            assert t.mask[: t.fork_position] == parent.mask[: t.fork_position]
            # forks happen right after a tool result
            assert tokenizer.decode(t.completion_ids[: t.fork_position]).endswith("</result>")
    if policy == "none":
        assert all(t.kind == "global" for t in result.trajectories) and result.stats.forks == 0


def test_mask_is_zero_exactly_on_result_spans(tokenizer):
    sampler = _sampler(tokenizer, calls_then_answers(3), num_generations=6, max_completion_length=300, seed=3)
    for t in sampler.sample(_prompts(tokenizer, 2)).trajectories:
        spans, current = [], []
        for token, bit in zip(t.completion_ids, t.mask):
            if bit == 0:
                current.append(token)
            elif current:
                spans.append(current)
                current = []
        if current:
            spans.append(current)
        assert len(spans) == t.tool_calls
        for span in spans:
            assert tokenizer.decode(span) == " <result>\n2\n</result>"
        model_text = tokenizer.decode([tok for tok, bit in zip(t.completion_ids, t.mask) if bit])
        assert "<result>" not in model_text


def _fork_rate(tokenizer, h_initial, h_after, trials=1500, policy="entropy"):
    """N=1, M=2: the global path calls a tool once; forked or not at that result decides path 2's kind."""
    def script(text, rng):
        if "</result>" not in text:
            return CALL, h_initial, "stop"
        return "<answer>\\boxed{2}</answer>", h_after, "eos"
    sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_policy=policy,
                       entropy_window=4, seed=123)
    prompt = _prompts(tokenizer, 1)
    forks = sum(sampler.sample(prompt).groups[0][1].kind == "branch" for _ in range(trials))
    return forks / trials


@pytest.mark.parametrize("delta", [-3.0, -1.0, 0.0, 1.0, 4.0])
def test_fork_frequency_matches_clip_tau_plus_beta_delta(tokenizer, delta):
    vocab_log = math.log(1000)
    per_token = lambda h: h * vocab_log / 4  # noqa: E731  (4 tokens summed, then / ln|V|)
    # "<answer>…" is more than 4 tokens and the call is too: both windows hold exactly 4 tokens.
    rate = _fork_rate(tokenizer, per_token(1.0), per_token(1.0 + delta))
    expected = min(1.0, max(0.0, 0.5 + 0.2 * delta))
    assert rate == pytest.approx(expected, abs=0.04)


def test_random_policy_ignores_entropy(tokenizer):
    assert _fork_rate(tokenizer, 0.0, 50.0, policy="random") == pytest.approx(0.5, abs=0.04)


def test_top_up_only_when_no_path_is_active(tokenizer):
    def script(text, rng):  # one call at most, then answer
        if "</result>" in text or rng.random() < 0.5:
            return "<answer>\\boxed{2}</answer>", 0.1, "eos"
        return CALL, 0.1, "stop"
    sampler = _sampler(tokenizer, script, num_generations=6, initial_rollouts=2, seed=0)
    for _ in range(20):
        sampler.engine.calls.clear()
        result = sampler.sample(_prompts(tokenizer, 1), initial_rollouts=2)
        group = result.groups[0]
        assert len(group) == 6
        # replay: a "fill" path is created in round r only if no path of the prompt was still active after r
        fills = [t for t in group if t.kind == "fill"]
        assert result.stats.fill_ups == len(fills)
        for fill in fills:
            earlier = [t for t in group if t.id < fill.id]
            assert all(not t.active for t in earlier)
        # each round after the first generates only for paths that exist and are active
        assert len(sampler.engine.calls[0]) == 2


def test_call_limit_ends_with_eos(tokenizer):
    sampler = _sampler(tokenizer, lambda text, rng: (CALL, 0.5, "stop"), num_generations=4, max_tool_calls=2,
                       max_completion_length=400, seed=0)
    for t in sampler.sample(_prompts(tokenizer, 2)).trajectories:
        assert t.tool_calls == 2 and t.finish_reason == "call_limit"
        assert t.completion_ids[-1] == tokenizer.eos_token_id and t.mask[-1] == 0
        assert tokenizer.decode(t.completion_ids).count("<result>") == 2


def test_budget_truncates_long_results(tokenizer):
    long_tool = Tool("python", lambda code: "x" * 500)
    sampler = _sampler(tokenizer, lambda text, rng: (CALL, 0.5, "stop"), tools=[long_tool], num_generations=4,
                       max_completion_length=40, seed=0)
    for t in sampler.sample(_prompts(tokenizer, 2)).trajectories:
        assert len(t.completion_ids) == len(t.mask) == len(t.logprobs) == 40
        assert t.finish_reason == "length"


def test_tool_errors_and_timeouts_become_result_text(tokenizer):
    def boom(code):
        raise RuntimeError("kaput")

    def hang(code):
        time.sleep(3)
        return "late"

    def script(text, rng):
        if "</result>" in text:
            return "<answer>\\boxed{2}</answer>", 0.1, "eos"
        return ("<python>1</python>" if rng.random() < 0.5 else "<search>q</search>"), 0.1, "stop"

    sampler = _sampler(tokenizer, script, tools=[Tool("python", boom), Tool("search", hang)], num_generations=4,
                       branch_policy="none", tool_timeout=0.5, seed=0)
    result = sampler.sample(_prompts(tokenizer, 1))
    texts = [tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in result.trajectories]
    assert result.stats.tool_failures == result.stats.tool_calls == 4
    for text in texts:
        assert "Error: Tool(python) execution failed with message: RuntimeError: kaput" in text or \
            "Error: Tool(search) timed out after 0.5 s." in text
        assert text.endswith("</answer>")


def test_real_python_tool_in_the_loop(tokenizer):
    def script(text, rng):
        if "</result>" in text:
            return "<answer>\\boxed{2}</answer>", 0.1, "eos"
        return "<python>import sys\nprint(sum(range(5)))\n1/0</python>", 0.1, "stop"
    sampler = _sampler(tokenizer, script, tools=[PythonTool(timeout=5)], num_generations=2, branch_policy="none")
    text = tokenizer.decode(sampler.sample(_prompts(tokenizer, 1)).trajectories[0].completion_ids)
    assert "10\nTraceback" in text and "ZeroDivisionError" in text


def test_empty_unknown_and_unclosed_tags(tokenizer):
    outputs = {"empty": ("<python>  </python>", "stop"), "unknown": ("<calc>1</calc> done", "eos"),
               "unclosed": ("<python>print(1) and more", "eos")}
    for name, (text, finish) in outputs.items():
        sampler = _sampler(tokenizer, lambda t, r, text=text, finish=finish: (text, 0.1, finish), num_generations=2,
                           branch_policy="none")
        for t in sampler.sample(_prompts(tokenizer, 1)).trajectories:
            assert t.tool_calls == 0
            assert t.finish_reason == ("empty_call" if name == "empty" else "eos")


def test_cut_when_the_tag_ends_inside_a_token(tokenizer):
    text = "x=1</python>\n more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = lambda i: tokenizer.decode(i, skip_special_tokens=True)  # noqa: E731
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    kept, rewritten, tag = cut_at_stop(ids, decode, encode, ["</python>", "</search>"])
    assert tag == "</python>"
    assert decode(kept + rewritten) == "x=1</python>"
    assert kept == ids[: len(kept)]  # the model's own tokens are untouched
    assert cut_at_stop(encode("no tag here >"), decode, encode, ["</python>"]) is None
    assert extract_call("<python>a</python>", "</python>") == "a"
    assert extract_call("<python><python>b</python>", "</python>") == "b"
    assert extract_call("no open</python>", "</python>") == ""


def test_straddling_token_is_rewritten(tokenizer):
    decode = lambda i: tokenizer.decode(i, skip_special_tokens=True)  # noqa: E731
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    vocab = tokenizer.get_vocab()
    straddlers = [tid for tok, tid in vocab.items() if decode([tid]).startswith(">") and len(decode([tid])) > 1]
    assert straddlers, "tokenizer should have a token such as '>\\n'"
    ids = encode("<python>1</python") + [straddlers[0]]
    kept, rewritten, _ = cut_at_stop(ids, decode, encode, ["</python>"])
    assert decode(kept + rewritten) == "<python>1</python>"
    assert kept == ids[:-1] and rewritten == encode(">")


def test_sampler_rejects_bad_arguments(tokenizer):
    engine = ScriptedEngine(tokenizer, calls_then_answers(1))
    with pytest.raises(ValueError, match="unique"):
        BranchingSampler(engine, tokenizer, [Tool("python", str), Tool("python", str)])
    with pytest.raises(ValueError, match="branch_policy"):
        BranchingSampler(engine, tokenizer, [], branch_policy="greedy")
    with pytest.raises(ValueError, match="initial_rollouts"):
        BranchingSampler(engine, tokenizer, [], num_generations=4, initial_rollouts=5)


def test_hung_and_failing_tools_under_concurrency_do_not_starve_later_rounds(tokenizer):
    """Round 1: every call hangs (2 workers, all stuck for good). Round 2: every call raises. Round 3 must still run
    every call: a timed-out call is abandoned (daemon thread), not left holding a worker as a ThreadPoolExecutor
    would."""
    release = threading.Event()

    def hang(code):
        release.wait(60)
        return "late"

    def script(text, rng):
        calls = text.count("</result>")
        if calls == 3:
            return "<answer>\\boxed{2}</answer>", 0.1, "eos"
        return ("<search>hang</search>", "<python>boom</python>", "<calc>2</calc>")[calls], 0.1, "stop"

    def boom(code):
        raise ValueError("bad input")

    tools = [Tool("search", hang), Tool("python", boom), Tool("calc", lambda s: str(int(s) * 21))]
    sampler = _sampler(tokenizer, script, tools=tools, num_generations=8, branch_policy="none", tool_timeout=0.3,
                       max_tool_workers=2, max_tool_calls=3, max_completion_length=600, seed=1)
    start = time.monotonic()
    result = sampler.sample(_prompts(tokenizer, 2))
    elapsed = time.monotonic() - start
    texts = [tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in result.trajectories]
    outputs = [s for text in texts for s in text.split("<result>\n")[1:]]
    assert len(outputs) == result.stats.tool_calls == 16 * 3
    for text in texts:
        first, second, third = text.split("<result>\n")[1:]
        assert first.startswith("Error: Tool(search) timed out after 0.3 s.")
        assert second.startswith("Error: Tool(python) execution failed with message: ValueError: bad input")
        assert third.startswith("42\n"), "round 3's calls starved behind the hung ones"
    assert elapsed < 3 * 0.3 + 10, "rounds waited for hung calls beyond the deadline"
    release.set()


def test_a_broken_tool_environment_stops_the_rollout(tokenizer):
    """A sandbox that cannot start is the trainer's problem, not an observation to train on."""
    def broken(code):
        raise ToolEnvironmentError("the sandbox could not start: no space left on device")

    sampler = _sampler(tokenizer, calls_then_answers(1), tools=[Tool("python", broken)], num_generations=2,
                       branch_policy="none")
    with pytest.raises(RuntimeError, match=r"Tool\(python\) cannot run: the sandbox could not start"):
        sampler.sample(_prompts(tokenizer, 1))


def test_rollout_time_is_split_into_generation_tools_and_overhead(tokenizer):
    def slow(code):
        time.sleep(0.2)
        return "2"

    sampler = _sampler(tokenizer, calls_then_answers(1), tools=[Tool("python", slow)], num_generations=2,
                       branch_policy="none")
    stats = sampler.sample(_prompts(tokenizer, 1)).stats
    assert stats.tool_seconds >= 0.2 and stats.generation_seconds > 0
    assert 0 <= stats.overhead_seconds < stats.seconds
    assert stats.seconds >= stats.tool_seconds + stats.generation_seconds
