"""`arpo-trl memory-plan --config RECIPE --gpu-gib G [--any_recipe_field value ...]`: will a colocated run of this
recipe fit a card of G GiB? The estimate `ARPOTrainer` checks at startup on CUDA before vLLM or the model loads
(`arpo_trl.colocate.memory_plan`), printed as a table; exit 0 when it fits, 2 with one line naming the setting to
change when it does not. Reads the model's config.json (a local folder, the Hugging Face cache, or the Hub), or, for
the models the shipped recipes name, arpo-trl's copy of it; downloads no weights.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from arpo_trl.commands.builders import model_init_kwargs
from arpo_trl.commands.recipes import fail, renamed_recipe, train_recipe_parser
from arpo_trl.preflight import UserInputError


def architecture(name: str, revision: str | None, trust_remote_code: bool):
    """The model's `Architecture` and its config (None when read from `KNOWN_ARCHITECTURES`)."""
    from transformers import AutoConfig

    from arpo_trl.colocate.memory_plan import KNOWN_ARCHITECTURES, Architecture

    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if name in KNOWN_ARCHITECTURES:
            return KNOWN_ARCHITECTURES[name], None
        raise UserInputError(f"model_name_or_path: no config.json for {name!r} here ({str(error).splitlines()[0]}); "
                             f"give a local model folder, or one of {sorted(KNOWN_ARCHITECTURES)}.") from error
    return Architecture.from_config(config), config


def make_parser():
    """The training recipe's parser, and the card's memory."""
    parser = train_recipe_parser("arpo-trl memory-plan")
    parser.add_argument("--gpu-gib", type=float, required=True,
                        help="The card's memory in GiB, as its maker states it (e.g. 24).")
    return parser


def plan_recipe(argv: Sequence[str]):
    """(architecture, shape, plan, gpu GiB) of a recipe and its flags on a card of `--gpu-gib` GiB."""
    from peft import LoraConfig
    from transformers import TrainingArguments
    from trl import get_peft_config

    from arpo_trl.colocate.engine_args import batch_limits
    from arpo_trl.colocate.memory_plan import GIB, model_dtype, plan, run_shape

    fields = {f for f in TrainingArguments.__dataclass_fields__}
    with renamed_recipe([*argv, "--use_cpu", "true"], fields) as args:  # a GPU recipe, planned on any machine
        _, training_args, model_args, known = make_parser().parse_args_and_config(args)
    if known.gpu_gib <= 0:
        raise UserInputError(f"--gpu-gib: expected the card's memory in GiB (e.g. 24), got {known.gpu_gib}.")
    if not (training_args.use_vllm and training_args.vllm_mode == "colocate"):
        raise UserInputError("use_vllm / vllm_mode: the plan is for vLLM colocated in the trainer (use_vllm: true, "
                             "vllm_mode: colocate).")
    prompt = training_args.max_prompt_length or (
        training_args.vllm_max_model_length - training_args.max_completion_length
        if training_args.vllm_max_model_length else None)
    if not prompt or prompt < 1:
        raise UserInputError("max_prompt_length: set it (or vllm_max_model_length): the plan needs the prompt budget.")
    arch, config = architecture(model_args.model_name_or_path, model_args.model_revision,
                                training_args.trust_remote_code)
    dtype = model_dtype(model_init_kwargs(model_args, training_args)["dtype"], config)
    peft = get_peft_config(model_args)
    shape = run_shape(training_args, dtype, peft if isinstance(peft, LoraConfig) else None, prompt,
                      *batch_limits(training_args))
    total = int(known.gpu_gib * GIB)
    return arch, shape, plan(arch, shape, total), known.gpu_gib


def memory_plan(argv: Sequence[str]) -> None:
    from arpo_trl.colocate.memory_plan import table

    try:
        arch, shape, result, gib = plan_recipe(argv)
    except (ValueError, FileNotFoundError, ImportError) as error:
        fail(error)
    print(f"arpo-trl memory-plan: a {gib:g} GiB card\n\n{table(arch, shape, result)}")
    if not result.fits:
        print(f"arpo-trl memory-plan: error: {result.problems[0][1]}", file=sys.stderr)
        sys.exit(2)
