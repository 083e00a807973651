"""`environment_factory` under `ARPOTrainer`: TRL's contract (one environment per rollout, `reset(**example)` starts
it and may return text appended to the prompt, its public methods are the tools, an optional `get_reward()` owns the
reward, a dict of factories picks one by each example's `environment` field), with branching (docs/environments.md).

ARPO runs the environments itself, so TRL's own environment machinery stays off: per prompt, one pooled instance is
reset with the example and every path of the prompt's tree starts from a copy of it; a branch starts from a copy of
its parent's environment at the fork (`arpo_trl.tools.environments.fork_environment`). The reward functions then
receive `environments=`, each completion's own path's environment, as under `GRPOTrainer`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from arpo_trl.tools.base import Tool
from arpo_trl.tools.environments import EnvironmentMethodTool, environment_methods

Factory = Callable[[], Any]


class Environments:
    """The factories, their tools (probed on one instance each, as TRL does) and the pool of reset instances."""

    def __init__(self, factory: Factory | Mapping[str, Factory], standalone_tools: Sequence[Tool]):
        self.multi = isinstance(factory, Mapping)
        self.factories: dict[str | None, Factory] = dict(factory) if self.multi else {None: factory}
        self.pool: dict[str | None, list] = {}
        self.tools: dict[str | None, list[Tool]] = {}
        self.methods: list[Callable] = []  # every environment's public methods, bound to its probe (TRL's `tools`)
        self.reward_funcs: list[Callable] = []
        for name, make in self.factories.items():
            instance = make()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"environment_factory: {type(instance).__name__} has no callable `reset`; each "
                                 "environment must define reset(**example) (returning None or text for the prompt).")
            self.pool[name] = [instance]
            bound = environment_methods(instance)
            self.methods += [method for method in bound if method not in self.methods]
            methods = [EnvironmentMethodTool(method) for method in bound]
            self.tools[name] = list(standalone_tools) + methods
            kind = type(instance)
            if callable(getattr(instance, "get_reward", None)) and all(f.environment_type is not kind
                                                                       for f in self.reward_funcs):
                self.reward_funcs.append(environment_reward(kind, instance.get_reward))

    def all_tools(self) -> list[Tool]:
        """Every environment's tools, once per name (the sampler recognises calls by name; each call then runs on its
        own path's environment)."""
        tools: dict[str, Tool] = {}
        for group in self.tools.values():
            for tool in group:
                tools.setdefault(tool.tag, tool)
        return list(tools.values())

    def start(self, examples: Sequence[dict], prompts: Sequence) -> tuple[list, list[list[dict]], list]:
        """Per prompt (with its example): the prompt with `reset`'s text appended, its environment's tool schemas, and
        the reset environment its tree starts from (pooled: constructed once, reset every batch)."""
        handed_out: dict[str | None, int] = {}
        out_prompts, schemas, starts = [], [], []
        for example, prompt in zip(examples, prompts, strict=True):
            name = example.get("environment") if self.multi else None
            if name not in self.factories:
                raise ValueError(f"Example has environment={name!r}, which is not among the environments passed to "
                                 f"environment_factory; expected one of {list(self.factories)}.")
            pool, index = self.pool[name], handed_out.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed_out[name] = index + 1
            environment = pool[index]
            kwargs = {k: v for k, v in example.items() if k != "environment"} if self.multi else dict(example)
            out_prompts.append(with_observation(prompt, environment.reset(**kwargs)))
            schemas.append([tool.schema() for tool in self.tools[name]])
            starts.append(environment)
        return out_prompts, schemas, starts


def with_observation(prompt, observation):
    """TRL's rule: text `reset` returns is appended to the last message (a new list; the example stays untouched)."""
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise TypeError(f"environment reset() must return None or a str, got {type(observation).__name__}.")
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def environment_reward(kind: type, get_reward: Callable) -> Callable:
    """A reward function scoring the completions whose environment is exactly `kind` by its `get_reward()` (None for
    the others), named after the class, as TRL adds it."""
    if inspect.iscoroutinefunction(get_reward):
        async def reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is kind else None for e in environments]
    else:
        def reward(environments, **kwargs):
            return [e.get_reward() if type(e) is kind else None for e in environments]
    reward.__name__ = reward.__qualname__ = kind.__name__
    reward.environment_type = kind
    return reward


def placeholder_dataset(factory, args):
    """TRL 1.16's `train_dataset=None` with an `environment_factory`: the environment owns the data and `reset()`
    returns the whole prompt; `max_steps` sets the length. As `GRPOTrainer.__init__` does (same checks, same messages),
    one generation round of empty user prompts, cycled across steps; here because ARPO keeps TRL's environment
    machinery off, so `GRPOTrainer` never sees the factory."""
    from datasets import Dataset

    if isinstance(factory, Mapping):
        raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                         "`environment` column to route each example to its environment. Provide a dataset, or pass a "
                         "single environment factory.")
    if args.max_steps <= 0:
        raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                         "prompt from `reset()`), `max_steps` must be set to a positive value to define the training "
                         "length. Set it via `ARPOConfig(max_steps=...)`.")
    rows = args.generation_batch_size // args.num_generations
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def setup_environments(factory, reward_funcs, tools: Sequence[Tool]):
    """`(reward_funcs, tools, environments)` for `ARPOTrainer(environment_factory=factory, …)`: the environments'
    `get_reward` added to the reward functions (which may then be omitted, as under TRL) and their tools to `tools`."""
    if factory is None:
        return reward_funcs, list(tools), None
    environments = Environments(factory, tools)
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
    return funcs + environments.reward_funcs, environments.all_tools(), environments


def reward_weights_with_environments(weights: Sequence[float] | None, user_funcs: int,
                                     environments: Environments | None) -> list[float] | None:
    """The weights TRL 1.16 gives the reward columns when environments own rewards: the user's (checked against the
    user's own reward functions, in TRL's words) and 1 for each environment's `get_reward` column after them
    (`GRPOTrainer.__init__`); None where TRL reads the user's weights unchanged."""
    if weights is None or environments is None or not environments.reward_funcs:
        return None
    if len(weights) != user_funcs:
        raise ValueError(f"Number of reward weights ({len(weights)}) must match number of reward functions "
                         f"({user_funcs})")
    return [*weights, *[1.0] * len(environments.reward_funcs)]


def trl_tool_list(tools: Sequence, environments: Environments | None) -> list:
    """What `GRPOTrainer.tools` lists: the tools as passed, then every environment's public methods (but `reset` and
    `get_reward`), bound to its probe instance, each once."""
    listed = list(tools)
    return listed + [method for method in (environments.methods if environments else []) if method not in listed]


class TRLToolList:
    """`trainer.tools` as `GRPOTrainer` lists them (`trl_tool_list`). ARPO runs the tools itself, so TRL's own code
    (its constructor, its tool loop in `_generate`, the tool schemas `_tokenize_prompts` renders) must see none: it
    gets the list TRL itself set while it runs (`_generate_and_score_completions`), the user the full one."""

    _listed_tools: list = []
    _trl_tools: list = []
    _tools_for_trl: bool = True  # during GRPOTrainer.__init__

    @property
    def tools(self) -> list:
        return self._trl_tools if self._tools_for_trl else self._listed_tools

    @tools.setter
    def tools(self, value: list) -> None:  # GRPOTrainer.__init__ sets it
        self._trl_tools = value

    def _generate_and_score_completions(self, inputs):  # TRL 1.16: (inputs) -> dict; reads self.tools inside
        self._tools_for_trl = True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._tools_for_trl = False


class EnvironmentRollouts:
    """Mixin placed before `GRPOTrainer` in `ARPOTrainer`'s bases: keeps the batch's examples for `reset`, and after a
    rollout sets `self.environments` (what TRL passes the reward functions) to each completion's own environment."""

    _environments: Environments | None = None
    _batch_examples: list[dict] | None = None

    def _generate_and_score_completions(self, inputs):  # TRL 1.16: (inputs) -> dict; `reset` needs the examples
        # TRL resets `self.environments` with the new batch's examples when it is set; ARPO resets its own
        self._batch_examples = inputs
        self.environments = None
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._batch_examples = None

    def _start_environments(self, prompts: list, m: int) -> tuple[list, list | None, list | None]:
        """`(prompts, schemas, starts)` for the distinct prompts of a batch (each M times in a row in the examples)."""
        if self._environments is None:
            return prompts, None, None
        if self.args.use_vllm and self.accelerator.num_processes > 1:  # the main process samples every rank's trees
            raise NotImplementedError("environment_factory with use_vllm=True runs on one process only (each "
                                      "process's environments live in its own memory); launch a single process.")
        return self._environments.start(self._batch_examples[::m], prompts)
