"""Stateful environments as TRL's `environment_factory` defines them, made forkable for ARPO's branching
(docs/environments.md).

An environment's public methods are its tools (`reset` and `get_reward` are not, nor `fork` / `clone`, nor names
starting with `_`). Every path of a rollout tree owns an environment: a branch continues from a copy of its parent's
environment taken at the fork (right after the tool result it forks at), so its state is the parent's state there and
siblings share nothing afterwards. The copy (`fork_environment`) is the environment's own `fork()` (or `clone()`)
when it has one, else `copy.deepcopy`.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from arpo_trl.tools.functions import FunctionTool

NOT_TOOLS = ("reset", "get_reward", "fork", "clone")
FORK_METHODS = ("fork", "clone")


def fork_environment(environment: Any) -> Any:
    """An independent copy of `environment` in its current state: its `fork()` / `clone()`, else a deep copy. An
    environment that cannot be copied gets one line naming the method to add."""
    name = type(environment).__name__
    for method in FORK_METHODS:
        fork = getattr(environment, method, None)
        if callable(fork):
            copied = fork()
            if copied is environment:
                raise TypeError(f"{name}.{method}() returned the environment itself; ARPO's branches need an "
                                "independent copy in the same state.")
            return copied
    try:
        return copy.deepcopy(environment)
    except Exception as exc:  # whatever deepcopy meets (locks, sockets, processes): the user's fix is the same
        raise TypeError(f"ARPO cannot fork the {name} environment for a branch: copy.deepcopy failed "
                        f"({type(exc).__name__}: {exc}); give {name} a `fork(self)` method that returns an "
                        "independent copy in the same state.") from exc


def environment_methods(environment: Any) -> list:
    """The environment's tools as TRL finds them: public functions of its class, bound to `environment`."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


class EnvironmentMethodTool(FunctionTool):
    """A method of an environment class as a tool, its schema from a probe instance's method. The sampler binds each
    call to its path's own environment (`bind_call`, beside the call formats)."""

    def bound(self, environment: Any) -> FunctionTool:
        """A plain `FunctionTool` running this method of `environment`."""
        method = getattr(environment, self.tag, None)
        if not callable(method):
            raise ValueError(f"this rollout's environment ({type(environment).__name__}) has no tool {self.tag!r}.")
        tool = copy.copy(self)
        tool.__class__, tool.fn = FunctionTool, method  # same schema and signature checks, no re-parsing
        return tool

    def __call__(self, content: str) -> str:
        raise RuntimeError(f"The environment tool {self.tag!r} was called without its path's environment.")

