"""What an evaluation (`arpo-trl eval`, `commands/evaluate.py`) is given and builds before it samples: its arguments
(`EvalArguments`, a recipe's fields), their checks, the dataset and the metric it is scored by, the tokenizer, and the
engine (transformers in process, or a running vLLM server), gathered in an `EvalSetup`; and the prompt's token ids."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arpo_trl.commands.builders import UserInputError, build_tools, check_chat_template, load_dataset, resolve_model
from arpo_trl.commands.recipes import DatasetArguments, ToolArguments, recipe_hint
from arpo_trl.generation.engine import SamplingSettings, eos_token_ids
from arpo_trl.preflight import check_writable_dir
from arpo_trl.rewards.eval_metrics import METRICS

BACKENDS = ("transformers", "vllm_server")


RESULTS_FILE = "eval_results.json"


@dataclass
class EvalArguments(ToolArguments, DatasetArguments):
    """Everything `arpo-trl eval` reads; a flat YAML recipe or `--flags`. Sampling defaults are the reference's
    evaluation settings (T=0.6, top_p 0.95, top_k 20, repetition penalty 1.1)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Model to evaluate: a local folder, a hub id, or 'smollm2' (SmolLM2-135M-Instruct, PyPI). "
                  "May be left out when `adapter` names its base model in adapter_config.json."},
    )
    adapter: str | None = field(
        default=None,
        metadata={"help": "Optional PEFT adapter folder (e.g. a LoRA training run's output_dir), applied to the model "
                  "(merged for the transformers backend, loaded as a LoRA module on the vLLM server)."},
    )
    dataset_split: str = field(default="test", metadata={"help": "Split to evaluate (hub datasets)."})
    dataset_seed: int = field(
        default=1234,
        metadata={"help": "Seed of generated datasets (reasoning_gym). Training generates with its `seed` (42 in the "
                  "quickstart), so a different value holds the questions out."},
    )
    num_samples: int | None = field(
        default=None, metadata={"help": "Evaluate only the first `num_samples` questions (all when unset)."}
    )
    n_samples: int = field(default=1, metadata={"help": "Trajectories sampled per question (n of pass@k; n >= k)."})
    k: list[int] = field(default_factory=lambda: [1], metadata={"help": "The k of pass@k to report (each <= n)."})
    seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={"help": "The whole evaluation is repeated once per seed; metrics are reported per seed and as "
                  "mean ± std. (A vLLM server receives no per-request seed: its runs are repeats.)"},
    )
    metric: str = field(
        default="auto",
        metadata={"help": f"Answer scoring, one of {list(METRICS)}: 'math' = math-verify equivalence, 'f1'/'em' = "
                  "SQuAD token F1 / exact match, 'choice' = the letter of a multiple-choice answer; any but 'auto' "
                  "scores every row so. 'auto' picks per row: the row's `metric` field, else 'choice' for a "
                  "one-letter ground truth, else by its `task` (math → 'math', qa → 'f1'), else the dataset's "
                  "(arpo_trl.data.named.dataset_metric), else 'math'."},
    )
    require_answer_tag: bool = field(
        default=True,
        metadata={"help": "Score the last \\boxed{} inside <answer>…</answer> (as the reward); false: the last "
                  "\\boxed{} anywhere in the completion."},
    )
    tool_call_format: str = field(
        default="tags",
        metadata={"help": "'tags' (<python>…</python>) or 'chat_template' (the tokenizer's own function calling; "
                  "see ARPOConfig.tool_call_format)."},
    )
    scoring_timeout: float = field(
        default=2.0,
        metadata={"help": "Seconds math-verify may spend on one answer (metric 'math'); past it the answer is "
                  "wrong. See docs/rewards.md."},
    )
    max_tool_calls: int = field(default=3, metadata={"help": "Tool calls per trajectory before it is ended."})
    tool_timeout: float = field(default=30.0, metadata={"help": "Seconds a round's concurrent tool calls may take."})
    max_completion_length: int = field(
        default=512, metadata={"help": "Token budget of a whole trajectory (model tokens plus tool results)."}
    )
    temperature: float = field(default=0.6, metadata={"help": "Sampling temperature (0 = greedy)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling."})
    top_k: int = field(default=20, metadata={"help": "Top-k sampling (0 = off)."})
    repetition_penalty: float = field(default=1.1, metadata={"help": "Repetition penalty (1.0 = off)."})
    batch_size: int = field(
        default=8, metadata={"help": "Questions per sampler call (each gives n_samples trajectories at once)."}
    )
    backend: str = field(
        default="transformers",
        metadata={"help": f"Generation backend, one of {list(BACKENDS)}. 'vllm_server' talks to a running server "
                  "(`arpo-trl vllm-serve`) at `vllm_server_base_url`."},
    )
    device: str = field(default="auto", metadata={"help": "transformers backend: 'auto', 'cpu', 'cuda', 'cuda:1'…"})
    dtype: str = field(default="auto", metadata={"help": "transformers backend: 'auto', 'float32', 'bfloat16'…"})
    vllm_server_base_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "Root URL of the vLLM server (without /v1)."}
    )
    vllm_model_name: str | None = field(
        default=None, metadata={"help": "Served model or LoRA name to sample from (default: the server's base model)."}
    )
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the vLLM server to answer /health."}
    )
    vllm_request_timeout: float = field(default=600.0, metadata={"help": "Seconds one completion request may take."})
    output_dir: str = field(default="runs/eval", metadata={"help": f"Folder for {RESULTS_FILE} and eval_results.md."})
    save_completions: bool = field(
        default=True, metadata={"help": "Store every completion's text in the per-question records."}
    )


@dataclass
class EvalSetup:
    """What a run needs, built (and checked) from `EvalArguments` by `prepare`."""

    engine: Any
    tokenizer: Any
    tools: list
    dataset: Any
    metric: str  # the dataset's metric: every row's when the arguments name one, else rows without their own
    model: str | None = None
    close: Callable[[], None] = lambda: None


def check_args(args: EvalArguments) -> None:
    """One-line `UserInputError`s naming the field, before anything is loaded."""
    if args.metric not in METRICS:
        raise UserInputError(f"metric: unknown metric {args.metric!r}; expected one of {list(METRICS)}.")
    if args.backend not in BACKENDS:
        raise UserInputError(f"backend: unknown backend {args.backend!r}; expected one of {list(BACKENDS)}.")
    if args.n_samples < 1:
        raise UserInputError(f"n_samples: must be >= 1, got {args.n_samples}.")
    if not args.k or any(k < 1 for k in args.k):
        raise UserInputError(f"k: every k of pass@k must be >= 1, got {args.k}.")
    if max(args.k) > args.n_samples:
        raise UserInputError(f"k: pass@{max(args.k)} needs n_samples >= {max(args.k)} trajectories per question "
                             f"(n_samples={args.n_samples}).")
    if not args.seeds:
        raise UserInputError("seeds: at least one seed is required.")
    for name in ("batch_size", "max_completion_length", "num_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserInputError(f"{name}: must be >= 1, got {value}.")
    if args.scoring_timeout <= 0:
        raise UserInputError(f"scoring_timeout: must be > 0 seconds, got {args.scoring_timeout}.")
    if args.max_tool_calls < 0:
        raise UserInputError(f"max_tool_calls: must be >= 0, got {args.max_tool_calls}.")
    if args.adapter and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise UserInputError(f"adapter: {args.adapter!r} is not a PEFT adapter folder (no adapter_config.json)"
                             f"{recipe_hint(args.adapter) or '.'}")


def load_eval_dataset(args: EvalArguments):
    """The dataset through the loader `arpo-trl train` uses (same formats and column checks), cut to `num_samples`."""
    data = load_dataset(args, args.dataset_split, "dataset_split", args.dataset_seed)
    if args.num_samples is not None:
        data = data.select(range(min(args.num_samples, len(data))))
    if len(data) == 0:
        raise UserInputError(f"dataset_name: {args.dataset_name!r} has no rows to evaluate.")
    return data


def resolve_metric(args: EvalArguments, dataset) -> str:
    """The dataset's metric: the one the arguments name, else (for 'auto') `arpo_trl.data.named.dataset_metric`, else
    'math'. Under 'auto', rows pick their own (`eval_metrics.row_metric`); a `metric` column is checked here."""
    if args.metric != "auto":
        return args.metric
    from arpo_trl.data.named import dataset_metric

    asked = set(dataset["metric"]) - {None, ""} if "metric" in dataset.column_names else set()
    if asked - set(METRICS[1:]):
        raise UserInputError(f"metric: the dataset's `metric` column asks for {sorted(asked - set(METRICS[1:]))}; "
                             f"expected values among {list(METRICS[1:])}.")
    return dataset_metric(args.dataset_name or "", default="math")


def base_model(args: EvalArguments) -> str:
    name = args.model_name_or_path
    if not name and args.adapter:
        name = json.loads((Path(args.adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return resolve_model(name)


def load_tokenizer(args: EvalArguments, model: str):
    from transformers import AutoTokenizer

    source = args.adapter if args.adapter and (Path(args.adapter) / "tokenizer_config.json").is_file() else model
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise UserInputError(f"model_name_or_path: cannot load a tokenizer from {source!r}: "
                             f"{str(error).splitlines()[0]}") from error


def transformers_engine(args: EvalArguments, model_path: str, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_trl.generation.transformers_engine import TransformersEngine

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=args.dtype)
    except OSError as error:
        raise UserInputError(f"model_name_or_path: cannot load {model_path!r}: {str(error).splitlines()[0]}") from error
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter).merge_and_unload()
    try:
        model.to(device).eval()
    except (RuntimeError, AssertionError) as error:  # 'cuda' without a GPU, a misspelt device
        raise UserInputError(f"device: cannot use {args.device!r}: {str(error).splitlines()[0]}") from error
    sampling = SamplingSettings.from_config(args, entropy_top_k=1,
                                            eos_token_ids=eos_token_ids(tokenizer, model.generation_config))
    return TransformersEngine(model, tokenizer, sampling=sampling)


def server_engine(args: EvalArguments, tokenizer):
    """A `VLLMServerEngine`; an adapter is loaded onto the server as a LoRA module and sampled from."""
    from arpo_trl.server.client import VLLMClient, check_server_tokenizer
    from arpo_trl.server.engine import VLLMServerEngine

    client = VLLMClient(args.vllm_server_base_url, args.vllm_request_timeout, args.vllm_server_timeout)
    client.wait_until_ready()
    model_name = args.vllm_model_name
    if args.adapter:
        model_name = model_name or f"eval-{Path(args.adapter).resolve().name}"
        client.load_lora_adapter(model_name, str(Path(args.adapter).resolve()))
    sampling = SamplingSettings.from_config(args, entropy_top_k=1, eos_token_ids=eos_token_ids(tokenizer))
    engine = VLLMServerEngine(client, tokenizer, model_name=model_name, sampling=sampling)
    check_server_tokenizer(client, tokenizer, engine.model_name)
    engine.check_server()
    return engine


def prepare(args: EvalArguments) -> EvalSetup:
    """Check the arguments, load the dataset, tools, tokenizer and engine; every user mistake is a UserInputError
    (or a ValueError/VLLMServerError naming the field or URL)."""
    check_args(args)
    check_writable_dir(args.output_dir)
    tools = build_tools(args)
    dataset = load_eval_dataset(args)
    metric = resolve_metric(args, dataset)
    model = base_model(args)
    tokenizer = load_tokenizer(args, model)
    check_chat_template(tokenizer, model, dataset)
    if args.backend == "vllm_server":
        engine = server_engine(args, tokenizer)
        return EvalSetup(engine, tokenizer, tools, dataset, metric, model, close=engine.close)
    return EvalSetup(transformers_engine(args, model, tokenizer), tokenizer, tools, dataset, metric, model)


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])
