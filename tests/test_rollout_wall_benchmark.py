"""`benchmarks/rollout_shape.py`'s simulated server (issue 55): what a request costs, and that the methods' rollouts
are interleaved so that a drifting machine load falls on both sides of each ratio."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import rollout_shape  # noqa: E402
from tiny import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_a_request_costs_its_admission_step_and_its_tokens(tokenizer, monkeypatch):
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(rollout_shape.asyncio, "sleep", sleep)
    engine = rollout_shape.SyntheticAgent(tokenizer, rollout_shape.REGIMES["quickstart"], 0, 0.003, request_steps=1)
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")
    probe = asyncio.run(engine.agenerate(prompt, 5, []))
    rest = asyncio.run(engine.agenerate(prompt + probe.token_ids, 1000, []))
    assert len(probe.token_ids) == 5 and probe.finish_reason == "length"
    assert slept == pytest.approx([0.003 * 6, 0.003 * (1 + len(rest.token_ids))])
    assert engine.generated == 5 + len(rest.token_ids)  # the admission step generates nothing


def test_the_methods_rollouts_alternate(tokenizer, monkeypatch):
    order = []
    sample = rollout_shape.BranchingSampler.sample

    def traced(self, prompts, *args, **kwargs):
        order.append(self.rule.branch_policy)
        return sample(self, prompts, *args, **kwargs)

    monkeypatch.setattr(rollout_shape.BranchingSampler, "sample", traced)
    args = types.SimpleNamespace(rollouts=2, prompts=2, token_ms=0.0, seed=0, speculation="auto", request_steps=1,
                                 segment_statistic=None)
    runs = rollout_shape.run_paired(tokenizer, rollout_shape.REGIMES["quickstart"], ["arpo", "grpo"], "steps/events",
                                    args)
    assert order == ["entropy", "none", "entropy", "none"]
    assert set(runs) == {"arpo", "grpo"} and runs["grpo"]["forks_per_group"] == 0
