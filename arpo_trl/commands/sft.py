"""Cold-start SFT before ARPO: teach a small model the tool format so that RL has something to reinforce.

A 135M instruct model never writes `<python>` on its own, so every ARPO trajectory gets the same -1 and there is
no advantage to learn from. As the paper's follow-ups (and Tool-Star) do, a short supervised pass on tool-use
transcripts comes first:

    <think>…</think>
    <python>print(<expression>)</python> <result>
    <what the real Python tool printed>
    </result>
    <answer>\\boxed{<ground truth>}</answer>

The transcripts are built from reasoning-gym arithmetic tasks (their metadata carries the expression) and the result
text is produced by running our real `PythonTool`. The result block is part of the supervised completion here (TRL's
SFT masks the prompt, not spans inside the completion); ARPO itself never trains on result tokens.

    arpo-trl sft --config recipes/quickstart_sft.yaml     # TRL's SFTTrainer; LoRA is merged into the saved model

From Python, `quickstart_cold_start()` returns that model's folder, running the same SFT first when it is missing.
"""

from __future__ import annotations

import ast
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset

from arpo_trl.commands.builders import model_init_kwargs, resolve_model
from arpo_trl.commands.recipes import RECIPES_DIR, fail, one_line_parser, parse_recipe
from arpo_trl.data.arithmetic import ArithmeticOptions, arithmetic_problems
from arpo_trl.data.arithmetic_chains import THOUGHT, arithmetic_chains
from arpo_trl.data.offline_sets import create_reasoning_gym_task
from arpo_trl.data.prompts import PYTHON_SYSTEM_PROMPT, arpo_prompt, resolve_system_prompt
from arpo_trl.preflight import adopt_checkpointing_default, check_writable_dir
from arpo_trl.tools.base import format_result
from arpo_trl.tools.python import PythonTool

ARITHMETIC_TASK = "arithmetic"  # one Python call per question (arpo_trl.data.arithmetic)
ARITHMETIC_TASKS = ("basic_arithmetic", "chain_sum", "products")  # reasoning-gym's, with an `expression`
CHAIN_TASK = "arithmetic_chain"  # multi-call transcripts: one Python call per step (arpo_trl.data.arithmetic_chains)
_THOUGHTS = (
    "I will compute this with Python.",
    "Let me evaluate the expression in Python.",
    "Python can do this arithmetic exactly.",
    "I should run the calculation in Python to avoid mistakes.",
)


@dataclass
class ColdStartArguments:
    """What `arpo-trl sft` needs beyond TRL's SFTConfig and ModelConfig."""

    task: str = field(
        default=ARITHMETIC_TASK,
        metadata={"help": f"{ARITHMETIC_TASK!r} (one Python call per question), {CHAIN_TASK!r} (multi-step "
                  f"arithmetic, one Python call per step), or a reasoning-gym task whose metadata holds an "
                  f"`expression` to compute: {ARITHMETIC_TASKS} (needs `pip install arpo-trl[reasoning-gym]`)."},
    )
    tool_call_format: str = field(
        default="tags",
        metadata={"help": "How the transcripts write calls: 'tags' (<python>…</python> <result>…</result>) or "
                  "'chat_template' (the template's tool calls and tool messages; arithmetic_chain only)."},
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "Replace the model's chat template by one TRL ships (e.g. 'qwen2_5', whose tool calling "
                  "TRL's GRPOTrainer(tools=…) understands); the saved model keeps it."},
    )
    task_config: dict | None = field(
        default=None,
        metadata={"help": "Options of the arithmetic or reasoning-gym task (e.g. {max_terms: 3}); use the RL recipe's "
                  "task_config."},
    )
    num_examples: int = field(default=256, metadata={"help": "Number of transcripts to build."})
    transcript_seed: int = field(
        default=1, metadata={"help": "Seed of the transcript questions (use a different one than the RL data's)."},
    )
    system_prompt: str = field(
        default="python",
        metadata={"help": "System message: 'python', 'python_short' or the text itself (train with the same one)."},
    )
    merge_lora: bool = field(
        default=True,
        metadata={"help": "With --use_peft, merge the adapter into the base weights and save a full model that "
                  "`arpo-trl train` can load (and attach a fresh adapter to)."},
    )


def _questions(task: str, size: int, seed: int, task_config: dict | None) -> list[dict]:
    """Each question with its answer and the Python expression that computes it."""
    if task == ARITHMETIC_TASK:
        return [{"question": problem.question, "answer": problem.answer, "expression": problem.expression}
                for problem in arithmetic_problems(size, seed, ArithmeticOptions.from_config(task_config))]
    rows = []
    for entry in create_reasoning_gym_task(task, size, seed, task_config):
        expression = entry.get("metadata", {}).get("expression")
        if not expression:
            raise ValueError(f"task: reasoning-gym task {task!r} has no `expression` in its metadata; "
                             f"use {ARITHMETIC_TASK!r} or one of {ARITHMETIC_TASKS}.")
        rows.append({"question": entry["question"], "answer": entry["answer"], "expression": expression})
    return rows


def tool_transcripts(task: str = ARITHMETIC_TASK, size: int = 256, seed: int = 1,
                     system_prompt: str = PYTHON_SYSTEM_PROMPT, task_config: dict | None = None) -> Dataset:
    """Prompt-completion conversations in ARPO's format, with results printed by the real Python tool."""
    rows = _questions(task, size, seed, task_config)
    rng, tool = random.Random(seed), PythonTool(timeout=10)
    codes = [f"print({entry['expression']})" for entry in rows]
    outputs = _run_prints(tool, [entry["expression"] for entry in rows])
    examples = []
    for entry, code, output in zip(rows, codes, outputs):
        transcript = (f"<think>{rng.choice(_THOUGHTS)}</think>\n<python>{code}</python>{format_result(output.strip())}"
                      f"\n<answer>\\boxed{{{entry['answer']}}}</answer>")
        examples.append({"prompt": arpo_prompt(entry["question"], system_prompt),
                         "completion": [{"role": "assistant", "content": transcript}],
                         "ground_truth": str(entry["answer"])})
    return Dataset.from_list(examples)


def chain_transcripts(size: int = 256, seed: int = 1, system_prompt: str = PYTHON_SYSTEM_PROMPT,
                      tool_call_format: str = "tags") -> Dataset:
    """Multi-call transcripts of `arithmetic_chains`: one Python call per step on the previous printed value, in
    the tag format or as chat messages (assistant `tool_calls`, `tool` results) with the tool schema in `tools`."""
    if tool_call_format not in ("tags", "chat_template"):
        raise ValueError(f"tool_call_format: expected 'tags' or 'chat_template', got {tool_call_format!r}.")
    chains, tool = arithmetic_chains(size, seed), PythonTool(timeout=10)
    printed = iter(_run_prints(tool, [expression for chain in chains for expression in chain.expressions()]))
    tool.close()
    examples, answer = [], "<answer>\\boxed{{{}}}</answer>"
    for chain in chains:
        steps = [(f"print({expression})", next(printed).strip()) for expression in chain.expressions()]
        row = {"prompt": arpo_prompt(chain.question(), system_prompt), "ground_truth": chain.answer}
        if tool_call_format == "tags":
            text = "".join(f"<python>{code}</python>{format_result(out)}\n" for code, out in steps)
            row["completion"] = [{"role": "assistant",
                                  "content": f"<think>{THOUGHT}</think>\n{text}{answer.format(chain.answer)}"}]
        else:
            row["completion"] = [message for index, (code, out) in enumerate(steps) for message in (
                {"role": "assistant", "content": f"<think>{THOUGHT}</think>" if index == 0 else "",
                 "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
                {"role": "tool", "content": out})] + [{"role": "assistant", "content": answer.format(chain.answer)}]
            row["tools"] = json.dumps([tool.schema()])
        examples.append(row)
    return Dataset.from_list(examples)


def _run_prints(tool: PythonTool, expressions: list[str]) -> list[str]:
    """What `print(expression)` shows for each expression, from one sandboxed run per 200 (not one each: the tool
    caps its output)."""
    if len(expressions) > 200:
        return _run_prints(tool, expressions[:200]) + _run_prints(tool, expressions[200:])
    script = (f"for source in {expressions!r}:\n"
              "    try:\n        print(repr(str(eval(source))))\n"
              "    except Exception as error:\n        print(repr(f'{type(error).__name__}: {error}'))")
    lines = tool(script).strip().splitlines()
    if len(lines) != len(expressions):
        raise RuntimeError(f"cold start: the Python tool printed {len(lines)} lines for {len(expressions)} "
                           f"expressions: {lines[-3:]}")
    return [ast.literal_eval(line) for line in lines]


def make_parser():
    from trl import ModelConfig, SFTConfig

    @dataclass
    class ColdStartSFTConfig(SFTConfig):
        """TRL's SFTConfig without the deprecation warning its own default causes (`adopt_checkpointing_default`)."""

        def __post_init__(self):
            adopt_checkpointing_default(self)
            super().__post_init__()

    return one_line_parser((ColdStartArguments, ColdStartSFTConfig, ModelConfig), "arpo-trl sft")


def sft(argv: Sequence[str]) -> None:
    """`arpo-trl sft --config recipe.yaml`: TRL's SFTTrainer on tool transcripts; saves a full model."""
    from trl import SFTTrainer, get_peft_config, get_quantization_config

    try:
        script_args, training_args, model_args = parse_recipe(make_parser(), argv, "sft")
        check_writable_dir(training_args.output_dir)
        training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)  # every ModelConfig field
        bundled_chat_template(script_args.chat_template)  # a wrong name or task costs a second, not a conversion
        dataset = transcripts(script_args)
        model = resolve_model(model_args.model_name_or_path, model_args.model_revision,
                              training_args.trust_remote_code)
        tokenizer = load_tokenizer(model, script_args.chat_template, model_args.model_revision,
                                   training_args.trust_remote_code)
    except (ValueError, FileNotFoundError, ImportError) as error:
        fail(error)
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=get_peft_config(model_args),
                         quantization_config=get_quantization_config(model_args))
    trainer.train()
    save_full_model(trainer, training_args.output_dir, merge=script_args.merge_lora)
    trainer.accelerator.print(f"Cold-start model saved to {training_args.output_dir}.")


def quickstart_cold_start(output_dir: str | os.PathLike | None = None,
                          recipe: str | os.PathLike | None = None) -> Path:
    """The quickstart's cold-start model, for ARPO from Python: SmolLM2-135M-Instruct after the SFT of
    `recipes/quickstart_sft.yaml` (about a minute on 2 CPU cores), which writes `<think>`, `<python>` calls and
    `<answer>\\boxed{…}</answer>` in the recipe's `python_short` prompt format.

    `output_dir` defaults to the recipe's (`runs/quickstart-sft`, relative to the working folder), which is where
    `arpo-trl quickstart` keeps it too. A folder that already holds a model is returned as it is (delete it to redo
    the SFT); otherwise `arpo-trl sft --config recipes/quickstart_sft.yaml --output_dir <output_dir>` runs in this
    process first. Needs a clone of the repository (`pip install -e .`), which has the recipe; `recipe` names another
    cold-start recipe (`arpo-trl quickstart` passes its own)."""
    import yaml

    recipe = Path(recipe or RECIPES_DIR / "quickstart_sft.yaml")
    if not recipe.is_file():
        raise FileNotFoundError(f"quickstart_cold_start: {recipe} not found; use a clone of the repository "
                                "(pip install -e .).")
    folder = Path(output_dir or yaml.safe_load(recipe.read_text(encoding="utf-8"))["output_dir"])
    if (folder / "config.json").is_file():
        print(f"Cold start: using {folder} (delete it to redo the SFT).")
    else:
        sft(["--config", str(recipe), "--output_dir", str(folder)])
    return folder


def transcripts(args: ColdStartArguments) -> Dataset:
    system_prompt = resolve_system_prompt(args.system_prompt)
    if args.task == CHAIN_TASK:
        return chain_transcripts(args.num_examples, args.transcript_seed, system_prompt, args.tool_call_format)
    if args.tool_call_format != "tags":
        raise ValueError(f"tool_call_format: {args.tool_call_format!r} transcripts exist for task {CHAIN_TASK!r} "
                         f"only; task {args.task!r} has 'tags' transcripts.")
    return tool_transcripts(args.task, args.num_examples, args.transcript_seed, system_prompt, args.task_config)


def bundled_chat_template(name: str | None) -> str | None:
    """The text of one of TRL's bundled chat templates (`trl/chat_templates/<name>.jinja`), None for none."""
    from importlib.resources import files

    if not name:
        return None
    template = files("trl").joinpath(f"chat_templates/{name}.jinja")
    if not template.is_file():
        names = sorted(p.name[:-6] for p in files("trl").joinpath("chat_templates").iterdir()
                       if p.name.endswith(".jinja"))
        raise ValueError(f"chat_template: TRL ships no template {name!r}; expected one of {names}.")
    return template.read_text()


def load_tokenizer(model: str, chat_template: str | None, revision: str | None = None,
                   trust_remote_code: bool = False):
    """The model's tokenizer, with one of TRL's bundled chat templates if named."""
    from transformers import AutoTokenizer

    template = bundled_chat_template(chat_template)
    tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    if template:
        tokenizer.chat_template = template
    return tokenizer


def save_full_model(trainer, output_dir: str, merge: bool = True) -> None:
    """Save weights `from_pretrained` can load directly: a PEFT adapter is merged first (unless merge=False)."""
    from peft import PeftModel

    model = trainer.accelerator.unwrap_model(trainer.model)
    if merge and isinstance(model, PeftModel):
        model = model.merge_and_unload()
    if trainer.accelerator.is_main_process:
        model.save_pretrained(output_dir)
        trainer.processing_class.save_pretrained(output_dir)
