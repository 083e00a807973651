"""vLLM colocated in the training process (`vllm_mode='colocate'`): the engine, its settings, its weight sync and the
trainer's mode (docs/one_gpu.md)."""
