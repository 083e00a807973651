"""Which weights the cached engine's KV and logits were computed with, and whether they changed since: checked when
requests join, so that a caller of the async API who updates the model between two requests samples the new policy.

Three signals, each cheap (some 20 microseconds per hundred parameters on a CPU): an update in place bumps a
parameter's version counter (`add_`, `copy_`, a foreach optimizer step); new storage (`param.data = ...`) changes its
data pointer; and a fused optimizer step (torch's `fused=True`, the `adamw_torch_fused` default of transformers'
Trainer), which writes in place without bumping the counters, is noted on the parameters it updated by a process-wide
post-step hook on `torch.optim.Optimizer` (an attribute holding the step's number; the optimizer itself may be gone by
the next look).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_STEP = "_arpo_optimizer_step"  # on a parameter: the number of the last optimizer step that updated it
_steps = 0  # optimizer steps taken in this process since the hook was registered
_hook: object | None = None


def _note_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1
    for group in optimizer.param_groups:
        for param in group["params"]:
            setattr(param, _STEP, _steps)


def _watch_optimizers() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_note_step)


def _has_storage(param: torch.Tensor) -> bool:
    try:
        param.data_ptr()
    except RuntimeError:
        return False
    return True


class WeightsVersion:
    """The state of a model's parameters when taken; `changed()` tells whether any was updated since."""

    def __init__(self, model: torch.nn.Module):
        _watch_optimizers()
        self.params = list(model.parameters())
        self.ids = [id(param) for param in self.params]
        self._counted = [param for param in self.params if not param.is_inference()]  # the others have no counter
        self._stored = [param for param in self.params if _has_storage(param)]  # not a wrapper such as a DTensor
        self.stamp = self._stamp()
        self.steps = _steps

    def _stamp(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(param.data_ptr() for param in self._stored), tuple(param._version for param in self._counted)

    def same_parameters(self, model: torch.nn.Module) -> bool:
        """Whether `model` has the parameters this version was taken of (a model context may yield another model)."""
        return [id(param) for param in model.parameters()] == self.ids

    def changed(self) -> bool:
        return self._stamp() != self.stamp or self._stepped()

    def _stepped(self) -> bool:
        """Whether an optimizer step updated one of these parameters since the last look."""
        if self.steps == _steps:
            return False
        since, self.steps = self.steps, _steps
        return any(getattr(param, _STEP, 0) > since for param in self.params)
