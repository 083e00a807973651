"""The model an in-process engine generates with (`model_for_generation`): in eval mode, decoding through SDPA
where it trains with FlexAttention, its LM head's weight packed once on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch


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


def packable_head(model) -> torch.nn.Linear | None:
    """The model's LM head (a PEFT layer's base layer where adapters wrap it) if `packed_head` computes the same
    product with it: a plain `nn.Linear` in float32 on the CPU whose `forward` nothing else replaced (accelerate's
    offloading hooks do), with oneDNN in this build of torch, and a whole weight of its own: not a ZeRO-3 partition
    (gathered by hooks at each forward) or another sharded tensor."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(head, "base_layer", head)
    if type(head) is not torch.nn.Linear or "forward" in vars(head) or not torch.backends.mkldnn.is_available():
        return None
    for p in head.parameters(recurse=False):
        if type(p) is not torch.nn.Parameter or hasattr(p, "ds_id") or p.device.type != "cpu" \
                or p.dtype != torch.float32:
            return None
    return head if head.weight.shape == (head.out_features, head.in_features) else None


@contextlib.contextmanager
def packed_head(model):
    """Inside, the LM head multiplies with a copy of its weight packed once, where `packable_head` allows; yields
    whether it does. The weight must not change inside.

    On the CPU, `F.linear` hands the weight to MKL's sgemm, which repacks it into blocks on every call; at a decode
    step's few rows that costs more than the product, and most for the vocabulary-wide head: SmolLM2-135M's took
    39.5 ms for 6 rows and 16 ms for 1 on a 2-core CPU; oneDNN packs it once (0.07 s) and then took 12.7 ms for 6 rows
    (docs/in_process_engine.md). Packing every linear layer gained more at 6 rows, nothing at 16, and lost at 64. An
    input the packed product would treat differently (another dtype, autocast, autograd) goes to `F.linear`."""
    head = packable_head(model)
    if head is None:
        yield False
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(head.weight.detach())

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return torch.nn.functional.linear(x, head.weight, head.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, head.bias, "none", [], "")

    head.forward = forward
    try:
        yield True
    finally:
        del head.forward


@contextlib.contextmanager
def model_for_generation(model, model_context: Callable[[], AbstractContextManager] | None = None):
    """The model an engine generates with: through `model_context` where given (TRL's unwrap for generation, which
    merges or gathers the current weights), decoding through SDPA (`decoding_attention`), its head packed on the CPU
    (`packed_head`: the weights are fixed while an engine holds the model)."""
    with (model_context() if model_context else contextlib.nullcontext(model)) as held, decoding_attention(held), \
            packed_head(held):
        yield held
