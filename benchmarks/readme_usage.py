"""The README's "Usage in Python" block, run as written and timed: does its reward rise, and how long does it take?

    python benchmarks/readme_usage.py                 # the block as written, in a new temporary working folder
    python benchmarks/readme_usage.py --max_steps 2   # a quicker look (replaces the block's one `max_steps=`)

The block runs in this process (`exec`), in an empty working folder, so its time includes the cold-start SFT it
triggers (`quickstart_cold_start()`), as a reader's first run does; SmolLM2's one-time conversion is not included
when `ARPO_TRL_CACHE` already holds it (`converted_smollm2_cached` says which). Writes --out (default
benchmarks/results/readme_usage.json): the commit, the load average, the steps, the reward of each step, seconds.
`tests/test_readme_usage.py` runs the block through `usage_block` and `run_block` with fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from quickstart import thirds  # noqa: E402  (the quickstart benchmark's reward summary, the same statistic)

README = ROOT / "README.md"
HEADING = "## Usage in Python"
_MAX_STEPS = re.compile(r"\bmax_steps=\d+")


def usage_block(readme: str) -> str:
    """The first ```python block under the `## Usage in Python` heading (and before the next `## ` heading)."""
    lines = readme.splitlines()
    if HEADING not in lines:
        raise ValueError(f"README.md has no {HEADING!r} heading")
    section = []
    for line in lines[lines.index(HEADING) + 1:]:
        if line.startswith("## "):
            break
        section.append(line)
    match = re.search(r"^```python\n(.*?)^```$", "\n".join(section), re.S | re.M)
    if match is None:
        raise ValueError(f"README.md has no ```python block under {HEADING!r}")
    return match.group(1)


def with_max_steps(code: str, steps: int) -> str:
    """The block with its one `max_steps=<n>` set to `steps` (a ValueError unless it occurs exactly once)."""
    found = _MAX_STEPS.findall(code)
    if len(found) != 1:
        raise ValueError(f"expected exactly one `max_steps=<n>` in the README block, found {found}")
    return _MAX_STEPS.sub(f"max_steps={steps}", code)


def run_block(code: str) -> dict:
    """Run the block as a script in the current working folder; its global names afterwards (`trainer`, …)."""
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"README.md ({HEADING})", "exec"), namespace)
    return namespace


def step_rewards(trainer) -> list[float]:
    """The training reward of each logged step, as the block reads them."""
    return [log["reward"] for log in trainer.state.log_history if "reward" in log]


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "README.md", "arpo_trl")
    return git("rev-parse", "HEAD") + (" (README.md or arpo_trl/ modified)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_steps", type=int, default=None,
                        help="replace the block's max_steps (default: as written)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "readme_usage.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    code = usage_block(README.read_text(encoding="utf-8"))
    if args.max_steps is not None:
        code = with_max_steps(code, args.max_steps)
    from arpo_trl.data.assets import default_cache_dir

    cached = (default_cache_dir() / "smollm2-135m-instruct" / "config.json").is_file()
    load_start, measured_commit = os.getloadavg(), commit()  # the code that runs is the code at the start
    with tempfile.TemporaryDirectory(prefix="readme_usage_") as folder:
        os.chdir(folder)
        start = time.monotonic()
        namespace = run_block(code)
        seconds = time.monotonic() - start
        os.chdir(ROOT)
    trainer = namespace["trainer"]
    rewards = step_rewards(trainer)
    first, last = thirds(rewards)
    train_seconds = next(log["train_runtime"] for log in trainer.state.log_history if "train_runtime" in log)
    report = {
        "commit": measured_commit, "block": "README.md, " + HEADING, "as_written": args.max_steps is None,
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "converted_smollm2_cached": cached, "steps": trainer.state.global_step,
        "rewards": [round(r, 3) for r in rewards], "first_step_reward": round(rewards[0], 3),
        "last_step_reward": round(rewards[-1], 3), "first_third_mean": round(first, 3),
        "last_third_mean": round(last, 3), "seconds": round(seconds, 1),
        "train_seconds": round(train_seconds, 1), "cold_start_and_setup_seconds": round(seconds - train_seconds, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
