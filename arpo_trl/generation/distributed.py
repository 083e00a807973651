"""Multi-process rollouts: work that only the main process does (talking to the vLLM server) while every rank waits
for its outcome, and an in-process engine whose model calls every rank makes together (sharded parameters)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from accelerate.utils import broadcast_object_list

from arpo_trl.generation.engine import GenerationEngine

T = TypeVar("T")


class _MainProcessFailure:
    def __init__(self, message: str):
        self.message = message


def run_on_main_process(accelerator, fn: Callable[[], T], what: str) -> T | None:
    """Run `fn` on the main process and broadcast its result to every rank (None where `fn` returns nothing).

    If `fn` raises, the main process re-raises it and every other rank, waiting in the broadcast, raises
    `RuntimeError("<what> failed on the main process: ...")` instead of hanging in a later collective.
    """
    several = accelerator.num_processes > 1
    payload: list = [None]
    if accelerator.is_main_process:
        try:
            payload = [fn()]
        except Exception as error:
            if several:
                failure = _MainProcessFailure(f"{what} failed on the main process: {type(error).__name__}: {error}")
                broadcast_object_list([failure], from_process=0)
            raise
    if several:
        broadcast_object_list(payload, from_process=0)
    if isinstance(payload[0], _MainProcessFailure):
        raise RuntimeError(payload[0].message)
    return payload[0]


class LockstepEngine(GenerationEngine):
    """A batch engine (`TransformersEngine`) over parameters sharded across ranks (DeepSpeed ZeRO-3, FSDP): every
    forward pass is a collective, and so is each gather of the parameters for generation, so every rank must call
    the model as often as the others. Each rank's tree differs (its own prompts), hence its number of waves: before
    each `generate` the ranks say whether they still work, and a rank whose rollout is done keeps answering with a
    one-token call on `idle_prefix` (`finish_rollout`) until no rank works. Inside a call, `synced_gpus` (set on the
    engine) keeps the ranks' decoding steps equal, as in TRL's own generation."""

    def __init__(self, engine: GenerationEngine, accelerator, idle_prefix: Sequence[int]):
        if engine.traits.event_driven:
            raise ValueError(f"LockstepEngine steps a batch engine's model calls; {type(engine).__name__} is "
                             "event-driven.")
        self.engine = engine
        self.accelerator = accelerator
        self.idle_prefix = list(idle_prefix)
        self.idle_calls = 0  # calls made only to keep step with the other ranks
        self.vocab_size, self.eos_token_ids, self.counters = engine.vocab_size, engine.eos_token_ids, engine.counters

    def rollout_scope(self):
        return self.engine.rollout_scope()

    def generate(self, prefixes, max_new_tokens, stop):
        self._anyone_working(True)
        return self.engine.generate(prefixes, max_new_tokens, stop)

    def finish_rollout(self) -> None:
        """After this rank's rollout: take part in the other ranks' model calls until every rank is done."""
        while self._anyone_working(False):
            self.engine.generate([self.idle_prefix], [1], [])
            self.idle_calls += 1

    def _anyone_working(self, working: bool) -> bool:
        flag = torch.tensor([int(working)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item())
