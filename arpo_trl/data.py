"""Dataset builders into ARPO's prompt format: a conversational `prompt` (system message with the tool tags, then
the question) and a `ground_truth` column that the rewards read.

Offline sources ship inside PyPI packages (``offline_assets.md``); for now `reasoning-gym`'s procedural tasks
(`pip install reasoning-gym==0.1.25`), seeded and unlimited.
"""

from __future__ import annotations

from datasets import Dataset

PYTHON_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the question step by step with the help of a Python interpreter. "
    "Think inside <think></think>. To run code, write it inside <python></python>; what it prints comes back "
    "inside <result></result>. Give the final answer inside <answer></answer>, as \\boxed{answer}. Example: "
    "<think>I need 17*23.</think><python>print(17*23)</python> <result>\n391\n</result>"
    "<answer>\\boxed{391}</answer>"
)


def arpo_prompt(question: str, system_prompt: str = PYTHON_SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def reasoning_gym_dataset(
    task: str = "basic_arithmetic", size: int = 256, seed: int = 0, system_prompt: str = PYTHON_SYSTEM_PROMPT
) -> Dataset:
    """`size` seeded questions of a reasoning-gym task (e.g. 'basic_arithmetic', 'chain_sum', 'gsm_symbolic')."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("reasoning-gym datasets need `pip install reasoning-gym==0.1.25`.") from error
    try:
        source = reasoning_gym.create_dataset(task, size=size, seed=seed)
    except Exception as error:  # reasoning-gym raises its own errors for unknown names
        raise ValueError(f"reasoning-gym has no task {task!r}: {error}") from error
    rows = [{"prompt": arpo_prompt(entry["question"], system_prompt), "ground_truth": str(entry["answer"]),
             "task": task} for entry in source]
    return Dataset.from_list(rows)


def named_dataset(spec: str, seed: int = 0) -> Dataset | None:
    """Datasets addressed by name in recipes: ``reasoning_gym:<task>[:<size>]``; None for anything else."""
    source, _, rest = spec.partition(":")
    if source != "reasoning_gym":
        return None
    task, _, size = rest.partition(":")
    if not task or (size and not size.isdigit()):
        raise ValueError(f"dataset_name: expected 'reasoning_gym:<task>[:<size>]', got {spec!r}.")
    return reasoning_gym_dataset(task, int(size) if size else 256, seed)
