"""The entropy around tool results (the paper's Fig. 1, for any model): mean token entropy at each offset before and
after a tool's reply, over the records of a trees file. Results are placed by the records' `calls`."""

from __future__ import annotations

from collections.abc import Sequence


def entropy_around_tools(records: Sequence[dict], window: int = 20) -> dict:
    """Mean per-token entropy (nats) at each offset from a tool result, over all records (any steps/groups).

    Offset k >= 1 is the k-th model-sampled token after a result; k <= -1 the |k|-th model token before it (the
    call's own tokens first). A window stops at the neighbouring result, or at any other environment span, and at
    the completion's ends; offset 0 is the result itself and holds no tokens. A token is counted only in the record
    that generated it (positions >= fork_position), so prefixes shared by branches count once. `baseline_*` is
    the same mean over the first model segment of each non-branch record (before any tool call); `occurrences`
    counts (record, result) pairs that contributed a token."""
    if window < 1:
        raise ValueError(f"entropy_around_tools: window must be >= 1, got {window}.")
    sums, counts = [0.0] * (2 * window + 1), [0] * (2 * window + 1)
    occurrences, base_sum, base_count = 0, 0.0, 0
    for r in records:
        segs, h = r["segments"], r["entropies"]
        if not r.get("fork_position") and segs and segs[0]["kind"] == "model":
            vals = [v for v in h[segs[0]["start"] : segs[0]["end"]] if v is not None]
            base_sum, base_count = base_sum + sum(vals), base_count + len(vals)
        occurrences += _accumulate_around(r, window, sums, counts)
    return {
        "window": window, "offsets": list(range(-window, window + 1)),
        "mean": [s / c if c else None for s, c in zip(sums, counts)], "count": counts,
        "occurrences": occurrences,
        "baseline_mean": base_sum / base_count if base_count else None, "baseline_count": base_count,
    }


def _model_before(segs: list[dict], k: int) -> dict | None:
    """The model segment that ends the call answered by result segment `k` (past a tag tail the sampler wrote)."""
    j = k - 1
    while j >= 0 and segs[j]["kind"] == "env":
        j -= 1
    return segs[j] if j >= 0 and segs[j]["kind"] == "model" else None


def _accumulate_around(r: dict, window: int, sums: list[float], counts: list[int]) -> int:
    """Add one record's own tokens around each of its tool results; returns how many results contributed."""
    segs, h, own = r["segments"], r["entropies"], r.get("fork_position") or 0
    occurrences = 0
    for k, seg in enumerate(segs):
        if seg["kind"] != "result":
            continue
        sides = []
        if k + 1 < len(segs) and segs[k + 1]["kind"] == "model":  # offsets +1, +2, … after the result
            nxt = segs[k + 1]
            sides.append((1, range(nxt["start"], min(nxt["end"], nxt["start"] + window))))
        prev = _model_before(segs, k)
        if prev is not None:  # offsets -1, -2, … back from the call's last token
            sides.append((-1, range(prev["end"] - 1, max(prev["start"], prev["end"] - window) - 1, -1)))
        used = False
        for sign, positions in sides:
            for distance, pos in enumerate(positions, 1):
                if pos >= own and pos < len(h) and h[pos] is not None:
                    sums[window + sign * distance] += h[pos]
                    counts[window + sign * distance] += 1
                    used = True
        occurrences += used
    return occurrences
