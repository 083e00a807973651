"""Execute notebooks/quickstart.ipynb top to bottom in a Jupyter kernel and save its outputs in the notebook, so that
a reader on GitHub sees the run's table, the reward curve and a rollout tree:

    pip install -e ".[dev]"            # nbconvert + ipykernel
    HF_HUB_OFFLINE=1 python notebooks/execute.py

By default it is the run the notebook is for: SmolLM2-135M-Instruct after its cold start (`runs/quickstart-sft`;
when that folder is missing the script first runs `arpo-trl sft --config recipes/quickstart_sft.yaml`, about 3 minutes
on 2 cores), then the notebook's ARPO run, `--steps` steps (the notebook's own default, 10), in a fresh
`runs/notebook-executed` (the trainer appends to an existing run's metrics.jsonl). `--model DIR` runs another model
(e.g. the test suite's tiny one) and `--out FILE` writes the executed copy elsewhere instead of in place.

Saved outputs are cleaned: stderr streams (progress bars, library warnings), timestamped log lines and transformers'
live progress display are dropped, the repository's and the home directory's absolute paths are written relative,
and the script refuses to save a notebook that still holds an absolute path, an ANSI escape or the value of a
token-like environment variable.
The first markdown cell gets a line saying which settings and how long produced the outputs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
COLD_START = ROOT / "runs" / "quickstart-sft"
OUTPUT = "runs/notebook-executed"  # relative to ROOT, the kernel's working directory
SAVED_LINE = "**Saved outputs**"  # the first markdown cell's line that this script writes
ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/(?:home|root|tmp|work|Users|var|private|mnt|opt|srv)/")
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[[A-Z]+\] .*\n?", re.MULTILINE)  # deepspeed's logger
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY", re.IGNORECASE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="ARPO steps (ARPO_NOTEBOOK_STEPS; default 10)")
    parser.add_argument("--model", help="model directory (ARPO_NOTEBOOK_MODEL); default: the cold start")
    parser.add_argument("--out", type=Path, default=NOTEBOOK, help="where to save the executed notebook")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds a cell may run (default 3600)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    if args.model is None:  # the SFT of recipes/quickstart_sft.yaml when the folder holds no model yet
        from arpo_trl.commands.sft import quickstart_cold_start

        quickstart_cold_start(COLD_START, ROOT / "recipes" / "quickstart_sft.yaml")
    sft_seconds = time.monotonic() - started

    shutil.rmtree(ROOT / OUTPUT, ignore_errors=True)
    os.environ.update(ARPO_NOTEBOOK_STEPS=str(args.steps), ARPO_NOTEBOOK_OUTPUT=OUTPUT, TQDM_DISABLE="1")
    if args.model:
        os.environ["ARPO_NOTEBOOK_MODEL"] = str(Path(args.model).resolve())
    else:
        os.environ.pop("ARPO_NOTEBOOK_MODEL", None)

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    print(f"Executing {NOTEBOOK.relative_to(ROOT)} ({args.steps} steps) ...", flush=True)
    executing = time.monotonic()
    ExecutePreprocessor(timeout=args.timeout, kernel_name="python3", record_timing=False).preprocess(
        notebook, {"metadata": {"path": str(ROOT)}})
    seconds = time.monotonic() - executing

    clean(notebook)
    model = "SmolLM2-135M-Instruct after its cold start" if args.model is None else f"`{Path(args.model).name}`"
    note_settings(notebook, f"{SAVED_LINE}: `python notebooks/execute.py --steps {args.steps}` ({model}, "
                            f"{args.steps} ARPO steps, {os.cpu_count()} CPU cores, {seconds / 60:.1f} min).")
    check(notebook)
    nbformat.validate(notebook)
    nbformat.write(notebook, args.out)
    size = args.out.stat().st_size
    print(f"Saved {args.out}: {size / 1024:.0f} KiB; notebook {seconds:.0f} s"
          + (f", cold start {sft_seconds:.0f} s" if sft_seconds > 1 else "") + ".")
    return 0


def clean(notebook) -> None:
    """Drop stderr, timestamped log lines and transformers' live progress display; absolute paths of this machine
    become relative."""
    replacements = [(str(ROOT) + os.sep, ""), (str(ROOT), "."), (str(Path.home()), "~")]
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stderr":
                continue
            if output.output_type == "stream":
                output.text = LOG_LINE.sub("", output.text)
                if not output.text.strip():
                    continue
            if "<progress" in str(output.get("data", {}).get("text/html", "")):  # NotebookProgressCallback
                continue
            kept.append(replace_text(output, replacements))
        cell.outputs = kept


def replace_text(node, replacements):
    """`node` (an output, nested) with every replacement made in its strings (image data holds no paths)."""
    if isinstance(node, str):
        for old, new in replacements:
            node = node.replace(old, new)
        return node
    if isinstance(node, list):
        return [replace_text(item, replacements) for item in node]
    if isinstance(node, dict):
        return type(node)({k: v if k.startswith("image/") else replace_text(v, replacements) for k, v in node.items()})
    return node


def note_settings(notebook, line: str) -> None:
    """Write `line` into the first markdown cell, in place of an earlier one."""
    cell = next(c for c in notebook.cells if c.cell_type == "markdown")
    kept = [text for text in cell.source.split("\n\n") if not text.startswith(SAVED_LINE)]
    cell.source = "\n\n".join([*kept, line])


def check(notebook) -> None:
    """Refuse to save outputs with an absolute path, ANSI escapes, a carriage return or a token's value."""
    secrets = [value for name, value in os.environ.items() if SECRET_NAME.search(name) and len(value) >= 8]
    problems = []
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            text = "\n".join(str(v) for k, v in output.get("data", {}).items() if not k.startswith("image/"))
            text += str(output.get("text", "")) + "\n".join(output.get("traceback", []))
            if output.output_type == "error":
                problems.append(f"cell {index}: {output.ename}: {output.evalue}")
            if match := ABSOLUTE_PATH.search(text):
                problems.append(f"cell {index}: absolute path {text[match.start():match.start() + 60]!r}")
            if "\x1b[" in text or "\r" in text:
                problems.append(f"cell {index}: ANSI escape or carriage return")
            if any(secret in text for secret in secrets):
                problems.append(f"cell {index}: the value of a token-like environment variable")
    if problems:
        raise SystemExit("Not saved:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    sys.exit(main())
