"""A seed reproduces a rollout, whatever its schedule (docs/differences.md, "Seeds"): every random draw is keyed by the
rollout's seed and the path's place in its tree (`Trajectory.key`), its fork draws in the sampler and its tokens in
the cached engine (`generation/sampling.py`), so neither the arrival of tool results nor the batch a request ran in,
nor the scheduler, drafts or fill-ups run ahead of the rule change what a path samples (`test_golden_trees.py` holds
the trees themselves).

The model is the tool model in float64 and samples at temperature 1: a batch's rounding then moves a logit by ~1e-16,
so a token could only change where its uniform falls within that of a boundary of its distribution."""

import random
import threading
import time

import pytest

from arpo_trl.generation import CachedTransformersEngine
from arpo_trl.generation.engine import SamplingSettings
from arpo_trl.rollout.paths import tree_order
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import Tool
from tests.test_cached_engine import _prompt

SAMPLING = SamplingSettings(temperature=1.0, entropy_top_k=None)
QUESTIONS = ["What is 12+30?", "What is 7+5?", "What is 61+20?"]


class JitteryTool(Tool):
    """A thread-safe tool whose calls take a random 0-20 ms (an unseeded clock-driven RNG, different in every run) and
    run several at once: tool results come back in another order each run."""

    def __init__(self):
        super().__init__("python")
        self.jitter, self.lock, self.running, self.most_at_once = random.Random(time.perf_counter_ns()), \
            threading.Lock(), 0, 0

    def __call__(self, content: str) -> str:
        with self.lock:
            delay, self.running = self.jitter.uniform(0.0, 0.02), self.running + 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(delay)
        with self.lock:
            self.running -= 1
        return str(sum(map(ord, content)) % 97)  # depends on the call alone


def trees(result) -> list[list[tuple]]:
    """Each group's paths as the trainer sees them: in order, with their place in the tree and every token."""
    return [[(t.id, t.key, t.kind, t.parent, t.fork_position, t.completion_ids, t.mask, t.finish_reason,
              [(c.tool, c.arguments, c.result_start, c.result_end) for c in t.calls]) for t in group]
            for group in result.groups]


def grow(model, tokenizer, *, seed=5, scheduler="events", policy="entropy", speculation="auto", rollouts=2, tool=None):
    """`rollouts` rollouts of the three questions (M = 6) from a fresh sampler and engine; their trees and the tool."""
    engine = CachedTransformersEngine(model, tokenizer, sampling=SAMPLING)
    tool = tool or JitteryTool()
    sampler = BranchingSampler(engine, tokenizer, [tool], num_generations=6, initial_rollouts=6 if policy == "none"
                               else 2, max_completion_length=64, branch_policy=policy, seed=seed, scheduler=scheduler,
                               speculation=speculation)
    prompts = [_prompt(tokenizer, q) for q in QUESTIONS]
    return [sampler.sample(prompts) for _ in range(rollouts)], tool


def test_a_seed_reproduces_the_trees_under_events_with_a_concurrent_tool(tool_model64, tokenizer):
    """Twice the same seed, event-driven, with tool calls that overlap and return in another order each time: the
    same trees token for token, numbered and ordered alike, over two rollouts (the second draws other trees)."""
    first, tool = grow(tool_model64, tokenizer)
    second, _ = grow(tool_model64, tokenizer)
    assert tool.most_at_once >= 2, "the tool calls never overlapped"
    assert trees(first[0]) == trees(second[0]) and trees(first[1]) == trees(second[1])
    assert trees(first[0]) != trees(first[1]), "a rollout repeated the one before it"
    paths = first[0].trajectories + first[1].trajectories
    assert {"global", "branch", "fill"} <= {t.kind for t in paths}, "no fork or no fill-up: nothing was tested"
    for group in first[0].groups:  # tree order: parents before their branches, numbered in that order
        assert [tree_order(t.key) for t in group] == sorted(tree_order(t.key) for t in group)
        assert all(t.parent is None or t.parent < t.id for t in group)
    other, _ = grow(tool_model64, tokenizer, seed=6)
    assert trees(other[0]) != trees(first[0])


@pytest.mark.parametrize("policy", ["entropy", "random", "aepo", "none"])
def test_the_same_seed_grows_the_same_trees_under_every_schedule(tool_model64, tokenizer, policy):
    """Waves or events, fill-ups run ahead (`prefetch.py`) or not: one seed, one tree per prompt."""
    expected = trees(grow(tool_model64, tokenizer, policy=policy, rollouts=1)[0][0])
    for schedule in ({"scheduler": "waves"}, {"speculation": "off"}):
        result = grow(tool_model64, tokenizer, policy=policy, rollouts=1, **schedule)[0][0]
        assert trees(result) == expected, schedule


# What a run's schedule decides (when requests ran, what the prefix cache held) and its timings: the rest of a step's
# metrics are the seed's.
SCHEDULE_METRICS = ("arpo/critical_path_tokens", "arpo/latest_fill_up_start_tokens", "arpo/discarded_tokens_per_group",
                    "arpo/waves",
                    "arpo/prefill_tokens_per_group", "arpo/engine_", "seconds", "step_time", "runtime", "per_second")


def test_two_runs_of_one_seed_log_the_same_steps(tool_model_dir, tokenizer, addition_dataset, tmp_path):
    """`ARPOTrainer` with its defaults (the cached engine, event-driven) and the sandboxed Python tool, twice with one
    seed: the same trees in trees.jsonl (all but the calls' seconds) and the same metrics at every step (all but the
    schedule's), loss and gradient norm included."""
    import torch
    from peft import LoraConfig

    from arpo_trl import ARPOConfig, ARPOTrainer, PythonTool, arpo_math_reward
    from arpo_trl.generation import CachedTransformersEngine
    from arpo_trl.runtime.schedulers import EventScheduler
    from arpo_trl.training.tracking import read_metrics
    from arpo_trl.trees import read_jsonl

    def run(name):
        args = ARPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                          initial_rollouts=2, max_completion_length=48, max_steps=3, learning_rate=5e-3,
                          logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=3,
                          temperature=1.2, model_init_kwargs={"dtype": torch.float64})
        trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=[arpo_math_reward], args=args,
                              train_dataset=addition_dataset, processing_class=tokenizer, tools=[PythonTool(timeout=5)],
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        assert isinstance(trainer.engine, CachedTransformersEngine)
        assert isinstance(trainer.sampler.scheduler, EventScheduler)
        trainer.train()
        trees = read_jsonl(tmp_path / name / "trees.jsonl")
        for record in trees:
            record["calls"] = [{k: v for k, v in call.items() if k != "seconds"} for call in record["calls"]]
        metrics = [{k: v for k, v in row.items() if not any(part in k for part in SCHEDULE_METRICS)}
                   for row in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in row]
        return trees, metrics

    (trees, metrics), (again, metrics_again) = run("first"), run("second")
    assert len(metrics) == 3 and {"reward", "loss", "grad_norm", "arpo/forks_per_group"} <= set(metrics[0])
    assert any(record["kind"] == "branch" for record in trees)
    assert trees == again
    assert metrics == metrics_again
