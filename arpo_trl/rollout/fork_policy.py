"""A fork policy of your own: `branch_policy` takes, besides the built-in names, any callable that maps what a path
shows at a tool result (`ForkPoint`) to its fork probability, or the import path of one ("package.module:function",
for a YAML recipe). The rule then draws the fork exactly as for its own policies (the keyed draw u < P, the line's
share of the budget, exactly M per prompt); only P is yours. docs/fork_policies.md has an example."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from arpo_trl.rollout.paths import Trajectory


@dataclass(frozen=True)
class ForkPoint:
    """What a fork policy sees of a path at one of its tool results, once the k tokens after the result are read
    (paper §3.1 steps 2-3). Entropies are per segment, normalised by ln|V| as ΔH is."""

    delta_entropy: float  # ΔH = H_t − H_initial
    initial_entropy: float  # H_initial: the path's first segment (inherited by a branch)
    tool: str  # the tag of the tool whose result this is ("" for a call that names no tool we have)
    tool_calls: int  # calls on the path so far, this one and inherited ones included
    fork_decisions: int  # fork decisions settled on the path before this one (inherited ones included)
    consecutive_forks: int  # the latest decisions on the path's line that forked, in a row (AEPO's l)
    completion_tokens: int  # the path's completion so far, the tool result included
    kind: str  # "global" or "branch" (a fill-up never forks)

    @classmethod
    def of(cls, path: Trajectory, delta: float) -> ForkPoint:
        return cls(delta, path.initial_entropy or 0.0, path.calls[-1].tool if path.calls else "", path.tool_calls,
                   path.growth.fork_decisions, path.growth.consecutive_forks, len(path.completion_ids), path.kind)


ForkPolicy = Callable[[ForkPoint], float]


def resolve_branch_policy(value, names: tuple[str, ...]) -> str | ForkPolicy:
    """One of the built-in `names`, a callable, or "module:attribute" imported to a callable; anything else is a
    ValueError naming the field."""
    if callable(value) or value in names:
        return value
    if isinstance(value, str) and ":" in value:
        module, _, attribute = value.partition(":")
        try:
            policy = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"branch_policy={value!r}: cannot import {attribute!r} from {module!r} ({error}).") \
                from error
        if not callable(policy):
            raise ValueError(f"branch_policy={value!r} is a {type(policy).__name__}, not a callable fork policy.")
        return policy
    raise ValueError(f"branch_policy must be one of {names}, a callable (ForkPoint) -> probability, or "
                     f"'module:function' naming one; got {value!r}.")


def policy_probability(policy: ForkPolicy, point: ForkPoint) -> float:
    """`policy(point)`, checked: a real number in [0, 1] (a policy is the user's code, and a NaN would never fork
    without a word)."""
    value = policy(point)
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"branch_policy {_name(policy)} returned {value!r} at {point}; a fork policy returns a "
                         "probability in [0, 1].")
    probability = float(value)
    if not (math.isfinite(probability) and 0.0 <= probability <= 1.0):
        raise ValueError(f"branch_policy {_name(policy)} returned {probability!r} at {point}; a fork policy returns "
                         "a probability in [0, 1].")
    return probability


def _name(policy: ForkPolicy) -> str:
    return getattr(policy, "__qualname__", None) or type(policy).__name__
