"""Work that only the main process does (talking to the vLLM server) while every rank waits for its outcome."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from accelerate.utils import broadcast_object_list

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
