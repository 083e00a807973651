"""The in-process engines' KV budget: a request waits for room instead of running the device out of memory.

A KV position costs `2 × layers × kv_heads × head_dim × dtype bytes` (`kv_bytes_per_token`). The budget comes from TRL's
`transformers_continuous_batching_config`, with transformers' meanings (`KVBudgetSetting.from_config`): `num_blocks` ×
`page_size` positions, else `max_memory_percent` (default `DEFAULT_MEMORY_FRACTION`) of the memory free when a rollout
starts; `max_requests_per_batch` bounds the running rows. A running row cannot be preempted cheaply, so the cached
engine reserves each row's worst case (prefix + max_new_tokens) up front (`KVBudget.fits`) and requests that do not fit
wait, first come first served; the waves engine splits a wave into sub-batches that fit (`wave_batches`). What is
counted and what is not: docs/in_process_engine.md#the-kv-budget-requests-wait-the-device-does-not-run-out.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("arpo_trl.trainer")

SETTING = "transformers_continuous_batching_config"
DEFAULT_MEMORY_FRACTION = 0.8  # transformers' default where logits are processed: room for activations and logits


def kv_bytes_per_token(model) -> int:
    """Bytes of one position's keys and values over all layers, from the model's config and dtype."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes the KV may take on `device` now, and where the number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + unused, f"free memory on {device} ({_gib(free)} free + {_gib(unused)} held unused by torch)"
    try:
        with open("/proc/meminfo") as meminfo:
            available = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")),
                             None)
    except OSError:
        available = None
    if available is not None:
        return available, "available RAM (MemAvailable)"
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available RAM (free pages)"


def _gib(count: int) -> str:
    return f"{count / 2 ** 30:.2f} GiB"


@dataclass(frozen=True)
class KVBudget:
    """A resolved budget: `bytes` of KV, `bytes_per_token`, at most `max_rows` running rows (None: any),
    `overhead_columns` per row beyond its longest span (the engine's layout: padding room, a step's new column), and the
    `batch_share` of the bytes one batch may take (the cached engine's half: its old buffer and the new one are both
    held while it regrows)."""

    bytes: float  # math.inf: unbounded
    bytes_per_token: int
    source: str
    max_rows: int | None = None
    overhead_columns: int = 0
    batch_share: float = 1.0

    def batch_bytes(self, spans: Sequence[int]) -> int:
        """The most a batch of rows that grow to `spans` positions may allocate, padded to the longest."""
        return len(spans) * (max(spans) + self.overhead_columns) * self.bytes_per_token if spans else 0

    def fits(self, spans: Sequence[int]) -> bool:
        return (self.max_rows is None or len(spans) <= self.max_rows) and \
            self.batch_bytes(spans) <= self.bytes * self.batch_share

    def too_large(self, span: int, what: str) -> ValueError:
        return ValueError(
            f"{what}: a request of {span} positions (prefix + max_new_tokens) needs "
            f"{_gib(self.batch_bytes([span]))} of KV alone, over the {self.batch_share:g} of the KV budget a batch may "
            f"take (budget: {self.describe()}). Raise the budget "
            f"({SETTING}: num_blocks × page_size, or max_memory_percent of free memory), or lower "
            f"max_completion_length / the prompt length.")

    def describe(self) -> str:
        if math.isinf(self.bytes):
            return "unbounded"
        rows = f", at most {self.max_rows} rows" if self.max_rows else ""
        return (f"{_gib(self.bytes)} ({int(self.bytes // self.bytes_per_token)} positions of "
                f"{self.bytes_per_token} bytes{rows}; {self.source})")


@dataclass(frozen=True)
class KVBudgetSetting:
    """Where an engine's budget comes from (module docstring): `tokens` positions, else `memory_fraction` of the
    memory free at a rollout's start; `max_rows` running rows at most; `unbounded`: no budget at all (ranks in
    lockstep must split their waves alike)."""

    tokens: int | None = None
    memory_fraction: float | None = None
    max_rows: int | None = None
    unbounded: bool = False

    def __post_init__(self):
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"{SETTING}: num_blocks × page_size must be >= 1, got {self.tokens}.")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"{SETTING}: max_memory_percent must be in (0, 1], got {self.memory_fraction}.")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"{SETTING}: max_requests_per_batch must be >= 1, got {self.max_rows}.")

    @classmethod
    def from_config(cls, config: dict | str | None) -> KVBudgetSetting:
        """From TRL's `transformers_continuous_batching_config` (validated as transformers does)."""
        from transformers.generation import ContinuousBatchingConfig

        kwargs = json.loads(config) if isinstance(config, str) else dict(config or {})
        defaults = ContinuousBatchingConfig(**kwargs)
        blocks = kwargs.get("num_blocks")
        size = kwargs.get("page_size", kwargs.get("block_size")) or defaults.page_size
        return cls(tokens=blocks * size if blocks else None, memory_fraction=kwargs.get("max_memory_percent"),
                   max_rows=kwargs.get("max_requests_per_batch"))

    def resolve(self, model, overhead_columns: int = 0, batch_share: float = 1.0) -> KVBudget:
        """The budget for a rollout starting now (the free memory measured now, where it comes from that)."""
        per_token, layout = kv_bytes_per_token(model), (self.max_rows, overhead_columns, batch_share)
        if self.unbounded:
            return KVBudget(math.inf, per_token, "unbounded", *layout)
        if self.tokens is not None:
            return KVBudget(self.tokens * per_token, per_token, f"{SETTING} num_blocks × page_size", *layout)
        device = next(model.parameters()).device
        free, source = free_memory(device)
        fraction = self.memory_fraction or DEFAULT_MEMORY_FRACTION
        source = f"{fraction:g} of the {source}" + ("" if self.memory_fraction else
                                                    f"; {SETTING} max_memory_percent sets the share")
        return KVBudget(int(free * fraction), per_token, source, *layout)


def log_budget(engine, budget: KVBudget) -> KVBudget:
    """One log line per engine, at its first rollout: the budget and where it came from."""
    if not engine.budget_logged:
        logger.info("ARPO: %s's KV budget: %s.", type(engine).__name__, budget.describe())
        engine.budget_logged = True
    return budget


def wave_batches(budget: KVBudget, prefix_lengths: Sequence[int], max_new_tokens: Sequence[int],
                 max_rows: int | None = None) -> list[slice]:
    """A wave's requests in consecutive sub-batches whose KV fits (`model.generate` left-pads a batch to its longest
    prefix and runs it to its largest budget); `max_rows` rows at most. A request too large alone raises."""
    rows_limit = min(filter(None, (max_rows, budget.max_rows)), default=None)
    batches, start, spans = [], 0, []
    longest_prefix = longest_budget = 0
    for index, (length, new) in enumerate(zip(prefix_lengths, max_new_tokens)):
        if not budget.fits([length + new]):
            raise budget.too_large(length + new, "TransformersEngine")
        grown = max(longest_prefix, length) + max(longest_budget, new)
        if spans and (not budget.fits([grown] * (len(spans) + 1)) or (rows_limit and len(spans) >= rows_limit)):
            batches.append(slice(start, index))
            start, spans, longest_prefix, longest_budget = index, [], 0, 0
            grown = length + new
        spans.append(grown)
        longest_prefix, longest_budget = max(longest_prefix, length), max(longest_budget, new)
    if spans:
        batches.append(slice(start, len(prefix_lengths)))
    return batches


class KVAccounting:
    """The cached engine's side of the budget, over the running batch and the prefix cache it is handed: the rollout's
    budget (`budget`, resolved at its first step), who joins, the prefix cache kept within what the running rows leave,
    and the peak held (`counters.kv_peak_bytes`; with a regrowing batch's old buffer, `kv_peak_copy_bytes`)."""

    def __init__(self, running, prefix_cache, counters):
        self.running = running
        self.prefix_cache = prefix_cache
        self.counters = counters
        self.budget: KVBudget | None = None

    def gate(self, joining: list) -> tuple[list, list]:
        """The requests that join now, and those that wait: in arrival order, while the budget holds the running rows
        and them at their worst case (a request waits behind an earlier one that waits). One that alone exceeds the
        budget fails."""
        spans = [request.span for request in self.running.requests]
        admitted, waiting = [], []
        for request in joining:
            span = request.span
            if not self.budget.fits([span]):
                request.future.set_exception(self.budget.too_large(span, "CachedTransformersEngine"))
            elif waiting or not self.budget.fits(spans + [span]):
                waiting.append(request)
            else:
                spans.append(span)
                admitted.append(request)
        self.counters.kv_waits += len(waiting)
        return admitted, waiting

    def keep(self, entry) -> None:
        """Store a prefix-cache entry, within what the running rows leave of the budget (older entries go)."""
        self.prefix_cache.store(entry)
        self._fit_cache(self.running.bytes)
        self._note_kv()

    def _fit_cache(self, other: float) -> None:
        if self.budget is not None and not math.isinf(self.budget.bytes):
            self.prefix_cache.shrink(max(0, int(self.budget.bytes - other)))

    def room(self, needed: int) -> float:
        """Before the batch allocates `needed` bytes at least, while it holds its old buffer: the prefix cache gives
        way to both; returns the bytes the new buffer may take (its spare room fits in what is left, and in the
        batch's share of the budget, so that the next regrowth's old and new buffers fit together too)."""
        if self.budget is None:
            return math.inf
        old = self.running.bytes
        self._fit_cache(needed + old)
        return min(self.budget.bytes * self.budget.batch_share, self.budget.bytes - self.prefix_cache.bytes - old)

    def allocated(self, old_bytes: int) -> None:
        """After the batch allocated its buffer (while the old one, `old_bytes`, was still held for the copy)."""
        cache, new = self.prefix_cache.bytes, self.running.bytes
        self.counters.kv_peak_copy_bytes = max(self.counters.kv_peak_copy_bytes, cache + new + old_bytes)
        self._note_kv()

    def _note_kv(self) -> None:
        held = self.running.bytes + self.prefix_cache.bytes
        self.counters.kv_peak_bytes = max(self.counters.kv_peak_bytes, held)
        self.counters.kv_peak_copy_bytes = max(self.counters.kv_peak_copy_bytes, held)
