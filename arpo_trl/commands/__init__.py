"""The `arpo-trl` subcommands `arpo_trl.cli` dispatches to (`train`, `sft`, `evaluate`, `trees`: view and plot,
`memory_plan`) and what they share (`recipes`: the argument groups, the recipe parser and the one-line error;
`builders`: rewards, tools, the model and the datasets built from them; `eval_setup`: what an evaluation is given and
builds). A command never imports another.

May import: config, trainer, training, rollout, runtime, rewards, data, trees, generation, tools, server, colocate,
preflight.
"""
