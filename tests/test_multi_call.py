"""The multi-call task (arithmetic chains), its cold-start transcripts in both call formats, and the paired bootstrap
the benchmark's intervals come from."""

from __future__ import annotations

import json
import math

import pytest

from arpo_trl.commands.sft import ColdStartArguments, chain_transcripts, load_tokenizer, transcripts
from arpo_trl.data import dataset_metric, named_dataset
from arpo_trl.data.arithmetic_chains import Chain, arithmetic_chains
from arpo_trl.rewards.eval_metrics import paired_bootstrap, seed_interval


def test_a_chain_says_its_steps_and_computes_each_on_the_previous_value():
    chain = Chain(347, (("*", 28), ("+", 915), ("-", 86)))
    assert chain.question().startswith("Start with 347. Multiply it by 28, then add 915, then subtract 86.")
    assert chain.values() == [9716, 10631, 10545] and chain.answer == "10545"
    assert chain.expressions() == ["347*28", "9716+915", "10631-86"]


def test_chains_are_seeded_distinct_and_start_with_a_multiplication():
    chains = arithmetic_chains(200, seed=5)
    assert chains == arithmetic_chains(200, seed=5) != arithmetic_chains(200, seed=6)
    assert len(set(chains)) == 200
    assert all(c.steps[0][0] == "*" and 2 <= len(c.steps) <= 3 for c in chains)
    with pytest.raises(ValueError, match="min_steps"):
        arithmetic_chains(3, min_steps=3, max_steps=2)


def test_named_dataset_arithmetic_chain():
    data = named_dataset("arithmetic_chain:7", seed=2)
    assert len(data) == 7 and dataset_metric("arithmetic_chain:7") == "math"
    first = arithmetic_chains(7, 2)[0]
    assert data[0]["ground_truth"] == first.answer and data[0]["prompt"][-1]["content"] == first.question()
    with pytest.raises(ValueError, match="arithmetic_chain"):
        named_dataset("arithmetic_chain:zero")


def test_transcripts_call_python_once_per_step_with_the_real_tools_output():
    chains = arithmetic_chains(6, seed=1)
    tags = chain_transcripts(6, seed=1, system_prompt="S")
    chat = chain_transcripts(6, seed=1, system_prompt="S", tool_call_format="chat_template")
    for chain, tag_row, chat_row in zip(chains, tags, chat):
        text = tag_row["completion"][0]["content"]
        assert text.count("<python>") == len(chain.steps) == text.count("</result>")
        for expression, value in zip(chain.expressions(), chain.values()):
            assert f"<python>print({expression})</python> <result>\n{value}\n</result>" in text
        assert text.endswith(f"<answer>\\boxed{{{chain.answer}}}</answer>")
        messages = chat_row["completion"]
        calls = [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant" and m["tool_calls"]]
        assert [c["arguments"]["code"] for c in calls] == [f"print({e})" for e in chain.expressions()]
        assert [m["content"] for m in messages if m["role"] == "tool"] == [str(v) for v in chain.values()]
        assert json.loads(chat_row["tools"])[0]["function"]["name"] == "python"


def test_cold_start_arguments_reject_chat_transcripts_for_other_tasks_and_unknown_templates(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="tool_call_format"):
        transcripts(ColdStartArguments(task="basic_arithmetic", tool_call_format="chat_template"))
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="chat_template: TRL ships no template 'nope'.*qwen2_5"):
        load_tokenizer(str(tmp_path), "nope")
    assert "<tool_call>" in load_tokenizer(str(tmp_path), "qwen2_5").chat_template


def test_paired_bootstrap_estimates_and_intervals():
    mine, base = {0: [2.0, 4.0], 1: [3.0, 3.0]}, {0: [4.0, 8.0], 1: [6.0, 6.0]}
    ratio = paired_bootstrap(mine, base, "ratio", resamples=300)
    assert ratio["estimate"] == ratio["low"] == ratio["high"] == pytest.approx(0.5)  # every resample is 0.5
    assert (ratio["groups"], ratio["units"]) == (2, 4)
    difference = paired_bootstrap({0: [1.0, 0.0], 1: [1.0, 1.0]}, {0: [0.0, 0.0], 1: [0.0, 1.0]}, "difference")
    assert difference["estimate"] == pytest.approx(0.5)
    assert 0.0 <= difference["low"] <= 0.5 <= difference["high"] <= 1.0
    assert ratio["undefined_resamples"] == 0
    zero_base = paired_bootstrap({0: [1.0, 2.0]}, {0: [0.0, 0.0]}, "ratio", resamples=50)
    assert math.isnan(zero_base["estimate"]) and math.isnan(zero_base["low"]) and math.isnan(zero_base["high"])
    assert zero_base["undefined_resamples"] == 50
    some_zero = paired_bootstrap({0: [1.0, 2.0]}, {0: [0.0, 1.0]}, "ratio", resamples=200)
    assert 0 < some_zero["undefined_resamples"] < 200 and some_zero["low"] <= some_zero["high"]
    with pytest.raises(ValueError, match="statistic"):
        paired_bootstrap(mine, base, "median")
    with pytest.raises(ValueError, match="no group"):
        paired_bootstrap({0: [1.0]}, {1: [1.0]}, "ratio")


def test_seed_interval_is_students_t_over_the_seeds_values():
    """Per seed the difference (ratio) of its units' means; across seeds Student's t, the seeds being the sample. The
    audit's case: per-seed ARPO - GRPO of +0.109, +0.049, -0.058 gives [-0.177, +0.243]."""
    mine = {0: [0.5, 0.718], 2: [0.3, 0.398], 3: [0.2, 0.084]}
    base = {0: [0.4, 0.6], 2: [0.25, 0.35], 3: [0.2, 0.2]}
    result = seed_interval(mine, base, "difference")
    assert result["per_seed"] == pytest.approx({"0": 0.109, "2": 0.049, "3": -0.058})
    assert (result["interval"], result["seeds"]) == ("t", 3)
    assert result["estimate"] == pytest.approx(0.1 / 3)
    assert (result["low"], result["high"]) == pytest.approx((-0.177, 0.243), abs=1e-3)
    ratio = seed_interval({0: [2.0, 4.0], 1: [3.0, 3.0]}, {0: [4.0, 8.0], 1: [6.0, 6.0]}, "ratio")
    assert ratio["estimate"] == ratio["low"] == ratio["high"] == pytest.approx(0.5)  # every seed's ratio is 0.5
    undefined = seed_interval({0: [1.0], 1: [2.0], 2: [1.0]}, {0: [0.0], 1: [1.0], 2: [1.0]}, "ratio")
    assert (undefined["seeds"], undefined["undefined_seeds"]) == (2, 1) and undefined["estimate"] == 1.5
    one = seed_interval({0: [1.0, 0.0, 1.0, 1.0]}, {0: [0.0, 0.0, 1.0, 0.0]}, "difference", resamples=300)
    assert one["interval"] == "units" and one["seeds"] == 1 and one["estimate"] == pytest.approx(0.5)
    assert one["low"] <= 0.5 <= one["high"]
    with pytest.raises(ValueError, match="no seed"):
        seed_interval({0: [1.0]}, {1: [1.0]}, "ratio")
