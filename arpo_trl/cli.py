"""`arpo-trl`: the command line, in TRL's style (`trl grpo --config recipe.yaml`).

    arpo-trl quickstart [--any_train_field value ...]        # cold-start SFT, then ARPO: SmolLM2 on a CPU
    arpo-trl train --config recipes/quickstart.yaml [--any_config_field value ...]
    arpo-trl sft --config recipes/quickstart_sft.yaml        # cold start on tool transcripts (TRL's SFTTrainer)
    arpo-trl eval --config recipes/eval_quickstart.yaml [--any_eval_field value ...]  # pass@k
    arpo-trl view RUN/trees.jsonl [--step N] [--group G] [--html OUT]   # rollout trees in the terminal
    arpo-trl plot RUN/trees.jsonl --out DIR                  # tree pictures + entropy around tool results
    arpo-trl vllm-serve --config RECIPE                      # the vLLM server a training recipe needs
    arpo-trl vllm-serve --model PATH --lora-rank 16          # = python -m arpo_trl.server serve
    arpo-trl memory-plan --config RECIPE --gpu-gib 24        # will a colocated run fit the card? (an estimate)

Each command is a module of `arpo_trl.commands` (train, sft, evaluate, trees) built on `arpo_trl.commands.recipes`
and `.builders`; this module only dispatches, and runs the quickstart, which chains the commands.
User mistakes (unknown key, wrong type, unknown reward or tool, missing dataset column, a model without a chat
template) end with one `arpo-trl: error: ...` line and exit code 2.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"quickstart": quickstart, "train": _train, "sft": _sft, "eval": _eval, "view": _trees("view"),
                "plot": _trees("plot"), "vllm-serve": _vllm_serve, "memory-plan": _memory_plan}
    if not argv or argv[0] not in commands:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    from arpo_trl.commands import help_texts

    if (command := help_texts.help_command(argv)) is not None:
        text = help_texts.stored_help(command)  # TRL's parsers take seconds to import; their text does not
        if text is not None:
            print(text, end="")
            sys.exit(0)
    if not sys.stderr.isatty() and argv and argv[0] in ("quickstart", "train", "sft", "eval"):
        import datasets  # a log or a pipe gets our lines, not hundreds of Map-bar frames

        datasets.disable_progress_bars()
    commands[argv[0]](argv[1:])


# The commands are imported when run: `train` does not pay for `eval`'s imports, nor the other way round, and
# `arpo-trl --help` for none of them.
def _train(argv: Sequence[str]) -> None:
    from arpo_trl.commands.train import train

    train(argv)


def _sft(argv: Sequence[str]) -> None:
    from arpo_trl.commands.sft import sft

    sft(argv)


def _eval(argv: Sequence[str]) -> None:
    from arpo_trl.commands.evaluate import eval_command

    eval_command(argv)


def _trees(command: str) -> Callable[[Sequence[str]], None]:
    def run(argv: Sequence[str]) -> None:
        from arpo_trl.commands.trees import main as trees_main

        sys.exit(trees_main([command, *argv], prog=f"arpo-trl {command}"))

    return run


def _memory_plan(argv: Sequence[str]) -> None:
    from arpo_trl.commands.memory_plan import memory_plan

    memory_plan(argv)


def _vllm_serve(argv: Sequence[str]) -> None:
    from arpo_trl.server.serve_command import main as serve_main

    serve_main(["serve", *argv])


def quickstart(argv: Sequence[str]) -> None:
    """`recipes/quickstart_sft.yaml` (skipped when its model exists), then `recipes/quickstart.yaml`; extra flags
    go to the ARPO run. `--max_minutes` bounds the whole pipeline: the ARPO run gets what the model fetch and the
    cold start left. Prints each stage's time, then where the run folder, trees, pictures and reward curve are."""
    from arpo_trl.commands.builders import resolve_model
    from arpo_trl.commands.recipes import RECIPES_DIR, fail
    from arpo_trl.preflight import check_writable_dir

    sft_recipe, arpo_recipe = RECIPES_DIR / "quickstart_sft.yaml", RECIPES_DIR / "quickstart.yaml"
    if not arpo_recipe.is_file():
        fail(FileNotFoundError(f"quickstart: {arpo_recipe} not found; run it from a clone of the repository "
                                "(pip install -e .)."))
    import yaml

    from arpo_trl.commands.sft import quickstart_cold_start
    from arpo_trl.commands.train import parse_train_args

    try:  # the ARPO run's flags are checked before the minutes of SFT
        training_args = parse_train_args(["--config", str(arpo_recipe), *argv])[1]
        check_writable_dir(training_args.output_dir)
    except ValueError as error:
        fail(error)
    sft_args = yaml.safe_load(sft_recipe.read_text())
    stages = StageClock()
    with stages("model fetch + conversion"):
        resolve_model(sft_args["model_name_or_path"])
    with stages("cold-start SFT"):
        quickstart_cold_start(recipe=sft_recipe)
    if training_args.max_minutes is not None:
        # an exhausted budget still lets ARPO take its first step (that is how a step is measured), and no more
        left = max(training_args.max_minutes - stages.total() / 60, 1e-4)
        print(f"Quickstart: {stages.total() / 60:.1f} of max_minutes={training_args.max_minutes:g} used before "
              f"ARPO; the ARPO run gets {left:.1f} min.")
        argv = [*argv, "--max_minutes", f"{left:.4f}"]  # the last occurrence of a flag wins
    with stages("ARPO"):
        _train(["--config", str(arpo_recipe), *argv])
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


if __name__ == "__main__":
    main()
