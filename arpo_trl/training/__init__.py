"""The training side of ARPOTrainer: tree-packed forwards of TRL's micro-batches (docs/tree_packing.md)."""

from arpo_trl.training.packed_logps import TreePackedTraining

__all__ = ["TreePackedTraining"]
