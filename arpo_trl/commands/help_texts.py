"""The `--help` of the commands whose parsers are built from TRL's configs (`train` and `quickstart`, `sft`, `eval`,
`memory-plan`), kept as text files beside this module so that printing them imports neither torch nor TRL (a tenth
of a second instead of several). Each file names the transformers and TRL it was written with; under other
versions (whose configs may have other fields) the command builds its parser and prints the live help instead.
`tests/test_cli.py` checks each file against the live parser; after changing a config field, write them again:

    python -m arpo_trl.commands.help_texts
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import version
from pathlib import Path

FOLDER = Path(__file__).parent / "help"
WIDTH = 120  # the columns the texts are wrapped to (argparse reads COLUMNS)
# command -> "module:function" that builds its parser
PARSERS = {
    "train": "arpo_trl.commands.train:make_parser",
    "sft": "arpo_trl.commands.sft:make_parser",
    "eval": "arpo_trl.commands.evaluate:make_eval_parser",
    "memory-plan": "arpo_trl.commands.memory_plan:make_parser",
}
SAME_HELP = {"quickstart": "train"}  # quickstart parses its ARPO run's flags with train's parser


def help_command(argv: list[str]) -> str | None:
    """The command whose stored help `argv` (the command line after `arpo-trl`) asks for, if any."""
    command = SAME_HELP.get(argv[0], argv[0]) if argv else None
    return command if command in PARSERS and any(arg in ("-h", "--help") for arg in argv[1:]) else None


def written_with() -> str:
    """The first line of each file: the versions whose configs the help lists."""
    return f"written with transformers=={version('transformers')} trl=={version('trl')}\n"


def stored_help(command: str) -> str | None:
    """The stored help, or None when it was written with other versions than those installed (or is missing)."""
    path = FOLDER / f"{command}.txt"
    if not path.is_file():
        return None
    first, _, text = path.read_text(encoding="utf-8").partition("\n")
    return text if f"{first}\n" == written_with() else None


def live_help(command: str) -> str:
    """What the command's parser prints for `--help`, wrapped at `WIDTH` columns."""
    module, _, function = PARSERS[command].partition(":")
    parser = getattr(importlib.import_module(module), function)()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return parser.format_help()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def write_all() -> None:
    FOLDER.mkdir(exist_ok=True)
    for command in PARSERS:
        (FOLDER / f"{command}.txt").write_text(written_with() + live_help(command), encoding="utf-8")
        print(f"wrote {FOLDER / command}.txt")


if __name__ == "__main__":
    write_all()
