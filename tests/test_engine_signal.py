"""What the in-process engines sample: the policy without dropout, the current weights, in a notebook too, with no
tensor kept alive beyond what it needs (issue 54, points 4-8)."""

import asyncio
import copy
from types import SimpleNamespace

import pytest
import torch
from tiny import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from arpo_trl.generation import CachedTransformersEngine, cached_engine_blocker
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.prefill import FORWARD_COST_TOKENS, PrefillJob, prefill
from arpo_trl.generation.support import check_full_attention
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool

GREEDY = SamplingSettings(temperature=0, entropy_top_k=None)
ENGINES = [TransformersEngine, CachedTransformersEngine]
PREFIXES, BUDGETS = [[5, 6, 7, 8, 9], [9, 10, 11], [5, 6, 7]], [7, 5, 6]


def _lora_in_training(tokenizer):
    """A tiny Llama with LoRA adapters whose dropout (0.5) would change every logit in training mode."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    return get_peft_model(tiny_model(tokenizer), config).train()


def _modes(model) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def _tokens(segments):
    return [(s.token_ids, s.finish_reason) for s in segments]


def _dropouts_seen(model) -> list[bool]:
    seen = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda m, args, out: seen.append(m.training))
    return seen


# --- point 4: rollouts sample in eval mode ----------------------------------------------------------------------

@pytest.mark.parametrize("engine_class", ENGINES)
def test_a_rollout_samples_with_dropout_off_and_hands_each_module_back_in_its_mode(tokenizer, engine_class):
    model = _lora_in_training(tokenizer)
    model.base_model.model.model.layers[1].mlp.eval()  # a submodule the caller keeps in eval mode stays so
    before = _modes(model)
    reference = copy.deepcopy(model).eval()
    seen = _dropouts_seen(model)
    torch.manual_seed(0)
    got = engine_class(model, tokenizer).generate(PREFIXES, BUDGETS, [])
    assert seen and not any(seen)
    assert _modes(model) == before
    torch.manual_seed(0)
    want = engine_class(reference, tokenizer).generate(PREFIXES, BUDGETS, [])
    assert _tokens(got) == _tokens(want)  # the same random draws: dropout drew none
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_the_events_path_samples_in_eval_mode_and_the_model_is_in_its_own_mode_between_requests(tokenizer):
    model = _lora_in_training(tokenizer)
    seen = _dropouts_seen(model)
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY)
    modes = []

    async def caller():
        first = await engine.agenerate(PREFIXES[0], 4, [])
        modes.append(model.training)
        await engine.agenerate(PREFIXES[0] + first.token_ids, 3, [])
        modes.append(model.training)
        await engine.aclose()

    asyncio.run(caller())
    assert seen and not any(seen)
    assert modes == [True, True] and all(_modes(model).values())


def test_the_waves_engine_restores_the_mode_when_generation_fails(tokenizer):
    model = tiny_model(tokenizer).train()
    model.generate = lambda **kwargs: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        TransformersEngine(model, tokenizer).generate(PREFIXES, BUDGETS, [])
    assert all(_modes(model).values())


def test_a_model_error_in_a_prefill_is_raised_not_waited_for(tokenizer):
    model = tiny_model(tokenizer).eval()
    model.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom"))

    async def caller():
        return await asyncio.wait_for(CachedTransformersEngine(model, tokenizer).agenerate([5, 6, 7], 3, []), 30)

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(caller())


# --- point 5: a wave inside a running event loop (Jupyter) ------------------------------------------------------

@pytest.mark.parametrize("engine_class", ENGINES)
def test_a_wave_generates_inside_a_running_event_loop(tokenizer, engine_class):
    engine = engine_class(tiny_model(tokenizer).eval(), tokenizer, sampling=GREEDY)
    expected = engine.generate(PREFIXES, BUDGETS, [])

    async def notebook_cell():
        return engine.generate(PREFIXES, BUDGETS, [])

    assert _tokens(asyncio.run(notebook_cell())) == _tokens(expected)


def test_a_waves_rollout_of_the_cached_engine_runs_inside_a_running_event_loop(tokenizer):
    engine = CachedTransformersEngine(tiny_model(tokenizer).eval(), tokenizer)

    def sample():
        torch.manual_seed(0)  # torch's generator is the process's, the same in the thread a running loop needs
        sampler = BranchingSampler(engine, tokenizer, [Tool("python", lambda code: "42")], num_generations=2,
                                   max_completion_length=12, seed=1, scheduler="waves")
        return [t.completion_ids for t in sampler.sample([PREFIXES[0], PREFIXES[1]]).trajectories]

    async def notebook_cell():
        return sample()

    assert asyncio.run(notebook_cell()) == sample()


# --- point 6: stored logits own their memory --------------------------------------------------------------------

def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_prefilled_logits_of_a_float32_model_do_not_keep_the_forwards_logits_alive(tokenizer):
    model = tiny_model(tokenizer).eval()
    jobs = [PrefillJob(list(range(3, 4 + n)), None, 0) for n in range(8)]
    results, positions = prefill(model, jobs, FORWARD_COST_TOKENS)
    assert len(positions) == 1  # one forward, whose logits are [8 rows, 8 positions, vocab]
    for _, logits in results:
        assert logits.dtype == torch.float32 and logits.shape == (1, model.config.vocab_size)
        assert _owns_its_storage(logits)


def test_the_prefix_cache_keeps_only_logits_of_their_own(tokenizer):
    engine = CachedTransformersEngine(tiny_model(tokenizer).eval(), tokenizer, sampling=GREEDY)
    with engine.rollout_scope():
        engine.generate([list(range(3, 4 + n)) for n in range(8)], [2] * 8, [])
        entries = list(engine.prefix_cache._entries.values())
        kept = [entry.logits for entry in entries if entry.logits is not None]
        kept += [logits for entry in entries for logits in entry.inner_logits.values()]
        assert kept and all(_owns_its_storage(logits) for logits in kept)


# --- point 7: sliding-window models are refused by the cached engine --------------------------------------------

def _config(model_type: str, **kwargs):
    return AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, **kwargs)


WINDOWED = [("mistral", {}), ("mistral", {"sliding_window": 64}), ("mixtral", {"sliding_window": 64}),
            ("phi3", {"sliding_window": 64}), ("starcoder2", {"sliding_window": 64}),
            ("qwen2", {"use_sliding_window": True, "sliding_window": 64})]
FULL = [("mistral", {"sliding_window": None}), ("llama", {}), ("qwen2", {"sliding_window": 64}), ("qwen3", {}),
        ("starcoder2", {})]


@pytest.mark.parametrize(("model_type", "kwargs"), WINDOWED)
def test_sliding_window_models_are_refused_by_the_cached_engine(model_type, kwargs):
    model = SimpleNamespace(config=_config(model_type, **kwargs))
    assert "sliding" in (cached_engine_blocker(model, None, None, False) or "")
    with pytest.raises(ValueError, match="sliding"):
        check_full_attention(model)


@pytest.mark.parametrize(("model_type", "kwargs"), FULL)
def test_full_attention_models_are_not_refused(model_type, kwargs):
    model = SimpleNamespace(config=_config(model_type, **kwargs))
    assert cached_engine_blocker(model, None, None, False) is None
    check_full_attention(model)


def test_a_mistral_with_a_window_is_refused_when_the_cached_engine_generates(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("mistral", sliding_window=4)).eval()
    with pytest.raises(ValueError, match="sliding"):
        CachedTransformersEngine(model, tokenizer).generate([[5, 6, 7]], [2], [])


# --- point 8: the caches follow the weights ---------------------------------------------------------------------

def _untied(tokenizer):
    """Untied, so that greedy decoding does not merely repeat the last token (a random tied head favours it)."""
    return tiny_model(tokenizer, tie=False).eval()


def _new_weights(model, seed: int = 1) -> None:
    with torch.no_grad():
        for param, new in zip(model.parameters(), tiny_model_like(model, seed).parameters()):
            param.copy_(new)


def tiny_model_like(model, seed: int):
    torch.manual_seed(seed)
    return type(model)(model.config)


def _adamw_fused_step(model) -> None:
    """The optimizer transformers' Trainer uses by default (adamw_torch_fused): it bumps no version counter."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.2, fused=True)
    model(torch.tensor([PREFIXES[0]])).logits.logsumexp(-1).sum().backward()
    optimizer.step()
    model.zero_grad()


@pytest.mark.parametrize("change", [_new_weights, _adamw_fused_step])
def test_a_weights_change_between_requests_is_sampled_not_the_cached_policy(tokenizer, change):
    model = _untied(tokenizer)
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY)
    prefix = PREFIXES[0]

    async def caller():
        before = await engine.agenerate(prefix, 6, [])
        change(model)
        after = await engine.agenerate(prefix, 6, [])
        await engine.aclose()
        return before, after

    before, after = asyncio.run(caller())
    fresh = CachedTransformersEngine(model, tokenizer, sampling=GREEDY).generate([prefix], [6], [])[0]
    assert fresh.token_ids != before.token_ids  # the change matters
    assert after.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)


def test_a_request_running_when_the_weights_change_fails_and_later_ones_sample_the_new_weights(tokenizer):
    model = _untied(tokenizer)
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY)

    async def caller():
        running = asyncio.create_task(engine.agenerate(PREFIXES[0], 40, []))
        while not engine.running.requests:
            await asyncio.sleep(0)
        _new_weights(model)
        later = await engine.agenerate(PREFIXES[1], 5, [])
        with pytest.raises(RuntimeError, match="weights changed"):
            await running
        await engine.aclose()
        return later

    later = asyncio.run(caller())
    fresh = CachedTransformersEngine(model, tokenizer, sampling=GREEDY).generate([PREFIXES[1]], [5], [])[0]
    assert later.token_ids == fresh.token_ids


def test_a_waves_rollout_scope_drops_its_cache_when_the_weights_change(tokenizer):
    model = _untied(tokenizer)
    engine = CachedTransformersEngine(model, tokenizer, sampling=GREEDY)
    with engine.rollout_scope():
        engine.generate([PREFIXES[0]], [3], [])
        _new_weights(model)
        after = engine.generate([PREFIXES[0]], [5], [])[0]
    fresh = CachedTransformersEngine(model, tokenizer, sampling=GREEDY).generate([PREFIXES[0]], [5], [])[0]
    assert after.token_ids == fresh.token_ids
