"""`arpo-trl vllm-serve --config RECIPE`: the vLLM server a training recipe needs, derived from the recipe as
`arpo-trl train` parses it (same parser, same dataset loading), so that no server flag is typed by hand.

    --model                   model_name_or_path
    --max-model-len           prompt budget + max_completion_length (tool results count in the completion). The
                              prompt budget is max_prompt_length when the recipe sets it, else the longest prompt of
                              the training data, chat template applied (as `arpo-trl train` measures prompts)
    --enable-lora --max-lora-rank   with use_peft and vllm_weight_sync 'lora'/'auto': the smallest rank vLLM accepts
                              that is >= lora_r
    --dtype                   bfloat16 with bf16, float16 with fp16, else the recipe's dtype (default float32)
    --gpu-memory-utilization  vllm_gpu_memory_utilization (GPU); on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB
    --host/--port             vllm_server_base_url (else vllm_server_host/vllm_server_port)

docs/server_mode.md#one-gpu-a-server-configured-from-the-recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from arpo_trl.preflight import UserInputError
from arpo_trl.server.server_check import RunNeeds

LORA_SYNC_MODES = ("lora", "auto")  # with a PEFT model, these load adapters into the server every step
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServePlan:
    """The server of one recipe: what it needs, and how it runs."""

    needs: RunNeeds
    dtype: str
    dtype_source: str
    gpu_memory_utilization: float
    host: str
    port: int

    def describe(self, recipe: str) -> str:
        """The derived flags and where each comes from, one per line."""
        needs = self.needs
        lines = [f"--model {needs.model}  (model_name_or_path)",
                 f"--max-model-len {needs.max_model_len}  ({needs.length_reason()})",
                 f"--dtype {self.dtype}  ({self.dtype_source})",
                 f"--host {self.host} --port {self.port}  (vllm_server_base_url / vllm_server_host, _port)"]
        if needs.lora_rank:
            lines.insert(2, f"--enable-lora --max-lora-rank {needs.max_lora_rank}  (lora_r {needs.lora_rank})")
        return f"arpo-trl vllm-serve: from {recipe}:\n  " + "\n  ".join(lines)


def plan_from_recipe(recipe: str) -> ServePlan:
    """Parse `recipe` with `arpo-trl train`'s parser and derive its server; `UserInputError` names the field."""
    script_args, args, model_args = _parse(recipe)
    from arpo_trl.commands.builders import resolve_model

    model = resolve_model(model_args.model_name_or_path)
    lora_rank = _lora_rank(args, model_args)
    if args.max_prompt_length is not None:
        prompt_tokens, source = args.max_prompt_length, "max_prompt_length"
    else:
        prompt_tokens, source = _longest_prompt(script_args, args, model)
    needs = RunNeeds(model, prompt_tokens, source, args.max_completion_length, lora_rank)
    _check_fits_model(model, needs)
    dtype, dtype_source = recipe_dtype(args, model_args)
    host, port = _address(args)
    return ServePlan(needs, dtype, dtype_source, _memory_share(args), host, port)


def _parse(recipe: str):
    """`arpo-trl train`'s parse. `use_cpu` is forced on: where the trainer runs does not change the server, and a
    bf16 recipe must parse on a machine without a GPU too (bf16 is refused there otherwise)."""
    from arpo_trl.commands.train import make_parser
    from arpo_trl.preflight import explain_precision_error

    try:
        return make_parser().parse_args_and_config(["--config", recipe, "--use_cpu", "true"])
    except ValueError as error:
        raise explain_precision_error(error) from error


def _lora_rank(args, model_args) -> int | None:
    if not model_args.use_peft or args.vllm_weight_sync not in LORA_SYNC_MODES:
        return None
    from arpo_trl.server.server_check import vllm_lora_rank

    try:
        vllm_lora_rank(model_args.lora_r)
    except ValueError as error:
        raise UserInputError(str(error)) from error
    return model_args.lora_r


def recipe_dtype(args, model_args) -> tuple[str, str]:
    """The server's dtype: the trainer's compute precision (bf16/fp16), else the weights' dtype, else float32."""
    if args.bf16:
        return "bfloat16", "bf16: true"
    if args.fp16:
        return "float16", "fp16: true"
    dtype = getattr(model_args, "dtype", None)
    if dtype in (None, "auto"):
        return "float32", "no bf16/fp16 in the recipe"
    if dtype not in DTYPES:
        raise UserInputError(f"dtype: {dtype!r} cannot be served; expected one of {list(DTYPES)} or 'auto'.")
    return dtype, f"dtype: {dtype}"


def _memory_share(args) -> float:
    share = args.vllm_gpu_memory_utilization
    if not isinstance(share, (int, float)) or not 0 < share < 1:
        raise UserInputError(f"vllm_gpu_memory_utilization: expected the server's share of the GPU's memory, between "
                             f"0 and 1 (the trainer needs the rest), got {share!r}.")
    return float(share)


def _address(args) -> tuple[str, int]:
    """Where the trainer will look for the server. A wildcard host (TRL's default 0.0.0.0) is served on 127.0.0.1:
    dev-mode endpoints (`/collective_rpc`) must not face the network unless `--host` says so."""
    if args.vllm_server_base_url:
        url = urlsplit(args.vllm_server_base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UserInputError(f"vllm_server_base_url: expected http://HOST:PORT, got "
                                 f"{args.vllm_server_base_url!r}.")
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    else:
        host, port = args.vllm_server_host, args.vllm_server_port
    return ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host), int(port)


def _longest_prompt(script_args, args, model: str) -> tuple[int, str]:
    """The longest prompt of the recipe's training data in tokens, measured as `arpo-trl train` measures them."""
    if args.tool_call_format == "chat_template":
        raise UserInputError("max_prompt_length: needed with tool_call_format='chat_template' (the tool schemas the "
                             "chat template adds to each prompt are not measured here); set it in the recipe.")
    from transformers import AutoTokenizer

    from arpo_trl.commands.builders import load_dataset
    from arpo_trl.preflight import prompt_token_lengths

    dataset = load_dataset(script_args, script_args.dataset_train_split, "dataset_train_split", args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = max(prompt_token_lengths(tokenizer, dataset["prompt"]))
    return longest, f"the longest prompt of {script_args.dataset_name} (set max_prompt_length to choose)"


def _check_fits_model(model: str, needs: RunNeeds) -> None:
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model).get_text_config(), "max_position_embeddings", None)
    if context and needs.max_model_len > context:
        raise UserInputError(f"max_completion_length: {needs.length_reason()} = {needs.max_model_len} tokens exceed "
                             f"the model's context ({context} tokens); lower max_completion_length or "
                             "max_prompt_length.")


def serve_flags(plan: ServePlan, gpu: bool) -> list[str]:
    """`vllm serve` arguments beyond `VLLMServer`'s own (model, length, dtype, LoRA): the memory share on a GPU."""
    return ["--gpu-memory-utilization", f"{plan.gpu_memory_utilization:g}"] if gpu else []

