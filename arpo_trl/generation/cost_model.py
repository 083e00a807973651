"""The cached engine's cost model, its types: what a decode step costs (`DecodeCost`) and what a forward costs on one
device and model (`ForwardCosts`). The drafts' length (`speculation.py`) and the prefill's grouping (`prefill.py`,
`admission.py`) decide with one; `calibration.py` measures it, `cpu/costs.py` holds the development CPU's constants.
A module of its own so that all of them import the types without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCost:
    """What a decode step costs, in any unit (seconds where measured): a fixed part per forward, a part per row fed
    one token; with drafts, a jump per forward and per row (several query positions take another attention path on a
    CPU) and a part per draft position; each position beyond `wide_positions` in all costs `wide_position` more (the
    model is trusted up to the widest step it was fitted on, beyond which a position costs at least a row's)."""

    fixed: float
    per_row: float
    draft_fixed: float = 0.0
    draft_per_row: float = 0.0
    per_draft_position: float = 0.0
    wide_positions: int = 160
    wide_position: float = 0.0

    def step(self, rows: int, draft_length: int) -> float:
        """What a decode step of `rows` rows, each fed its token and `draft_length` drafts, costs."""
        if not draft_length:
            return self.fixed + rows * self.per_row
        wide = max(0, rows * (1 + draft_length) - self.wide_positions)
        return (self.fixed + self.draft_fixed + rows * (self.per_row + self.draft_per_row
                                                          + self.per_draft_position * draft_length)
                + self.wide_position * wide)


@dataclass(frozen=True)
class ForwardCosts:
    """The cost model of one device and model: a decode step's (`DecodeCost`, seconds where measured), and a
    forward's fixed cost in prefilled positions (`forward_cost_tokens`); `source` says where it comes from."""

    decode: DecodeCost
    forward_cost_tokens: float
    source: str = "given"
