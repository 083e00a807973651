"""What the in-process engines keep only for CPU speed: the LM head packed once through oneDNN (`packed_head`).
Measured on the 2-core development CPU (docs/cpu_measurements.md); never used on another device.

May import: nothing outside generation.
"""
