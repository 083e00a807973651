"""Exact invariants of the branching sampler, driven by a scripted engine (a test double for the model only:
tokenizer, tag cutting, tools and bookkeeping are the real ones)."""

import asyncio
import hashlib
import math
import os
import random
import signal
import threading
import time

import pytest

from arpo_trl.generation.engine import EngineTraits, GenerationEngine, Segment
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import PythonTool, Tool, ToolEnvironmentError
from arpo_trl.tools.tags import cut_at_stop, extract_call

CALL = "<python>print(1+1)</python>"


class ScriptedEngine(GenerationEngine):
    """`script(completion_text, rng) -> (text, per-token entropy, finish)`; ids are the text's real tokens. A segment
    cut by its token budget is continued, from where it stopped, by the next request for that prefix (a probe and its
    continuation). `calls` holds each `generate` call's prefixes (one wave) and `budgets` their token budgets."""

    def __init__(self, tokenizer, script, vocab_size=1000, seed=0):
        self.tokenizer, self.script, self.vocab_size = tokenizer, script, vocab_size
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.rng = random.Random(seed)
        self.calls: list[list[list[int]]] = []
        self.budgets: list[list[int]] = []
        self.segments: list[list[Segment]] = []
        self.rest: dict[tuple[int, ...], tuple[list[int], float, str]] = {}

    def generate(self, prefixes, max_new_tokens, stop):
        self.calls.append([list(p) for p in prefixes])
        self.budgets.append(list(max_new_tokens))
        self.segments.append([self.segment(prefix, budget) for prefix, budget in zip(prefixes, max_new_tokens)])
        return self.segments[-1]

    def segment(self, prefix, budget) -> Segment:
        if (rest := self.rest.pop(tuple(prefix), None)) is not None:
            ids, entropy, finish = rest
        else:
            text = self.tokenizer.decode(prefix, skip_special_tokens=False).split("<|im_start|>assistant\n")[-1]
            new, entropy, finish = self.script(text, self.rng)
            ids = self.tokenizer.encode(new, add_special_tokens=False)
            if finish == "eos":
                ids.append(self.tokenizer.eos_token_id)
        if len(ids) > budget:
            self.rest[tuple(prefix) + tuple(ids[:budget])] = ids[budget:], entropy, finish
            ids, finish = ids[:budget], "length"
        return Segment(ids, [-0.5] * len(ids), [entropy] * len(ids), finish)


class AsyncScriptedEngine(ScriptedEngine):
    """The same policy, served one request at a time (`agenerate`) with a random delay per token, so that requests
    complete in random order, as on a server. `cancelled` counts requests cancelled midway."""

    traits = EngineTraits(event_driven=True)

    def __init__(self, tokenizer, script, seed=0, token_seconds=0.0005, **kw):
        super().__init__(tokenizer, script, seed=seed, **kw)
        self.token_seconds, self.delay_rng, self.cancelled, self.in_flight = token_seconds, random.Random(seed), 0, 0

    async def agenerate(self, prefix, max_new_tokens, stop):
        segment = self.segment(list(prefix), max_new_tokens)
        self.in_flight += 1
        try:
            await asyncio.sleep(self.token_seconds * len(segment.token_ids) * self.delay_rng.uniform(0.2, 3.0))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        return segment


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


def _sampler(tokenizer, script, tools=None, engine_class=None, **kw):
    """A sampler over a scripted engine."""
    engine = (engine_class or ScriptedEngine)(tokenizer, script, seed=kw.pop("engine_seed", 0))
    kw.setdefault("seed", 0)  # a seed fixes every fork draw: no test depends on an unseeded one
    sampler = BranchingSampler(engine, tokenizer, tools if tools is not None else [Tool("python", lambda c: "2")], **kw)
    return sampler


def _is_prompt(prefix, prompts) -> bool:
    return any(list(prefix) == list(p) for p in prompts)


@pytest.mark.parametrize("scheduler", ["waves", "events"])
@pytest.mark.parametrize("policy", ["entropy", "random", "aepo", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_exactly_m_per_prompt_and_branch_prefixes(tokenizer, policy, seed, scheduler):
    m = 8
    sampler = _sampler(tokenizer, calls_then_answers(3), num_generations=m, branch_policy=policy,
                       max_completion_length=200, seed=seed, engine_seed=seed, scheduler=scheduler,
                       engine_class=AsyncScriptedEngine if scheduler == "events" else None)
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


@pytest.mark.parametrize("scheduler", ["waves", "events"])
@pytest.mark.parametrize("seed", range(3))
def test_branches_start_from_the_tool_result(tokenizer, seed, scheduler):
    """A fork's copies start once the probe decides the fork, from the path as it was at the tool result (its probe's
    tokens not included)."""
    sampler = _sampler(tokenizer, calls_then_answers(3), num_generations=8, initial_rollouts=2, seed=seed,
                       engine_seed=seed, max_completion_length=200, scheduler=scheduler,
                       engine_class=AsyncScriptedEngine if scheduler == "events" else None)
    result = sampler.sample(_prompts(tokenizer, 3))
    assert [len(g) for g in result.groups] == [8, 8, 8] and result.stats.forks > 0
    by_id = {t.id: t for t in result.trajectories}
    for t in result.trajectories:
        if t.kind == "branch":
            parent = by_id[t.parent]
            assert t.completion_ids[: t.fork_position] == parent.completion_ids[: t.fork_position]
            assert tokenizer.decode(t.completion_ids[: t.fork_position]).endswith("</result>")
            assert t.growth.fork_decisions <= t.tool_calls


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


def test_fork_probability_is_clip_tau_plus_beta_delta(tokenizer):
    sampler = _sampler(tokenizer, calls_then_answers(1), branch_threshold=0.3, entropy_weight=0.25)
    rule = sampler.rule
    for delta, expected in [(0.0, 0.3), (1.0, 0.55), (-1.0, 0.05), (-1.2, 0.0), (-5.0, 0.0), (2.8, 1.0), (9.0, 1.0)]:
        assert rule.fork_probability(delta) == pytest.approx(expected, abs=1e-12)
    assert rule.fork_probability(-5.0, policy="random") == rule.fork_probability(9.0, policy="random") == 0.3


def _fork_rate(tokenizer, h_initial, h_after, prompts=6000, policy="entropy", scheduler="waves"):
    """N=1, M=2, one prompt per group: the global path calls a tool once; a group's second path is a branch iff the
    decision at that result forked. One rollout of `prompts` groups (deterministic seeds)."""
    def script(text, rng):
        if "</result>" not in text:
            return CALL, h_initial, "stop"
        return "<answer>\\boxed{2}</answer>", h_after, "eos"
    sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_policy=policy,
                       entropy_window=4, seed=123, scheduler=scheduler,
                       engine_class=AsyncScriptedEngine if scheduler == "events" else None)
    if scheduler == "events":
        sampler.engine.token_seconds = 0.0
    groups = sampler.sample(_prompts(tokenizer, 1) * prompts).groups
    return sum(group[1].kind == "branch" for group in groups) / prompts


# below, inside and above [0, 1]: the default tier; two more points inside, the full tier
@pytest.mark.parametrize("delta", [-3.0, pytest.param(-1.0, marks=pytest.mark.long),
                                   pytest.param(0.0, marks=pytest.mark.long), 1.0, 4.0])
def test_fork_frequency_matches_clip_tau_plus_beta_delta(tokenizer, delta):
    vocab_log = math.log(1000)
    per_token = lambda h: h * vocab_log / 4  # noqa: E731  (4 tokens summed, then / ln|V|)
    # "<answer>…" is more than 4 tokens and the call is too: both windows hold exactly 4 tokens. Entropies stay ≥ 0.
    start = max(1.0, -delta)
    rate = _fork_rate(tokenizer, per_token(start), per_token(start + delta))
    expected = min(1.0, max(0.0, 0.5 + 0.2 * delta))
    # 6000 trials: ±0.02 is over 3σ at p=0.5 and τ or β off by 0.03 fails (p=0.3 ↔ 0.27: 4.6σ)
    assert rate == pytest.approx(expected, abs=0.02)


def test_fork_frequency_event_driven(tokenizer):
    vocab_log = math.log(1000)
    rate = _fork_rate(tokenizer, vocab_log / 4, 2 * vocab_log / 4, prompts=3000, scheduler="events")
    assert rate == pytest.approx(0.7, abs=0.03)


def test_random_policy_ignores_entropy(tokenizer):
    assert _fork_rate(tokenizer, 0.0, 50.0, policy="random") == pytest.approx(0.5, abs=0.02)


def _waves_with_bare_prompts(engine, prompts) -> list[int]:
    return [sum(_is_prompt(prefix, prompts) for prefix in wave) for wave in engine.calls]


def test_fill_ups_start_at_once_when_forks_cannot_fill_the_budget(tokenizer):
    """Replay the engine's calls wave by wave (fill-ups start once certain). The reference adds one fill-up
    per round once every path has ended; here all missing paths start together as soon as they are certain."""
    answer = lambda text, rng: ("<answer>\\boxed{2}</answer>", 0.1, "eos")  # noqa: E731  (no call: nothing forks)
    prompts = _prompts(tokenizer, 2)
    sampler = _sampler(tokenizer, answer, num_generations=6, initial_rollouts=2)
    result = sampler.sample(prompts)
    # wave 1: the 2 globals of each prompt; they end without a call, so wave 2 starts the 4 missing of each prompt
    assert _waves_with_bare_prompts(sampler.engine, prompts) == [4, 8]
    assert [[t.kind for t in g] for g in result.groups] == [["global"] * 2 + ["fill"] * 4] * 2
    # no tool calls allowed: forking can never fill, so every path starts in wave 1
    sampler = _sampler(tokenizer, calls_then_answers(2), num_generations=6, initial_rollouts=2, max_tool_calls=0)
    sampler.sample(prompts)
    assert _waves_with_bare_prompts(sampler.engine, prompts) == [12]


def test_fill_ups_wait_for_the_last_fork_decision_that_could_fill(tokenizer):
    """Each global calls once (the limit), probes, then answers; fork probability 0 (τ=β=0). With M=4, N=2 the two
    missing slots could be filled by the two decisions, so the fill-ups start in the wave after the probes decided:
    not before, and not only once the globals have ended."""
    def script(text, rng):
        return (CALL, 0.1, "stop") if "</result>" not in text else ("<answer>\\boxed{2}</answer>", 0.1, "eos")
    prompts = _prompts(tokenizer, 1)
    sampler = _sampler(tokenizer, script, num_generations=4, initial_rollouts=2, branch_threshold=0.0,
                       entropy_weight=0.0, entropy_window=3, max_tool_calls=1)
    result = sampler.sample(prompts)
    engine = sampler.engine
    # wave 1: globals to their call; wave 2: their probes (3 tokens); wave 3: the probes decided "no fork", so both
    # fill-ups start with the globals' continuations
    assert _waves_with_bare_prompts(engine, prompts) == [2, 0, 2, 0]
    assert engine.budgets[1] == [3, 3]  # the two probes, k tokens each
    assert [t.kind for t in result.groups[0]] == ["global", "global", "fill", "fill"]
    assert result.stats.forks == 0 and result.stats.fill_ups == 2


def test_branches_start_after_their_parents_probe(tokenizer):
    """Fork probability 1: the copy starts once the probe has decided the fork, from its parent's tokens up to the
    result (the probe's not included): its first request is in the wave after the probe, beside the parent's
    continuation."""
    def script(text, rng):
        return (CALL, 0.1, "stop") if "</result>" not in text else ("thinking hard <answer>\\boxed{2}</answer>",
                                                                     0.1, "eos")
    prompts = _prompts(tokenizer, 1)
    sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_threshold=1.0,
                       entropy_window=2, max_tool_calls=1)
    result = sampler.sample(prompts)
    parent, child = result.groups[0]
    assert child.kind == "branch" and child.parent == parent.id
    fork_point = parent.prompt_ids + parent.completion_ids[: child.fork_position]
    probe, after = sampler.engine.calls[1], sampler.engine.calls[2]
    assert [list(p) for p in probe] == [fork_point] and sampler.engine.budgets[1] == [2]
    assert len(after) == 2 and fork_point in [list(p) for p in after]
    assert child.completion_ids[: child.fork_position] == parent.completion_ids[: child.fork_position]


class KeyedAsyncPolicy(AsyncScriptedEngine):
    """As a server that takes a path's seed: each segment a function of the path's seed and whole prefix (prompt
    included), served one request at a time in random order."""

    traits = EngineTraits(event_driven=True, request_options=frozenset({"seed"}))

    def __init__(self, tokenizer, script=None, seed=0, **kw):
        super().__init__(tokenizer, self.script, seed=seed, **kw)

    async def agenerate(self, prefix, max_new_tokens, stop, seed=0):
        self._key = (seed, list(prefix))  # read by `script`, which runs before the first await
        return await super().agenerate(prefix, max_new_tokens, stop)

    def script(self, text, rng):
        h = int(hashlib.sha256(str(self._key).encode()).hexdigest()[:6], 16) / 16**6
        calls = text.count("</result>")
        if calls < 3 and h < 0.7:
            return f"step{calls}{int(h * 100)} {CALL}", 3 * h, "stop"
        return "<answer>\\boxed{2}</answer>", h, "eos"


def test_fill_ups_run_ahead_of_the_rule_leave_the_trees_unchanged(tokenizer):
    """The event scheduler runs likely fill-ups ahead of the rule (`prefetch.py`) and hands one over only when the
    rule starts it, its program replaying the shadow's answers: on an engine that draws a path's tokens from its seed,
    the trees are those grown without it, token for token, whatever order the requests complete in. One tool call per
    path: then only a global path can fork, so no two paths of a line race for its last branch slot (which the first
    to decide takes, so that with more calls a tree may depend on the order decisions come in, prefetch or not)."""
    adopted = discarded = 0
    for seed in range(4):
        grown, stats = [], []
        for speculation in ("auto", "off"):
            sampler = _sampler(tokenizer, None, num_generations=8, initial_rollouts=3, seed=seed, engine_seed=seed,
                               max_tool_calls=1, engine_class=KeyedAsyncPolicy, scheduler="events",
                               speculation=speculation)
            result = sampler.sample(_prompts(tokenizer, 6))
            grown.append([[(t.id, t.key, t.kind, t.parent, t.fork_position, t.completion_ids, t.mask, t.finish_reason,
                            [(c.tool, c.arguments, c.result_start, c.result_end) for c in t.calls]) for t in group]
                           for group in result.groups])
            stats.append(result.stats)
        assert grown[0] == grown[1], seed
        assert stats[0].forks == stats[1].forks > 0 and stats[0].fill_ups == stats[1].fill_ups > 0
        assert stats[0].speculative_fill_ups > 0 and stats[0].tool_calls == stats[1].tool_calls
        assert stats[1].speculative_fill_ups == stats[1].adopted_fill_ups == stats[1].discarded_tokens == 0
        adopted, discarded = adopted + stats[0].adopted_fill_ups, discarded + stats[0].discarded_tokens
    assert adopted > 0 and discarded > 0  # some fill-ups were handed over, some dropped


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


class SlowEngine(ScriptedEngine):
    def generate(self, prefixes, max_new_tokens, stop):
        time.sleep(0.2)
        return super().generate(prefixes, max_new_tokens, stop)


def test_rollout_time_is_split_into_generation_tools_and_overhead(tokenizer):
    """Waves: 3 generation waves of 0.2 s, and between them 2 moments of tool calls (0.5 s, the 3 paths' calls
    concurrently). The sampler's own time is measured, not derived, and the three add up to the rollout's."""
    def slow(code):
        time.sleep(0.5)
        return "2"

    def script(text, rng):
        return (CALL, 0.1, "stop") if text.count("</result>") < 2 else ("<answer>\\boxed{2}</answer>", 0.1, "eos")

    sampler = _sampler(tokenizer, script, tools=[Tool("python", slow)], num_generations=3, branch_policy="none",
                       engine_class=SlowEngine)
    stats = sampler.sample(_prompts(tokenizer, 1)).stats
    assert stats.waves == 3 and stats.tool_calls == 6
    # A sleep never ends early, so each part holds at least its own sleeps: a wave counted as tool time (or a tool
    # moment as generation) leaves the other part short. A loaded machine only adds time; the upper bounds leave
    # it less than one tool moment (0.5 s), so a moment counted twice still fails.
    assert 3 * 0.2 - 0.05 <= stats.generation_seconds < 3 * 0.2 + 0.45
    assert 2 * 0.5 - 0.05 <= stats.tool_seconds < 2 * 0.5 + 0.45  # tools wait alone: no request overlaps them
    assert 0 < stats.overhead_seconds < 0.45
    assert stats.seconds == pytest.approx(stats.generation_seconds + stats.tool_seconds + stats.overhead_seconds,
                                          abs=0.2)


def test_event_driven_time_split_overlaps_tools_with_generation(tokenizer):
    """Events: path 0 calls a 0.6 s tool while path 1 generates for 1.2 s: the overlap counts as generation, and the
    rollout takes about 1.2 s, not 1.85 s as sequential rounds would. (The tool ends well inside the long request,
    so that a loaded machine's scheduling delays cannot make it wait alone.)"""
    def slow(code):
        time.sleep(0.6)
        return "2"

    turns = iter([(CALL, 0.1, "stop"), ("x <answer>7</answer>", 0.1, "eos")])

    def script(text, rng):
        return next(turns, ("<answer>\\boxed{2}</answer>", 0.1, "eos"))

    class Timed(AsyncScriptedEngine):  # the long answer takes 1.2 s, any other request 0.05 s
        async def agenerate(self, prefix, max_new_tokens, stop):
            segment = self.segment(list(prefix), max_new_tokens)
            await asyncio.sleep(1.2 if "x <answer>7" in tokenizer.decode(segment.token_ids) else 0.05)
            return segment

    sampler = _sampler(tokenizer, script, tools=[Tool("python", slow)], num_generations=2, branch_policy="none",
                       engine_class=Timed, scheduler="events")
    stats = sampler.sample(_prompts(tokenizer, 1)).stats
    assert stats.tool_calls == 1 and 1.2 <= stats.seconds < 1.2 + 0.5
    assert 1.2 - 0.05 <= stats.generation_seconds <= stats.seconds  # a request is in flight all along
    assert stats.tool_seconds < 0.3  # the tool never waited alone (counted as tool time, the overlap is 0.6 s)


def _tool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("arpo-tool") and t.name != "arpo-tool-watchdog"]


def test_a_hung_tool_delays_only_its_own_path(tokenizer):
    """Event-driven: one path's first call never returns; it gets the timeout error after 2 s and goes on, while
    the other paths (two calls each) are done long before."""
    release, answers = threading.Event(), []

    def tool(code):
        if code == "hang":
            release.wait(30)
        return "2"

    class Recording(AsyncScriptedEngine):  # when each path's final answer came back
        async def agenerate(self, prefix, max_new_tokens, stop):
            segment = await super().agenerate(prefix, max_new_tokens, stop)
            if segment.finish_reason == "eos":
                answers.append(time.monotonic())
            return segment

    turns = iter(["<python>hang</python>"])
    script = lambda text, rng: ((next(turns, CALL), 0.1, "stop") if text.count("</result>") < 2  # noqa: E731
                                else ("<answer>\\boxed{2}</answer>", 0.1, "eos"))
    sampler = _sampler(tokenizer, script, tools=[Tool("python", tool)], num_generations=4, branch_policy="none",
                       engine_class=Recording, scheduler="events", tool_timeout=2.0)
    start = time.monotonic()
    result = sampler.sample(_prompts(tokenizer, 1))
    elapsed = time.monotonic() - start
    release.set()
    texts = [tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in result.trajectories]
    assert sum("Error: Tool(python) timed out after 2 s." in text for text in texts) == 1
    assert all(text.endswith("</answer>") for text in texts)
    assert result.stats.tool_calls == 8 and result.stats.tool_failures == 1
    assert 2.0 <= elapsed < 2.0 + 5, "the rollout waited for the hung call beyond its timeout (30 s)"
    assert sorted(answers)[2] - start < 1.5, "the other paths waited for the hung call (2 s)"


def _cmdline(pid: str) -> str:
    """A process's command line; empty if it ended after `ps` listed it (as the shell that ran `ps` does)."""
    try:
        with open(f"/proc/{pid}/cmdline", errors="replace") as file:
            return file.read()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("scheduler", ["events", "waves"])
def test_ctrl_c_cancels_the_rollout_and_leaves_nothing_running(tokenizer, scheduler):
    """SIGINT while a sandboxed Python call sleeps and (events) requests are in flight: KeyboardInterrupt comes out
    at once; the requests were cancelled, the sandbox process killed, the tool threads gone."""
    from arpo_trl.tools import PythonTool

    python = PythonTool(timeout=60, pool_size=0)
    turns = iter([("<python>import time; time.sleep(50)</python>", 0.1, "stop")])

    def script(text, rng):
        return next(turns, ("x " * 40 + "<answer>1</answer>", 0.1, "eos"))

    class Hanging(AsyncScriptedEngine):
        async def agenerate(self, prefix, max_new_tokens, stop):
            segment = self.segment(list(prefix), max_new_tokens)
            self.in_flight += 1
            try:
                await asyncio.sleep(0.01 if "<python>" in tokenizer.decode(segment.token_ids) else 60)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.in_flight -= 1
            return segment

        def generate(self, prefixes, max_new_tokens, stop):
            segments = super().generate(prefixes, max_new_tokens, stop)
            if len(self.calls) > 1:
                time.sleep(60)
            return segments

    sampler = _sampler(tokenizer, script, tools=[python], num_generations=3, branch_policy="none",
                       engine_class=Hanging, scheduler=scheduler)
    earlier = set(_tool_threads())  # an earlier test's abandoned call may still run: not this rollout's
    # a terminal's Ctrl-C, whatever this process inherited (started in the background, SIGINT is ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))  # as Ctrl-C: to the process
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            sampler.sample(_prompts(tokenizer, 1))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 20  # not the 50-60 s the call and the requests would take
    if scheduler == "events":
        assert sampler.engine.in_flight == 0 and sampler.engine.cancelled == 2
    mine = lambda: set(_tool_threads()) - earlier  # noqa: E731
    deadline = time.monotonic() + 30
    while mine() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mine(), "a tool thread outlived the cancelled rollout"
    assert not python.sandbox._running, "the sandboxed call was not killed"
    children = os.popen(f"ps -o pid= --ppid {os.getpid()}").read().split()
    assert not [pid for pid in children if "sleep(50)" in _cmdline(pid)]
    python.close()


def test_a_huge_tool_output_is_clipped_before_encoding(tokenizer):
    """A 20 MB result: only what can fit the budget is encoded (quickly), and the tokens are the full text's."""
    huge = "abc def " * 2_500_000
    sampler = _sampler(tokenizer, calls_then_answers(1), tools=[Tool("python", lambda code: huge)], num_generations=2,
                       branch_policy="none", max_completion_length=300, seed=1)
    start = time.monotonic()
    result = sampler.sample(_prompts(tokenizer, 1))
    assert time.monotonic() - start < 3
    for t in result.trajectories:
        assert len(t.completion_ids) <= 300
        if t.tool_calls:  # cut inside the result: the path ends with environment tokens, the text's beginning
            at = max(i for i, bit in enumerate(t.mask) if bit) + 1
            env = t.completion_ids[at:]
            assert len(env) > 200 and env == tokenizer.encode(" <result>\n" + huge[:10_000],
                                                              add_special_tokens=False)[: len(env)]


@pytest.mark.parametrize("scheduler", ["waves", "events"])
def test_a_rollout_leaves_no_thread_behind(tokenizer, scheduler):
    sampler = _sampler(tokenizer, calls_then_answers(2), num_generations=4, seed=0, scheduler=scheduler,
                       engine_class=AsyncScriptedEngine if scheduler == "events" else None)
    before = set(threading.enumerate())  # earlier tests' abandoned calls may still sleep
    sampler.sample(_prompts(tokenizer, 2))
    new = lambda: [t.name for t in set(threading.enumerate()) - before if t.name.startswith("arpo-")]  # noqa: E731
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and new():
        time.sleep(0.02)
    assert not new()
