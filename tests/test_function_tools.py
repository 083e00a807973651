"""Plain-function tools, as TRL documents `GRPOTrainer(tools=[multiply])`, with `GRPOTrainer` / `GRPOConfig` swapped
for `ARPOTrainer` / `ARPOConfig`: the schema from transformers' `get_json_schema`, sync and async functions, any mix
with our `Tool`s, malformed calls answered with an error as the result (a failed call), forks after their results.
The model is a scripted engine (test double) whose text is tokenised for real; the sampler and trainer are real."""

import asyncio
import json

import pytest
from test_tool_calls import ANSWER, RecordingTrainer, ScriptedEngine, env_spans, response
from tiny import tiny_model
from transformers.utils import get_json_schema

from arpo_trl import ARPOConfig
from arpo_trl.rollout.tool_calls import ChatTemplateFormat, TagFormat, make_call_format
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import PythonTool, Tool
from arpo_trl.tools.functions import FunctionTool, as_tools


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a + b


def shout(text: str) -> str:
    """
    Upper-cases a text.

    Args:
        text: The text.
    """
    return text.upper()


def call(name, arguments):
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def scripted(calls):
    """The model writes `calls` in turn, one per segment, then answers."""
    def script(text, rng):
        done = text.count("</tool_response>")
        if done < len(calls):
            return f"step {done} {calls[done]}", rng.uniform(0.0, 2.0), "stop"
        return ANSWER, rng.uniform(0.0, 2.0), "eos"
    return script


def _sample(tokenizer, calls, tools, **kw):
    tools = as_tools(tools)
    fmt = make_call_format("auto", tokenizer, tools)
    sampler = BranchingSampler(ScriptedEngine(tokenizer, scripted(calls)), tokenizer, tools, call_format=fmt,
                               **{"num_generations": 2, "branch_policy": "none", "max_completion_length": 400, **kw})
    prompts = fmt.prompt_ids([[{"role": "user", "content": "What is 3*4?"}]])
    return sampler.sample(prompts)


def test_schema_is_transformers_own_and_auto_picks_the_chat_template(hermes):
    tool = FunctionTool(multiply)
    assert tool.tag == "multiply" and tool.schema() == get_json_schema(multiply)
    assert isinstance(make_call_format("auto", hermes, [tool, PythonTool()]), ChatTemplateFormat)
    assert isinstance(make_call_format("auto", hermes, [PythonTool()]), TagFormat)
    prompt = hermes.decode(make_call_format("auto", hermes, [tool]).prompt_ids([[{"role": "user", "content": "x"}]])[0])
    assert json.dumps(get_json_schema(multiply)) in prompt
    with pytest.raises(ValueError, match="'undocumented'.*docstring"):
        FunctionTool(undocumented)
    with pytest.raises(TypeError, match="tools: expected arpo_trl.Tool instances or functions"):
        as_tools([multiply, 3])


def undocumented(x: int) -> int:
    return x


def test_sync_and_async_functions_and_a_tool_run_and_their_results_are_masked(hermes):
    calls = [call("multiply", {"a": 3, "b": 4}), call("async_add", {"a": 3, "b": 4}),
             call("python", {"code": "print(6*7)"})]
    result = _sample(hermes, calls, [multiply, async_add, PythonTool(timeout=5)], max_tool_calls=3)
    for t in result.trajectories:
        assert [hermes.decode(span) for span in env_spans(t)] == [response("12"), response("7"), response("42")]
        assert (t.tool_calls, t.tool_failures, t.finish_reason) == (3, 0, "eos")
        assert [c.tool for c in t.calls] == ["multiply", "async_add", "python"]


@pytest.mark.parametrize(("bad", "error"), [
    (call("divide", {"a": 1}), "Error: unknown tool 'divide'; the tools are: multiply, shout."),
    (call("multiply", {"a": 3, "c": 4}),
     "Error: Tool(multiply) call is invalid: got an unexpected keyword argument 'c'"),
    (call("multiply", {"a": 3}), "Error: Tool(multiply) call is invalid: missing a required argument: 'b'"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 3,</tool_call>', "Error: the tool call is not valid JSON"),
    (call("multiply", {"a": "x", "b": None}), "Error: Tool(multiply) execution failed with message: TypeError"),
])
def test_a_malformed_call_is_answered_with_its_error_and_counted_as_failed(hermes, bad, error):
    result = _sample(hermes, [bad, call("shout", {"text": "ok"})], [multiply, shout], max_tool_calls=2)
    for t in result.trajectories:
        first, second = (hermes.decode(span) for span in env_spans(t))
        assert error in first
        assert second == response("OK")  # the path goes on after its mistake
        assert (t.tool_calls, t.tool_failures, t.finish_reason) == (2, 1, "eos")
    assert result.stats.tool_failures == 2


def test_function_tools_in_the_tag_format(tokenizer):
    from test_rollout import ScriptedEngine as TagEngine
    from test_rollout import _prompts

    steps = ['<multiply>{"a": 3, "b": 4}</multiply>', "<shout>hey</shout>", "<multiply>7</multiply>"]

    def script(text, rng):
        done = text.count("</result>")
        return (steps[done], 0.5, "stop") if done < 3 else ("<answer>\\boxed{12}</answer>", 0.5, "eos")

    tools = as_tools([multiply, shout])
    sampler = BranchingSampler(TagEngine(tokenizer, script), tokenizer, tools, call_format=TagFormat(tools),
                               num_generations=1, branch_policy="none", max_completion_length=400)
    (t,) = sampler.sample(_prompts(tokenizer, 1)).trajectories
    results = [tokenizer.decode(span) for span in env_spans(t)]
    assert results[:2] == [" <result>\n12\n</result>", " <result>\nHEY\n</result>"]
    assert "the arguments must be a JSON object with the keys ['a', 'b']" in results[2]
    assert (t.tool_calls, t.tool_failures) == (3, 1)


def test_the_sampler_forks_after_a_function_result(hermes):
    result = _sample(hermes, [call("multiply", {"a": 3, "b": 4})] * 2, [multiply], num_generations=4,
                     initial_rollouts=1, branch_policy="random", branch_threshold=1.0, max_tool_calls=2)
    branches = [t for t in result.trajectories if t.parent is not None]
    assert len(branches) == 3 and result.stats.forks == 3
    for branch in branches:  # each fork sits right after a function's result
        assert branch.fork_position in {call.result_end for call in branch.calls if call.result_end is not None}


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def test_trainer_takes_plain_functions_as_grpo_trainer_does(hermes, addition_dataset, tmp_path):
    """TRL's documented `tools=[multiply]` example with the two names swapped (plus a scripted engine, so that the
    calls happen by construction)."""
    # every fork that can happen does (τ = 1, β = 0): each global's one branch slot, at its first call
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=400,
        max_steps=1, logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no", log_trees=False,
        branch_threshold=1.0, entropy_weight=0.0,
    )
    calls = [call("multiply", {"a": 3, "b": 4}), call("async_add", {"a": 1, "c": 2})]
    trainer = RecordingTrainer(model=tiny_model(hermes), reward_funcs=constant_reward,
                               args=args, train_dataset=addition_dataset, processing_class=hermes,
                               tools=[multiply, async_add, Tool("echo", str)],
                               engine=ScriptedEngine(hermes, scripted(calls)))
    trainer.train()
    output = trainer.recorded[0]
    assert '"name": "multiply"' in hermes.decode(output["prompt_ids"][0])
    for ids, real, tool in zip(*(output[k].tolist() for k in ("completion_ids", "completion_mask", "tool_mask"))):
        env = hermes.decode([t for t, r, m in zip(ids, real, tool) if r and not m])
        assert env.startswith(response("12")) and "unexpected keyword argument 'c'" in env
    logged = next(e for e in trainer.state.log_history if "arpo/tool_failures_per_group" in e)
    # every trajectory makes both calls (a branch shares its parent's first); the second fails in each of the four
    assert logged["arpo/tool_failures_per_group"] == 4 and logged["arpo/tool_calls_per_trajectory"] == 2
