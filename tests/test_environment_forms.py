"""The `environment_factory` forms TRL 1.16 accepts, under `ARPOTrainer` with branching: no `train_dataset` (the
environment owns the data and `reset()` returns the whole prompt, `max_steps` sets the length), refused as TRL refuses
it without `max_steps` or with a dict of factories; an async `get_reward`; environment methods called on the training
thread, as `GRPOTrainer` calls them. Scripted engine (test double) whose calls are tokenised for real."""

import json
import threading

import pytest
from test_environments import IncrementEnv, Recording, calls, config
from tiny import tiny_model

from arpo_trl import ARPOTrainer

THREADS: list[threading.Thread] = []


class PuzzleEnv(IncrementEnv):
    """Owns its data: each reset draws the next puzzle and returns it as the whole prompt."""

    puzzles = iter(range(1000))

    def reset(self, **kwargs):
        super().reset()
        self.puzzle = next(self.puzzles)
        return f"Puzzle {self.puzzle}: count up."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        THREADS.append(threading.current_thread())
        return super().increment(step)

    async def get_reward(self) -> float:
        return float(self.counter)


def test_an_environment_that_owns_the_data_trains_without_a_dataset(hermes, tmp_path):
    THREADS.clear()
    trainer = Recording(model=tiny_model(hermes), args=config(tmp_path, max_steps=2), processing_class=hermes,
                        environment_factory=PuzzleEnv, engine=_engine(hermes))
    assert trainer.reward_func_names == ["PuzzleEnv"]  # the async get_reward, as TRL adds it
    trainer.train()
    assert len(trainer.trees) == 2
    puzzles = set()
    for result, environments in trainer.trees:
        assert result.stats.forks > 0  # branching, each branch on a copy of its parent's environment
        for t, env in zip(result.trajectories, environments):
            prompt = hermes.decode(t.prompt_ids)
            assert f"Puzzle {env.puzzle}: count up." in prompt  # reset's text is the whole prompt
            puzzles.add(env.puzzle)
            assert env.counter == sum(json.loads(c.arguments)["step"] for c in t.calls)
    assert len(puzzles) == 2  # a new puzzle each step (one prompt per step here)
    means = [e["rewards/PuzzleEnv/mean"] for e in trainer.state.log_history if "rewards/PuzzleEnv/mean" in e]
    assert len(means) == 2 and min(means) >= 2  # awaited: two increments of at least 1 each per completion
    assert THREADS and set(THREADS) == {threading.main_thread()}  # environment methods: on the training thread


@pytest.mark.parametrize("kw,factory,message", [
    ({"max_steps": -1}, PuzzleEnv, "`max_steps` must be set to a positive value"),
    ({}, {"a": PuzzleEnv, "b": IncrementEnv}, "requires a `train_dataset` with an `environment` column"),
])
def test_without_a_dataset_refused_as_trl_refuses_it(hermes, tmp_path, kw, factory, message):
    with pytest.raises(ValueError, match=message):
        ARPOTrainer(model=tiny_model(hermes), args=config(tmp_path, **kw), processing_class=hermes,
                    environment_factory=factory, engine=_engine(hermes))


def _engine(tokenizer):
    from test_tool_calls import ScriptedEngine

    return ScriptedEngine(tokenizer, calls)
