"""Rollout shape: how long a rollout waits, ARPO vs GRPO vs random branching, with a synthetic agent (no model).

The synthetic agent is a real `GenerationEngine` over the test suite's BPE tokenizer: each segment is a run of filler
tokens (length uniform in the regime's range) ending with a `<python>` call (with the regime's probability, while
calls remain) or an answer and EOS; its tokens carry a per-token entropy drawn per segment. A request cut by its
token budget (ARPO's probe) is continued exactly by the next request from that point. The sampler, tag cutting,
fork rule, tools (real `Tool`s that sleep) and schedulers are the real ones.

Cost models, both labelled in the output:
* decode steps (no waiting): a batched GPU decoder's wave costs its longest segment, so a rollout costs its
  `critical_path_tokens` (waves scheduler: the sum of each wave's longest segment; events: the longest chain);
* simulated GPU server (wall time, `--token-ms`): every request takes (its tokens × a fixed time per token), all
  requests run concurrently, as continuous batching makes them on a GPU; tools sleep their latency. A request also
  waits `--request-steps` (1) token times before its first token: vLLM admits a request at its next step and prefills
  it, so a probe and its continuation cost one step more than one request (without it, the extra request was free).
  Not modelled: a real server's step time grows with its batch (here concurrency is unlimited, so tokens cost no wall
  time), and a real client parses the logprobs of every token while this engine decodes each prefix
  (docs/differences.md, "Rollout wall time on a simulated server").

The methods' rollouts alternate (rollout i of each method back to back): on a shared machine whose load drifts, each
ratio then compares rollouts made under the same load (run one method after the other, a load spike during one of
them gave a ratio of 3.2). `wall_s_paired_median` is the median of those per-rollout ratios.

    python benchmarks/rollout_shape.py                         # all regimes; JSON + tables
    python benchmarks/rollout_shape.py --regimes quickstart --rollouts 4
    python benchmarks/rollout_shape.py --regimes bias --thresholds 0.3 1.0   # order bias of fork slots

The bias regime reports the order-bias metric: two classes of global path differ in segment length and tool
latency, not in entropy; a fork-slot rule that does not depend on arrival order gives each class the share of
branches it has of global paths (|gap| <= 0.05 is the target).

Each rollout samples `--prompts` prompts; every method sees the same agent and fork seeds per rollout index
(paired), and ratios are of means over rollouts. `--speculation off`: no fill-ups run ahead of the rule
(`runtime/prefetch.py`; the hedge is its constant `HEDGE`, and `--fill-up-hedge`, which varied it, ran at 758a85e and
earlier; `--no-speculation` was `--speculation off` before 77a01e5, when the same estimate ran inside the rule).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny import build_tokenizer  # noqa: E402

from arpo_trl.generation.engine import EngineTraits, GenerationEngine, Segment  # noqa: E402
from arpo_trl.runtime import BranchingSampler  # noqa: E402
from arpo_trl.tools import Tool  # noqa: E402

QWEN_VOCAB = 151_665  # entropy is normalised by ln|V| of a Qwen-sized vocabulary, as in the paper's runs


@dataclass(frozen=True)
class Regime:
    name: str
    num_generations: int  # M
    initial_rollouts: int  # N
    max_calls: int
    segment_tokens: tuple[int, int]
    call_probability: float
    max_completion_length: int
    tool_seconds: tuple[float, float]  # latency uniform in [lo, hi]
    token_entropy: tuple[float, float] = (0.0, 1.0)  # nats per token, drawn per segment
    # A second class of global path (drawn per global path with this probability, inherited by its branches):
    # (probability, segment_tokens, tool_seconds). Its segments are written with another filler token, and its calls
    # with another argument, so that the agent and the tool know a path's class; entropy does not depend on it.
    fast_class: tuple[float, tuple[int, int], tuple[float, float]] | None = None


REGIMES = {
    "paper": Regime("paper-like: <=3 calls, 150-450-token segments, M=16 N=8", 16, 8, 3, (150, 450), 0.9, 2048,
                    (0.0, 0.0)),
    "quickstart": Regime("quickstart-like: <=2 calls, 15-45-token segments, M=8 N=4", 8, 4, 2, (15, 45), 0.4, 192,
                         (0.0, 0.0)),
    "jitter": Regime("paper-like with tool latency U(0.2 s, 2 s)", 16, 8, 3, (150, 450), 0.9, 2048, (0.2, 2.0)),
    "bias": Regime("two classes of path: half fast (5-25-token segments, tools U(0, 20 ms)), half slow (150-450, "
                   "U(0.2 s, 0.6 s)); entropy independent of class; M=16 N=8", 16, 8, 3, (150, 450), 0.9, 2048,
                   (0.2, 0.6), fast_class=(0.5, (5, 25), (0.0, 0.02))),
}
FAST_FILLER, SLOW_FILLER = "z", "x"  # the tokens a path of each class writes its segments with
METHODS = {"arpo": "entropy", "grpo": "none", "random": "random"}


class SyntheticAgent(GenerationEngine):
    """A scripted policy with a token-time cost. `token_seconds=0`: no waiting (decode-step model)."""

    traits = EngineTraits(event_driven=True)

    def __init__(self, tokenizer, regime: Regime, seed: int, token_seconds: float = 0.0, request_steps: int = 0):
        self.tokenizer, self.regime, self.token_seconds = tokenizer, regime, token_seconds
        self.request_steps = request_steps  # decode steps a request waits before its first token (see the docstring)
        self.vocab_size = QWEN_VOCAB
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.rng = random.Random(seed)
        self.filler = tokenizer.encode(SLOW_FILLER, add_special_tokens=False)
        self.fast_filler = tokenizer.encode(FAST_FILLER, add_special_tokens=False)
        self.call = tokenizer.encode("<python>1</python>", add_special_tokens=False)
        self.fast_call = tokenizer.encode("<python>0</python>", add_special_tokens=False)
        self.answer = tokenizer.encode("<answer>\\boxed{2}</answer>", add_special_tokens=False) + self.eos_token_ids
        self.pending: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}
        self.generated = 0.0  # tokens the engine generated, also for requests cancelled midway (pro rata)

    def _plan(self, prefix: list[int]) -> tuple[list[int], list[float]]:
        if (rest := self.pending.pop(tuple(prefix), None)) is not None:
            return rest
        text = self.tokenizer._decode(prefix)  # no per-id type checks (benchmark speed)
        calls, r = text.count("</result>"), self.regime
        fast = r.fast_class is not None and (FAST_FILLER in text or (SLOW_FILLER not in text and
                                                                     self.rng.random() < r.fast_class[0]))
        filler, call, lengths = (self.fast_filler, self.fast_call, r.fast_class[1]) if fast else \
            (self.filler, self.call, r.segment_tokens)
        tail = call if calls < r.max_calls and self.rng.random() < r.call_probability else self.answer
        ids = filler * self.rng.randint(*lengths) + tail
        return ids, [self.rng.uniform(*r.token_entropy)] * len(ids)

    def _segment(self, prefix: list[int], budget: int) -> Segment:
        ids, entropies = self._plan(list(prefix))
        if len(ids) > budget:
            self.pending[tuple(prefix) + tuple(ids[:budget])] = ids[budget:], entropies[budget:]
            return Segment(ids[:budget], [-1.0] * budget, entropies[:budget], "length")
        return Segment(ids, [-1.0] * len(ids), entropies, "eos" if ids[-1] in self.eos_token_ids else "stop")

    def generate(self, prefixes, max_new_tokens, stop):
        segments = [self._segment(p, b) for p, b in zip(prefixes, max_new_tokens)]
        time.sleep(self.token_seconds * max(len(s.token_ids) for s in segments))  # the batch runs concurrently
        self.generated += sum(len(s.token_ids) for s in segments)
        return segments

    async def agenerate(self, prefix, max_new_tokens, stop):
        segment, start = self._segment(prefix, max_new_tokens), time.perf_counter()
        try:
            await asyncio.sleep(self.token_seconds * (self.request_steps + len(segment.token_ids)))
        except asyncio.CancelledError:  # a fill-up run ahead and dropped: the server generated this much of it
            done = (time.perf_counter() - start) / self.token_seconds - self.request_steps if self.token_seconds \
                else len(segment.token_ids)
            self.generated += min(len(segment.token_ids), max(0.0, done))
            raise
        self.generated += len(segment.token_ids)
        return segment


class SlowTool(Tool):
    """Sleeps a latency drawn uniformly from its range; a fast-class path's call ('0') from the fast range."""

    def __init__(self, latency: tuple[float, float], seed: int, fast_latency: tuple[float, float] | None = None):
        super().__init__("python")
        self.latency, self.fast_latency, self.rng = latency, fast_latency or latency, random.Random(seed)

    def __call__(self, content: str) -> str:
        time.sleep(self.rng.uniform(*(self.fast_latency if content.strip() == "0" else self.latency)))
        return "2"


def class_counts(tokenizer, result) -> dict[str, dict]:
    """Per class of path: its global paths (the N lines; fill-ups, which never fork, are left out), its branches (a
    branch has its line's class), and the ΔH of the global paths' decisions (each segment after a tool result against
    the path's first)."""
    counts = {"population": {"fast": 0, "slow": 0}, "branches": {"fast": 0, "slow": 0},
              "deltas": {"fast": [], "slow": []}}
    for path in result.trajectories:
        name = "fast" if FAST_FILLER in tokenizer._decode(path.completion_ids) else "slow"
        if path.kind != "fill":
            counts["branches" if path.kind == "branch" else "population"][name] += 1
        if path.kind == "global" and path.initial_entropy is not None:
            counts["deltas"][name] += [h - path.initial_entropy for h in path.segment_entropies[1:]]
    return counts


def order_bias(counts: dict[str, dict]) -> dict:
    """The bias metric: the fast class's share of branches minus its share of global paths (0 when fork slots do
    not depend on who reaches a tool result first), pooled over the rollouts; and each class's mean ΔH (equal when
    the segment statistic does not depend on segment length)."""
    population, branches, deltas = counts["population"], counts["branches"], counts["deltas"]
    fast_population = population["fast"] / max(1, sum(population.values()))
    fast_branches = branches["fast"] / max(1, sum(branches.values()))
    return {"fast_population_share": round(fast_population, 4), "fast_branch_share": round(fast_branches, 4),
            "gap": round(fast_branches - fast_population, 4), "branches": sum(branches.values()),
            **{f"mean_delta_{name}": round(statistics.fmean(values), 3) if values else None
               for name, values in deltas.items()}}


def _counts() -> dict[str, dict]:
    return {"population": {"fast": 0, "slow": 0}, "branches": {"fast": 0, "slow": 0},
            "deltas": {"fast": [], "slow": []}}


def rollouts(tokenizer, regime: Regime, method: str, scheduler: str, args, counts: dict, threshold: float = 0.5):
    """`args.rollouts` successive rollouts of one sampler, as in training: one report per rollout, yielded as it ends
    (`run_paired` interleaves the methods' rollouts)."""
    policy = METHODS[method]
    token_seconds = args.token_ms / 1000 if scheduler.startswith("server") else 0.0
    engine = SyntheticAgent(tokenizer, regime, args.seed, token_seconds, args.request_steps)
    m = regime.num_generations
    fast_latency = regime.fast_class[2] if regime.fast_class else None
    tool = SlowTool(regime.tool_seconds, args.seed, fast_latency) if token_seconds else SlowTool((0.0, 0.0), args.seed)
    extra = {"segment_statistic": args.segment_statistic} if args.segment_statistic else {}
    sampler = BranchingSampler(
        engine, tokenizer, [tool],
        num_generations=m, initial_rollouts=m if policy == "none" else regime.initial_rollouts,
        branch_policy=policy, max_tool_calls=regime.max_calls, max_completion_length=regime.max_completion_length,
        seed=args.seed, scheduler=scheduler.split("/")[-1], max_tool_workers=64, tool_timeout=60.0,
        branch_threshold=threshold, speculation=args.speculation, **extra,
    )
    for rollout in range(args.rollouts):
        prompts = [tokenizer.encode(f"<|im_start|>user\nWhat is {i}+{rollout}?<|im_end|>\n<|im_start|>assistant\n")
                   for i in range(args.prompts)]
        generated = engine.generated
        result = sampler.sample(prompts)
        stats, groups = result.stats, len(result.groups)
        if any(len(group) != m for group in result.groups):
            raise AssertionError(f"a group does not hold exactly M={m} trajectories")
        for role, by_class in class_counts(tokenizer, result).items():
            for name, value in by_class.items():
                counts[role][name] += value
        yield {
            "critical_path_tokens": stats.critical_path_tokens, "waves": stats.waves,
            "unique_tokens_per_group": sum(t.own_tokens() for t in result.trajectories) / groups,
            "generated_tokens_per_group": (engine.generated - generated) / groups,
            "tool_calls_per_group": stats.tool_calls / groups,
            "discarded_tool_calls_per_group": stats.discarded_tool_calls / groups,
            "forks_per_group": stats.forks / groups, "fill_ups_per_group": stats.fill_ups / groups,
            "latest_fill_up_start_tokens": stats.latest_fill_up_start_tokens,
            "wall_s": stats.seconds, "overhead_fraction": stats.overhead_seconds / stats.seconds,
            # the simulated server: wall time beyond the longest chain's tokens (the sampler's own time and waits)
            "wall_beyond_chain_s": stats.seconds - token_seconds * stats.critical_path_tokens,
        }


def summarise(runs: list[dict], counts: dict, regime: Regime) -> dict:
    means = {key: statistics.fmean(r[key] for r in runs) for key in runs[0]}
    means["per_rollout"] = {key: [round(r[key], 3) for r in runs]
                            for key in ("wall_s", "critical_path_tokens", "latest_fill_up_start_tokens")}
    return {**means, "order_bias": order_bias(counts)} if regime.fast_class else means


def run_method(tokenizer, regime: Regime, method: str, scheduler: str, args, threshold: float = 0.5) -> dict:
    counts = _counts()
    return summarise(list(rollouts(tokenizer, regime, method, scheduler, args, counts, threshold)), counts, regime)


def run_paired(tokenizer, regime: Regime, methods: list[str], scheduler: str, args) -> dict[str, dict]:
    """The methods' rollouts in turn (rollout 0 of each, then rollout 1, ...): on a shared machine whose load
    drifts, each ratio compares rollouts made under the same load."""
    counts = {method: _counts() for method in methods}
    streams = {method: rollouts(tokenizer, regime, method, scheduler, args, counts[method]) for method in methods}
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for _ in range(args.rollouts):
        for method in methods:
            runs[method].append(next(streams[method]))
    return {method: summarise(runs[method], counts[method], regime) for method in methods}


BIAS_LIMIT = 0.05  # |fast share of branches - fast share of global paths| (issue 28)


def measure_bias(tokenizer, schedulers: list[str], args) -> dict:
    """The order-bias regime: ARPO at each τ of `--thresholds`, per scheduler; the gap must stay within BIAS_LIMIT."""
    regime = REGIMES["bias"]
    out = {f"{scheduler}/arpo/tau={tau}": run_method(tokenizer, regime, "arpo", scheduler, args, tau)
           for scheduler in schedulers for tau in args.thresholds}
    gaps = {name: run["order_bias"]["gap"] for name, run in out.items()}
    within = all(abs(gap) <= BIAS_LIMIT for gap in gaps.values())
    return {"regime": regime.name, "runs": out, "ratios": {},
            "order_bias": {"gaps": gaps, "limit": BIAS_LIMIT, "within": within}}


RATIO_KEYS = ("critical_path_tokens", "wall_s", "unique_tokens_per_group", "generated_tokens_per_group",
              "tool_calls_per_group")


def measure(tokenizer, regime_key: str, schedulers: list[str], args) -> dict:
    regime = REGIMES[regime_key]
    out = {f"{scheduler}/{method}": run
           for scheduler in schedulers for method, run in run_paired(tokenizer, regime, args.methods, scheduler,
                                                                      args).items()}
    ratios = {}
    for scheduler in schedulers:
        base = out.get(f"{scheduler}/grpo")
        for method in args.methods:
            if method != "grpo" and base:
                run = out[f"{scheduler}/{method}"]
                ratio = {key: round(run[key] / base[key], 3) for key in RATIO_KEYS}
                if scheduler.startswith("server"):  # issue 55: wall ratio <= generated-token ratio + 0.05
                    # rollout i of each method ran back to back: the median of their ratios shrugs off a load spike
                    ratio["wall_s_paired_median"] = round(statistics.median(
                        a / b for a, b in zip(run["per_rollout"]["wall_s"], base["per_rollout"]["wall_s"])), 3)
                    ratio["wall_beyond_chain_s_minus_grpo"] = round(run["wall_beyond_chain_s"] -
                                                                    base["wall_beyond_chain_s"], 3)
                    ratio["within_token_allowance"] = ratio["wall_s"] <= ratio["generated_tokens_per_group"] + 0.05
                ratios[f"{scheduler}/{method}_vs_grpo"] = ratio
    if "server/events" in schedulers and "server/waves" in schedulers:
        for method in args.methods:
            ratios[f"{method}_events_vs_waves_wall"] = round(
                out[f"server/events/{method}"]["wall_s"] / out[f"server/waves/{method}"]["wall_s"], 3)
    return {"regime": regime.name, "runs": out, "ratios": ratios}


def print_tables(report: dict) -> None:
    for key, section in report["regimes"].items():
        print(f"\n### {key}: {section['regime']}\n")
        print("| scheduler/method | critical-path tokens | waves | wall s | unique tokens/group | generated/group | "
              "tool calls/group (+discarded) | forks/group | fill-ups/group | sampler overhead |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in section["runs"].items():
            print(f"| {name} | {r['critical_path_tokens']:.0f} | {r['waves']:.1f} | {r['wall_s']:.2f} | "
                  f"{r['unique_tokens_per_group']:.0f} | {r['generated_tokens_per_group']:.0f} | "
                  f"{r['tool_calls_per_group']:.2f} (+{r['discarded_tool_calls_per_group']:.2f}) | "
                  f"{r['forks_per_group']:.2f} | {r['fill_ups_per_group']:.2f} | "
                  f"{100 * r['overhead_fraction']:.1f} % |")
        print()
        if "order_bias" in section:
            print("| run | fast share of global paths | fast share of branches | gap | branches | mean ΔH fast / slow|")
            print("|---|---|---|---|---|---|")
            for name, r in section["runs"].items():
                b = r["order_bias"]
                print(f"| {name} | {b['fast_population_share']:.3f} | {b['fast_branch_share']:.3f} | "
                      f"{b['gap']:+.3f} | {b['branches']} | {b['mean_delta_fast']} / {b['mean_delta_slow']} |")
            print(f"\nall gaps within ±{BIAS_LIMIT}: {section['order_bias']['within']}")
        for name, value in section["ratios"].items():
            print(f"- {name}: {value}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per method (paired seeds)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--token-ms", type=float, default=0.5, help="simulated server: milliseconds per token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-steps", type=int, default=1,
                        help="simulated server: decode steps a request waits before its first token")
    parser.add_argument("--speculation", choices=["auto", "off"], default="auto",
                        help="'off': no fill-ups run ahead of the rule (ablation)")
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.3, 1.0], help="τ values of the bias regime")
    parser.add_argument("--segment-statistic", choices=["mean", "sum"], default=None,
                        help="the sampler's segment entropy statistic (default: the sampler's own)")
    parser.add_argument("--schedulers", nargs="+", default=None,
                        help="only these of each regime's cost models (e.g. server/events)")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer()
    schedulers = {"paper": ["steps/waves", "steps/events", "server/events"],
                  "quickstart": ["steps/waves", "steps/events", "server/events"],
                  "jitter": ["server/waves", "server/events"], "bias": ["steps/waves", "server/events"]}
    if args.schedulers:
        schedulers = {key: [name for name in names if name in args.schedulers] for key, names in schedulers.items()}
    report = {"token_ms": args.token_ms, "request_steps": args.request_steps,
              "rollouts": args.rollouts, "prompts": args.prompts, "speculation": args.speculation,
              "segment_statistic": args.segment_statistic,
              "regimes": {key: measure_bias(tokenizer, schedulers[key], args) if key == "bias"
                          else measure(tokenizer, key, schedulers[key], args) for key in args.regimes}}
    print(json.dumps(report, indent=2))
    print_tables(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
