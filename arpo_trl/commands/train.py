"""`arpo-trl train --config recipe.yaml [--any_config_field value ...]`: ARPO on a dataset with tools.

A recipe is flat YAML over `ARPOScriptArguments` (dataset, rewards, tools), `ARPOConfig` and TRL's `ModelConfig`
(model and `--use_peft --lora_r ...`); every field is also a `--flag`. Works under `accelerate launch`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from arpo_trl.commands.builders import (
    build_tools,
    check_chat_template,
    check_quantization,
    check_tool_args,
    load_dataset,
    load_reward,
    model_init_kwargs,
    resolve_model,
)
from arpo_trl.commands.recipes import ARPOScriptArguments, fail, parse_recipe, train_recipe_parser
from arpo_trl.config import ARPOConfig
from arpo_trl.preflight import check_prompt_lengths, check_writable_dir


def make_parser():
    return train_recipe_parser("arpo-trl train")


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
    from transformers import AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from arpo_trl.trainer import ARPOTrainer

    # Cheap checks of what the user typed first; then the data; the model (maybe a download and conversion) last.
    rewards = [load_reward(name) for name in script_args.reward_funcs]
    check_tool_args(script_args)
    check_quantization(model_args, training_args)
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)  # every ModelConfig field
    dataset = load_dataset(script_args, script_args.dataset_train_split, "dataset_train_split", training_args.seed)
    model = resolve_model(model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model, revision=model_args.model_revision,
                                              trust_remote_code=training_args.trust_remote_code)
    check_chat_template(tokenizer, model, dataset)
    check_prompts_fit(model, tokenizer, dataset, training_args)
    tools = build_tools(script_args)
    return ARPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=dataset, tools=tools,
                       processing_class=tokenizer, peft_config=get_peft_config(model_args),
                       quantization_config=get_quantization_config(model_args))


def train(argv: Sequence[str]) -> None:
    """Parse, check and build everything (user mistakes: one line, exit 2), train, save, summarise the run."""
    try:
        script_args, training_args, model_args = parse_train_args(argv)
        check_writable_dir(training_args.output_dir)
        resume = resume_target(training_args.resume_from_checkpoint)
        trainer = build_trainer(script_args, training_args, model_args)
    except (ValueError, FileNotFoundError, ImportError) as error:  # ours and ARPOConfig's checks name the field
        fail(error)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if trainer.accelerator.is_main_process:
        from arpo_trl.training.tracking import run_summary

        print(run_summary(training_args.output_dir))
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()


def parse_train_args(argv: Sequence[str]):
    """`(script_args, ARPOConfig, ModelConfig)`; without a GPU, CPU and float32 unless the recipe says otherwise."""
    return parse_recipe(make_parser(), argv, "train")


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
