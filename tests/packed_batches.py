"""Micro-batches of rollout trees built by construction (no sampling), in the layout TRL hands its loss: prompts
left-padded, completions right-padded, tool-result tokens at tool_mask 0, soft (B,) or hard (B, T) advantages."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from arpo_trl.training.advantages import hard_advantages, owner_mask, token_owners

# Paths of one prompt's tree: (parent path or None, fork position in the parent's completion, own tokens). Every path
# writes a tool call answered by a 3-token tool result at its own tokens 2..4, so forks at 6 or later share it.
TREES = {
    "grpo": [(None, 0, 9), (None, 0, 11), (None, 0, 7), (None, 0, 10)],  # no fork: only the prompt is shared
    "one_fork": [(None, 0, 12), (None, 0, 9), (0, 6, 7), (None, 0, 8)],
    "several_forks": [(None, 0, 14), (0, 6, 8), (0, 6, 5), (1, 10, 6)],  # a node with three children, a fork of a fork
}
TOOL_SPAN = slice(2, 5)


@dataclass
class Group:
    prompt: list[int]
    completions: list[list[int]]
    tool_bits: list[list[int]]
    parents: list[int | None]
    forks: list[int | None]


def build_group(rng: random.Random, vocab: int, prompt_length: int, paths) -> Group:
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_length)]
    group = Group(prompt, [], [], [], [])
    for parent, fork, own_length in paths:
        base = group.completions[parent][:fork] if parent is not None else []
        base_bits = group.tool_bits[parent][:fork] if parent is not None else []
        own = [rng.randrange(3, vocab) for _ in range(own_length)]
        bits = [1] * own_length
        bits[TOOL_SPAN] = [0] * len(bits[TOOL_SPAN])
        group.completions.append(base + own)
        group.tool_bits.append(base_bits + bits)
        group.parents.append(parent)
        group.forks.append(fork if parent is not None else None)
    return group


def micro_batch(trees: list, vocab: int, pad: int, attribution: str = "soft", truncate_row: int | None = None,
                seed: int = 0, prompt_lengths: list[int] | None = None) -> dict:
    """One micro-batch holding a group per tree (a name of `TREES` or a list of paths), TRL's loss-input keys.
    Prompts are 5, 7, 9, ... tokens unless `prompt_lengths` says otherwise."""
    rng = random.Random(seed)
    prompt_lengths = prompt_lengths or [5 + 2 * i for i in range(len(trees))]
    groups = [build_group(rng, vocab, prompt_lengths[i], TREES[tree] if isinstance(tree, str) else tree)
              for i, tree in enumerate(trees)]
    prompts = [g.prompt for g in groups for _ in g.completions]
    completions = [c for g in groups for c in g.completions]
    bits = [b for g in groups for b in g.tool_bits]
    p_width, width = max(map(len, prompts)), max(map(len, completions))
    rows = len(prompts)
    batch = {
        "prompt_ids": torch.tensor([[pad] * (p_width - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (p_width - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [pad] * (width - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions]),
        "tool_mask": torch.tensor([b + [1] * (width - len(b)) for b in bits]),
    }
    if truncate_row is not None:  # TRL's mask_truncated_completions: the whole completion leaves the mask
        batch["completion_mask"][truncate_row] = 0
    advantages = torch.linspace(-1.0, 1.2, rows)
    if attribution == "hard":
        ids = list(range(rows))
        offsets = [sum(len(g.completions) for g in groups[:i]) for i in range(len(groups))]
        parents = [None if p is None else p + offsets[i] for i, g in enumerate(groups) for p in g.parents]
        forks = [f for g in groups for f in g.forks]
        owners = token_owners(ids, parents, forks, [len(c) for c in completions], width)
        group_of = [i for i, g in enumerate(groups) for _ in g.completions]
        advantages = hard_advantages(advantages, owners, group_of)
        batch["tool_mask"] = batch["tool_mask"] * owner_mask(owners, ids)
    batch["advantages"] = advantages
    batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum()
    return batch
