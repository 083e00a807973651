"""Basic arithmetic: one integer expression a question, the quickstart's task.

    Calculate 347 - 28 * (5 + 61).

The cold start (`arpo-trl sft --task arithmetic`) teaches one Python call that prints the expression; ARPO then
trains on fresh questions of the same kind. It is generated here rather than taken from reasoning-gym's
`basic_arithmetic` because reasoning-gym pins pycosat, which PyPI ships only as source: the quickstart must
install without a C compiler. Operands of 1 to `max_digits` digits, `+ - *` only (every answer is an integer), and
an optional pair of parentheses; every expression is evaluated exactly in Python to give the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

QUESTION_FORMS = ("Calculate {}.", "What is {}?", "Compute {}.", "Evaluate {}.")
OPERATORS = "+-*"


@dataclass(frozen=True)
class ArithmeticOptions:
    """What a recipe's `task_config` may set for the `arithmetic` task."""

    min_terms: int = 2
    max_terms: int = 3
    max_digits: int = 3
    parentheses: bool = True

    def __post_init__(self) -> None:
        for name in ("min_terms", "max_terms", "max_digits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"task_config.{name}: expected a positive integer, got {value!r}.")
        if self.max_terms < max(self.min_terms, 2):
            raise ValueError(f"task_config.max_terms: expected >= min_terms and >= 2, got max_terms={self.max_terms},"
                             f" min_terms={self.min_terms}.")
        if self.max_digits > 6:
            raise ValueError(f"task_config.max_digits: expected at most 6, got {self.max_digits}.")
        if not isinstance(self.parentheses, bool):
            raise ValueError(f"task_config.parentheses: expected true or false, got {self.parentheses!r}.")

    @classmethod
    def from_config(cls, task_config: dict | None) -> ArithmeticOptions:
        """The options of a recipe's `task_config` mapping; an unknown key is an error that names the known ones."""
        config = dict(task_config or {})
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"task_config: the arithmetic task has no option {', '.join(map(repr, unknown))}; "
                             f"expected some of {sorted(known)}.")
        return cls(**config)


@dataclass(frozen=True)
class ArithmeticProblem:
    expression: str  # Python syntax, what the cold start's transcripts print
    question: str

    @property
    def answer(self) -> str:
        return str(eval(self.expression, {"__builtins__": {}}))  # digits, operators, parentheses: built here


def _expression(rng: random.Random, options: ArithmeticOptions) -> str:
    terms = rng.randint(max(options.min_terms, 2), options.max_terms)
    operands = [str(rng.randint(1, 10 ** rng.randint(1, options.max_digits) - 1)) for _ in range(terms)]
    operators = [rng.choice(OPERATORS) for _ in range(terms - 1)]
    if options.parentheses and terms > 2 and rng.random() < 0.5:
        first = rng.randrange(terms - 1)  # parenthesise operands first..first+1 (and the operator between)
        operands[first], operands[first + 1] = f"({operands[first]}", f"{operands[first + 1]})"
    text = operands[0]
    for operator, operand in zip(operators, operands[1:]):
        text += f" {operator} {operand}"
    return text


def arithmetic_problems(size: int, seed: int = 0, options: ArithmeticOptions | None = None) -> list[ArithmeticProblem]:
    """`size` distinct problems, reproducible from `seed`."""
    options = options or ArithmeticOptions()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"arithmetic: expected a positive integer size, got {size!r}.")
    rng, problems, seen = random.Random(seed), [], set()
    for _ in range(100 * size):
        if len(problems) == size:
            break
        expression = _expression(rng, options)
        if expression in seen:
            continue
        seen.add(expression)
        problems.append(ArithmeticProblem(expression, rng.choice(QUESTION_FORMS).format(expression)))
    if len(problems) < size:
        raise ValueError(f"arithmetic: found only {len(problems)} distinct problems of the {size} asked under "
                         f"{options}.")
    return problems
