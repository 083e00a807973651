"""The training side of ARPOTrainer, after the rollout: attribution over the rollout trees (`advantages`), TRL's loss
hooks (`entropy_balanced_update`: AEPO's balanced update; `packed_logps` with `packing`, `grouping`, `forward_cost`
and `compatibility`: tree-packed forwards of TRL's micro-batches, docs/tree_packing.md), and what a run leaves and
how long it may take (`tracking`, `time_budget`).

May import: rollout, generation, trees, markdown.

Nothing is re-exported here: each module is imported by its own path (the trainer's mixins, config's checks).
"""
