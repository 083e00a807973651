"""`arpo-trl eval --config recipe.yaml`: pass@k evaluation of a (trained) model with its tools.

    arpo-trl eval --config recipes/eval_quickstart.yaml [--any_field value ...]

As the reference evaluates (docs/reference.md#evaluation): no branching, `n_samples` whole trajectories per question
(`BranchingSampler` with branch_policy='none'), the answer is the last `\\boxed{}` inside `<answer>` of what the model
wrote (never inside a tool result), scored by the row's metric (`eval_metrics.row_metric`: math equivalence with
`math-verify`, SQuAD F1/EM, or the letter of a multiple-choice answer). Reported per seed and as mean ± std over
`seeds`: pass@1 (mean correctness), pass@k (the unbiased estimator of Chen et al. 2021, `1 - C(n-c, k) / C(n, k)`),
mean F1/EM, the format-valid rate, tool-call statistics, finish reasons, tokens generated and wall time; with several
sources (the `task` column), pass@k and scores per source too. Writes `<output_dir>/eval_results.json` (config,
summary, per-seed metrics, per-question records with completions) and `eval_results.md`, and prints the tables.
Scoring and metrics: `arpo_trl.rewards.eval_metrics`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from arpo_trl.commands.eval_setup import RESULTS_FILE, EvalArguments, EvalSetup, prepare, prompt_ids
from arpo_trl.commands.recipes import fail, one_line_parser
from arpo_trl.rewards.eval_metrics import (
    ground_truth,
    pass_at_k,
    question_text,
    row_metric,
    row_source,
    score_paths,
    seed_metrics,
    seed_table,
    source_table,
    summarize,
)
from arpo_trl.rewards.math_scoring import configure_math_scoring


# ---- the run ----------------------------------------------------------------------------------------------------
def run_seed(args: EvalArguments, setup: EvalSetup, sampler, seed: int) -> tuple[dict[str, float], list[dict]]:
    """One pass over the dataset: `n_samples` trajectories per question, scored; returns (metrics, records)."""
    import torch

    torch.manual_seed(seed)
    sampler.rule.reseed(seed)
    tags = [tool.tag for tool in setup.tools]
    rows, records, start = list(setup.dataset), [], time.perf_counter()
    for begin in range(0, len(rows), args.batch_size):
        batch = rows[begin : begin + args.batch_size]
        if hasattr(sampler.call_format, "prompt_ids"):  # chat-template calls: tool schemas rendered in the prompt
            ids = sampler.call_format.prompt_ids([r["prompt"] for r in batch])
        else:
            ids = [prompt_ids(setup.tokenizer, r["prompt"]) for r in batch]
        result = sampler.sample(ids, num_generations=args.n_samples, branch_policy="none")
        for offset, (row, group) in enumerate(zip(batch, result.groups)):
            records.append(_record(args, setup, tags, seed, begin + offset, row, group))
        print(f"arpo-trl eval: seed {seed}: {len(records)}/{len(rows)} questions", file=sys.stderr, flush=True)
    return seed_metrics(records, args.k, tags, time.perf_counter() - start), records


def _record(args: EvalArguments, setup: EvalSetup, tags: list[str], seed: int, index: int, row: dict,
            group: list) -> dict:
    truth = ground_truth(row)
    metric = row_metric(row, setup.metric) if args.metric == "auto" else setup.metric
    completions = score_paths(group, truth, metric, lambda ids: setup.tokenizer.decode(ids, skip_special_tokens=True),
                              tags, args.require_answer_tag, args.save_completions)
    num_correct = int(sum(c["correct"] for c in completions))
    return {
        "seed": seed, "index": index, "question": question_text(row["prompt"]), "ground_truth": truth,
        "source": row_source(row), "metric": metric, "num_correct": num_correct,
        **{f"pass@{k}": pass_at_k(len(group), num_correct, k) for k in args.k}, "completions": completions,
    }


def evaluate(args: EvalArguments, setup: EvalSetup | None = None) -> dict:
    """Run the evaluation for every seed; write `eval_results.json` and `eval_results.md` into `output_dir`; return
    the results (`config`, `model`, `metric`, `summary`, `per_seed`, `records`, `table`). `setup` replaces the
    engine, tools and data built from `args` (tests, notebooks)."""
    from arpo_trl.rollout.tool_calls import make_call_format
    from arpo_trl.runtime import BranchingSampler

    setup = setup or prepare(args)
    configure_math_scoring(timeout=args.scoring_timeout, batch_timeout=max(8.0, args.scoring_timeout))
    call_format = make_call_format(args.tool_call_format, setup.tokenizer, setup.tools)
    sampler = BranchingSampler(
        setup.engine, setup.tokenizer, setup.tools, num_generations=args.n_samples, branch_policy="none",
        max_tool_calls=args.max_tool_calls, max_completion_length=args.max_completion_length,
        tool_timeout=args.tool_timeout, seed=args.seeds[0], call_format=call_format,
    )
    per_seed, records = [], []
    try:
        for seed in args.seeds:
            metrics, seed_records = run_seed(args, setup, sampler, seed)
            per_seed.append({"seed": seed, **metrics})
            records += seed_records
    finally:
        setup.close()
    summary, scored_by = summarize(per_seed), {}
    for record in records:
        scored_by.setdefault(record["source"], set()).add(record["metric"])
    scored_by = {source: sorted(metrics) for source, metrics in scored_by.items()}
    results = {"config": asdict(args), "model": setup.model, "metric": setup.metric, "metrics_by_source": scored_by,
               "summary": summary, "per_seed": per_seed, "records": records, "table": seed_table(per_seed, summary),
               "source_table": source_table(summary, scored_by)}
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / RESULTS_FILE).write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str))
    (output / "eval_results.md").write_text(results["table"] + "\n\n" + results["source_table"] + "\n")
    return results


# ---- the command ------------------------------------------------------------------------------------------------
def make_eval_parser():
    return one_line_parser((EvalArguments,), "arpo-trl eval")


def eval_command(argv: Sequence[str]) -> None:
    """`arpo-trl eval --config recipe.yaml [--flags]`: user mistakes end with one line and exit code 2."""
    from arpo_trl.rollout.tool_calls import make_call_format
    from arpo_trl.server.client import VLLMServerError

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        (args,) = make_eval_parser().parse_args_and_config(list(argv))
        setup = prepare(args)
        make_call_format(args.tool_call_format, setup.tokenizer, setup.tools)  # a template without tools: one line
    except (ValueError, FileNotFoundError, ImportError, VLLMServerError) as error:
        fail(error)
    results = evaluate(args, setup)
    print(results["table"] + "\n\n" + results["source_table"])
    print(f"Results written to {Path(args.output_dir) / RESULTS_FILE}.")
