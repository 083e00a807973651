"""vLLM server mode (docs/server_mode.md), end to end: a vertical slice of that mode. Its engine side sits with the
engines: the HTTP client (`client`), what a server's answers must hold (`responses`, `segments`), the engine
(`engine`), whether a running server serves this run (`server_check`). Its trainer side: the trainer's mode
(`trainer_mode`), how trained weights reach the server (`weight_sync`), the launcher of a vLLM-CPU/GPU server in its
own venv (`launcher`). Its commands: `python -m arpo_trl.server`, `arpo-trl vllm-serve` (`serve_command`,
`serve_config`).

May import: generation, entropy, colocate, data, config, preflight, commands.
"""

from arpo_trl.server.client import VLLMClient, VLLMServerError, check_server_tokenizer

__all__ = ["VLLMClient", "VLLMServerError", "check_server_tokenizer"]
