"""The cached engine's cost model, measured on the device and model it runs on, once per process.

Two decisions weigh a forward's fixed cost against its cost per position: how many forwards the requests that join in
one step are prefilled in (`prefill.group_by_length`, and whether a request waits a round for a longer shared prefix:
`admission.py`), and how many n-gram drafts a decode step feeds (`speculation.Acceptance.draft_length`). Their ratio
differs by orders of magnitude between devices (on a GPU a forward is kernel launches and one read of the weights until
thousands of positions), so constants fitted on one device would split prefills and refuse drafts on another.

`measure_costs` times forwards of the model itself (random tokens, no gradients, in the mode the engine holds it):
decode steps after `PAST` cached positions of 1 and `ROWS` rows, fed 1, 2 and `1 + DRAFTS` tokens each, and one
prefill of `PREFILL` tokens, each shape the fastest of up to `REPEATS` rounds after a warm-up round (the fastest is
the least disturbed by other work on the machine), synchronizing the device around each. `fit_costs` turns those
times into the cost model: exact arithmetic on given times, tested on its own.

The decisions then depend on timings: a seed fixes the trees only as long as the cost model is the same, so it is
measured once per process and kind of model (`_MEASURED`: engines of one process share it) and an engine may be given
one (`CachedTransformersEngine(cost_model=...)`, e.g. `cpu.costs.CPU_COSTS`) to pin it across processes. By default
(`device_costs`) only an accelerator is measured; a CPU keeps the development CPU's constants (`cpu/costs.py`). What
these took and found on the development CPU: docs/cpu_measurements.md.
"""

from __future__ import annotations

import hashlib
import time

import torch
from transformers import DynamicCache

from arpo_trl.generation.cost_model import DecodeCost, ForwardCosts
from arpo_trl.generation.cpu.costs import CPU_COSTS
from arpo_trl.generation.prefill import MAX_FORWARD_POSITIONS
from arpo_trl.generation.prefix_cache import layer_pairs, stack_layers

PAST, ROWS, DRAFTS, PREFILL = 64, 16, 4, 128  # the shapes timed (module docstring)
REPEATS, MAX_SECONDS = 3, 3.0  # timed rounds at most; no further round once this much time went into timing
SHAPES = ((1, 0), (ROWS, 0), (1, 1), (ROWS, 1), (ROWS, DRAFTS))  # decode steps: (rows, drafts per row)


def fit_costs(decode_seconds: dict[tuple[int, int], float], prefill_seconds: float, source: str = "given",
              rows: int = ROWS, drafts: int = DRAFTS, prefill_tokens: int = PREFILL) -> ForwardCosts:
    """The cost model through the measured times: `decode_seconds[(r, d)]` a decode step of r rows fed 1 + d tokens
    each, for the `SHAPES` (with `rows` and `drafts`), and `prefill_seconds` a forward of `prefill_tokens` new tokens.

    Plain steps give the fixed part and the part per row (a line through 1 and `rows` rows); the drafted steps' excess
    over them gives the jump (fixed and per row, from 1 and `rows` rows fed 2 tokens) and the part per draft position
    (from `rows` rows fed 2 and 1 + `drafts` tokens). Beyond the widest step timed (rows × (1 + drafts) positions) a
    position costs at least a row's. The prefill's excess over a 1-row step, per token, prices a prefilled position.
    Noise that would make a part negative makes it 0."""
    t = decode_seconds
    per_row = max((t[rows, 0] - t[1, 0]) / (rows - 1), 0.0)
    fixed = max(t[1, 0] - per_row, 0.0)
    jump_one, jump_rows = t[1, 1] - t[1, 0], t[rows, 1] - t[rows, 0]
    per_draft_position = max((t[rows, drafts] - t[rows, 1]) / (rows * (drafts - 1)), 0.0)
    draft_per_row = max((jump_rows - jump_one) / (rows - 1) - per_draft_position, 0.0)
    draft_fixed = max(jump_one - draft_per_row - per_draft_position, 0.0)
    widest = rows * (1 + drafts)
    decode = DecodeCost(fixed, per_row, draft_fixed, draft_per_row, per_draft_position, widest,
                        max(per_row - per_draft_position, 0.0))
    per_position = (prefill_seconds - t[1, 0]) / (prefill_tokens - 1)
    tokens = fixed / per_position if per_position > 0 else MAX_FORWARD_POSITIONS
    return ForwardCosts(decode, min(max(tokens, 1.0), MAX_FORWARD_POSITIONS), source)


def device_costs(model) -> ForwardCosts:
    """The cost model the cached engine decides with unless given one: measured on an accelerator (`measured_costs`);
    on a CPU, the development CPU's constants (`cpu.costs.CPU_COSTS`): on a shared CPU a measurement reads the
    machine's load as cost and bought no faster rollout, and the constants keep a seed's trees the same across
    processes (docs/in_process_engine.md)."""
    return CPU_COSTS if next(model.parameters()).device.type == "cpu" else measured_costs(model)


_MEASURED: dict[str, ForwardCosts] = {}  # by `_key`: engines of one process share a measurement


def measured_costs(model) -> ForwardCosts:
    """The cost model of `model` on its device: measured at the first call of the process for this kind of model
    (class, configuration, device, dtype, threads), the same afterwards. Call without gradients, in eval mode."""
    key = _key(model)
    if key not in _MEASURED:
        _MEASURED[key] = measure_costs(model)
    return _MEASURED[key]


def _key(model) -> str:
    parameter = next(model.parameters())
    config = model.config.to_json_string() if hasattr(model, "config") else ""
    text = f"{type(model).__name__}|{config}|{parameter.device}|{parameter.dtype}|{torch.get_num_threads()}"
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def measure_costs(model, repeats: int = REPEATS, max_seconds: float = MAX_SECONDS) -> ForwardCosts:
    """Time the `SHAPES` and a prefill on `model` (module docstring) and fit the cost model."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    vocab = min(getattr(model.config, "vocab_size", 1000), 1000)
    ids = torch.randint(0, vocab, (ROWS, PAST + PREFILL), generator=generator).to(device)
    cache = DynamicCache()
    model(input_ids=ids[:1, :PAST], cache=cache, use_cache=True, logits_to_keep=1)
    past = stack_layers([(layer.keys, layer.values) for layer in cache.layers])
    past = past.expand(*past.shape[:2], ROWS, *past.shape[3:]).contiguous()
    shapes = {shape: (lambda s=shape: _decode(model, past, ids, *s)) for shape in SHAPES}
    shapes["prefill"] = lambda: model(input_ids=ids[:1, PAST:], use_cache=False, logits_to_keep=1)
    best = {shape: float("inf") for shape in shapes}
    begin = time.perf_counter()
    for round_ in range(repeats + 1):  # round 0 warms up (allocations, kernels chosen)
        for shape, forward in shapes.items():
            seconds = _timed(forward, device)
            if round_:
                best[shape] = min(best[shape], seconds)
        if round_ and time.perf_counter() - begin > max_seconds:
            break
    elapsed = time.perf_counter() - begin
    prefill_seconds = best.pop("prefill")
    return fit_costs(best, prefill_seconds, f"measured on {device} in {elapsed:.1f} s")


def _decode(model, past: torch.Tensor, ids: torch.Tensor, rows: int, drafts: int):
    """A decode step of `rows` rows after `PAST` cached positions, fed 1 + `drafts` tokens each (logits at all)."""
    width, device = 1 + drafts, ids.device
    cache = DynamicCache(ddp_cache_data=layer_pairs(past[:, :, :rows]))  # concatenated into new tensors: not written
    positions = torch.arange(PAST, PAST + width, device=device).expand(rows, width)
    mask = torch.ones(rows, PAST + width, dtype=torch.long, device=device)
    return model(input_ids=ids[:rows, PAST: PAST + width], attention_mask=mask, position_ids=positions, cache=cache,
                 use_cache=True)


def _timed(forward, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    forward()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's forward returns before its kernels ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()
