"""vLLM server mode: the HTTP client (`client`), the launcher of a vLLM-CPU/GPU server in its own venv (`launcher`,
`python -m arpo_trl.server`), and how trained weights reach the server (`weight_sync`). See docs/server_mode.md."""

from arpo_trl.server.client import VLLMClient, VLLMServerError, check_server_tokenizer

__all__ = ["VLLMClient", "VLLMServerError", "check_server_tokenizer"]
