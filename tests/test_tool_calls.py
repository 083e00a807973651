"""Chat-template tool calls (`tool_call_format='chat_template'`): a tiny tokenizer with a Hermes-style template written
here, a scripted engine (the model only is a test double), the real sampler, tools and, at the end, the trainer."""

import json
import math
import random

import pytest
from tiny import HERMES, build_tokenizer, tiny_model

from arpo_trl import ARPOConfig, ARPOTrainer, arpo_math_reward
from arpo_trl.generation.engine import GenerationEngine, Segment
from arpo_trl.rollout.tool_calls import ChatTemplateFormat, TagFormat, ToolCall, make_call_format
from arpo_trl.runtime import BranchingSampler
from arpo_trl.tools import BrowseTool, PageStore, PythonTool, SearchTool, Tool
from arpo_trl.tools.base import format_result

# Hermes-style: the schemas in a system turn, calls as <tool_call>{json}</tool_call>, results in a user turn.
PY_CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
CALC_CALL = '<tool_call>{"name": "python", "arguments": {"input": "6*7"}}</tool_call>'  # a plain Tool's schema
ANSWER = "<answer>\\boxed{42}</answer>"


def response(text: str) -> str:
    """What the environment appends after a call: the end of the assistant turn, the tool turn, the next header."""
    return f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class ScriptedEngine(GenerationEngine):
    """`script(prefix_text, rng) -> (text, per-token entropy, finish)`; ids are the text's real tokens."""

    def __init__(self, tokenizer, script, seed=0):
        self.tokenizer, self.script, self.vocab_size = tokenizer, script, 1000
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.rng = random.Random(seed)

    def generate(self, prefixes, max_new_tokens, stop):
        assert list(stop) == ["</tool_call>"]
        out = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            new, entropy, finish = self.script(self.tokenizer.decode(prefix), self.rng)
            ids = self.tokenizer.encode(new, add_special_tokens=False)
            ids += [self.tokenizer.eos_token_id] * (finish == "eos")
            if len(ids) > budget:
                ids, finish = ids[:budget], "length"
            out.append(Segment(ids, [-0.5] * len(ids), [entropy] * len(ids), finish))
        return out


def call_then_answer(call=PY_CALL, calls=1, p_call=1.0):
    def script(text, rng):
        done = text.count("</tool_response>")
        if done < calls and rng.random() < p_call:
            return f"step {done} {call}", rng.uniform(0.0, 2.0), "stop"
        return ANSWER, rng.uniform(0.0, 2.0), "eos"
    return script


def _sampler(tokenizer, script, tools, seed=0, **kw):
    return BranchingSampler(ScriptedEngine(tokenizer, script, seed), tokenizer, tools, seed=seed,
                            call_format=ChatTemplateFormat(tokenizer, tools), **kw)


def _prompts(fmt, n=1):
    return fmt.prompt_ids([[{"role": "user", "content": f"What is 6*{i + 7}?"}] for i in range(n)])


def env_spans(t):
    spans, current = [], []
    for token, bit in zip(t.completion_ids + [None], t.mask + [1]):
        if bit == 0:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    return spans


def test_prompt_lists_the_tool_schemas(hermes):
    tools = [PythonTool(), SearchTool(backend=None), BrowseTool(PageStore({"A": "a"})), Tool("calc", str)]
    fmt = ChatTemplateFormat(hermes, tools)
    text = hermes.decode(_prompts(fmt)[0])
    schemas = [json.loads(line) for line in text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()]
    assert [s["function"]["name"] for s in schemas] == ["python", "search", "browse", "calc"]
    assert [s["function"]["parameters"]["required"] for s in schemas] == [["code"], ["query"], ["ref"], ["input"]]
    assert text.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    browse = tools[2]
    assert browse.arguments_to_content({"ref": "A", "goal": "when?"}) == "A | when?"
    assert browse.arguments_to_content({"ref": "https://x.org/a"}) == "https://x.org/a"
    with pytest.raises(ValueError, match="string"):
        fmt.prompt_ids(["a plain string prompt"])


def test_python_call_runs_and_the_tool_message_is_appended_with_mask_zero(hermes):
    sampler = _sampler(hermes, call_then_answer(), [PythonTool(timeout=5)], num_generations=2, branch_policy="none")
    result = sampler.sample(_prompts(sampler.call_format))
    for t in result.trajectories:
        assert hermes.decode(t.completion_ids) == f"step 0 {PY_CALL}{response('42')}{ANSWER}<|im_end|>"
        assert [hermes.decode(span) for span in env_spans(t)] == [response("42")]
        assert (t.tool_calls, t.tool_failures, t.finish_reason) == (1, 0, "eos")
        assert [math.isnan(h) for h in t.entropies] == [bit == 0 for bit in t.mask]
    # the appended text is the template's own rendering of the tool message and the next generation prompt
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "python", "arguments": {}}}]}]
    full = hermes.apply_chat_template(conversation + [{"role": "tool", "content": "42"}], tokenize=False,
                                      add_generation_prompt=True)
    assert full.endswith(PY_CALL.replace('{"code": "print(6*7)"}', "{}") + response("42"))


@pytest.mark.parametrize("policy", ["entropy", "random"])
@pytest.mark.parametrize("seed", range(3))
def test_exactly_m_per_prompt_with_branches_at_tool_responses(hermes, policy, seed):
    m = 8
    tools = [Tool("python", lambda code: "42")]
    sampler = _sampler(hermes, call_then_answer(CALC_CALL, calls=3, p_call=0.8), tools, seed=seed, num_generations=m,
                       branch_policy=policy, max_completion_length=300, branch_threshold=0.9)
    result = sampler.sample(_prompts(sampler.call_format, 3))
    assert [len(g) for g in result.groups] == [m, m, m]
    by_id = {t.id: t for t in result.trajectories}
    for t in result.trajectories:
        assert not t.active and len(t.completion_ids) == len(t.mask) == len(t.logprobs) <= 300
        assert [hermes.decode(span) for span in env_spans(t)] == [response("42")] * t.tool_calls
        if t.kind == "branch":
            parent = by_id[t.parent]
            assert t.completion_ids[: t.fork_position] == parent.completion_ids[: t.fork_position]
            assert hermes.decode(t.completion_ids[: t.fork_position]).endswith(response("42"))
    assert result.stats.forks > 0


def test_call_limit_and_budget(hermes):
    tool = Tool("python", lambda code: "42")
    sampler = _sampler(hermes, lambda text, rng: (CALC_CALL, 0.5, "stop"), [tool], num_generations=2, max_tool_calls=2,
                       max_completion_length=400)
    for t in sampler.sample(_prompts(sampler.call_format)).trajectories:
        assert (t.tool_calls, t.finish_reason) == (2, "call_limit")
        assert t.completion_ids[-1] == hermes.eos_token_id and t.mask[-1] == 0
        assert t.tool_failures == 0
    sampler = _sampler(hermes, lambda text, rng: (CALC_CALL, 0.5, "stop"), [tool], num_generations=2,
                       max_completion_length=60)
    for t in sampler.sample(_prompts(sampler.call_format)).trajectories:
        assert len(t.completion_ids) == len(t.mask) == 60 and t.finish_reason == "length"


@pytest.mark.parametrize("call,error", [
    ('<tool_call>{"name": "python", "arguments": {"code": </tool_call>', "Error: the tool call is not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>',
     "Error: unknown tool 'calculator'; the tools are: python."),
    ('<tool_call>{"name": "python", "arguments": {"src": "1"}}</tool_call>',
     "Error: Tool(python) call is invalid: missing the required argument 'code'."),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "Error: Tool(python) arguments must be a JSON"),
    ('<tool_call>"python"</tool_call>', "Error: a tool call must be a JSON object"),
])
def test_malformed_calls_become_the_result(hermes, call, error):
    class NeverRuns(PythonTool):  # PythonTool's schema (`code`); running it would put another error in the result
        def __call__(self, code):
            raise AssertionError("a malformed call must not run")

    sampler = _sampler(hermes, call_then_answer(call), [NeverRuns()], num_generations=2, branch_policy="none")
    result = sampler.sample(_prompts(sampler.call_format))
    assert result.stats.tool_calls == result.stats.tool_failures == 2
    for t in result.trajectories:
        (span,) = env_spans(t)
        text = hermes.decode(span)
        assert text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n" + error), text
        assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert hermes.decode(t.completion_ids).endswith(ANSWER + "<|im_end|>")  # the path went on


def test_empty_call_ends_the_path_as_with_tags(hermes):
    sampler = _sampler(hermes, lambda text, rng: ("<tool_call> </tool_call>", 0.1, "stop"), [PythonTool()],
                       num_generations=2, branch_policy="none")
    assert {t.finish_reason for t in sampler.sample(_prompts(sampler.call_format)).trajectories} == {"empty_call"}


def test_templates_that_cannot_serve_are_rejected(hermes):
    tokenizer = build_tokenizer()
    tokenizer.name_or_path = "tiny/chatml-no-tools"  # tests/tiny.py's ChatML template ignores `tools`
    with pytest.raises(ValueError, match=r"'tiny/chatml-no-tools' ignores `tools`.*tool_call_format='tags'"):
        ChatTemplateFormat(tokenizer, [PythonTool()])
    with pytest.raises(ValueError, match="ending with '</function>'"):
        ChatTemplateFormat(hermes, [PythonTool()], "<function>", "</function>")
    no_tool_turns = build_tokenizer()
    no_tool_turns.chat_template = HERMES.replace("{{ message.content }}\n</tool_response>", "</tool_response>")
    with pytest.raises(ValueError, match="does not render tool messages"):
        ChatTemplateFormat(no_tool_turns, [PythonTool()])
    with pytest.raises(ValueError, match="tool_call_format must be one of"):
        make_call_format("json", hermes, [])


def test_tag_format_is_the_old_behaviour():
    # The whole of tests/test_rollout.py runs the sampler with its default TagFormat; this pins the pieces.
    tool = Tool("python", str)
    fmt = TagFormat([tool, Tool("search", str)])
    assert fmt.stop_strings == ["</python>", "</search>"]
    assert fmt.parse("x <python> 1+1 </python>", "</python>") == ToolCall(tool, "1+1", start=2)
    assert fmt.parse("<python>  </python>", "</python>") is None
    assert fmt.render_result("2", ToolCall(tool, "1+1")) == format_result("2") == " <result>\n2\n</result>"


def test_config_validates_the_format(tmp_path):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True, bf16=False,
                report_to="none")
    assert ARPOConfig(**base).tool_call_format == "auto"
    with pytest.raises(ValueError, match="tool_call_format must be one of"):
        ARPOConfig(**base, tool_call_format="hermes")
    with pytest.raises(ValueError, match="tool_call_close"):
        ARPOConfig(**base, tool_call_format="chat_template", tool_call_close="")


class RecordingTrainer(ARPOTrainer):
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.recorded = getattr(self, "recorded", []) + [output]
        return output


def test_trainer_step_with_chat_template_calls(hermes, addition_dataset, tmp_path):
    model = tiny_model(hermes)
    args = ARPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, initial_rollouts=2,
        max_completion_length=160, max_steps=1, learning_rate=5e-3, logging_steps=1, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", seed=0, beta=0.0, log_trees=False, tool_call_format="chat_template",
    )
    engine = ScriptedEngine(hermes, call_then_answer(p_call=0.7))
    trainer = RecordingTrainer(model=model, reward_funcs=arpo_math_reward, args=args, train_dataset=addition_dataset,
                               processing_class=hermes, tools=[PythonTool(timeout=5)], engine=engine)
    trainer.train()
    output = trainer.recorded[0]
    prompt = hermes.decode(output["prompt_ids"][0], skip_special_tokens=True)
    assert '"name": "python"' in prompt  # the schema went through the chat template
    responses = 0
    for ids, real, tool in zip(*(output[k].tolist() for k in ("completion_ids", "completion_mask", "tool_mask"))):
        env = [t for t, r, m in zip(ids, real, tool) if r and not m]
        if env:
            assert hermes.decode(env) == response("42")
            responses += 1
    assert responses > 0
    assert any("arpo/tool_calls_per_group" in entry for entry in trainer.state.log_history)


def test_an_unclosed_call_is_recorded_and_is_a_format_error(tokenizer, hermes):
    """A path that ends (EOS) inside a call the environment never saw: the format reports the call's tool, the sampler
    records it as not run, and the call-aware reward gives -1 as the reference's text check does (tags) — now in the
    chat-template format too."""
    from test_rollout import ScriptedEngine, _prompts

    tags = TagFormat([Tool("python", str), Tool("search", str)])
    assert tags.unclosed_call("<think>a</think><python>print(1)") == "python"
    assert tags.unclosed_call("<search>q</search> <result>\nx\n</result> <python>") == "python"
    assert tags.unclosed_call("<python>1</python> <result>\n1\n</result> done") is None
    chat = ChatTemplateFormat(hermes, [Tool("python", str)])
    assert chat.unclosed_call('<tool_call>{"name": "pyth') == ""
    assert chat.unclosed_call(PY_CALL + " done") is None
    answer = "<think>a</think><answer>\\boxed{2}</answer>"
    for tok, fmt, opening in ((tokenizer, tags, "<python>print(1)"), (hermes, chat, '<tool_call>{"name": "py')):
        engine = ScriptedEngine(tok, lambda text, rng, opening=opening: (answer + opening, 0.5, "eos"))
        sampler = BranchingSampler(engine, tok, [Tool("python", str)], num_generations=1, call_format=fmt, seed=0)
        (path,) = sampler.sample(_prompts(tok, 1), branch_policy="none").trajectories
        assert path.finish_reason == "eos" and path.tool_calls == 0 and len(path.calls) == 1
        assert not path.calls[0].ran and not path.calls[0].answered
        text = tok.decode(path.completion_ids, skip_special_tokens=True)
        calls = [[{"tool": c.tool, "result_start": c.result_start} for c in path.calls]]
        assert arpo_math_reward([text], ground_truth=["2"], arpo_calls=calls) == [-1.0]
        assert arpo_math_reward([answer], ground_truth=["2"], arpo_calls=[[]]) == [1.0]
