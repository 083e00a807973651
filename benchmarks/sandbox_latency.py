"""Python tool call latency: one call through `Sandbox.run` (rlimits or namespace isolation, cold or from a
pre-started pool, numpy pre-imported or not) against the reference's bare ``python -c`` subprocess (no sandbox).

    python benchmarks/sandbox_latency.py                          # every variant, 30 calls each (about a minute)
    python benchmarks/sandbox_latency.py --calls 100 --only numpy --out outputs/sandbox_latency.json

Wall: `time.perf_counter()` around one call, as the rollout sees it (for the sandbox: taking a worker, running the
code, killing the worker and starting its pooled replacement). Inner: `SandboxResult.seconds` (from sending the
code to its end). Pooled variants pause `--pause` s after each call so the pool refills, as it does between
generation rounds; the `-b2b` variants call back to back. `PythonTool`'s defaults are `pool_size=2`, no preimport.

Prints one JSON object (also written to `--out` if given), then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from arpo_trl.tools.sandbox import Sandbox, _probe_namespaces

PAYLOADS = {  # name: (code, expected output)
    "sum": ("print(sum(range(1000)))", "499500"),
    "numpy": ("import numpy as np\nprint(int(np.arange(1000).sum()))", "499500"),
}
Call = Callable[[str], tuple[str, float | None]]  # code -> (output, inner seconds or None)


@dataclass(frozen=True)
class Variant:
    name: str
    payload: str
    isolation: str | None = None  # None: the reference's bare `python -c`
    pool_size: int = 0
    preimport: tuple[str, ...] = ()
    pause: bool = False  # sleep --pause s after each call (pooled: lets the pool refill)


def all_variants(namespaces: bool, pool: int) -> list[Variant]:
    isolations = ["rlimits"] + (["namespaces"] if namespaces else [])
    variants = [Variant("sum/baseline", "sum")]
    for iso in isolations:
        variants += [Variant(f"sum/{iso}/cold", "sum", iso), Variant(f"sum/{iso}/pooled", "sum", iso, pool, pause=True),
                     Variant(f"sum/{iso}/pooled-b2b", "sum", iso, pool)]
    iso, numpy = isolations[-1], ("numpy",)
    return variants + [
        Variant("numpy/baseline", "numpy"), Variant(f"numpy/{iso}/cold", "numpy", iso),
        Variant(f"numpy/{iso}/pooled", "numpy", iso, pool, pause=True),
        Variant(f"numpy/{iso}/pooled-preimport", "numpy", iso, pool, numpy, pause=True),
        Variant(f"numpy/{iso}/pooled-preimport-b2b", "numpy", iso, pool, numpy),
    ]


def select(variants: list[Variant], only: str | None) -> list[Variant]:
    """Variants whose name contains one of the comma-separated `only` parts, plus their payloads' baselines."""
    if not only:
        return variants
    keep = [v for v in variants if any(part in v.name for part in only.split(","))]
    payloads = {v.payload for v in keep}
    return [v for v in variants if v in keep or (v.isolation is None and v.payload in payloads)]


def bare_python(timeout: float) -> Call:
    def call(code: str) -> tuple[str, float | None]:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        return proc.stdout + proc.stderr, None

    return call


def sandboxed(sandbox: Sandbox) -> Call:
    def call(code: str) -> tuple[str, float | None]:
        result = sandbox.run(code)
        return result.output, result.seconds

    return call


def time_calls(call: Call, payload: str, calls: int, warmup: int, pause: float) -> tuple[list[float], list[float]]:
    code, expected = PAYLOADS[payload]
    walls, inners = [], []
    for i in range(warmup + calls):
        start = time.perf_counter()
        output, inner = call(code)
        wall = time.perf_counter() - start
        if output.strip() != expected:
            raise RuntimeError(f"{payload}: expected {expected!r}, got {output!r}")
        if i >= warmup:
            walls.append(wall)
            inners += [] if inner is None else [inner]
        if pause:
            time.sleep(pause)
    return walls, inners


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(prefix: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"{prefix}_ms_p50": None, f"{prefix}_ms_p90": None, f"{prefix}_ms_mean": None}
    ms = [s * 1000 for s in seconds]
    return {f"{prefix}_ms_p50": round(percentile(ms, 0.5), 2), f"{prefix}_ms_p90": round(percentile(ms, 0.9), 2),
            f"{prefix}_ms_mean": round(statistics.mean(ms), 2)}


def measure(variant: Variant, args: argparse.Namespace) -> dict:
    pause = args.pause if variant.pause else 0.0
    row = {"payload": variant.payload, "isolation": variant.isolation or "none (python -c)",
           "pool_size": variant.pool_size, "preimport": list(variant.preimport), "pause_s": pause}
    if variant.isolation is None:
        walls, inners = time_calls(bare_python(args.timeout), variant.payload, args.calls, args.warmup, pause)
    else:
        with Sandbox(timeout=args.timeout, isolation=variant.isolation, pool_size=variant.pool_size,
                     preimport=variant.preimport) as sandbox:
            row["isolation"], row["pool_size"] = sandbox.isolation, sandbox.pool_size  # what ran, not what was asked
            walls, inners = time_calls(sandboxed(sandbox), variant.payload, args.calls, args.warmup, pause)
    return {**row, "timed_calls": len(walls), **summary("wall", walls), **summary("inner", inners)}


def add_ratios(runs: dict[str, dict]) -> None:
    for run in runs.values():
        baseline = runs.get(f"{run['payload']}/baseline")
        if baseline:
            run["p50_vs_baseline"] = round(run["wall_ms_p50"] / baseline["wall_ms_p50"], 2)
            run["mean_vs_baseline"] = round(run["wall_ms_mean"] / baseline["wall_ms_mean"], 2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (they also fill the pool)")
    parser.add_argument("--pause", type=float, default=0.2, help="seconds between pooled calls (pool refill)")
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call timeout, s")
    parser.add_argument("--only", default=None, help="comma-separated name parts, e.g. 'sum/rlimits,numpy'")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        parser.error("--calls must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    namespaces = sys.platform.startswith("linux") and _probe_namespaces(sys.executable)
    report = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "uid": os.getuid(),
              "namespaces_available": namespaces, "calls": args.calls, "warmup": args.warmup, "pause_s": args.pause,
              "pool_size": args.pool_size, "notes": [], "runs": {}}
    if not namespaces:
        report["notes"].append("Linux namespaces unavailable here: namespace variants skipped, numpy uses rlimits.")
    for variant in select(all_variants(namespaces, args.pool_size), args.only):
        report["runs"][variant.name] = measure(variant, args)
    add_ratios(report["runs"])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print_table(report)
    return report


def print_table(report: dict) -> None:
    print(f"\n{report['calls']} calls per variant after {report['warmup']} warm-up; ms; "
          f"ratio = wall p50 / the same payload's baseline p50")
    print("\n| variant | pool | pause s | wall p50 | wall p90 | wall mean | inner p50 | inner mean | vs baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        inner = [r["inner_ms_p50"], r["inner_ms_mean"]]
        p50, mean = ("-" if v is None else v for v in inner)
        print(f"| {name} | {r['pool_size']} | {r['pause_s']} | {r['wall_ms_p50']} | {r['wall_ms_p90']} | "
              f"{r['wall_ms_mean']} | {p50} | {mean} | {r.get('p50_vs_baseline', '-')} |")
    for note in report["notes"]:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
