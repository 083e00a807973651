"""KV states keyed by the token prefix they cover, so that a continuation or a fork starts from its parent's
computed context instead of recomputing it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KV = torch.Tensor
"""One row's keys and values over all layers, [2 (keys, values), layers, 1, heads, tokens, head_dim]: copying a row
(into the running batch, out of it, out of a prefill) is one tensor operation, not two per layer."""


def kv_length(kv: KV) -> int:
    return kv.shape[-2]


def layer_pairs(kv: KV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, views of its keys and values ([rows, heads, tokens, head_dim]), as transformers' caches take them."""
    return [(kv[0, layer], kv[1, layer]) for layer in range(kv.shape[1])]


def stack_layers(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> KV:
    """Per-layer keys and values ([rows, heads, tokens, head_dim] each) copied into one `KV`."""
    shapes = {tuple(tensor.shape) for pair in pairs for tensor in pair}
    if len(shapes) != 1:
        raise ValueError(f"CachedTransformersEngine keeps all layers' keys and values in one tensor, but this model's "
                         f"layers differ in shape ({sorted(shapes)}): use the waves engine "
                         f"(in_process_engine='waves').")
    return torch.stack([tensor for pair in zip(*pairs) for tensor in pair]).unflatten(0, (2, len(pairs)))


@dataclass
class CachedPrefix:
    """The KV of `tokens` (one row); `logits`: the next-token logits after them, when known (a prefill's);
    `inner_logits`: those after its first n tokens, by n, kept from the shorter entries it superseded (a fork that
    starts once its parent went on finds its tool result's logits here, so nothing is prefilled for it)."""

    tokens: tuple[int, ...]
    kv: KV
    logits: torch.Tensor | None = None
    inner_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    def logits_after(self, length: int) -> torch.Tensor | None:
        """The next-token logits after the first `length` tokens, when known."""
        return self.logits if length == len(self.tokens) else self.inner_logits.get(length)

    def absorb(self, shorter: CachedPrefix) -> None:
        """Keep the logits of an entry whose tokens begin this one's."""
        self.inner_logits.update(shorter.inner_logits)
        if shorter.logits is None:
            return
        if len(shorter.tokens) < len(self.tokens):
            self.inner_logits[len(shorter.tokens)] = shorter.logits
        elif self.logits is None:  # the same tokens stored again, without logits (a request that wrote one token)
            self.logits = shorter.logits


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search over slice comparisons (done in C)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # invariant: a[:low] == b[:low], a[:high+1] != b[:high+1]
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def crop(kv: KV, length: int) -> KV:
    """The first `length` positions (a view: the stored entry is never written to; the model's cache update
    concatenates into new tensors)."""
    return kv[..., :length, :]


class PrefixCache:
    """Entries evicted least-recently-used once they hold more than `max_tokens` positions (None: unbounded; the
    engine clears the cache after every rollout anyway). An entry whose tokens begin a newer entry's is dropped: the
    newer one serves it, with its logits if it had any (`CachedPrefix.inner_logits`)."""

    def __init__(self, max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"PrefixCache: max_tokens must be >= 1 or None, got {max_tokens}.")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self._tokens = self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def bytes(self) -> int:
        """The entries' KV bytes (each entry's own tensor; their logits are not counted)."""
        return self._bytes

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = self._bytes = 0

    def shrink(self, max_bytes: int) -> None:
        """Drop the least recently used entries until the rest hold at most `max_bytes` of KV (the KV budget)."""
        while self._bytes > max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def lookup(self, prefix: Sequence[int]) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with `prefix`, and that length (0 and None if none); of entries that
        share as much, one that holds the next-token logits there (siblings that went on from one tool result each
        hold its tokens, but only the first to go on kept its logits)."""
        prefix = tuple(prefix)
        best, best_length = None, 0
        for entry in self._entries.values():
            length = common_prefix_length(entry.tokens, prefix)
            if length > best_length or (length == best_length and length and best.logits_after(length) is None
                                        and entry.logits_after(length) is not None):
                best, best_length = entry, length
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best, best_length

    def store(self, entry: CachedPrefix) -> None:
        for tokens in [t for t in self._entries if len(t) <= len(entry.tokens) and entry.tokens[: len(t)] == t]:
            entry.absorb(self._entries[tokens])
            self._drop(tokens)
        if longer := next((t for t in self._entries if len(t) > len(entry.tokens) and
                           t[: len(entry.tokens)] == entry.tokens), None):
            self._entries[longer].absorb(entry)  # a longer entry already covers it
            return
        self._entries[entry.tokens] = entry
        self._tokens += len(entry.tokens)
        self._bytes += entry.kv.numel() * entry.kv.element_size()
        while self.max_tokens is not None and self._tokens > self.max_tokens and self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, tokens: tuple[int, ...]) -> None:
        entry = self._entries.pop(tokens)
        self._tokens -= len(tokens)
        self._bytes -= entry.kv.numel() * entry.kv.element_size()
