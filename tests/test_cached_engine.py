"""CachedTransformersEngine (arpo_trl.generation): the same segments as the waves engine, prefixes never recomputed,
and the sampler's invariants on a real model driven event by event."""

import asyncio
import contextlib
import gc
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.generation import CachedTransformersEngine, PrefixCache
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.prefix_cache import CachedPrefix, common_prefix_length
from arpo_trl.generation.sampling import keyed_uniforms, sample_tokens
from arpo_trl.generation.support import cache_budget
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool

GREEDY = SamplingSettings(temperature=0, entropy_top_k=None)


def _prompt(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def _as_tuples(result):
    return [(t.id, t.kind, t.parent, t.fork_position, t.completion_ids, t.mask) for t in result.trajectories]


def test_greedy_segments_equal_the_waves_engine(tool_model64, tokenizer, poisoned_buffers):
    prefixes = [_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "hi")[:5], [5, 6, 7],
                _prompt(tokenizer, "What is 12+30?")]
    budgets, stop = [40, 9, 13, 3], ["</python>"]
    waves = TransformersEngine(tool_model64, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    cached = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    assert any(s.finish_reason == "stop" for s in waves)
    for a, b in zip(waves, cached):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(b.entropies), torch.tensor(a.entropies), atol=1e-6, rtol=0)


@pytest.mark.parametrize("engine_class", [TransformersEngine, CachedTransformersEngine])
def test_a_flex_attention_model_generates_with_sdpa_and_is_handed_back_flex(tool_model_dir, tool_model64, tokenizer,
                                                                            engine_class):
    """FlexAttention compiles per input shape and a decode step's shapes change every step, so both engines decode
    through SDPA (the same segments as the SDPA model's) and hand the model back with FlexAttention set for training."""
    flex = AutoModelForCausalLM.from_pretrained(tool_model_dir, attn_implementation="flex_attention").eval().double()
    seen = []
    flex.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation))
    prefixes, budgets, stop = [_prompt(tokenizer, "What is 12+30?"), [5, 6, 7]], [30, 9], ["</python>"]
    got = engine_class(flex, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    want = engine_class(tool_model64, tokenizer, sampling=GREEDY).generate(prefixes, budgets, stop)
    assert [(s.token_ids, s.finish_reason) for s in got] == [(s.token_ids, s.finish_reason) for s in want]
    assert seen and set(seen) == {"sdpa"}
    assert flex.config._attn_implementation == "flex_attention"


@pytest.mark.parametrize("scheduler", ["waves", "events"])
def test_greedy_trees_equal_the_waves_engine(tool_model64, tokenizer, scheduler, poisoned_buffers):
    """Same seeded sampler, greedy model: the new engine under either scheduler grows the waves engine's trees."""
    def grow(engine, scheduler):
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=4,
                                   max_completion_length=80, branch_policy="random", seed=3, scheduler=scheduler)
        return sampler.sample([_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")])

    expected = grow(TransformersEngine(tool_model64, tokenizer, sampling=GREEDY), "waves")
    assert any(t.kind == "branch" for t in expected.trajectories)  # the comparison covers forks
    engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY)
    result = grow(engine, scheduler)
    if scheduler == "waves":
        assert _as_tuples(result) == _as_tuples(expected)
    else:  # requests reach the sampler's RNG in another order, so forks may fall elsewhere; the globals may not
        for got, want in zip(result.groups, expected.groups):
            assert len(got) == len(want) == 4
            globals_ = [{tuple(t.completion_ids) for t in group if t.kind == "global"} for group in (got, want)]
            assert globals_[0] == globals_[1]
    assert len(engine.prefix_cache) == 0  # freed after the rollout


@pytest.mark.parametrize("scheduler", ["events", "waves"])
def test_no_tensor_outlives_a_rollout(scheduler, tool_model_dir, tokenizer):
    """The rollout's KV (running batch, prefix cache), logits and sampled tokens are all released when it ends: no
    tensor created during a sampled rollout with forks is still reachable afterwards. A first rollout runs before
    the census, so that what torch or transformers build once on first use does not count."""
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    engine = CachedTransformersEngine(model, tokenizer)
    sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=8,
                               initial_rollouts=2, max_completion_length=64, branch_policy="random", seed=0,
                               scheduler=scheduler)
    prompts = [_prompt(tokenizer, f"What is {a}+{b}?") for a, b in ((12, 30), (7, 5), (40, 2))]

    def live_tensors() -> dict[int, torch.Tensor]:
        gc.collect()
        return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    sampler.sample(prompts)
    before = live_tensors()
    result = sampler.sample(prompts)
    assert any(t.kind == "branch" for t in result.trajectories)
    survivors = [(tuple(t.shape), t.dtype) for key, t in live_tensors().items() if key not in before]
    assert survivors == []


def test_waves_keep_the_cache_for_the_rollout_and_a_seed_fixes_the_trees(tool_model_dir, tool_model64, tokenizer):
    """Under the waves scheduler the prefix cache lives as long as the rollout (`rollout_scope`): a later wave's
    continuations prefill only their new tokens, with the same greedy trees as waves that start cold; and, sampling,
    a seed fixes the trees (requests join in path order, not in the order tools finish)."""
    def grow(engine, seed=3):
        torch.manual_seed(seed)
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=4,
                                   max_completion_length=80, branch_policy="random", seed=seed, scheduler="waves")
        return sampler.sample([_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")])

    scoped, cold = (CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY) for _ in range(2))
    cold.rollout_scope = contextlib.nullcontext  # what an engine without the scope does: free after every wave
    kept, fresh = grow(scoped), grow(cold)
    assert _as_tuples(kept) == _as_tuples(fresh) and kept.stats.waves > 1
    assert scoped.counters.prefill_tokens < cold.counters.prefill_tokens
    assert len(scoped.prefix_cache) == 0  # freed when the rollout ends
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    sampled = CachedTransformersEngine(model, tokenizer, sampling=SamplingSettings(entropy_top_k=None))
    first, second, other = grow(sampled, 5), grow(sampled, 5), grow(sampled, 6)
    assert _as_tuples(first) == _as_tuples(second) != _as_tuples(other)


@pytest.mark.parametrize("seed", range(2))
def test_exact_m_forks_and_fill_ups_event_driven(tool_model_dir, tokenizer, seed):
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    torch.manual_seed(seed)
    engine = CachedTransformersEngine(model, tokenizer, sampling=SamplingSettings(entropy_top_k=None))
    sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=6,
                               initial_rollouts=2, max_completion_length=80, branch_policy="random", seed=seed,
                               scheduler="events")
    result = sampler.sample([_prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7+5?")])
    assert [len(g) for g in result.groups] == [6, 6]
    by_id = {t.id: t for t in result.trajectories}
    for t in result.trajectories:
        assert len(t.completion_ids) == len(t.mask) == len(t.logprobs) <= 80
        if t.kind == "branch":
            parent = by_id[t.parent]
            assert t.completion_ids[: t.fork_position] == parent.completion_ids[: t.fork_position]
            assert tokenizer.decode(t.completion_ids[: t.fork_position]).endswith("</result>")
    assert {t.kind for t in result.trajectories} >= {"global"}
    assert engine.counters.reused_tokens > 0


def test_continuation_and_fork_prefill_only_new_tokens(tool_model64, tokenizer):
    engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY)
    prompt = _prompt(tokenizer, "What is 12+30?")
    result = tokenizer.encode(" <result>\n42\n</result>", add_special_tokens=False)

    async def rollout():
        first = await engine.agenerate(prompt, 20, ["</python>"])
        assert engine.counters.prefill_tokens == len(prompt)
        context = prompt + first.token_ids + result
        await engine.agenerate(context, 5, [])
        continued = engine.counters.prefill_tokens - len(prompt)
        forks = await asyncio.gather(*(engine.agenerate(context, 5, []) for _ in range(3)))
        forked = engine.counters.prefill_tokens - len(prompt) - continued
        await engine.aclose()
        return continued, forked, forks

    continued, forked, forks = asyncio.run(rollout())
    assert continued == len(result) + 1  # the tool result and the last sampled token, never fed before
    assert forked == 0  # the context's logits outlive its entry, superseded when the continuation finished
    assert len({tuple(f.token_ids) for f in forks}) == 1  # greedy: forks of one context agree
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.tokens == 0


def test_counters_time_each_phase_and_count_decode_forwards(tool_model64, tokenizer):
    """One row: every generated token but the first (from the prefill's logits) and the last (never fed) costs one
    decode forward; the step's phases are timed."""
    engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY)
    segment = asyncio.run(engine.agenerate(_prompt(tokenizer, "What is 12+30?"), 6, []))
    asyncio.run(engine.aclose())
    assert engine.counters.decode_steps == engine.counters.decode_tokens == len(segment.token_ids) - 1
    phases = {"admit", "sample"} | ({"decode"} if engine.counters.decode_steps else set())
    assert set(engine.counters.seconds) == phases
    assert all(seconds > 0 for seconds in engine.counters.seconds.values())


def test_waves_engine_counts_its_padded_prefills(tool_model64, tokenizer):
    """The waves engine recomputes every row's whole prefix, left-padded to the wave's longest: rows × width."""
    engine = TransformersEngine(tool_model64, tokenizer, sampling=GREEDY)
    prefixes = [_prompt(tokenizer, "What is 12+30?"), [5, 6, 7]]
    segments = engine.generate(prefixes, [4, 4], [])
    width = max(map(len, prefixes))
    assert engine.counters.prefill_tokens == 2 * width and engine.counters.requests == 2
    assert engine.counters.decode_tokens == 2 * (max(len(s.token_ids) for s in segments) - 1)
    engine.generate(prefixes[1:], [3], [])
    assert engine.counters.prefill_tokens == 2 * width + 3


def _chi2_quantile(dof: int) -> float:
    """The chi-square statistic's quantile at p = 1e-6 (Wilson-Hilferty; 4.753 is the normal quantile)."""
    return dof * (1 - 2 / (9 * dof) + 4.753 * math.sqrt(2 / (9 * dof))) ** 3


def _chi2_and_bound(tokens: list[int], probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square of sampled `tokens` against `probs` (cells expecting < 5 pooled), and the statistic's
    quantile at p = 1e-6 (Wilson-Hilferty): exceeding it takes a real sampling bug, not bad luck."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs * len(tokens)
    big = expected >= 5
    observed_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    expected_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected_cells > 0
    chi2 = float(((observed_cells[keep] - expected_cells[keep]) ** 2 / expected_cells[keep]).sum())
    assert not (observed_cells[~keep] > 0).any(), "sampled a token of probability 0"
    dof = int(keep.sum()) - 1
    assert dof >= 20
    return chi2, _chi2_quantile(dof)


def _two_sample_chi2(a: list[int], b: list[int]) -> tuple[float, float]:
    """Pearson's chi-square that samples `a` and `b` of a discrete statistic come from one distribution (values
    seen fewer than 10 times in all pooled into one cell), and its quantile at p = 1e-6 (Wilson-Hilferty)."""
    from collections import Counter

    counts_a, counts_b = Counter(a), Counter(b)
    common = [v for v in counts_a.keys() | counts_b.keys() if counts_a[v] + counts_b[v] >= 10]
    cells = [(counts_a[v], counts_b[v]) for v in common]
    rest = (len(a) - sum(x for x, _ in cells), len(b) - sum(y for _, y in cells))
    cells += [rest] if sum(rest) else []
    chi2 = 0.0
    for x, y in cells:
        for observed, size in ((x, len(a)), (y, len(b))):
            expected = (x + y) * size / (len(a) + len(b))
            chi2 += (observed - expected) ** 2 / expected
    dof = max(len(cells) - 1, 1)
    return chi2, _chi2_quantile(dof)


def test_trees_have_the_waves_engines_distribution(tool_model_dir, tokenizer):
    """Sampled rollouts (entropy forking, tool calls) of one seeded model through each engine and scheduler: the
    distributions of tree shapes (branches per group, tool calls per trajectory), of first segments' lengths and of
    first tokens agree (two-sample chi-square at p = 1e-6: failing takes a real difference, not bad luck)."""
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    prompts = [_prompt(tokenizer, f"What is {a}+{b}?") for a, b in ((12, 30), (7, 5), (40, 2), (3, 9))]
    sampling = SamplingSettings(temperature=1.3, entropy_top_k=None)

    def statistics(engine, scheduler: str, rollouts: int = 20) -> dict:
        seen = {"branches": [], "calls": [], "first_length": [], "first_token": []}
        for seed in range(rollouts):
            torch.manual_seed(seed)
            sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda c: "42")], num_generations=4,
                                       max_completion_length=48, branch_threshold=0.6, seed=seed,
                                       scheduler=scheduler)
            result = sampler.sample(prompts)
            seen["branches"] += [sum(t.kind == "branch" for t in group) for group in result.groups]
            for t in result.trajectories:
                seen["calls"].append(t.tool_calls)
                if t.kind != "branch":
                    first = t.mask.index(0) if 0 in t.mask else len(t.mask)
                    seen["first_length"].append(first // 4)
                    seen["first_token"].append(t.completion_ids[0])
        return seen

    waves = statistics(TransformersEngine(model, tokenizer, sampling=sampling), "waves")
    assert sum(waves["branches"]) > 20 and sum(waves["calls"]) > 100  # the trees fork and call tools
    for scheduler in ("events", "waves"):
        cached = statistics(CachedTransformersEngine(model, tokenizer, sampling=sampling), scheduler)
        for name in waves:
            chi2, bound = _two_sample_chi2(waves[name], cached[name])
            assert chi2 < bound, f"{scheduler}: {name} differs (chi2 {chi2:.1f} > {bound:.1f})"


@pytest.mark.parametrize("top_k", [0, 50])
def test_sampled_first_tokens_follow_the_model_distribution(tiny_model_dir, tokenizer, top_k):
    """3000 first tokens from a random model (a spread-out distribution) against its own tempered softmax, top-k
    truncated. The waves engine is checked at top_k=50 only: with top_k=0 `model.generate` falls back to its
    default top_k=50, so it does not sample the full distribution."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prefix = _prompt(tokenizer, "What is 3+4?")
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].double() / 0.9
    if top_k:
        logits[logits < logits.topk(top_k).values[-1]] = -math.inf
    probs = torch.softmax(logits, -1)
    settings, n = SamplingSettings(temperature=0.9, top_k=top_k, entropy_top_k=None), 3000
    for engine_class in (CachedTransformersEngine, TransformersEngine) if top_k else (CachedTransformersEngine,):
        torch.manual_seed(0)
        segments = engine_class(model, tokenizer, sampling=settings).generate([prefix] * n, [1] * n, [])
        chi2, bound = _chi2_and_bound([s.token_ids[0] for s in segments], probs)
        assert chi2 < bound, (engine_class.__name__, chi2, bound)


def test_two_level_sampling_draws_the_distribution_and_never_a_masked_token():
    """`sample_tokens` on a vocabulary that is not a multiple of its block (the last block padded), with masked tokens
    and mass spread over blocks: frequencies match the probabilities (chi-square at p = 1e-6), masked ones never."""
    torch.manual_seed(0)
    logits = torch.randn(300, dtype=torch.float64) * 2
    logits[torch.randperm(300)[:120]] = -math.inf
    probs = torch.softmax(logits, -1)
    rows = torch.log_softmax(logits.float(), -1).expand(20000, -1).contiguous()
    tokens = sample_tokens(rows, keyed_uniforms(range(20000), [7] * 20000), block=64)  # one draw per seed
    assert torch.isfinite(logits[tokens]).all()
    chi2, bound = _chi2_and_bound(tokens.tolist(), probs)
    assert chi2 < bound, (chi2, bound)


def test_prefix_cache_lookup_store_and_budget():
    kv = torch.zeros(2, 1, 1, 1, 5, 2)
    cache = PrefixCache(max_tokens=8)
    cache.store(CachedPrefix((1, 2, 3), kv))
    cache.store(CachedPrefix((1, 2, 3, 4, 5), kv))  # supersedes (1, 2, 3)
    assert len(cache) == 1 and cache.tokens == 5
    assert cache.lookup([1, 2, 9])[1] == 2 and cache.lookup([7])[0] is None
    cache.store(CachedPrefix((7, 8, 9, 10), kv))  # over budget: the least recently used goes
    assert len(cache) == 1 and cache.lookup([7, 8])[1] == 2
    logits = torch.ones(1, 4)
    cache = PrefixCache()
    cache.store(CachedPrefix((1, 2), kv, logits))
    cache.store(CachedPrefix((1, 2, 3, 4), kv))  # supersedes (1, 2) and keeps its next-token logits
    entry, shared = cache.lookup([1, 2])
    assert shared == 2 and entry.logits_after(2) is logits and entry.logits_after(3) is None
    cache.store(CachedPrefix((1, 2, 3), kv, 2 * logits))  # a longer entry covers it: its logits go there
    assert len(cache) == 1 and torch.equal(cache.lookup([1, 2, 3])[0].logits_after(3), 2 * logits)
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 3, 5]) == 3 and common_prefix_length([], [1]) == 0
    assert cache_budget({"num_blocks": 4, "block_size": 16}) == 64 and cache_budget(None) is None
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(max_tokens=0)


def test_lookup_finds_the_logits_a_sibling_kept():
    """Two siblings went on from one context (a fork's copies); only the first stored absorbed the context's logits.
    A request for the context itself then finds them, whichever sibling's entry comes first, so nothing is prefilled."""
    kv, logits = torch.zeros(2, 1, 1, 1, 4, 2), torch.ones(1, 4)
    cache = PrefixCache()
    cache.store(CachedPrefix((1, 2), kv, logits))
    cache.store(CachedPrefix((1, 2, 3, 4), kv))  # keeps the logits after (1, 2)
    cache.store(CachedPrefix((1, 2, 5, 6), kv))  # shares (1, 2), without them
    assert cache.lookup([1, 2, 3])[0].tokens == (1, 2, 3, 4)  # now the most recently used: (1, 2, 5, 6) comes first
    entry, shared = cache.lookup([1, 2])
    assert shared == 2 and entry.logits_after(2) is logits


def test_a_row_stopped_at_its_budget_is_held_for_its_continuation(tool_model64, tokenizer):
    """An ARPO probe: a request stopped at its budget, whose path goes on with the same text. Continued at once, the
    continuation takes the probe's row over; continued steps later, it finds the row's KV and next-token logits in the
    prefix cache. Either way nothing is prefilled for it, and it writes what one long request writes."""
    prompt, other = _prompt(tokenizer, "What is 12+30?"), _prompt(tokenizer, "What is 7*6?")
    reference = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY).generate([prompt], [12], [])[0]
    assert reference.finish_reason == "length" and len(reference.token_ids) == 12

    async def probe_then_continue(engine: CachedTransformersEngine, delay: int):
        async def path():
            probe = await engine.agenerate(prompt, 4, [])
            prefilled = engine.counters.prefill_forwards
            for _ in range(delay):  # the engine steps meanwhile, for the row running beside
                await asyncio.sleep(0)
            rest = await engine.agenerate(prompt + probe.token_ids, 8, [])
            return probe, rest, engine.counters.prefill_forwards - prefilled

        outcome, beside = await asyncio.gather(path(), engine.agenerate(other, 24, []))
        await engine.aclose()
        assert beside.finish_reason == "length"  # it ran through both of the path's requests
        return outcome

    for delay, adopted in [(0, 1), (4, 0)]:
        engine = CachedTransformersEngine(tool_model64, tokenizer, sampling=GREEDY)
        probe, rest, prefilled = asyncio.run(probe_then_continue(engine, delay))
        assert probe.finish_reason == "length" and prefilled == 0
        assert engine.counters.adopted_rows == adopted
        assert probe.token_ids + rest.token_ids == reference.token_ids
        for name in ("logprobs", "entropies"):
            torch.testing.assert_close(torch.tensor(getattr(probe, name) + getattr(rest, name)),
                                       torch.tensor(getattr(reference, name)), atol=1e-6, rtol=0)
        assert len(engine.prefix_cache) == 0


def test_unsupported_generation_kwargs_are_refused(tokenizer, tool_model64):
    with pytest.raises(ValueError, match="generation_kwargs"):
        CachedTransformersEngine(tool_model64, tokenizer,
                                 sampling=SamplingSettings(generation_kwargs={"typical_p": .5}))


def test_trainer_selects_it_by_name_and_samples_the_current_lora_weights(tool_model_dir, tokenizer,
                                                                         addition_dataset, tmp_path):
    """`in_process_engine='cached'` picks the cached engine; after the adapter changes,
    its logprobs are the adapted model's (the cache is rebuilt per rollout, through TRL's unwrap context)."""
    from peft import LoraConfig

    from arpo_trl import ARPOConfig, ARPOTrainer, arpo_math_reward

    args = ARPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, initial_rollouts=2,
                      max_completion_length=16, max_steps=1, use_cpu=True, bf16=False, report_to="none",
                      save_strategy="no", beta=0.0, gradient_checkpointing=False,
                      in_process_engine="cached",
                      transformers_continuous_batching_config={"num_blocks": 64, "block_size": 32})
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward], args=args,
                          train_dataset=addition_dataset, processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    engine = trainer.engine
    assert isinstance(engine, CachedTransformersEngine) and engine.prefix_cache.max_tokens == 64 * 32
    model = trainer.model
    prompt = _prompt(tokenizer, "What is 12+30?")
    for scale in (0.0, 0.3):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(scale)
        torch.manual_seed(0)
        segment = engine.generate([prompt], [8], [])[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + segment.token_ids])).logits[0, len(prompt) - 1: -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(segment.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(segment.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_the_cached_engine_is_the_default_where_it_can_run(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """ARPOConfig's in_process_engine='auto' picks the cached engine, and the waves engine where the cached one
    cannot run (here: a generation_kwarg it does not sample with); 'cached' there is a clear error. TRL's
    use_transformers_continuous_batching (transformers' own engine, which ARPO does not use) is refused in one line,
    and so is its deprecated name, which TRL maps to it."""
    from arpo_trl import ARPOConfig, ARPOTrainer, arpo_math_reward

    def engine(**kw):
        args = ARPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=16, use_cpu=True, bf16=False, report_to="none", **kw)
        return ARPOTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward], args=args,
                           train_dataset=addition_dataset, processing_class=tokenizer).engine

    assert ARPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).in_process_engine == "auto"
    assert type(engine()) is CachedTransformersEngine
    assert type(engine(in_process_engine="waves")) is TransformersEngine
    assert type(engine(use_transformers_continuous_batching=False)) is CachedTransformersEngine  # TRL's default
    ngrams = {"generation_kwargs": {"no_repeat_ngram_size": 3}}
    assert type(engine(**ngrams)) is TransformersEngine
    with pytest.raises(NotImplementedError, match=r"no_repeat_ngram_size.*'waves' or 'auto'"):
        engine(in_process_engine="cached", **ngrams)
    for refused in ("use_transformers_continuous_batching", "use_transformers_paged"):
        with pytest.raises(ValueError, match=rf"^{refused}=True is not supported by ARPOTrainer: .*set "
                                             r"in_process_engine \(auto, cached or waves\)\.$"):
            ARPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{refused: True})
    with pytest.raises(ValueError, match=r"in_process_engine must be one of \('auto', 'cached', 'waves'\)"):
        ARPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, in_process_engine="paged")


def test_logprobs_are_those_of_the_distribution_sampled(tiny_model_dir, tokenizer):
    """With top-k, each token's logprob is under the truncated distribution it was drawn from (what TRL's
    importance-sampling correction needs); entropy stays that of the tempered distribution."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = CachedTransformersEngine(model, tokenizer,
                                      sampling=SamplingSettings(temperature=0.8, top_k=5, entropy_top_k=None))
    prefix = _prompt(tokenizer, "What is 3+4?")
    torch.manual_seed(0)
    segment = engine.generate([prefix], [6], [])[0]
    with torch.no_grad():
        logits = model(torch.tensor([prefix + segment.token_ids])).logits[0, len(prefix) - 1: -1] / 0.8
    truncated = logits.masked_fill(logits < logits.topk(5, -1).values[:, -1:], -math.inf)
    expected = torch.log_softmax(truncated, -1).gather(-1, torch.tensor(segment.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(segment.logprobs), expected, atol=1e-4, rtol=1e-4)
    tempered = torch.log_softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(segment.entropies), -(tempered.exp() * tempered).sum(-1),
                               atol=1e-4, rtol=1e-4)
