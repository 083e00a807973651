"""Dataset builders: reasoning-gym tasks in ARPO's prompt format, addressed by name in recipes."""

import pytest

from arpo_trl.data import PYTHON_SYSTEM_PROMPT, named_dataset, reasoning_gym_dataset
from arpo_trl.rewards import arpo_math_reward


def test_reasoning_gym_rows_have_arpo_prompts_and_ground_truth():
    data = reasoning_gym_dataset("basic_arithmetic", size=8, seed=3)
    assert len(data) == 8 and {"prompt", "ground_truth", "task"} <= set(data.column_names)
    row = data[0]
    assert row["prompt"][0] == {"role": "system", "content": PYTHON_SYSTEM_PROMPT}
    assert row["prompt"][1]["role"] == "user" and row["prompt"][1]["content"].startswith("Calculate")
    # the ground truth scores 1 through the ARPO reward when answered in the expected format
    answer = [{"role": "assistant", "content": f"<think>x</think><answer>\\boxed{{{row['ground_truth']}}}</answer>"}]
    assert arpo_math_reward([answer], ground_truth=[row["ground_truth"]]) == [1.0]
    assert reasoning_gym_dataset("basic_arithmetic", size=8, seed=3)["ground_truth"] == data["ground_truth"]


def test_named_dataset_specs():
    assert named_dataset("data/train.jsonl") is None
    assert len(named_dataset("reasoning_gym:chain_sum:5")) == 5
    with pytest.raises(ValueError, match="reasoning_gym:<task>"):
        named_dataset("reasoning_gym:chain_sum:many")
    with pytest.raises(ValueError, match="no task 'no_such_task'"):
        named_dataset("reasoning_gym:no_such_task")
