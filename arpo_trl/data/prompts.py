"""ARPO's prompt format: a conversational `prompt` (a system message that shows the tool tags, then the question),
the system prompts by name, and the row every dataset builder writes (`prompt`, `ground_truth`, `task`, `source`)."""

from __future__ import annotations

from datasets import Dataset

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


def prompt_row(question: str, ground_truth: str, task: str, source: str, system_prompt: str) -> dict:
    return {"prompt": arpo_prompt(question, system_prompt), "ground_truth": ground_truth, "task": task,
            "source": source}
