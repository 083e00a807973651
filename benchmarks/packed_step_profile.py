"""Where one training step's time goes on a GPU, tree-packed against unpacked (docs/gpu_checks.md).

    python benchmarks/packed_step_profile.py [sdpa|eager|flex_attention]

SmolLM2-135M's architecture (random weights), the multi-call recipe's LoRA and loss, bf16 autocast, eight M16N8 ARPO
micro-batches built as benchmarks/packed_training.py builds them. Three warm-up steps per mode on the first three
batches, then five steps per mode on batches the run has not seen (the first sight of each shape), the same five again
(shapes seen), and a torch.profiler table of one step per mode. Prints seconds and the tables; needs CUDA.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.packed_training import make_trainer, step_batch  # noqa: E402


def spec(attention: str) -> dict:
    """benchmarks/packed_training.py's worker spec: M16N8, SmolLM2-135M's 30 layers, bf16 on the GPU, seed 0, the
    process's CPU threads left as they are."""
    return {"setting": [16, 8], "seed": 0, "method": "arpo", "packed": True, "max_length": None, "layers": 30,
            "tiny": False, "threads": torch.get_num_threads(), "out": "runs/packed_step_profile", "device": "cuda",
            "attention": attention}


def step_seconds(trainer, batch: dict, packed: bool) -> float:
    trainer.args.tree_packing = packed
    torch.cuda.synchronize()
    started = time.perf_counter()
    trainer.compute_loss(trainer.model, batch).backward()
    torch.cuda.synchronize()
    trainer.model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main(attention: str) -> None:
    trainer = make_trainer(spec(attention))
    batches = [step_batch(spec(attention), step, trainer) for step in range(8)]
    for packed in (True, False):
        for batch in batches[:3]:
            step_seconds(trainer, batch, packed)
    for seen, packed in ((False, True), (False, False), (True, True), (True, False)):
        times = [round(step_seconds(trainer, batch, packed), 3) for batch in batches[3:]]
        print(attention, "packed" if packed else "unpacked", "shapes seen" if seen else "first sight", times)
    for packed in (True, False):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            step_seconds(trainer, batches[3], packed)
        for key, rows in (("self_cpu_time_total", 18), ("self_device_time_total", 12)):
            print(f"==== {attention} {'packed' if packed else 'unpacked'}: top by {key}")
            print(profiler.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sdpa")
