"""What makes `ARPOTrainer` a drop-in for TRL's `GRPOTrainer` (docs/coming_from_grpo.md): the tree metadata kept out of
the user's examples (`rows`), `environment_factory` with branching (`environments`, docs/environments.md), and the
GRPOConfig settings ARPO refuses, each with its reason (`grpo_fields`).

May import: tools.
"""
