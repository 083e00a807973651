"""The fork rule of the branching sampler (paper §3.1 steps 3-4): how many copies a tool result starts, how many a
decision keeps, which policy decides, what a decision counts, and when it lets the fill-ups start. Scripted engine
(tests/test_rollout.py), waves: deterministic."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_rollout import CALL, AsyncScriptedEngine, _prompts, _sampler, _waves_with_bare_prompts, calls_then_answers

from arpo_trl.rollout import ForkPoint, default_initial_rollouts

ANSWER = "<answer>\\boxed{2}</answer>"


def call_then_answer(calls: int = 1, entropy: float = 0.1):
    """Each path calls the tool `calls` times, then answers."""
    def script(text, rng):
        return (CALL, entropy, "stop") if text.count("</result>") < calls else (ANSWER, entropy, "eos")
    return script


def kinds(result) -> list[list[str]]:
    return [[path.kind for path in group] for group in result.groups]


@pytest.mark.parametrize("m,policy,n", [
    (16, "entropy", 8), (12, "random", 6), (3, "entropy", 1), (2, "entropy", 1), (1, "entropy", 1), (8, "none", 8),
])
def test_n_defaults_to_half_of_m_as_the_released_scripts(m, policy, n):
    assert default_initial_rollouts(m, policy) == n


@pytest.mark.parametrize("m,copies_started,shares", [
    (3, 1, [1, 0]),  # one slot: the line that owns it starts one copy (not Z-1 = 2)
    (5, 3, [2, 1]),  # shares of 2 and 1 slots (the odd one drawn)
])
def test_forks_never_exceed_the_budget(tokenizer, m, copies_started, shares):
    """N = 2 globals call a tool at once; every decision forks (τ = 1), Z = 3. Each line holds its share of branches,
    listed right after its global path (tree order)."""
    sampler = _sampler(tokenizer, call_then_answer(), num_generations=m, initial_rollouts=2, branch_factor=3,
                       branch_threshold=1.0, entropy_weight=0.0, entropy_window=2, max_tool_calls=1)
    result = sampler.sample(_prompts(tokenizer, 1))
    assert len(sampler.engine.calls[1]) == 2  # the two probes; the copies start once they have decided
    assert len(sampler.engine.calls[2]) == 2 + copies_started  # the globals going on, and the copies
    lines = [path for path in result.groups[0] if path.kind == "global"]
    per_line = [sum(path.growth.line == line.id for path in result.groups[0] if path.kind == "branch")
                for line in lines]
    assert sorted(per_line, reverse=True) == shares
    assert kinds(result) == [[kind for count in per_line for kind in ["global"] + ["branch"] * count]]
    branches = [path for path in result.groups[0] if path.kind == "branch"]
    assert result.stats.forks == len(branches)
    assert result.stats.fork_deltas == [path.fork_delta for path in branches] and None not in result.stats.fork_deltas


def test_a_rollouts_policy_override_decides_its_forks(tokenizer):
    """τ = 1, β = 1 and an entropy that falls after the tool: the entropy rule never forks, the 'random' ablation
    (probability τ) always does, also when a rollout asks for it."""
    def script(text, rng):
        return (CALL, 50.0, "stop") if "</result>" not in text else (ANSWER, 0.0, "eos")
    sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_threshold=1.0,
                       entropy_weight=1.0, entropy_window=2, max_tool_calls=1)
    assert kinds(sampler.sample(_prompts(tokenizer, 1))) == [["global", "fill"]]
    assert kinds(sampler.sample(_prompts(tokenizer, 1), branch_policy="random")) == [["global", "branch"]]


@pytest.mark.parametrize("m,n,z", [(2, 1, 1), (2, 2, 2)])
def test_no_probe_where_no_fork_can_follow(tokenizer, m, n, z):
    """With Z = 1, or once the prompt holds all M paths, a path goes on after a tool result with its whole budget:
    no k-token probe, no copies."""
    sampler = _sampler(tokenizer, call_then_answer(), num_generations=m, initial_rollouts=n, branch_factor=z,
                       entropy_window=2, max_tool_calls=1, max_completion_length=200)
    result = sampler.sample(_prompts(tokenizer, 1))
    assert all(budget > 2 for wave in sampler.engine.budgets for budget in wave)
    assert result.stats.forks == 0 and {path.kind for path in result.groups[0]} <= {"global", "fill"}


def test_each_tool_result_settles_one_fork_decision(tokenizer):
    """One global (M = 2) calls twice and never forks (τ = β = 0): the fill-up starts right after its second
    decision, when no decision is left that could fill the slot; not after the first, not once the global ended."""
    sampler = _sampler(tokenizer, call_then_answer(calls=2), num_generations=2, initial_rollouts=1,
                       branch_threshold=0.0, entropy_weight=0.0, entropy_window=3, max_tool_calls=2)
    prompts = _prompts(tokenizer, 1)
    result = sampler.sample(prompts)
    # waves: the global to its call; its probe (P = 0: no copy starts); on to its second call; its probe; the
    # global's answer beside the fill-up's first call; the fill-up's second call; its answer
    assert _waves_with_bare_prompts(sampler.engine, prompts) == [1, 0, 0, 0, 1, 0, 0]
    assert kinds(result) == [["global", "fill"]] and result.stats.fill_ups == 1


def entropy_per_request(entropies, calls: int = 1):
    """As `call_then_answer`, with each request's entropy taken from `entropies` in turn (waves: path order), 1.0
    past its end. β = 10 then makes a probe's fork probability 1 (entropy 5 after 1) or 0 (entropy 0 after 1)."""
    values = iter(entropies)

    def script(text, rng):
        call = text.count("</result>") < calls
        return (CALL, next(values, 1.0), "stop") if call else (ANSWER, next(values, 1.0), "eos")
    return script


def test_a_branch_inherits_its_parents_settled_decisions(tokenizer):
    """M = 4, N = 1, two tool calls per path. The global forks at its first result; at their second results it
    forks again and the branch does not. The branch's first decision was its parent's, so that was the last decision
    that could fill the fourth slot: the fill-up starts right then, not before, not once the branch has answered."""
    # waves: the global's call; its probe (forks); the global's rest beside the branch's first request; their second
    # probes (fork, no fork); the rests beside the new copy and the fill-up
    script = entropy_per_request([1.0, 5.0, 1.0, 1.0, 5.0, 0.0], calls=2)
    sampler = _sampler(tokenizer, script, num_generations=4, initial_rollouts=1, branch_threshold=0.5,
                       entropy_weight=10.0, entropy_window=2, max_tool_calls=2)
    prompts = _prompts(tokenizer, 1)
    result = sampler.sample(prompts)
    assert _waves_with_bare_prompts(sampler.engine, prompts) == [1, 0, 0, 0, 1, 0, 0]
    assert [len(wave) for wave in sampler.engine.calls][:5] == [1, 1, 2, 2, 4]
    assert kinds(result) == [["global", "branch", "branch", "fill"]]


def test_decisions_at_a_full_prompt_do_not_count_in_the_fork_rate(tokenizer):
    """M = 3, N = 2, τ = 1, β = 0.2: the first global's probe entropy rises (P = 1: it forks and fills the prompt),
    the second's falls (P < 1) but its line owns no branch slot (seed 1 gives the prompt's one slot to the first
    line, `ForkShares`; the branch is listed after its parent, tree order). Only the decisions that could fork are
    recorded (`Trajectory.decisions`)."""
    entropies = iter([1.0, 1.0, 5.0, 0.0])  # per request, in path order: the two calls, then the two probes

    def script(text, rng):
        return (CALL if "</result>" not in text else ANSWER), next(entropies, 1.0), \
            "stop" if "</result>" not in text else "eos"
    sampler = _sampler(tokenizer, script, num_generations=3, initial_rollouts=2, branch_threshold=1.0,
                       entropy_weight=0.2, entropy_window=2, max_tool_calls=1, seed=1)
    result = sampler.sample(_prompts(tokenizer, 1))
    assert kinds(result) == [["global", "branch", "global"]] and result.groups[0][1].parent == result.groups[0][0].id
    first, branch, second = result.groups[0]
    assert [d.probability for d in first.decisions] == [1.0] and second.decisions == []


def _one_call_event_rollout(tokenizer, branch_threshold: float):
    """M = 2, N = 1, one tool call, event-driven, zero-cost tokens, no fill-up run ahead of the rule: (result, call
    tokens, answer tokens + EOS)."""
    sampler = _sampler(tokenizer, call_then_answer(), num_generations=2, initial_rollouts=1,
                       branch_threshold=branch_threshold, entropy_weight=0.0, entropy_window=2, max_tool_calls=1,
                       scheduler="events", engine_class=AsyncScriptedEngine, speculation="off")
    sampler.engine.token_seconds = 0.0
    result = sampler.sample(_prompts(tokenizer, 1))
    call = len(tokenizer.encode(CALL, add_special_tokens=False))
    return result, call, len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1


def test_a_fill_ups_chain_continues_the_decision_that_started_it(tokenizer):
    """τ = 0: the global's probe decides not to fork, which makes the fill-up certain; the rollout's critical path
    runs through the global's call and probe, then the whole fill-up."""
    result, call, answer = _one_call_event_rollout(tokenizer, branch_threshold=0.0)
    assert kinds(result) == [["global", "fill"]]
    assert result.stats.critical_path_tokens == (call + 2) + (call + answer)
    assert result.stats.critical_path_kind == "fill" and result.stats.latest_fill_up_start_tokens == call + 2


def test_a_branchs_chain_continues_its_parents_at_the_fork(tokenizer):
    """τ = 1: the branch starts once the global's probe decides the fork, from the global's tool result, so its chain
    counts the global's call and probe before its own tokens."""
    result, call, answer = _one_call_event_rollout(tokenizer, branch_threshold=1.0)
    assert kinds(result) == [["global", "branch"]]
    assert result.stats.critical_path_tokens == call + 2 + answer  # the branch's: the global's call and probe, its own
    # the global's chain is shorter (its call, then the answer its probe began): the longest is the branch's
    assert result.stats.critical_path_kind == "branch" and result.stats.latest_fill_up_start_tokens == 0


def _line(path, by_id) -> int:
    while path.parent is not None and path.kind == "branch":
        path = by_id[path.parent]
    return path.id


@pytest.mark.parametrize("scheduler", ["events", "waves"])
def test_fork_slots_do_not_go_to_whoever_reaches_a_tool_result_first(tokenizer, scheduler):
    """Issue 28 point 2. Half the global paths write one-word segments, half hundred-word ones; every decision forks
    (τ = 1) and every path reaches three tool results. With M = 4, N = 2 each line owns one branch slot, whichever
    reaches its tool results first; first-come allocation gave both slots to the quick line."""
    def script(text, rng):
        quick = "quick" in text or ("slow" not in text and rng.random() < 0.5)
        words = "quick " if quick else "slow " * 100
        return (words + CALL, 0.1, "stop") if text.count("</result>") < 3 else (ANSWER, 0.1, "eos")
    engine = AsyncScriptedEngine if scheduler == "events" else None
    sampler = _sampler(tokenizer, script, engine_class=engine, num_generations=4, initial_rollouts=2, seed=0,
                       branch_threshold=1.0, entropy_weight=0.0, entropy_window=2, scheduler=scheduler,
                       max_completion_length=1024)
    result = sampler.sample(_prompts(tokenizer, 12))
    mixed = 0
    for group in result.groups:
        by_id = {path.id: path for path in group}
        lines = [path.id for path in group if path.kind == "global"]
        branches = [_line(path, by_id) for path in group if path.kind == "branch"]
        assert len(group) == 4 and sorted(branches) == sorted(lines), [(p.kind, p.parent) for p in group]
        mixed += len({"quick" in sampler.rule.tokenizer.decode(by_id[line].completion_ids) for line in lines}) == 2
    assert mixed >= 3  # groups where the two lines differ in speed


@pytest.mark.parametrize("statistic,same", [("mean", True), ("sum", False)])
def test_a_short_segment_reads_at_its_tokens_entropy_not_its_length(tokenizer, statistic, same):
    """Issue 28 point 3: every token has the same entropy; the first segment is long (more than k tokens), the one
    after the tool result a short answer. By default (k × the mean) both segments read alike, so ΔH = 0; the
    reference's sum (`segment_statistic='sum'`) reads the short one as lower entropy."""
    def script(text, rng):
        if "</result>" not in text:
            return "let me think about it step by step " * 3 + CALL, 0.7, "stop"
        return ANSWER, 0.7, "eos"
    kw = {} if statistic == "mean" else {"segment_statistic": statistic}
    sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_threshold=0.5,
                       entropy_window=20, max_tool_calls=1, **kw)
    path = sampler.sample(_prompts(tokenizer, 1)).groups[0][0]
    assert len(tokenizer.encode(ANSWER)) + 1 < 20 < len(tokenizer.encode("let me think about it step by step " * 3))
    first, after = path.segment_entropies[:2]
    assert (after == pytest.approx(first)) is same


def _one_call_rollouts(tokenizer, probe_entropy: float, rollouts: int = 300):
    """M = 2, N = 1, one call (entropy 3.454, so H_initial = 2·3.454/ln 1000 = 1.0 with k = 2, |V| = 1000), τ = 0.6,
    β = 0.4: per seed, the result and the engine's waves (wave 1: the probe)."""
    def script(text, rng):
        return (CALL, 3.454, "stop") if "</result>" not in text else (ANSWER, probe_entropy, "eos")
    for seed in range(rollouts):
        sampler = _sampler(tokenizer, script, num_generations=2, initial_rollouts=1, branch_threshold=0.6,
                           entropy_weight=0.4, entropy_window=2, max_tool_calls=1, seed=seed)
        result = sampler.sample(_prompts(tokenizer, 1))
        assert len(result.groups[0]) == 2 and result.stats.fill_ups == result.stats.forks ^ 1
        yield result, sampler.engine.calls


def test_a_fork_starts_once_its_probe_decides_it_and_forks_as_often_as_p(tokenizer):
    """k = 2, |V| = 1000: the call's entropy 3.454 gives H_initial = 2·3.454/ln 1000 = 1.0, the probe's 1.727 gives
    H = 0.5, so P = clip(τ + β·ΔH) = 0.6 - 0.4·0.5 = 0.4. Over 300 rollouts the forks follow Binomial(300, 0.4),
    within 4.5 standard deviations, and a fork's copy starts in the wave after the probe that decided it."""
    forks = 0
    for result, waves in _one_call_rollouts(tokenizer, 1.727):
        forks += result.stats.forks
        assert len(waves[1]) == 1  # the wave after the tool result: the probe alone
        if result.stats.forks:
            assert result.stats.fork_deltas == [pytest.approx(-0.5, abs=1e-3)] and len(waves[2]) == 2
    assert abs(forks - 120) <= 4.5 * (300 * 0.4 * 0.6) ** 0.5


def test_a_probe_that_reads_below_zero_entropy_forks_at_the_clipped_p(tokenizer):
    """A server's top logprobs may sit a rounding above 0, which makes a token's entropy slightly negative. The probe
    here reads H = -0.5, so P = clip(0.6 + 0.4·(-1.5), 0, 1) = 0: no rollout forks."""
    assert sum(result.stats.forks for result, _ in _one_call_rollouts(tokenizer, -1.727, rollouts=50)) == 0


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "0.2", True])
def test_beta_is_checked_like_tau(tokenizer, weight):
    with pytest.raises(ValueError, match=r"entropy_weight \(β\) must be a finite number"):
        _sampler(tokenizer, call_then_answer(), entropy_weight=weight)


def _entropy_script(first: float, later: float, calls: int):
    """Every path calls the tool `calls` times, then answers; a path's first segment has per-token entropy `first`,
    every segment after a tool result `later`."""
    def script(text, rng):
        entropy = first if "</result>" not in text else later
        return (CALL, entropy, "stop") if text.count("</result>") < calls else (ANSWER, entropy, "eos")
    return script


def test_aepo_counts_a_lines_forks_in_a_row_into_each_decisions_p(tokenizer):
    """AEPO's P = clip(1 − τ/(1 − λ·l) + β·ΔH, 0, 1), l the forks in a row on the path's line before the decision:
    a copy starts with its parent's l + 1, a decision that keeps copies adds one, one that does not resets it. Every
    recorded decision: its position is the path's length at the tool result (a branch's fork position), its ΔH the
    probe's entropy against the line's initial entropy (inherited by a branch), its draw `fork_draw`'s, and it forked
    iff draw < P."""
    import math

    from arpo_trl.rollout.arpo import aepo_fork_probability, fork_draw

    tau, beta, lam = 0.1, 0.2, 0.3
    sampler = _sampler(tokenizer, _entropy_script(3.0, 1.0, calls=3),
                       num_generations=16, initial_rollouts=1, branch_policy="aepo", pre_monitoring_beta=None,
                       branch_threshold=tau, entropy_weight=beta, branch_penalty=lam, entropy_window=2,
                       max_tool_calls=3, seed=4)
    result = sampler.sample(_prompts(tokenizer, 2))
    by_id = {t.id: t for t in result.trajectories}
    delta = 2 * (1.0 - 3.0) / math.log(1000)  # k × the mean, normalised by ln|V|, against the first segment's
    decisions = 0
    for path in result.trajectories:
        if path.kind == "branch":
            parent = by_id[path.parent]
            at = next(d for d in parent.decisions if d.position == path.fork_position)
            assert at.forked and path.fork_delta == pytest.approx(at.delta)
        l_run = _forks_in_a_row_before(path, by_id)
        for d in path.decisions:
            decisions += 1
            assert d.delta == pytest.approx(delta)
            assert d.probability == pytest.approx(aepo_fork_probability(d.delta, l_run, tau, beta, lam))
            assert d.forked == (d.draw < d.probability)
            l_run = l_run + 1 if d.forked else 0
    assert decisions >= 6 and any(d.forked for t in result.trajectories for d in t.decisions)
    assert any(not d.forked for t in result.trajectories for d in t.decisions)
    seeded = sampler.sample(_prompts(tokenizer, 1)).groups[0][0]  # the draws are the path's keyed ones
    assert [d.draw for d in seeded.decisions][:1] == [fork_draw(_with_decisions(seeded, 0))]
    assert sampler.rule.fork_probability(0.0, "aepo") == pytest.approx(aepo_fork_probability(0.0, 0, tau, beta, lam))


def _forks_in_a_row_before(path, by_id) -> int:
    """l at the path's first own decision: 0 for a global path; a branch's parent's l at the fork, plus one."""
    if path.kind != "branch":
        return 0
    parent = by_id[path.parent]
    l_run = _forks_in_a_row_before(parent, by_id)
    for d in parent.decisions:
        if d.position == path.fork_position:
            return l_run + 1
        l_run = l_run + 1 if d.forked else 0
    raise AssertionError(f"no decision of path {parent.id} at {path.fork_position}")


def _with_decisions(path, n: int):
    """`path` as it stood before its (n+1)-th fork decision, for `fork_draw`."""
    from dataclasses import replace

    return replace(path, growth=replace(path.growth, fork_decisions=n))


def test_a_forks_copies_are_keyed_by_their_index(tokenizer):
    """Z = 3, τ = 1: a fork starts two copies, keyed (parent's key, decision, 0) and (…, 1), in tree order."""
    sampler = _sampler(tokenizer, call_then_answer(), num_generations=3,
                       initial_rollouts=1, branch_factor=3, branch_threshold=1.0, entropy_weight=0.0,
                       entropy_window=2, max_tool_calls=1)
    parent, first, second = sampler.sample(_prompts(tokenizer, 1)).groups[0]
    assert (first.key, second.key) == ((parent.key, 0, 0), (parent.key, 0, 1))


def test_z_of_one_never_decides_a_fork(tokenizer):
    sampler = _sampler(tokenizer, call_then_answer(), num_generations=4,
                       initial_rollouts=2, branch_factor=1, branch_threshold=1.0, entropy_window=2, max_tool_calls=1)
    result = sampler.sample(_prompts(tokenizer, 1))
    assert kinds(result) == [["global", "global", "fill", "fill"]]
    assert all(not path.decisions for path in result.trajectories)


def test_a_decision_at_a_line_whose_share_was_taken_meanwhile_is_not_recorded(tokenizer):
    """M = 3, N = 1, Z = 2, τ = 1, two calls: the global forks at its first call (one slot of its line's two left);
    at the second call, the global and its copy reach their tool results in one wave, the global decides first
    (path order) and takes the last slot; the copy's probe then finds none left: no decision is recorded for it."""
    sampler = _sampler(tokenizer, call_then_answer(calls=2),
                       num_generations=3, initial_rollouts=1, branch_threshold=1.0, entropy_weight=0.0,
                       entropy_window=2, max_tool_calls=2)
    glob, copy, last = sampler.sample(_prompts(tokenizer, 1)).groups[0]
    assert [path.kind for path in (glob, copy, last)] == ["global", "branch", "branch"]
    assert [d.forked for d in glob.decisions] == [True, True] and copy.decisions == []
    assert last.parent == glob.id and copy.parent == glob.id


# ---- a fork policy of one's own (docs/fork_policies.md) -------------------------------------------------------------
def third(point) -> float:
    """A constant policy, importable as `test_fork_rule:third`."""
    return 0.3


def _trees(result) -> list:
    return [(p.kind, p.parent, p.fork_position, p.completion_ids, [(d.probability, d.draw, d.forked)
                                                                    for d in p.decisions])
            for group in result.groups for p in group]


@pytest.mark.parametrize("policy", [third, "test_fork_rule:third"])
def test_a_constant_policy_of_ones_own_grows_the_random_ablations_trees(tokenizer, policy):
    """Only P is the policy: a callable (or its import path) that always answers 0.3 gives, draw for draw, the trees of
    the built-in 'random' policy at τ = 0.3."""
    kw = dict(num_generations=6, initial_rollouts=2, branch_threshold=0.3, max_tool_calls=3)
    own = _sampler(tokenizer, calls_then_answers(3), branch_policy=policy, **kw).sample(_prompts(tokenizer, 3))
    ablation = _sampler(tokenizer, calls_then_answers(3), branch_policy="random", **kw).sample(_prompts(tokenizer, 3))
    assert _trees(own) == _trees(ablation)
    assert own.stats.forks > 0 and any(not d.forked for p in own.trajectories for d in p.decisions)


def test_the_documented_policy_sees_each_fork_point_and_decides_its_p(tokenizer):
    """The example of docs/fork_policies.md, run as written: every decision's P is what it answered for that path's
    `ForkPoint`, which carries the path's state at its tool result."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "fork_policies.md").read_text(encoding="utf-8")
    namespace: dict = {}
    exec(re.search(r"```python\n(.*?)```", text, re.S).group(1), namespace)  # noqa: S102  (our own docs)
    documented, seen = namespace["unsure_after_search"], []

    def recording(point: ForkPoint) -> float:
        seen.append(point)
        return documented(point)

    sampler = _sampler(tokenizer, calls_then_answers(3), branch_policy=recording, num_generations=8,
                       initial_rollouts=2, max_tool_calls=3)
    result = sampler.sample(_prompts(tokenizer, 4))
    decisions = sorted((d.delta, d.probability) for p in result.trajectories for d in p.decisions)
    assert decisions and decisions == sorted((point.delta_entropy, documented(point)) for point in seen)
    assert {point.tool for point in seen} == {"python"} and {point.kind for point in seen} <= {"global", "branch"}
    assert all(point.tool_calls >= 1 and point.tool_calls == point.fork_decisions + 1 for point in seen)
    assert any(point.consecutive_forks for point in seen) or result.stats.forks <= 1


@pytest.mark.parametrize("answer", [1.2, float("nan"), -0.1, "0.5", True])
def test_a_policy_answer_that_is_no_probability_stops_the_rollout_naming_it(tokenizer, answer):
    sampler = _sampler(tokenizer, call_then_answer(), branch_policy=lambda point: answer, num_generations=4,
                       initial_rollouts=2)
    with pytest.raises(ValueError, match=r"branch_policy .*<lambda>.* returned .*ForkPoint\(delta_entropy="):
        sampler.sample(_prompts(tokenizer, 1))


@pytest.mark.parametrize("value,message", [
    ("no_such_module_xyz:policy", "cannot import 'policy' from 'no_such_module_xyz'"),
    ("test_fork_rule:ANSWER", "is a str, not a callable fork policy"),
    ("entropic", "branch_policy must be one of"),
    (3, "branch_policy must be one of"),
])
def test_a_policy_that_cannot_be_one_is_refused_in_the_config(tmp_path, value, message):
    from arpo_trl import ARPOConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        ARPOConfig(output_dir=str(tmp_path), branch_policy=value, use_cpu=True, bf16=False, report_to="none")
