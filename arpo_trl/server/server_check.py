"""Does a running vLLM server serve this run? What a run needs from its server (`RunNeeds`: the model, the longest
sequence, the LoRA rank), what a server offers (`ServerOffer`, read from `/v1/models` and, in dev mode,
`/server_info`), and the one-line refusal naming the `vllm serve` flag to change (`check_server_serves`).

`arpo-trl vllm-serve --config RECIPE` starts a server from the same `RunNeeds` (`arpo_trl.server.serve_config`), so
a server started that way always passes. docs/server_mode.md#one-gpu-a-server-configured-from-the-recipe.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_trl.server.responses import VLLMServerError, Where, read_models, shown, violation

logger = logging.getLogger("arpo_trl.trainer")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's `--max-lora-rank` accepts
MAX_CONTEXT = 1 << 24  # a larger `max_model_len` from a server is nonsense, not a context length


def vllm_lora_rank(rank: int, name: str = "lora_r (the LoRA rank)") -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves adapters of rank `rank` (`name`: the field that set
    it, for the error)."""
    valid = isinstance(rank, int) and not isinstance(rank, bool)
    allowed = [r for r in VLLM_LORA_RANKS if valid and r >= rank]
    if not valid or rank < 1 or not allowed:
        raise ValueError(f"{name} must be an integer between 1 and {VLLM_LORA_RANKS[-1]} (the "
                         f"largest --max-lora-rank vLLM accepts), got {rank!r}.")
    return allowed[0]


class ServerMismatchError(VLLMServerError, ValueError):
    """The server runs, but cannot serve this run (another model, too short a context, too small a LoRA rank).
    A `ValueError` too, so that `arpo-trl train` ends with its one `arpo-trl: error:` line."""


@dataclass(frozen=True)
class RunNeeds:
    """What a run asks of its vLLM server.

    `prompt_tokens` is the prompt budget (`max_prompt_length`, else the longest prompt of the data, as
    `prompt_source` says); ARPO's `max_completion_length` counts everything after the prompt, tool results included,
    so no request ever reaches past `prompt_tokens + max_completion_length` tokens. `lora_rank` is the rank of the
    adapters loaded every step (`vllm_weight_sync='lora'`), None without LoRA sync."""

    model: str | None
    prompt_tokens: int
    prompt_source: str
    max_completion_length: int
    lora_rank: int | None = None

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens + self.max_completion_length

    @property
    def max_lora_rank(self) -> int | None:
        return vllm_lora_rank(self.lora_rank) if self.lora_rank else None

    def length_reason(self) -> str:
        return (f"{self.prompt_source} ({self.prompt_tokens}) + max_completion_length "
                f"({self.max_completion_length}, tool results included)")


@dataclass(frozen=True)
class ServerOffer:
    """What a server says it serves; None where it does not say (`/server_info` exists in dev mode only)."""

    model: str | None
    max_model_len: int | None
    lora_enabled: bool | None = None
    max_lora_rank: int | None = None
    runtime_lora_loading: bool | None = None


def read_offer(client, info: dict | None = None) -> ServerOffer:
    """The base model's card of `/v1/models` (`root`: the `--model` it was started with, `max_model_len`), and the
    LoRA settings of `info` (`client.server_info()`: dev mode only). Every field is checked (hostile input)."""
    where = Where(client.base_url, "GET /v1/models")
    models = read_models(where, client.request("GET", "/v1/models", expect="json"))
    card = next((m for m in models if not m.get("parent")), None)
    if card is None:
        raise VLLMServerError(f"The vLLM server at {client.base_url} lists no base model in /v1/models: "
                              f"{shown(models)}", base_url=client.base_url, endpoint=where.endpoint)
    root = card.get("root")
    if root is not None and (not isinstance(root, str) or not root.strip()):
        raise violation(where, "data[].root", "the path or hub id the model was loaded from (a string)", root)
    length = _optional_int(where, card, "max_model_len", "data[].max_model_len")
    lora = _lora_settings(Where(client.base_url, "GET /server_info"), info)
    return ServerOffer(model=root, max_model_len=length, **lora)


def _optional_int(where: Where, mapping: dict, key: str, name: str) -> int | None:
    value = mapping.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CONTEXT:
        raise violation(where, name, f"a positive integer of at most {MAX_CONTEXT}", value)
    return value


def _lora_settings(where: Where, info: dict | None) -> dict[str, Any]:
    """`lora_enabled`, `max_lora_rank`, `runtime_lora_loading` from `/server_info`, or {} without one (not in dev
    mode, or its `pip list` failed): LoRA is then checked by the first adapter load, whose error names the flag."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict) or "lora_config" not in config:
        return {}
    lora = config["lora_config"]
    if lora is not None and not isinstance(lora, dict):
        raise violation(where, "vllm_config.lora_config", "null or an object", lora)
    settings: dict[str, Any] = {"lora_enabled": lora is not None}
    if isinstance(lora, dict):
        settings["max_lora_rank"] = _optional_int(where, lora, "max_lora_rank", "vllm_config.lora_config.max_lora_rank")
    env = info.get("vllm_env")
    if isinstance(env, dict) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in env:
        settings["runtime_lora_loading"] = str(env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]).lower() in ("1", "true")
    return settings


def same_model(served: str | None, trained: str | None) -> bool:
    """Whether the server's `--model` is the trained model: the same folder, the same hub id, or a folder and a hub
    id (or a Hugging Face cache snapshot) of the same name. Unknown on either side counts as the same (the tokenizer
    check and the startup probe still run)."""
    if not served or not trained:
        return True
    a, b = _canonical(served), _canonical(trained)
    return a == b or a.rstrip("/").rsplit("/", 1)[-1].lower() == b.rstrip("/").rsplit("/", 1)[-1].lower()


def _canonical(name: str) -> str:
    path = Path(name).expanduser()
    if path.is_dir():
        name = os.path.realpath(path)
    parts = Path(name).parts
    for i, part in enumerate(parts[:-1]):  # <cache>/models--Org--Name/snapshots/<hash> is Org/Name
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/")
    return name


def mismatches(needs: RunNeeds, offer: ServerOffer) -> tuple[list[str], list[str]]:
    """(what the server lacks, the `vllm serve` flags that fix it), both empty when it serves the run."""
    problems, flags = [], []
    if not same_model(offer.model, needs.model):
        problems.append(f"it serves {offer.model!r}, but the trainer trains {needs.model!r}")
        flags.append(f"--model {needs.model}")
    if offer.max_model_len is not None and offer.max_model_len < needs.max_model_len:
        problems.append(f"its context is {offer.max_model_len} tokens, but {needs.length_reason()} need "
                        f"{needs.max_model_len}")
        flags.append(f"--max-model-len {needs.max_model_len}")
    if needs.lora_rank:
        if offer.lora_enabled is False:
            problems.append(f"it serves no LoRA adapters, but vllm_weight_sync='lora' loads one (rank "
                            f"{needs.lora_rank}) every step")
            flags.append(f"--enable-lora --max-lora-rank {needs.max_lora_rank}")
        elif offer.max_lora_rank is not None and offer.max_lora_rank < needs.lora_rank:
            problems.append(f"its --max-lora-rank is {offer.max_lora_rank}, but the adapters have rank "
                            f"{needs.lora_rank} (lora_r)")
            flags.append(f"--max-lora-rank {needs.max_lora_rank}")
        if offer.runtime_lora_loading is False:
            problems.append("it does not load adapters at run time")
            flags.append("(environment) VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    return problems, flags


def check_server_serves(client, needs: RunNeeds, info: dict | None = None) -> ServerOffer:
    """Refuse, in one line naming the flags to restart it with, a server that cannot serve the run; `info` is
    `client.server_info()`."""
    offer = read_offer(client, info)
    problems, flags = mismatches(needs, offer)
    if problems:
        raise ServerMismatchError(
            f"The vLLM server at {client.base_url} cannot serve this run: {'; '.join(problems)}. Restart it with "
            f"{' '.join(flags)} (`arpo-trl vllm-serve --config RECIPE` derives them from the recipe).",
            base_url=client.base_url, endpoint="GET /v1/models")
    unknown = [name for name, value in (("its context length", offer.max_model_len),
                                        ("its LoRA rank", offer.max_lora_rank if needs.lora_rank else 0))
               if value is None]
    if unknown:
        logger.info("ARPO: the vLLM server at %s does not report %s (not checked at startup).", client.base_url,
                    " or ".join(unknown))
    return offer
