"""N-gram speculative decoding in the cached engine (`arpo_trl.generation.speculation`): drafts are looked up in the
rollout's own text, the draft length pays for itself, and verification leaves the sampled distribution and the greedy
trees exactly as plain decoding has them."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.cpu.costs import CPU_COSTS, CPU_DECODE_COST
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.speculation import Acceptance, DraftIndex
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool
from tests.test_cached_engine import GREEDY, _chi2_and_bound, _prompt


def test_drafts_follow_the_longest_suffix_where_it_occurred_before():
    index = DraftIndex(sizes=(3, 2))
    earlier = [1, 2, 3, 4, 5, 6, 7]
    index.add(earlier)
    running = [9, 2, 3]
    index.add(running)
    assert index.draft(running, 3) == [4, 5, 6]  # after (2, 3) in the earlier sequence
    assert index.draft([8, 3, 4], 2) == [5, 6]  # (3, 4)
    assert index.draft([0, 5, 6], 5) == [7]  # (0, 5, 6) never occurred: the shorter (5, 6) did
    assert index.draft([5, 9], 4) == []  # nothing ends with (5, 9)
    assert index.draft(running, 0) == []
    running.append(4)  # the running row writes on: its own suffix is indexed once a token follows it
    index.add(running, len(running) - 2)
    assert index.draft(running, 2) == [5, 6]  # (2, 3, 4) last occurred in `earlier`, not at the row's own end


def test_drafts_repeat_a_sequence_that_loops():
    index, loop = DraftIndex(sizes=(2,)), [1, 2, 3, 1, 2]
    index.add(loop)
    assert index.draft(loop, 4) == [3, 1, 2]  # its own earlier text, up to where it stands


def test_draft_length_pays_for_the_positions_it_costs():
    acceptance = Acceptance(max_draft=8, cost=CPU_DECODE_COST)
    assert acceptance.rate == pytest.approx(0.5)
    assert acceptance.draft_length([8]) > 0  # one row: the forward's fixed cost dominates
    assert acceptance.draft_length([8] * 256) == 0  # many rows: every draft position costs its full price
    assert acceptance.draft_length([0, 0, 0]) == 0
    assert acceptance.may_pay(1) and not acceptance.may_pay(256)  # the bulk skips the lookups
    acceptance.record(drafted=1000, accepted=0)
    assert acceptance.draft_length([8]) == 0  # drafts that are never accepted do not pay
    confident = Acceptance(max_draft=8, cost=CPU_DECODE_COST)
    confident.record(drafted=1000, accepted=990)
    assert confident.draft_length([8]) == 8 and confident.draft_length([3, 8]) >= 3


def test_draft_length_weighs_each_row_at_its_own_rate():
    """25 rows that follow text written before them (late paths) pay for drafts at their own α, although the
    rollout's rate (rows decoding side by side) would not; a lone confident row among many does not pay for all."""
    acceptance = Acceptance(max_draft=8, cost=CPU_DECODE_COST)
    acceptance.record(drafted=1000, accepted=300)
    assert acceptance.draft_length([8] * 25) == 0
    assert acceptance.draft_length([8] * 25, [0.95] * 25) > 0
    assert acceptance.draft_length([8] * 25, [0.95] + [0.3] * 24) == 0
    assert acceptance.draft_length([8, 0, 0], [0.95, 0.3, 0.3]) > 0  # few rows: the fixed cost dominates
    assert acceptance.may_pay(25, 0.95) and not acceptance.may_pay(25)


def test_step_cost_follows_the_measured_steps():
    """The cost model against the step times measured on the development CPU (docs/cpu_measurements.md, ms for
    D = 0, 1, 2, 4, 8 at 1, 16, 32 and 64 rows): within 25 % where drafts can pay, and never cheaper than measured
    where many positions make them too dear."""
    measured = {1: [101, 157, 180, 154, 170], 16: [181, 340, 387, 413, 568], 32: [288, 518, 660, 773, 903],
                64: [432, 930, 1885, 2717, 3500]}
    step_cost = CPU_DECODE_COST.step
    unit = 101 / step_cost(1, 0)
    for rows, times in measured.items():
        for length, ms in zip([0, 1, 2, 4, 8], times):
            modelled = unit * step_cost(rows, length)
            if rows * (1 + length) <= 160:
                assert modelled == pytest.approx(ms, rel=0.25), (rows, length)
            else:  # where the model errs low, drafts must still not pay (α 0.9, every row holding 8)
                pays = Acceptance(cost=CPU_DECODE_COST).draft_length([8] * rows, [0.9] * rows)
                assert modelled >= 0.8 * ms or pays < length
    assert all(step_cost(rows, d) < step_cost(rows, d + 1) < step_cost(rows + 1, d + 1) for rows in (1, 16, 64)
               for d in range(8))


def test_a_guess_is_the_first_token_a_draft_would_start_with():
    index = DraftIndex(sizes=(3, 2))
    index.add([1, 2, 3, 4, 5])
    assert index.guess([7, 2, 3]) == 4 == index.draft([7, 2, 3], 1)[0]
    assert index.guess([5, 9]) == -1
    looping = [6, 6]
    index.add(looping)  # (6,) has no token after it yet: the suffix (6, 6) is not followed by anything
    assert index.guess(looping) == -1


def test_a_late_row_learns_its_own_rate_and_drafts_from_text_written_before_it(tool_model64, tokenizer):
    """Greedy: a prompt decoded once, then again beside two other prompts while the rollout's rate says drafts never
    pay (as after a bulk of rows decoding side by side). The repeat's guesses match the first decoding, so its own α
    rises from observation alone and its drafts are fed and accepted; its tokens equal plain decoding's."""
    prompts = [_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?"), _prompt(tokenizer, "hi")]
    plain = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY, max_draft_tokens=0)
    expected = plain.generate(prompts, [30] * 3, [])
    engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY, cost_model=CPU_COSTS)  # the steps
    with engine.rollout_scope():  # below need drafts that pay: a cost model measured on the tiny model may not say so
        first = engine.generate(prompts[:1], [30], [])
        engine.speculator.acceptance.record(drafted=10_000, accepted=0)
        assert not engine.speculator.acceptance.may_pay(3)
        accepted = engine.counters.accepted_tokens
        again = engine.generate(prompts, [30] * 3, [])
        assert engine.counters.accepted_tokens - accepted >= 10
    assert first[0].token_ids == again[0].token_ids == expected[0].token_ids
    assert [s.token_ids for s in again] == [s.token_ids for s in expected]


@pytest.mark.parametrize("scheduler", ["waves", "events"])
def test_greedy_trees_equal_plain_decoding(tool_model64, tokenizer, scheduler):
    """The same seeded sampler on a greedy float64 model grows the same trees, logprobs and entropies with drafts as
    without, under either scheduler (the fork draws are keyed by the paths, not by the order requests finish in);
    drafts were fed, accepted and rejected."""
    def grow(max_draft_tokens):
        engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY, max_draft_tokens=max_draft_tokens,
                                          cost_model=CPU_COSTS)  # drafts fed whatever the tiny model's timings
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=4,
                                   max_completion_length=80, branch_policy="random", seed=3, scheduler=scheduler)
        return sampler.sample([_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")]), engine

    (plain, _), (speculative, engine) = grow(0), grow(8)
    assert engine.counters.accepted_tokens > 0 and engine.counters.drafted_tokens > engine.counters.accepted_tokens
    # both live for one rollout, as the prefix cache does: a seed alone fixes what the next rollout samples
    assert not engine.speculator.drafts.seen and engine.speculator.acceptance.drafted == 0
    assert any(t.kind == "branch" for t in plain.trajectories)
    for a, b in zip(plain.trajectories, speculative.trajectories, strict=True):
        assert (a.id, a.kind, a.parent, a.completion_ids, a.mask) == (b.id, b.kind, b.parent, b.completion_ids, b.mask)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-6, rtol=0)
        assert torch.allclose(torch.tensor(b.entropies), torch.tensor(a.entropies), atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("top_k", [0, 40])
def test_tokens_after_a_verified_draft_follow_the_model_distribution(tiny_model_dir, tokenizer, top_k):
    """4000 two-token samples whose second token is always drafted (the likeliest given the first, so that it is
    accepted about a quarter of the time at temperature 0.2): the second token's frequencies match its exact marginal
    Σ p(x1)·p(x2 | x1), tempered and top-k truncated; a rejected draft's resample comes from p without it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prefix, temperature, n = _prompt(tokenizer, "What is 3+4?"), 0.2, 4000

    def warped(logits):
        logits = logits.double() / temperature
        if top_k:
            logits[logits < logits.topk(top_k).values[-1]] = -math.inf
        return torch.softmax(logits, -1)

    with torch.no_grad():
        first = warped(model(torch.tensor([prefix])).logits[0, -1])
        support = first.nonzero().squeeze(1)
        batch = torch.cat([torch.tensor([prefix] * len(support)), support[:, None]], 1)
        second = torch.stack([warped(row) for row in model(batch).logits[:, -1]])
    engine = CachedTransformersEngine(model, tokenizer, sampling=SamplingSettings(temperature=temperature, top_k=top_k,
                                                                                  entropy_top_k=None))
    going_on = torch.tensor([token not in engine.eos_token_ids for token in support.tolist()])  # EOS ends a sample
    weights = first[support] * going_on
    marginal = (weights[:, None] * second).sum(0) / weights.sum()
    likeliest = dict(zip(support.tolist(), second.argmax(1).tolist()))

    # under test: the verification
    engine.speculator.drafts.draft = lambda tokens, limit: [likeliest[tokens[-1]]][:limit]
    engine.speculator.acceptance.draft_length = lambda available, alphas=None: max(available)
    torch.manual_seed(0)
    segments = engine.generate([prefix] * n, [2] * n, [])
    counters = engine.counters
    assert 0.95 * n < counters.drafted_tokens <= n and 0.1 * n < counters.accepted_tokens < 0.9 * n  # some end at EOS
    pairs = [segment for segment in segments if len(segment.token_ids) == 2]
    assert len(pairs) > 0.95 * n
    chi2, bound = _chi2_and_bound([s.token_ids[1] for s in pairs], marginal)
    assert chi2 < bound, (chi2, bound)
    for segment in pairs:  # logprobs are under p, whether the token was accepted or resampled
        x1, x2 = segment.token_ids
        row = int((support == x1).nonzero())
        assert segment.logprobs[1] == pytest.approx(math.log(second[row, x2]), abs=1e-3)
