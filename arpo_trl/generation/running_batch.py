"""The cached engine's running batch: the requests decoding now and, row for row, their state.

`CachedTransformersEngine.running` owns it and hands it to the parts that read or change it: admission adds rows,
the KV accounting weighs them (as vLLM's `KVCacheManager` hands its block pool to what
allocates from it). Every per-row tensor follows the order of `requests`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from arpo_trl.generation.kv_batch import KVBatch
from arpo_trl.generation.prefix_cache import KV, kv_length


@dataclass
class Request:
    """One segment asked of the engine, from its arrival to its answer (`ids`: the tokens generated so far)."""

    prefix: list[int]
    budget: int
    stop: list[str]
    future: asyncio.Future
    stop_window: int = 0  # tokens of decoded tail that can hold a stop string
    ids: list[int] = field(default_factory=list)
    text: list[int] = field(default_factory=list)  # prefix + ids: a token's position keys its draw
    cached: int = 0  # leading prefix tokens the prefix cache held at admission
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    held: bool = False  # answered at its budget alone; its row waits one step for the continuation (`Admission.adopt`)
    seed: int = 0  # its path's: with a token's position, it keys the token's draw (`sampling.keyed_uniforms`)

    @property
    def span(self) -> int:
        """The positions its row holds at most: its prefix and max_new_tokens."""
        return len(self.prefix) + self.budget


class RunningBatch:
    """The running rows: `requests`, their keys and values (`kv`), and per row its next position (`positions`), its
    next-token logits (`logits`) and the token it just sampled, fed by the next decode (`tokens`)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """No rows (the buffers go)."""
        self.requests: list[Request] = []
        self.kv: KVBatch | None = None
        self.positions: torch.Tensor | None = None  # [rows]
        self.logits: torch.Tensor | None = None  # [rows, vocab]
        self.tokens: torch.Tensor | None = None  # [rows]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def bytes(self) -> int:
        return self.kv.bytes if self.kv is not None else 0

    def all_held(self, but: frozenset[int] = frozenset()) -> bool:
        """Whether every row (but those in `but`) is held: answered, waiting for its continuation."""
        return all(request.held for row, request in enumerate(self.requests) if row not in but)

    def join(self, rows: list[tuple[Request, KV, torch.Tensor]], new_kv: Callable[[], KVBatch]) -> None:
        """Append admitted rows (each its request, prefilled KV and next-token logits); `new_kv` makes the buffers."""
        if self.kv is None:
            self.kv = new_kv()
        self.kv.add([kv for _, kv, _ in rows])
        positions = torch.tensor([kv_length(kv) for _, kv, _ in rows], device=rows[0][2].device)
        self.positions = _appended(self.positions, positions)
        self.logits = _appended(self.logits, torch.cat([logits for _, _, logits in rows]))
        self.requests += [request for request, _, _ in rows]

    def remove(self, rows: list[int]) -> None:
        """Take `rows` out; the others keep their order, an empty batch frees its buffers."""
        order = self.kv.remove(rows)
        if not order:
            self.clear()
            return
        index = torch.tensor(order, device=self.positions.device)
        self.requests = [self.requests[row] for row in order]
        self.positions = self.positions[index]
        self.logits = self.logits[index]
        self.tokens = None if self.tokens is None else self.tokens[index]


def _appended(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    return rows if tensor is None else torch.cat([tensor, rows])
