"""Multi-step arithmetic: a task where every trajectory makes several tool calls.

    Start with 347. Multiply it by 28, then add 915. Compute each step with its own Python call.

A chain has 2-3 steps (multiply by 2-99, add or subtract 10-999); the cold start (`arpo-trl sft --task
arithmetic_chain`) teaches one Python call per step, each using the previous call's printed value, so the model
averages 2-3 calls per trajectory before RL, the regime of the paper's multi-call benchmarks (arXiv 2507.19849
§4), where a fork after a tool result shares the calls before it. The numbers are large enough that a 135M model
cannot do the steps in its head, and small enough that copying a result into the next call is learnable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OPERATIONS = {"*": "multiply it by {}", "+": "add {}", "-": "subtract {}"}
THOUGHT = "One Python call per step, each on the previous result."


@dataclass(frozen=True)
class Chain:
    start: int
    steps: tuple[tuple[str, int], ...]  # (operator, operand) in order

    def question(self) -> str:
        said = [OPERATIONS[op].format(operand) for op, operand in self.steps]
        then = ", then ".join(said)
        return (f"Start with {self.start}. {then[0].upper()}{then[1:]}. Compute each step with its own Python "
                f"call. What is the final number?")

    def expressions(self) -> list[str]:
        """Each step's Python expression, written on the previous step's value (what the cold start teaches)."""
        values = self.values()
        return [f"{previous}{op}{operand}" for previous, (op, operand) in zip([self.start, *values], self.steps)]

    def values(self) -> list[int]:
        value, values = self.start, []
        for op, operand in self.steps:
            value = value * operand if op == "*" else value + operand if op == "+" else value - operand
            values.append(value)
        return values

    @property
    def answer(self) -> str:
        return str(self.values()[-1])


def arithmetic_chains(size: int, seed: int = 0, min_steps: int = 2, max_steps: int = 3) -> list[Chain]:
    """`size` distinct chains, reproducible from `seed`."""
    if size < 1 or not 1 <= min_steps <= max_steps:
        raise ValueError(f"arithmetic chains: need size >= 1 and 1 <= min_steps <= max_steps, got size={size}, "
                         f"min_steps={min_steps}, max_steps={max_steps}.")
    rng, chains, seen = random.Random(seed), [], set()
    while len(chains) < size:
        steps = []
        for index in range(rng.randint(min_steps, max_steps)):
            op = "*" if index == 0 else rng.choice("*+-")  # a first multiplication: no step is trivial
            steps.append((op, rng.randint(2, 99) if op == "*" else rng.randint(10, 999)))
        chain = Chain(rng.randint(10, 999), tuple(steps))
        if chain not in seen:
            seen.add(chain)
            chains.append(chain)
    return chains

