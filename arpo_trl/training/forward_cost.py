"""Whether a packed forward is cheaper than TRL's padded rows: a FLOP estimate of both layouts of one chunk.

A pack saves the positions its rows share, but all its slots attend within one sequence: with a dense mask (SDPA,
eager) attention costs L² pairs per pack of L slots, and every pack is padded to the longest. A row longer than
`tree_packing_max_length`, or rows that share little, can make the packs dearer than TRL's rows (B rows of the
batch's width W: B·W positions, B·W² pairs). FlexAttention skips fully masked blocks, so there both layouts pay
roughly the pairs they see: a slot sees its depth + 1 tokens, a padded row its causal triangle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arpo_trl.training.packing import PackedBatch


@dataclass(frozen=True)
class ForwardCost:
    """FLOPs of one forward and backward, up to a common factor: `per_position` for the weights every position goes
    through (2 per parameter outside the embeddings), `per_pair` for one attention score and its value read."""

    per_position: float
    per_pair: float
    dense: bool  # attention computes every pair of a sequence, masked or not

    @classmethod
    def of(cls, model: torch.nn.Module, config, attn_implementation: str) -> ForwardCost:
        embeddings = model.get_input_embeddings().weight.numel()
        weights = sum(p.numel() for p in model.parameters()) - embeddings
        heads, layers = config.num_attention_heads, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(per_position=2.0 * weights, per_pair=4.0 * heads * head_dim * layers,
                   dense=attn_implementation != "flex_attention")

    def packed(self, packed: PackedBatch) -> float:
        packs, length = packed.input_ids.shape
        if self.dense:
            pairs = packs * length * length
        else:
            pairs = int((packed.position_ids.float() + 1).sum())  # padding's depth 0: one pair, as in the mask
        return packs * length * self.per_position + pairs * self.per_pair

    def unpacked(self, rows: int, width: int) -> float:
        pairs = rows * width * width if self.dense else rows * width * (width + 1) // 2
        return rows * width * self.per_position + pairs * self.per_pair
