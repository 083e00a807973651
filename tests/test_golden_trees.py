"""Golden rollout trees: what the rule grows on the tiny tool model, recorded once and compared byte for byte.

The model is the tiny tool model trained in float64 from Python-drawn weights (`tiny.exact_tool_model`), so that the
records hold on every CPU. 3 seeds × the four branch policies × both schedulers (events and waves grow the same trees
for a seed), each tree with its tokens, loss mask, calls, forks (where, ΔH, P, the draw and whether it forked) and
every path's seed.
A change to the rule's code that is meant to leave the rule as it is (a refactoring, a runtime change) must leave
these files unchanged; a change of the rule itself rewrites them on purpose:

    python -m tests.test_golden_trees   # rewrites tests/golden/rollout_trees.json

ΔH and P come from float64 entropies and are recorded to 9 significant digits (another CPU's kernels may differ in
the last bits); every draw and seed is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo_trl.rollout.paths import RolloutResult
from arpo_trl.runtime import BranchingSampler
from tests.test_seeds import QUESTIONS, SAMPLING, JitteryTool

GOLDEN = Path(__file__).parent / "golden" / "rollout_trees.json"
SEEDS = (1, 2, 3)
POLICIES = ("entropy", "random", "aepo", "none")
SCHEDULERS = ("events", "waves")


def _float(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.9g}")


def record(result: RolloutResult) -> dict:
    """A rollout as plain data: per group, its paths in tree order, with what the rule decided for each."""
    groups = [[{
        "id": t.id, "key": json.loads(json.dumps(t.key)), "kind": t.kind, "parent": t.parent,
        "fork_position": t.fork_position, "seed": t.seed, "finish_reason": t.finish_reason,
        "completion_ids": t.completion_ids, "mask": t.mask,
        "calls": [[c.tool, c.arguments, c.ran, c.result_start, c.result_end, c.failed] for c in t.calls],
        "decisions": [[d.position, _float(d.delta), _float(d.probability), d.draw, d.forked] for d in t.decisions],
    } for t in group] for group in result.groups]
    stats = result.stats
    return {"groups": groups, "forks": stats.forks, "fill_ups": stats.fill_ups,
            "global_samples": {str(g): m for g, m in sorted(stats.global_samples.items())}}


def grow(model, tokenizer, seed: int, policy: str, scheduler: str) -> dict:
    """Two rollouts of the three questions (M = 6, N = 2; GRPO: N = M) from a fresh sampler on the cached engine."""
    from arpo_trl.generation import CachedTransformersEngine
    from tests.test_cached_engine import _prompt

    engine = CachedTransformersEngine(model, tokenizer, sampling=SAMPLING)
    sampler = BranchingSampler(engine, tokenizer, [JitteryTool()], num_generations=6,
                               initial_rollouts=6 if policy == "none" else 2, max_completion_length=64,
                               branch_policy=policy, seed=seed, scheduler=scheduler)
    prompts = [_prompt(tokenizer, q) for q in QUESTIONS]
    return {"rollouts": [record(sampler.sample(prompts)) for _ in range(2)]}


def key(seed: int, policy: str) -> str:
    return f"seed{seed}/{policy}"


@pytest.fixture(scope="module")
def model(tokenizer):
    from tests.tiny import exact_tool_model

    return exact_tool_model(tokenizer)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_covers_every_case(golden):
    assert set(golden["trees"]) == {key(s, p) for s in SEEDS for p in POLICIES}
    kinds = {t["kind"] for trees in golden["trees"].values() for r in trees["rollouts"] for g in r["groups"] for t in g}
    assert kinds == {"global", "branch", "fill"}, "no fork or no fill-up: the guard would not see the rule"
    decisions = [d for trees in golden["trees"].values() for r in trees["rollouts"] for g in r["groups"] for t in g
                 for d in t["decisions"]]
    assert {d[4] for d in decisions} == {True, False}, "every fork decision went one way"


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_rule_grows_the_golden_trees(model, tokenizer, golden, policy, scheduler):
    for seed in SEEDS:
        got = grow(model, tokenizer, seed, policy, scheduler)
        want = golden["trees"][key(seed, policy)]
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True), (seed, policy, scheduler)


def main() -> None:
    """Rewrite the golden file (events scheduler; the test checks waves against the same trees)."""
    from tests.tiny import build_tokenizer, exact_tool_model

    tokenizer = build_tokenizer()
    model = exact_tool_model(tokenizer)
    trees = {key(s, p): grow(model, tokenizer, s, p, "events") for s in SEEDS for p in POLICIES}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"about": __doc__.split("\n\n")[0], "trees": trees},
                                 sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
