"""The development CPU's constant cost models, which the cached engine decides with on a CPU unless it is given one or
told to measure (`calibration.device_costs`): a measurement on a shared CPU reads the machine's load as cost, and
constants keep a seed's trees the same across processes. Fitted on the 2-core development CPU with SmolLM2-135M
(docs/cpu_measurements.md); an accelerator measures its own (`calibration.measured_costs`)."""

from __future__ import annotations

from arpo_trl.generation.cost_model import DecodeCost, ForwardCosts

FORWARD_COST_TOKENS = 64  # a forward's fixed cost in prefilled positions (~90 measured)
# A decode step in units of one row of a plain step: the fixed part, the jump a step with drafts pays (fixed and per
# row), each draft position, and each position beyond 160 in all.
CPU_DECODE_COST = DecodeCost(fixed=18, per_row=1, draft_fixed=6, draft_per_row=1.5, per_draft_position=0.4,
                             wide_positions=160, wide_position=1.0)
CPU_COSTS = ForwardCosts(CPU_DECODE_COST, FORWARD_COST_TOKENS, "the 2-core development CPU's constants")
