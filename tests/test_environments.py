"""`environment_factory` with branching, from TRL's documented environment example with `GRPOTrainer` / `GRPOConfig`
swapped for `ARPOTrainer` / `ARPOConfig`: a branch continues from its parent's environment as it was at the fork,
siblings share nothing afterwards, rewards read their own path's environment; several environment classes; the
environment's own reward without `reward_funcs`; an environment that cannot be forked is told which method to add.
The model is a scripted engine (test double) whose calls are tokenised for real; sampler and trainer are real."""

import itertools
import json
import threading

import pytest
from datasets import Dataset
from test_tool_calls import ANSWER, ScriptedEngine
from tiny import tiny_model

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.tools.environments import fork_environment


class IncrementEnv:
    """TRL's docs example: a counter the model increments through a tool."""

    def reset(self, **kwargs):
        self.counter = 0
        self.history = []

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        self.history.append(step)
        return self.counter


class ScoredIncrementEnv(IncrementEnv):
    def get_reward(self) -> float:
        return float(self.counter)


class DoubleEnv:
    def reset(self, start: int = 1, **kwargs):
        self.value = start
        return f" Start at {start}."

    def double(self) -> int:
        """
        Doubles the value.
        """
        self.value *= 2
        return self.value


def counter_reward(environments, **kwargs):
    return [float(env.counter) for env in environments]


STEPS = itertools.count(1)


def calls(text, rng):
    """Two calls per path, each increment by a step no other call uses (siblings diverge after a fork), then the
    answer."""
    done = text.count("</tool_response>")
    if done < 2:
        name = "double" if "Start at" in text else "increment"
        arguments = {} if name == "double" else {"step": next(STEPS)}
        return f'step {done} <tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>', \
            rng.uniform(0.0, 2.0), "stop"
    return ANSWER, 1.0, "eos"


def config(tmp_path, **kw):
    return ARPOConfig(**{
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4, "initial_rollouts": 1,
        "branch_policy": "random", "branch_threshold": 1.0, "max_tool_calls": 2, "max_completion_length": 300,
        "max_steps": 1, "entropy_window": 400, "use_cpu": True, "bf16": False, "report_to": "none",
        "save_strategy": "no", "log_trees": False, "logging_steps": 1, **kw})


class Recording(ARPOTrainer):
    def _arpo_rollout(self, prompts, trainer=None):
        out = super()._arpo_rollout(prompts, trainer)
        self.trees = getattr(self, "trees", []) + [(self._last_rollout, list(self.environments))]
        return out


def dataset(n=4, **columns):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count {i}"}], **columns} for i in range(n)])


def test_branches_continue_from_their_parents_environment(hermes, tmp_path):
    seen = []

    def reward(environments, completions, **kwargs):
        seen.append(environments)
        return counter_reward(environments)

    trainer = Recording(model=tiny_model(hermes), reward_funcs=reward, args=config(tmp_path),
                        train_dataset=dataset(), processing_class=hermes, environment_factory=IncrementEnv,
                        engine=ScriptedEngine(hermes, calls))
    trainer.train()
    result, environments = trainer.trees[0]
    assert seen[0] == environments and len({id(e) for e in environments}) == 4  # one per completion, none shared
    by_node = {t.id: (t, env) for t, env in zip(result.trajectories, environments)}
    branches = [t for t in result.trajectories if t.parent is not None]
    assert result.stats.forks == 3 and len(branches) == 3
    for t, env in by_node.values():
        steps = [json.loads(c.arguments)["step"] for c in t.calls]
        assert env.history == steps and env.counter == sum(steps)  # the path's own calls, its inherited ones first
        if t.parent is not None:  # at the fork the branch's environment was its parent's: same calls up to there
            parent, parent_env = by_node[t.parent]
            inherited = sum(c.result_end is not None and c.result_end <= t.fork_position for c in t.calls)
            assert inherited >= 1 and env.history[:inherited] == parent_env.history[:inherited]
    assert len({tuple(env.history) for env in environments}) > 1  # siblings went on alone after their fork
    prompt = hermes.decode(trainer.sampler.call_format.prompt_ids([[{"role": "user", "content": "x"}]])[0])
    assert '"name": "increment"' in prompt


def test_environment_owned_reward_without_reward_funcs_and_several_classes(hermes, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Go"}], "environment": name, "start": 3}
            for name in ("counter", "double")] * 2
    trainer = Recording(model=tiny_model(hermes), args=config(tmp_path, max_steps=2),
                        train_dataset=Dataset.from_list(rows), processing_class=hermes,
                        environment_factory={"counter": ScoredIncrementEnv, "double": DoubleEnv},
                        engine=ScriptedEngine(hermes, calls))
    assert trainer.reward_func_names == ["ScoredIncrementEnv"]
    trainer.train()
    kinds = set()
    for result, environments in trainer.trees:
        for t, env in zip(result.trajectories, environments):
            kinds.add(type(env))
            if isinstance(env, DoubleEnv):  # reset(start=3) from the example, then two doublings on this path
                assert env.value == 12 and [c.tool for c in t.calls] == ["double", "double"]
            else:
                assert env.counter == sum(json.loads(c.arguments)["step"] for c in t.calls)
    assert kinds == {ScoredIncrementEnv, DoubleEnv}
    # the counter's own reward scored its rows (two increments of at least 1 each); the other class's rows have none
    means = [e.get("rewards/ScoredIncrementEnv/mean") for e in trainer.state.log_history if "reward" in e]
    assert sorted(m is None for m in means) == [False, True] and min(m for m in means if m is not None) >= 2


def test_no_reward_source_is_refused_as_trl_refuses_it(hermes, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        ARPOTrainer(model=tiny_model(hermes), args=config(tmp_path), train_dataset=dataset(), processing_class=hermes,
                    environment_factory=IncrementEnv, engine=ScriptedEngine(hermes, calls))


class LockedEnv(IncrementEnv):
    def reset(self, **kwargs):
        super().reset()
        self.lock = threading.Lock()


class ForkableLockedEnv(LockedEnv):
    def fork(self):
        twin = ForkableLockedEnv()
        twin.reset()
        twin.counter, twin.history = self.counter, list(self.history)
        return twin


def test_the_fork_rule():
    env = IncrementEnv()
    env.reset()
    env.increment(2)
    twin = fork_environment(env)
    twin.increment(5)
    assert (env.history, twin.history) == ([2], [2, 5])
    locked = LockedEnv()
    locked.reset()
    with pytest.raises(TypeError, match=r"^ARPO cannot fork the LockedEnv environment .*give LockedEnv a `fork\("):
        fork_environment(locked)
    forkable = ForkableLockedEnv()
    forkable.reset()
    forkable.increment(4)
    assert fork_environment(forkable).history == [4]
