"""What the in-process engine keeps only for CPU speed: the development CPU's constant cost models (`costs`) and the
LM head packed once through oneDNN (`packed_head`). Measured on the 2-core development CPU (docs/cpu_measurements.md);
never a GPU default: an accelerator measures its own costs (`generation/calibration.py`).

May import: generation (the cost model's types, the prefill's default forward cost).
"""
