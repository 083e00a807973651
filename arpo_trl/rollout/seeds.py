"""The rule's seeds: every random draw of a rollout (a path's seed, its fork draws, a line's share of the odd branch
slots) derives from the rollout's seed and a key naming what it is for (docs/differences.md, "Seeds")."""

from __future__ import annotations

import hashlib


def derive_seed(*parts) -> int:
    """A 63-bit seed from `parts` (ints, strings and tuples of them): the same in every process, run and machine
    (Python's `hash` of a string is not)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
