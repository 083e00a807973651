"""The model an in-process engine generates with (`model_for_generation`): in eval mode, decoding through SDPA
where it trains with FlexAttention, its LM head's weight packed once on the CPU (`cpu/packed_head.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from arpo_trl.generation.cpu.packed_head import packed_head


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode inside, and each module back in its own mode after. A rollout samples the policy, not
    one dropout draw of it (LoRA's dropout would perturb the tokens, their logprobs and the entropies that decide
    forks; a vLLM server has none). Restored with `train()`, which modules may override (PEFT's DoRA clears a cache)."""
    modes = {module: module.training for module in model.modules()}
    if not any(modes.values()):
        yield model
        return
    model.train(False)
    try:
        yield model
    finally:
        model.train(modes[model])
        for module, training in modes.items():
            if module.training != training:  # a submodule the caller keeps in the other mode
                module.training = training


@contextlib.contextmanager
def decoding_attention(model):
    """Generate with SDPA where the model trains with FlexAttention, and switch back afterwards. FlexAttention
    compiles a kernel per input shape, and a decode step's shapes change every step: on a GPU it recompiled up to
    torch._dynamo's limit and then ran unfused (docs/gpu_checks.md). SDPA computes the same attention."""
    if getattr(model.config, "_attn_implementation", None) != "flex_attention":
        yield model
        return
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation("flex_attention")


@contextlib.contextmanager
def model_for_generation(model, model_context: Callable[[], AbstractContextManager] | None = None):
    """The model an engine generates with: through `model_context` where given (TRL's unwrap for generation, which
    merges or gathers the current weights), decoding through SDPA (`decoding_attention`), its head packed on the CPU
    (`packed_head`: the weights are fixed while an engine holds the model)."""
    with (model_context() if model_context else contextlib.nullcontext(model)) as held, decoding_attention(held), \
            packed_head(held):
        yield held
