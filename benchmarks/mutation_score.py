"""Mutation score of the modules where a silent bug costs a training run (docs/mutation_testing.md).

For each target, `mutmut` (https://mutmut.readthedocs.io) rewrites the module's code one small change at a time
(`<` to `<=`, `and` to `or`, a constant to another, an argument dropped…) and runs the target's fast unit tests
against each such mutant; a mutant some test fails on is *killed*, one every test passes on *survived* — a bug of
that shape would reach a training run unnoticed. Score = killed / mutants (a mutant the tests make hang past
mutmut's time limit counts as killed too, and is listed under `timeout`).

Each target runs in a fresh temporary copy of the package and its tests, with one mutmut worker (`--workers`), so
the checkout is left untouched. Not part of the pytest run (about 10 minutes for all targets on 2 cores). Usage:

    nice -n 10 python benchmarks/mutation_score.py                      # every target
    nice -n 10 python benchmarks/mutation_score.py --targets tags budget --output /tmp/score.json

Prints a JSON summary and a markdown table, writes the full result (survivors with their diffs) to `--output`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "mutation_score.json"
MUTMUT = Path(sys.executable).with_name("mutmut")  # the console script of this environment
# Deterministic: the fuzz tests draw the same examples for every mutant.
PYTEST_ARGS = ["-p", "no:cacheprovider", "--hypothesis-seed=0"]
# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code), folded into the table's columns.
KILLED_CODES, SURVIVED_CODES, NO_TESTS_CODES = {1, 3}, {0}, {5, 33}
TIMEOUT_CODES = {-24, 24, 152, 255, 36}


@dataclass(frozen=True)
class Target:
    """A module to mutate, optionally only some of its functions (`Class.method` or `function`), and the pytest
    arguments (files or node ids) of the fast tests that should catch its bugs."""

    name: str
    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    def mutant_globs(self) -> list[str]:
        """mutmut names a mutant `<module>.x_<function>__mutmut_<n>` or `<module>.xǁ<Class>ǁ<method>__mutmut_<n>`."""
        if not self.functions:
            return [f"{self.module}.*"]
        globs = []
        for function in self.functions:
            mangled = "xǁ" + "ǁ".join(function.split(".")) if "." in function else "x_" + function
            globs.append(f"{self.module}.{mangled}__mutmut_*")
        return globs


_ROLLOUT_FAST = tuple(f"tests/test_rollout.py::test_{name}" for name in (
    "exactly_m_per_prompt_and_branch_prefixes", "mask_is_zero_exactly_on_result_spans",
    "fork_probability_is_clip_tau_plus_beta_delta", "fill_ups_start_at_once_when_forks_cannot_fill_the_budget",
    "fill_ups_wait_for_the_last_fork_decision_that_could_fill", "branches_start_after_their_parents_probe",
    "call_limit_ends_with_eos", "fill_ups_run_ahead_of_the_rule_leave_the_trees_unchanged",
))
_FUZZ_TAGS = tuple(f"tests/test_fuzz.py::test_{name}" for name in (
    "cut_with_char_level_tokens", "cut_with_byte_chunk_tokens", "cut_with_the_byte_level_bpe",
    "cut_with_a_sentencepiece_style_tokenizer", "a_sentencepiece_tag_tail_is_not_re_encoded_with_a_space",
    "cut_keeps_a_token_that_completes_a_character_whole", "extract_call_on_tag_soup",
    "extract_call_is_the_text_between_the_last_opening_and_the_first_closing_tag",
))
_HOSTILE = "tests/test_hostile_outputs.py::test_"

TARGETS = (
    Target("advantages", "arpo_trl/training/advantages.py",
           ("tests/test_advantages.py", "tests/test_hard_attribution.py")),
    Target("rewards", "arpo_trl/rewards/reward_functions.py", ("tests/test_rewards.py",)),
    # The math-equivalence verdicts (caps, text comparison, cache); the worker-process plumbing is left out: its
    # mutants hang or race rather than change a score, and its tests are timing tests.
    Target("scoring", "arpo_trl/rewards/math_scoring.py", (
        "tests/test_rewards.py", "tests/test_scoring.py", _HOSTILE + "caps_compare_long_answers_as_text",
        _HOSTILE + "cheap_answers_score_exactly_as_math_verify_in_process",
    ), ("nesting_depth", "_squash", "MathScorer.score", "MathScorer._capped", "MathScorer._cached",
        "MathScorer._store")),
    Target("tags", "arpo_trl/tools/tags.py", (
        "tests/test_tags.py", *_FUZZ_TAGS, "tests/test_rollout.py::test_cut_when_the_tag_ends_inside_a_token",
        "tests/test_rollout.py::test_straddling_token_is_rewritten",
    )),
    Target("budget", "arpo_trl/rollout/arpo.py", ("tests/test_budget.py", *_ROLLOUT_FAST), (
        "BranchingSampler._fill_up", "BranchingSampler.capacity", "BranchingSampler.forking",
        "BranchingSampler.live_lines", "ForkShares.split", "ForkShares.shares", "ForkShares.remaining",
        "ForkShares.free")),
    Target("prefetch", "arpo_trl/runtime/prefetch.py", ("tests/test_prefetch.py", *_ROLLOUT_FAST)),
    # The fork rule only: the rest of the sampler is the path program, covered by the slower rollout tests.
    Target("fork_rule", "arpo_trl/rollout/arpo.py", ("tests/test_fork_rule.py", *_ROLLOUT_FAST), (
        "default_initial_rollouts", "BranchingSampler.fork_probability", "BranchingSampler._at_tool_result",
        "BranchingSampler.branch", "BranchingSampler._may_fork", "BranchingSampler._decide_fork")),
)


def existing_tests(tests: tuple[str, ...]) -> list[str]:
    """The target's test arguments whose file exists (new test files join a target once written)."""
    return [test for test in tests if (ROOT / test.split("::")[0]).exists()]


@dataclass
class Outcome:
    target: Target
    seconds: float = 0.0
    statuses: dict[str, str] = field(default_factory=dict)  # mutant name -> killed/survived/no tests/timeout/...
    diffs: dict[str, str] = field(default_factory=dict)  # survivors only

    def count(self, status: str) -> int:
        return sum(value == status for value in self.statuses.values())

    def summary(self) -> dict:
        total, killed, timeout = len(self.statuses), self.count("killed"), self.count("timeout")
        survived = self.count("survived") + self.count("no tests")
        return {
            "module": self.target.name, "path": self.target.path, "functions": list(self.target.functions),
            "tests": existing_tests(self.target.tests), "mutants": total, "killed": killed, "survived": survived,
            "timeout": timeout, "other": total - killed - survived - timeout,
            "score": round((killed + timeout) / total, 4) if total else None, "seconds": round(self.seconds, 1),
            "survivors": [{"name": name, "status": status, "diff": self.diffs.get(name, "")}
                          for name, status in sorted(self.statuses.items(), key=lambda item: _natural(item[0]))
                          if status in ("survived", "no tests", "other")],
        }


def _natural(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("__mutmut_")
    return stem, int(number) if number.isdigit() else 0


def status_of(exit_code: int | None) -> str:
    if exit_code in KILLED_CODES:
        return "killed"
    if exit_code in SURVIVED_CODES:
        return "survived"
    if exit_code in NO_TESTS_CODES:
        return "no tests"
    if exit_code in TIMEOUT_CODES:
        return "timeout"
    return "other"  # not checked, suspicious, segfault: listed with the survivors


def prepare_copy(target: Target, workdir: Path) -> None:
    """The package, the tests and pyproject.toml, with a `[tool.mutmut]` section for this target."""
    for name in ("arpo_trl", "tests", "benchmarks"):  # some tests load a benchmark script
        shutil.copytree(ROOT / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
    config = {
        "source_paths": ["arpo_trl/"], "only_mutate": [target.path], "also_copy": ["benchmarks/"],
        "pytest_add_cli_args_test_selection": existing_tests(target.tests), "pytest_add_cli_args": PYTEST_ARGS,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in config.items()]
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (workdir / "pyproject.toml").write_text(text + "\n[tool.mutmut]\n" + "\n".join(lines) + "\n", encoding="utf-8")


def run_target(target: Target, workers: int, log_dir: Path | None) -> Outcome:
    outcome, start = Outcome(target), time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    mutmut = [str(MUTMUT)]
    with tempfile.TemporaryDirectory(prefix=f"mutation-{target.name}-") as tmp:
        workdir = Path(tmp)
        prepare_copy(target, workdir)
        run = subprocess.run([*mutmut, "run", "--max-children", str(workers), *target.mutant_globs()], cwd=workdir,
                             env=env, capture_output=True, text=True)
        if log_dir is not None:
            (log_dir / f"{target.name}.log").write_text(run.stdout + run.stderr, encoding="utf-8")
        meta = workdir / "mutants" / f"{target.path}.meta"
        if run.returncode != 0 or not meta.exists():
            raise RuntimeError(f"mutmut failed on {target.name} (exit {run.returncode}):\n"
                               f"{(run.stdout + run.stderr)[-4000:]}")
        codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        globs = target.mutant_globs()
        for name, code in codes.items():
            if any(fnmatch.fnmatchcase(name, glob) for glob in globs):
                outcome.statuses[name] = status_of(code)
        for name, status in outcome.statuses.items():
            if status != "killed" and status != "timeout":
                show = subprocess.run([*mutmut, "show", name], cwd=workdir, env=env, capture_output=True, text=True)
                outcome.diffs[name] = "\n".join(line for line in show.stdout.splitlines()
                                                if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))
    outcome.seconds = time.monotonic() - start
    return outcome


def markdown_table(summaries: list[dict]) -> str:
    rows = ["| module | mutants | killed | survived | timeout | score |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in summaries:
        score = "n/a" if s["score"] is None else f"{100 * s['score']:.1f} %"
        rows.append(f"| {s['module']} | {s['mutants']} | {s['killed']} | {s['survived']} | {s['timeout']} | {score} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="*", choices=[t.name for t in TARGETS], help="default: all")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--workers", type=int, default=1, help="mutmut worker processes (default 1)")
    parser.add_argument("--log-dir", type=Path, help="keep mutmut's output per target here")
    parser.add_argument("--update", action="store_true",
                        help="replace only the chosen targets' entries in an existing --output file")
    args = parser.parse_args(argv)
    if not MUTMUT.exists():
        parser.error(f"mutmut is not installed next to {sys.executable}: pip install -e '.[dev]'")
    chosen = [t for t in TARGETS if not args.targets or t.name in args.targets]
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    summaries = []
    for target in chosen:
        summaries.append(run_target(target, args.workers, args.log_dir).summary())
        print(f"{target.name}: {summaries[-1]['killed']}/{summaries[-1]['mutants']} killed "
              f"in {summaries[-1]['seconds']} s", file=sys.stderr, flush=True)
    if args.update and args.output.exists():
        fresh = {s["module"]: s for s in summaries}
        kept = {s["module"]: s for s in json.loads(args.output.read_text(encoding="utf-8"))["modules"]}
        summaries = [fresh.get(t.name) or kept[t.name] for t in TARGETS if t.name in fresh or t.name in kept]
    result = {"tool": "mutmut " + _mutmut_version(), "workers": args.workers,
              "seconds": round(sum(s["seconds"] for s in summaries), 1), "modules": summaries}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    brief = {**result, "modules": [{k: v for k, v in s.items() if k not in ("survivors", "tests")} for s in summaries]}
    print(json.dumps(brief, indent=2, ensure_ascii=False))
    print()
    print(markdown_table(summaries))
    return 0


def _mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


if __name__ == "__main__":
    sys.exit(main())
