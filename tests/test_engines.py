"""TransformersEngine on tiny models: budgets, stop tags, EOS, and logprobs/entropies equal to the model's."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.entropy import segment_entropy, token_entropy
from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.transformers_engine import TransformersEngine

ENGINES = pytest.mark.parametrize("engine_class", [TransformersEngine, CachedTransformersEngine])


@pytest.fixture(scope="module")
def random_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tool_model(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()


def _prompt(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


@ENGINES
def test_per_prefix_budgets_are_respected(random_model, tokenizer, engine_class):
    engine = engine_class(random_model, tokenizer, sampling=SamplingSettings())
    torch.manual_seed(0)
    prefixes = [_prompt(tokenizer, "What is 1+2?"), _prompt(tokenizer, "hello")[:5], [5, 6, 7]]
    budgets = [3, 9, 1]
    segments = engine.generate(prefixes, budgets, stop=["</python>"])
    assert len(segments) == 3
    for seg, budget in zip(segments, budgets):
        assert 1 <= len(seg.token_ids) <= budget
        assert len(seg.logprobs) == len(seg.token_ids) == len(seg.entropies)
        if seg.finish_reason == "length":
            assert len(seg.token_ids) == budget
        if seg.finish_reason == "eos":
            assert seg.token_ids[-1] == tokenizer.eos_token_id


@ENGINES
def test_logprobs_and_exact_entropy_match_a_forward_pass(random_model, tokenizer, engine_class):
    engine = engine_class(random_model, tokenizer, sampling=SamplingSettings(temperature=0.7))
    torch.manual_seed(1)
    prefixes = [_prompt(tokenizer, "What is 3+4?"), _prompt(tokenizer, "hi")]
    segments = engine.generate(prefixes, [12, 12], stop=[])
    for prefix, seg in zip(prefixes, segments):
        ids = torch.tensor([prefix + seg.token_ids])
        with torch.no_grad():
            logits = random_model(ids).logits[0, len(prefix) - 1 : -1] / 0.7
        logprobs = torch.log_softmax(logits, -1)
        expected = logprobs.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(seg.logprobs), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(seg.entropies), token_entropy(logprobs), atol=1e-4, rtol=1e-4)


def test_top_k_entropy_is_the_reference_estimator():
    logprobs = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]), -1)
    p = logprobs.exp()[0]
    top2 = -(p[:2] * p[:2].log()).sum()
    assert token_entropy(logprobs, "top_k", 2).item() == pytest.approx(top2.item())
    assert token_entropy(logprobs, "exact").item() == pytest.approx(-(p * p.log()).sum().item())
    assert token_entropy(logprobs, "top_k", 2).item() < token_entropy(logprobs, "exact").item()
    assert segment_entropy([1.0] * 30, 20, 100, "sum") == pytest.approx(20 / math.log(100))


@ENGINES
def test_stops_at_the_tool_tag(tool_model, tokenizer, engine_class):
    engine = engine_class(tool_model, tokenizer)
    torch.manual_seed(0)
    prefixes = [_prompt(tokenizer, "What is 12+30?")] * 4
    segments = engine.generate(prefixes, [60] * 4, stop=["</python>"])
    stopped = [s for s in segments if s.finish_reason == "stop"]
    assert stopped, [tokenizer.decode(s.token_ids) for s in segments]
    for seg in stopped:
        text = tokenizer.decode(seg.token_ids)
        assert "</python>" in text
        assert "</python>" not in tokenizer.decode(seg.token_ids[:-1])  # stopped at the completing token


@ENGINES
def test_bad_budget_is_a_clear_error(random_model, tokenizer, engine_class):
    engine = engine_class(random_model, tokenizer)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1, 2]], [0], stop=[])
