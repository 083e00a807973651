"""TRL's own `GRPOTrainer(tools=[python])` on an `arpo-trl train` recipe: the peer row of `arpo_vs_grpo.py`.

    python benchmarks/trl_peer.py --config recipes/arpo_vs_grpo_chat.yaml --seed 0 --output_dir runs/peer

This is what a user would pick instead of arpo-trl: TRL 1.16's built-in tool loop (`_tool_call_loop`: generate,
parse the chat template's tool calls, run them, append the tool turn masked out of the loss, continue; M independent
trajectories per prompt). It reads the same recipe as `arpo-trl train` (model, dataset, rewards, LoRA, M, token and
call budgets, sampling); the ARPO-only fields (branching, entropy, call format) are dropped and `max_tool_calls`
becomes TRL's `max_tool_calling_iterations`. The model must have a chat template TRL can parse tool calls from
(`recipes/multi_call_chat_sft.yaml` gives the cold-start model TRL's bundled `qwen2_5` template).

Both trainers run the same tool with the same schema: `python` wraps arpo-trl's sandboxed `PythonTool` and its JSON
schema is checked equal to `PythonTool.schema()`, which ARPO's `tool_call_format='chat_template'` renders. Rewards get
each completion's calls in the form ARPOTrainer passes them (`arpo_calls`, read from TRL's tool messages), so the
format check (-1 for a call that was not answered) is the same for both.

Besides TRL's own logs, `metrics.jsonl` gets the keys the benchmark reads from ARPO runs: `arpo/rollout_seconds`,
`arpo/tool_seconds`, `arpo/tool_calls_per_group` and `arpo/tokens_generated_per_group` (TRL counts model tokens
only, tool_mask = 1); every trajectory is generated in full, so the unique and trained tokens are the same.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def grpo_recipe(argv: list[str]) -> list[str]:
    """`argv` with its recipe rewritten for TRL: ARPO-only fields dropped, max_tool_calls renamed."""
    from trl import GRPOConfig

    from arpo_trl.config import ARPOConfig

    arpo_only = {f.name for f in fields(ARPOConfig)} - {f.name for f in fields(GRPOConfig)}
    at = argv.index("--config")
    recipe = yaml.safe_load(Path(argv[at + 1]).read_text())
    recipe["max_tool_calling_iterations"] = recipe.pop("max_tool_calls", 3)
    recipe = {key: value for key, value in recipe.items() if key not in arpo_only}
    file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(recipe, file)
    file.close()
    return [*argv[:at], "--config", file.name, *argv[at + 2:]]


def python_function(tool, seconds: list[float]):
    """`tool` as the typed, documented callable TRL's `tools=` takes; its schema is PythonTool's."""
    from transformers.utils import get_json_schema

    def python(code: str):  # no return annotation: get_json_schema would add a "return" key PythonTool's lacks
        start = time.perf_counter()
        try:
            return tool(code)
        finally:
            seconds.append(time.perf_counter() - start)

    schema = tool.schema()["function"]
    python.__doc__ = (f"{schema['description']}\n\n    Args:\n        code: "
                      f"{schema['parameters']['properties']['code']['description']}\n")
    if get_json_schema(python) != tool.schema():
        raise RuntimeError(f"the TRL tool's schema {get_json_schema(python)} differs from PythonTool's "
                           f"{tool.schema()}: the two trainers would prompt differently.")
    return python


def trl_calls(completion) -> list[dict]:
    """A TRL tool-loop completion's calls as ARPOTrainer's `arpo_calls` dicts: answered when a tool message
    follows the call (TRL stops at `max_tool_calling_iterations` and leaves the last calls unanswered)."""
    calls, messages = [], list(completion) if isinstance(completion, list) else []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        answers = next((n for n, m in enumerate(messages[index + 1:]) if m.get("role") != "tool"),
                       len(messages) - index - 1)
        for number, call in enumerate(message.get("tool_calls") or []):
            calls.append({"tool": (call.get("function") or {}).get("name"),
                          "result_start": 0 if number < answers else None})
    return calls


def with_trl_calls(reward):
    def wrapped(completions, **kwargs):
        return reward(completions, **{**kwargs, "arpo_calls": [trl_calls(c) for c in completions]})

    wrapped.__name__ = getattr(reward, "__name__", "reward")
    return wrapped


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, get_peft_config

    from arpo_trl.commands.builders import build_tools, load_dataset, load_reward, model_init_kwargs, resolve_model
    from arpo_trl.commands.recipes import ARPOScriptArguments, one_line_parser, parse_recipe
    from arpo_trl.training.tracking import MetricsFile

    argv = grpo_recipe(list(sys.argv[1:] if argv is None else argv))
    parser = one_line_parser((ARPOScriptArguments, GRPOConfig, ModelConfig), "trl_peer")
    script_args, args, model_args = parse_recipe(parser, argv, "train")
    args.model_init_kwargs = model_init_kwargs(model_args, args)  # as trl/scripts/grpo.py: dtype, attention, ...
    model = resolve_model(model_args.model_name_or_path)
    tools, seconds = build_tools(script_args), []
    if [t.tag for t in tools] != ["python"]:
        raise SystemExit(f"trl_peer runs the python tool only; the recipe has {[t.tag for t in tools]}.")
    dataset = load_dataset(script_args, script_args.dataset_train_split, "dataset_train_split", args.seed)
    trainer_class = timed_trainer(GRPOTrainer, seconds, args.num_generations)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset,
                            processing_class=AutoTokenizer.from_pretrained(model),
                            reward_funcs=[with_trl_calls(load_reward(n)) for n in script_args.reward_funcs],
                            tools=[python_function(tools[0], seconds)], peft_config=get_peft_config(model_args),
                            callbacks=[MetricsFile()])
    trainer.train()
    trainer.save_model(args.output_dir)
    tools[0].close()


def timed_trainer(base, tool_seconds: list[float], group_size: int):
    """`base` logging what ARPOTrainer logs about its rollouts: wall time of `_generate` (TRL 1.16's generation and
    tool loop), tool time, calls and model tokens per group (TRL's `_metrics` is where its own logs go)."""

    class TimedGRPOTrainer(base):
        def _generate(self, prompts):
            tool_seconds.clear()
            start = time.perf_counter()
            result = super()._generate(prompts)
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["arpo/rollout_seconds"].append(time.perf_counter() - start)
            metrics["arpo/tool_seconds"].append(sum(tool_seconds))
            calls, lengths = metrics.get("tools/call_frequency"), metrics.get("completions/mean_length")
            if calls:
                metrics["arpo/tool_calls_per_group"].append(calls[-1] * group_size)
                metrics["arpo/tool_calls_per_trajectory"].append(calls[-1])
            if lengths:
                metrics["arpo/tokens_generated_per_group"].append(lengths[-1] * group_size)
                metrics["arpo/tokens_trained_per_group"].append(lengths[-1] * group_size)
            return result

    return TimedGRPOTrainer


if __name__ == "__main__":
    main()
