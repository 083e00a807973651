"""What ARPO measures as entropy (issue 28, points 3 and 7): the default estimators rise with the true entropy, the
segment statistic does not depend on the segment's length, and the transformers backend records the logprobs of the
distribution it actually sampled from (after temperature, top-k, top-p, min-p), checked by brute force."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from arpo_trl.entropy import segment_entropy, token_entropy, top_k_entropies
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.generation.transformers_engine import TransformersEngine
from arpo_trl.server.engine import VLLMServerEngine


def _distributions(vocab: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """Logits of varied shapes: Zipf-like slopes, noise levels and scales."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64).log()
    out = []
    for _ in range(count):
        scale, slope = 6 * torch.rand(1, generator=generator), 3 * torch.rand(1, generator=generator)
        out.append(torch.randn(vocab, generator=generator, dtype=torch.float64) * scale - slope * ranks)
    return out


def _flattenings(logits: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Two ways to make a distribution flatter step by step: raising the temperature, mixing in the uniform."""
    probs = torch.softmax(logits, -1)
    return {
        "temperature": [torch.log_softmax(logits / t, -1) for t in torch.linspace(0.05, 3.0, 30).tolist()],
        "uniform mixture": [((1 - a) * probs + a / len(logits)).log() for a in torch.linspace(0, 1, 30).tolist()],
    }


@pytest.mark.parametrize("estimator,top_k", [("exact", None), ("top_k_tail", 10), ("top_k_tail", 20)])
def test_default_estimators_are_monotone_under_flattening(estimator, top_k):
    """'exact' (transformers' default) and 'top_k_tail' (a server's) never decrease as a distribution flattens."""
    for logits in _distributions(2000, 60):
        for way, steps in _flattenings(logits).items():
            values = [token_entropy(lp, estimator, top_k).item() for lp in steps]
            drops = [(a, b) for a, b in zip(values, values[1:]) if b < a - 1e-9]
            assert not drops, (estimator, top_k, way, drops[:3])


def test_the_reference_estimator_reads_a_flat_distribution_as_peaked():
    """Issue 28's example: flat over 1,000 tokens vs one token at p=0.5 (k=10)."""
    flat = torch.full((1000,), 1 / 1000, dtype=torch.float64).log()
    peaked = torch.cat([torch.tensor([0.5]), torch.full((999,), 0.5 / 999)]).double().log()
    assert token_entropy(flat, "top_k", 10) < token_entropy(peaked, "top_k", 10)  # the reference's reversal
    assert token_entropy(flat, "top_k_tail", 10) > token_entropy(peaked, "top_k_tail", 10)
    assert token_entropy(flat, "top_k_tail", 10).item() == pytest.approx(math.log(1000))  # exact: uniform tail


def test_tail_estimator_uses_every_returned_logprob_and_the_tail_mass():
    """A server row holds the top k plus, when outside them, the sampled token; padding (-inf) is not a token."""
    row = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.05), -math.inf]], dtype=torch.float64)
    tail, unseen = 0.25, 100 - 3
    expected = -(0.5 * math.log(0.5) + 0.2 * math.log(0.2) + 0.05 * math.log(0.05)) - tail * math.log(tail / unseen)
    assert top_k_entropies(row, "top_k_tail", 2, 100).item() == pytest.approx(expected)
    assert top_k_entropies(row, "top_k", 2, 100).item() == pytest.approx(-(0.5 * math.log(0.5) + 0.2 * math.log(0.2)))


class _ScriptedServer:
    """Answers a completion as vLLM does (the contract `read_completion` checks), with fixed top logprobs per token;
    the sampled token is always id 0."""

    base_url = "http://scripted"

    def __init__(self, tops: list[dict[int, float]]):
        self.tops = tops

    def base_model(self):
        return "m"

    def completion(self, payload):
        n = len(self.tops)
        logprobs = {"token_logprobs": [top[0] for top in self.tops], "tokens": ["token_id:0"] * n,
                    "top_logprobs": [{f"token_id:{i}": lp for i, lp in top.items()} for top in self.tops]}
        return {"choices": [{"index": 0, "token_ids": [0] * n, "finish_reason": "length", "stop_reason": None,
                             "text": "", "logprobs": logprobs}]}


def test_server_engine_default_reads_flatter_as_higher(tokenizer):
    flat = {i: math.log(1 / 1000) for i in range(20)}
    peaked = {0: math.log(0.5), **{i: math.log(0.5 / 999) for i in range(1, 20)}}
    engine = VLLMServerEngine(_ScriptedServer([flat, peaked]), tokenizer)
    assert (engine.entropy_estimator, engine.entropy_top_k, engine.sampling["logprobs"]) == ("top_k_tail", 20, 20)
    entropies = engine.generate([[1, 2]], [2], stop=[])[0].entropies
    assert entropies[0] > entropies[1]
    engine.close()


def test_segment_statistic_does_not_depend_on_how_many_tokens_exist():
    """A quick call (5 tokens) and a long segment at the same per-token entropy read alike by default; the
    reference's sum (still available) reads the short one as low entropy."""
    short, long = [0.8] * 5, [0.8] * 40
    assert segment_entropy(short, 20, 1000) == pytest.approx(segment_entropy(long, 20, 1000))
    assert segment_entropy(long, 20, 1000) == pytest.approx(segment_entropy(long, 20, 1000, "sum"))
    assert segment_entropy(short, 20, 1000, "sum") == pytest.approx(segment_entropy(long, 20, 1000, "sum") / 4)


# ---- point 7: the transformers backend's logprobs are those of the distribution sampled ----------------------------
def _brute_force_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                          min_p: float | None) -> torch.Tensor:
    """The sampled distribution, token by token and in plain loops: temperature, then keep the top k, then the
    smallest head whose mass reaches top_p, then tokens with p >= min_p·max p (HF's and vLLM's order)."""
    logits = logits.double() / temperature
    keep = [True] * len(logits)
    order = sorted(range(len(logits)), key=lambda i: -logits[i].item())
    if top_k:
        for i in order[top_k:]:
            keep[i] = False

    def probs() -> list[float]:
        z = sum(math.exp(logits[i].item()) for i in range(len(logits)) if keep[i])
        return [math.exp(logits[i].item()) / z if keep[i] else 0.0 for i in range(len(logits))]

    if top_p < 1.0:
        p = probs()
        for i in range(len(logits)):  # dropped iff the mass of tokens ranked at or below it is <= 1 - top_p
            below = sum(p[j] for j in range(len(logits)) if p[j] <= p[i])
            keep[i] = keep[i] and below > 1 - top_p
    if min_p is not None:
        p = probs()
        keep = [keep[i] and p[i] >= min_p * max(p) for i in range(len(logits))]
    return torch.tensor([math.log(q) if q > 0 else -math.inf for q in probs()])


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 5, 1.0, None), (1.3, 0, 0.6, None), (0.9, 0, 1.0, 0.6), (0.8, 40, 0.9, 0.3)])
def test_transformers_logprobs_are_those_of_the_distribution_sampled(tiny_model_dir, tokenizer, temperature, top_k,
                                                                     top_p, min_p):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    sampling = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    engine = TransformersEngine(model, tokenizer, sampling=sampling)
    torch.manual_seed(3)
    prefixes = [tokenizer.encode("What is 3+4?"), tokenizer.encode("hello world")]
    for prefix, seg in zip(prefixes, engine.generate(prefixes, [10, 10], stop=[])):
        with torch.no_grad():
            logits = model(torch.tensor([prefix + seg.token_ids])).logits[0, len(prefix) - 1 : -1]
        expected = [_brute_force_logprobs(row, temperature, top_k, top_p, min_p)[token].item()
                    for row, token in zip(logits, seg.token_ids)]
        assert all(math.isfinite(v) for v in expected)  # every sampled token is inside the sampled support
        torch.testing.assert_close(torch.tensor(seg.logprobs), torch.tensor(expected), atol=2e-4, rtol=1e-4)
        # entropy stays the model's, at the sampling temperature, over the whole vocabulary ('exact' by default)
        full = torch.log_softmax(logits.float() / temperature, -1)
        torch.testing.assert_close(torch.tensor(seg.entropies), token_entropy(full), atol=1e-4, rtol=1e-4)
