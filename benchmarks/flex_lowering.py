"""Which FlexAttention calls Inductor lowers on this GPU, by sequence length (docs/gpu_checks.md).

    python benchmarks/flex_lowering.py

`torch.compile(flex_attention)` as transformers calls it, a causal block mask, the tests' head layout (2 query heads,
1 key/value head of dim 32, batch 2), float32, forward and backward; each length in a fresh compile. Prints one line
per length: seconds, and `ok` or the error. Needs CUDA.
"""

from __future__ import annotations

import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

LENGTHS = (77, 127, 128, 200, 256, 384)


def causal(batch, head, query, key):
    return query >= key


def try_length(compiled, length: int) -> str:
    q, k, v = (torch.randn(2, heads, length, 32, device="cuda", requires_grad=True) for heads in (2, 1, 1))
    mask = create_block_mask(causal, 2, None, length, length, device="cuda")
    try:
        compiled(q, k, v, block_mask=mask, enable_gqa=True).sum().backward()
        torch.cuda.synchronize()
        return "ok"
    except Exception as error:  # noqa: BLE001  (any failure to lower is the result being measured)
        return f"{type(error).__name__}: {str(error)[:120]!r}"


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name())
    compiled = torch.compile(flex_attention)
    for length in LENGTHS:
        torch._dynamo.reset()
        started = time.perf_counter()
        result = try_length(compiled, length)
        print(f"fp32 fwd+bwd L={length:4} {time.perf_counter() - started:6.1f}s {result}", flush=True)


if __name__ == "__main__":
    main()
