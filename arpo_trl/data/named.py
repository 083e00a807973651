"""Datasets by the names recipes write (``dataset_name``: `named_dataset`), and how each is scored
(`dataset_metric`)."""

from __future__ import annotations

from datasets import Dataset

from arpo_trl.data.arithmetic import ArithmeticOptions, arithmetic_problems
from arpo_trl.data.arithmetic_chains import arithmetic_chains
from arpo_trl.data.corpora import PAPER_BENCHMARKS, benchmark
from arpo_trl.data.hub_sets import arpo_released, paper_benchmark
from arpo_trl.data.offline_sets import champ, gsm8k100, reasoning_gym_dataset, two_hop_qa
from arpo_trl.data.prompts import PYTHON_SYSTEM_PROMPT, prompt_row

NAMED_SPECS = ("arithmetic[:<size>]", "reasoning_gym:<task>[:<size>]", "gsm8k100", "champ[:<size>]",
               "two_hop_qa[:<size>]", "arithmetic_chain[:<size>]", "paper:<benchmark>", "arpo:<file.parquet>")


def _size(spec: str, text: str, expected: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"dataset_name: expected {expected!r} with a positive integer size, got {spec!r}.")
    return int(text)


def named_dataset(spec: str, seed: int = 0, task_config: dict | None = None) -> Dataset | None:
    """A dataset addressed by name in recipes (one of `NAMED_SPECS`); None for anything else (a local file or a Hub
    id)."""
    source, _, rest = spec.partition(":")
    if source == "arithmetic":
        problems = arithmetic_problems(_size(spec, rest, "arithmetic[:<size>]") or 512, seed,
                                       ArithmeticOptions.from_config(task_config))
        return Dataset.from_list([prompt_row(p.question, p.answer, source, f"{source}:{seed}", PYTHON_SYSTEM_PROMPT)
                                  for p in problems])
    if source == "reasoning_gym":
        task, _, size = rest.partition(":")
        if not task:
            raise ValueError(f"dataset_name: expected 'reasoning_gym:<task>[:<size>]', got {spec!r}.")
        return reasoning_gym_dataset(task, _size(spec, size, "reasoning_gym:<task>[:<size>]") or 256, seed,
                                     task_config=task_config)
    if source == "gsm8k100":
        if rest:
            raise ValueError(f"dataset_name: expected 'gsm8k100' (all 100 items, no size), got {spec!r}.")
        return gsm8k100()
    if source == "champ":
        return champ(_size(spec, rest, "champ[:<size>]"), seed)
    if source == "arithmetic_chain":
        return Dataset.from_list([prompt_row(c.question(), c.answer, source, f"{source}:{seed}", PYTHON_SYSTEM_PROMPT)
                                  for c in arithmetic_chains(_size(spec, rest, f"{source}[:<size>]") or 512, seed)])
    if source == "two_hop_qa":
        return two_hop_qa(_size(spec, rest, "two_hop_qa[:<size>]") or 256, seed)
    if source == "paper":
        try:
            benchmark(rest)
        except ValueError:
            raise ValueError(f"dataset_name: expected 'paper:<benchmark>' with a benchmark among "
                             f"{', '.join(PAPER_BENCHMARKS)}, got {spec!r}.") from None
        return paper_benchmark(rest)
    if source == "arpo":
        if not rest.endswith(".parquet"):
            raise ValueError(f"dataset_name: expected 'arpo:<file.parquet>' (one of ARPO's released parquet files), "
                             f"got {spec!r}.")
        return arpo_released(rest)
    return None


def dataset_metric(spec: str, default: str | None = None) -> str:
    """How to score answers to a named dataset: "math" (math-verify equivalence) or "f1" (token F1, the reference's
    reward, also for ARPO's released mixed data). Other specs get `default`, or a ValueError if it is None."""
    source, _, rest = spec.partition(":")
    if source in ("arithmetic", "reasoning_gym", "gsm8k100", "champ", "arithmetic_chain"):
        return "math"
    if source in ("two_hop_qa", "arpo"):
        return "f1"
    if source == "paper":
        return benchmark(rest).metric
    if default is None:
        raise ValueError(f"dataset_name: {spec!r} is not a named dataset ({', '.join(NAMED_SPECS)}); pass the metric "
                         "('math' or 'f1') explicitly.")
    return default
