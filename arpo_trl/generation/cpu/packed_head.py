"""The LM head packed once on the CPU while an engine holds the model (`packed_head`): `F.linear` hands the weight to
MKL's sgemm, which repacks it into blocks on every call, and at a decode step's few rows that repacking costs more than
the product, most for the vocabulary-wide head; oneDNN packs it once (docs/cpu_measurements.md). It goes through
torch's private `torch.ops.mkldnn._*` operators, CPU and float32 only."""

from __future__ import annotations

import contextlib

import torch


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
    whether it does. The weight must not change inside. Only the head is packed: packing every linear layer paid at
    few rows only and lost at many (docs/cpu_measurements.md). An input the packed product would treat differently
    (another dtype, autocast, autograd) goes to `F.linear`."""
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
