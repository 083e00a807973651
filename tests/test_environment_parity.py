"""Environments written for `GRPOTrainer` run unchanged under `ARPOTrainer` (TRL 1.16's documented forms): an
environment that owns its reward beside the user's own weighted reward functions, `trainer.tools` listing the
environment's methods, and TRL's `tools/*` metrics, each compared with a real `GRPOTrainer` built from the same
environment, and each run for a real `ARPOTrainer` step with branching (scripted engine, real sampler and trainer)."""

import math

import pytest
import torch
from test_environments import Recording, ScoredIncrementEnv, calls, config, dataset
from test_tool_calls import ScriptedEngine
from tiny import qwen_chat_tokenizer, tiny_model
from trl import GRPOConfig, GRPOTrainer

from arpo_trl import ARPOTrainer


def length_reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """`GRPOTrainer` with the environment that owns its reward, the user's weighted reward and a standalone tool."""
    tokenizer = qwen_chat_tokenizer()
    args = GRPOConfig(str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, use_cpu=True, bf16=False, report_to="none",
                      save_strategy="no", logging_steps=1, reward_weights=[0.5])
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=[length_reward], args=args,
                          train_dataset=dataset(), processing_class=tokenizer, environment_factory=ScoredIncrementEnv,
                          tools=[multiply])
    trainer.train()
    return trainer


def _arpo(hermes, tmp_path, **kw):
    return Recording(model=tiny_model(hermes), reward_funcs=[length_reward],
                     args=config(tmp_path, reward_weights=[0.5], **kw), train_dataset=dataset(),
                     processing_class=hermes, environment_factory=ScoredIncrementEnv, tools=[multiply],
                     engine=ScriptedEngine(hermes, calls))


def test_an_environments_reward_joins_the_users_weighted_rewards_as_under_grpo_trainer(hermes, tmp_path,
                                                                                       trl_trainer):
    """TRL checks the weights against the user's functions, then adds the environment's `get_reward` as a column of
    weight 1 (`GRPOTrainer.__init__`); the user's config keeps its own weights."""
    trainer = _arpo(hermes, tmp_path)
    assert trainer.reward_func_names == trl_trainer.reward_func_names == ["length_reward", "ScoredIncrementEnv"]
    assert torch.equal(trainer.reward_weights, trl_trainer.reward_weights)
    assert trainer.reward_weights.tolist() == [0.5, 1.0] and trainer.args.reward_weights == [0.5]
    trainer.train()
    result, environments = trainer.trees[0]
    assert result.stats.forks > 0
    logged = next(e for e in trainer.state.log_history if "rewards/ScoredIncrementEnv/mean" in e)
    counters = [float(env.counter) for env in environments]
    assert logged["rewards/ScoredIncrementEnv/mean"] == pytest.approx(sum(counters) / len(counters))
    with pytest.raises(ValueError, match=r"Number of reward weights \(2\) must match number of reward functions \(1\)"):
        ARPOTrainer(model=tiny_model(hermes), reward_funcs=[length_reward], args=config(tmp_path,
                    reward_weights=[0.5, 0.5]), train_dataset=dataset(), processing_class=hermes,
                    environment_factory=ScoredIncrementEnv, engine=ScriptedEngine(hermes, calls))


def test_trainer_tools_lists_the_tools_and_the_environments_methods_as_under_grpo_trainer(hermes, tmp_path,
                                                                                        trl_trainer):
    """Every public method but `reset` and `get_reward`, bound to a probe instance, after the tools passed; TRL's own
    tool loop still never runs (ARPO's sampler calls the tools), so the step trains on ARPO's trees."""
    trainer = _arpo(hermes, tmp_path)
    names = [getattr(tool, "__name__", None) for tool in trainer.tools]
    assert names == [tool.__name__ for tool in trl_trainer.tools] == ["multiply", "increment"]
    assert trainer.tools[0] is multiply and isinstance(trainer.tools[1].__self__, ScoredIncrementEnv)
    trainer.train()
    result, _ = trainer.trees[0]
    assert result.stats.tool_calls > 0 and trainer.tools[0] is multiply


def test_trls_tool_metrics_are_logged_under_their_names_and_meanings(hermes, tmp_path, trl_trainer):
    """`tools/call_frequency`: calls per completion; `tools/failure_frequency`: failed calls over calls. A call a branch
    inherits counts in each completion holding it, as in M independent completions."""
    trainer = _arpo(hermes, tmp_path)
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "tools/call_frequency" in e)
    trl_logged = next(e for e in trl_trainer.state.log_history if "tools/call_frequency" in e)
    assert {"tools/call_frequency", "tools/failure_frequency"} <= set(logged) and \
        {"tools/call_frequency", "tools/failure_frequency"} <= set(trl_logged)
    result, _ = trainer.trees[0]
    rows = result.trajectories
    assert logged["tools/call_frequency"] == pytest.approx(sum(t.tool_calls for t in rows) / len(rows))
    assert logged["tools/call_frequency"] == pytest.approx(logged["arpo/tool_calls_per_trajectory"])
    calls_run = sum(t.tool_calls for t in rows)
    failures = sum(t.tool_failures for t in rows) / calls_run if calls_run else 0.0
    assert math.isclose(logged["tools/failure_frequency"], failures, abs_tol=1e-9)
    # executed once each, shared by the branches that inherit them: fewer than the rows hold
    assert logged["arpo/tool_calls_per_group"] < logged["tools/call_frequency"] * len(rows)
