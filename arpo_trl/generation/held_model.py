"""The model an in-process engine holds while its requests run (`cached_engine.py`): taken once through
`model_for_generation` (the trainer's model context, SDPA decoding, the packed head) and kept until the engine lets it
go, in eval mode only while requests run, so that the callers' code between steps sees the model in its own mode."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from arpo_trl.generation.model_context import eval_mode, model_for_generation


class HeldModel:
    """Holds a model (through its context where given) from `take` to `release`."""

    def __init__(self):
        self._stack: contextlib.ExitStack | None = None
        self._held = None
        self._mode: contextlib.ExitStack | None = None  # the held model in eval mode, while requests run

    def take(self, model, model_context: Callable[[], AbstractContextManager] | None) -> tuple[object, bool]:
        """The held model (`model` through `model_context`, once), and whether it was taken just now: the context may
        have gathered other weights."""
        if self._held is not None:
            return self._held, False
        self._stack = contextlib.ExitStack()
        self._held = self._stack.enter_context(model_for_generation(model, model_context))
        return self._held, True

    def in_eval_mode(self, model) -> None:
        """`model` (the held one) in eval mode until `restore_mode`."""
        if self._mode is None:
            self._mode = contextlib.ExitStack()
            self._mode.enter_context(eval_mode(model))

    def restore_mode(self) -> None:
        if self._mode is not None:
            self._mode.close()
        self._mode = None

    def release(self) -> None:
        """Give the model back (its context exits: merged or gathered weights go, the head is unpacked)."""
        self.restore_mode()
        if self._stack is not None:
            self._stack.close()
        self._stack = self._held = None
