"""Tree packing of one micro-batch: the rows' token prefixes merged into a trie, laid out as packed sequences.

A row is its real tokens (prompt, then completion, padding removed). Two rows that agree on their first k tokens
share those k trie nodes: identical context gives identical hidden states, so any shared prefix is computed once,
whether it is a GRPO group's prompt or the trunk of an ARPO tree. Each pack is a trie laid out in preorder, so the
subtree of the node in slot j is the slot range [j, end_j) and "slot i sees slot j" (j is i's ancestor or i itself)
is `j <= i < end_j`. A token's position id is its depth, as in its own unpacked row.

The log-probability of a row's token j is read at the slot of its parent (the node of token j-1), labelled with
token j. A parent with several children whose log-probabilities are needed (a fork point, or a GRPO group's last
prompt token) gets one copy of itself per further child: the copy has the parent's token and depth, sees the
parent's ancestors and itself, is seen by nobody, and so computes the parent's hidden state again with one more
label. That keeps one label per slot, which is what the fused LM head scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

IGNORE = -100  # the label of a slot whose log-probability nobody needs (as in TRL's and transformers' losses)


@dataclass
class _Node:
    token: int
    depth: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    labels: list[int] = field(default_factory=list)  # child tokens whose log-probability is read at this node
    slot: int = -1
    end: int = -1


@dataclass
class Pack:
    """One packed sequence: `tokens`, `depths` (position ids) and, per slot, `seen_from` (the slot range
    [start, end) of the slots that see it) and the label read there; copies carry the slot they copy."""

    tokens: list[int]
    depths: list[int]
    ends: list[int]  # a node slot j is seen by slots j..ends[j]-1 (nodes) and by the copies of those
    labels: list[int]
    copy_of: dict[int, int]  # copy slot -> the node slot it copies


class _Trie:
    def __init__(self) -> None:
        self.root = _Node(token=-1, depth=-1, parent=None)
        self.nodes = 0
        self.copies = 0

    def cost(self, row: Sequence[int], needed_from: int) -> int:
        """Slots that inserting `row` would add: its new nodes, and a copy for each label new at a labelled node."""
        node, copies = self.root, 0
        for j, token in enumerate(row):
            if j >= needed_from and node.labels and token not in node.labels:
                copies += 1
            child = node.children.get(token)
            if child is None:  # token j and every later one are new nodes, each with at most one label
                return copies + len(row) - j
            node = child
        return copies

    def insert(self, row: Sequence[int], needed_from: int) -> list[tuple[_Node, int]]:
        """Add `row`; return, for each needed token j >= needed_from, the node and label index it is read at."""
        node, readers = self.root, []
        for j, token in enumerate(row):
            if j >= needed_from:
                if token not in node.labels:
                    node.labels.append(token)
                    self.copies += len(node.labels) > 1
                readers.append((node, node.labels.index(token)))
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(token=token, depth=j, parent=node)
                self.nodes += 1
            node = child
        return readers

    def size(self) -> int:
        return self.nodes + self.copies


@dataclass
class PackedBatch:
    """Several packs padded to one length, and where each row's needed log-probabilities are read."""

    input_ids: torch.Tensor  # (P, L)
    position_ids: torch.Tensor  # (P, L)
    anchors: torch.Tensor  # (P, L): the node whose ancestors a slot sees (a copy's node; a node or padding: itself)
    ends: torch.Tensor  # (P, L): a node slot j is the ancestor of the slots in (j, ends[j]) (preorder subtree)
    nodes: torch.Tensor  # (P,): slots holding trie nodes; copies follow them, then padding
    labels: torch.Tensor  # (P, L): the token whose log-probability is read at each slot, or IGNORE
    gather_index: torch.Tensor  # (B, T) into the flattened (P*L) outputs, P*L = an always-zero slot
    lengths: list[int]  # slots of each pack holding a node or a copy (the rest is padding)

    def visible(self, device=None) -> torch.Tensor:
        """(P, 1, L, L) bool: query slot i may attend to key slot j (the dense mask SDPA and eager read), built on
        `device` from the O(L) indices, so that no L × L mask crosses from the host to a GPU."""
        anchors, ends, nodes = self.anchors.to(device), self.ends.to(device), self.nodes.to(device)
        index = torch.arange(self.input_ids.size(1), device=anchors.device)
        return sees(index[None, :, None], index[None, None, :], anchors[:, :, None], ends[:, None, :],
                    nodes[:, None, None])[:, None]

    def block_mask(self, device):
        """The same visibility as a FlexAttention `BlockMask` whose mask function reads O(L) indices per pack: the
        kernels skip fully masked blocks and read no L × L mask (`attn_implementation='flex_attention'`)."""
        from torch.nn.attention.flex_attention import create_block_mask

        anchors, ends, nodes = self.anchors.to(device), self.ends.to(device), self.nodes.to(device)

        def mask_mod(batch, head, query, key):
            return sees(query, key, anchors[batch, query], ends[batch, key], nodes[batch])

        packs, length = self.input_ids.shape
        return create_block_mask(mask_mod, packs, None, length, length, device=device)

    def gather(self, per_slot: torch.Tensor) -> torch.Tensor:
        """(P, L) per-slot values -> TRL's (B, T) layout, 0 where no log-probability is read (as TRL's own)."""
        flat = torch.cat([per_slot.reshape(-1), per_slot.new_zeros(1)])
        return flat[self.gather_index]


def _layout(trie: _Trie) -> tuple[Pack, dict[int, int]]:
    """Preorder slots for the nodes, then one slot per extra label of a node; returns the pack and, per node id,
    the slot of each of its labels (keyed by id(node) and label index)."""
    tokens, depths, ends, labels = [], [], [], []
    stack = list(reversed(trie.root.children.values()))
    order: list[_Node] = []
    while stack:
        node = stack.pop()
        node.slot = len(order)
        order.append(node)
        stack.extend(reversed(node.children.values()))
    for node in reversed(order):  # children come after their parent in preorder: fill ends bottom-up
        node.end = max((child.end for child in node.children.values()), default=node.slot + 1)
    copy_of: dict[int, int] = {}
    label_slots: dict[tuple[int, int], int] = {}
    for node in order:
        tokens.append(node.token)
        depths.append(node.depth)
        ends.append(node.end)
        labels.append(node.labels[0] if node.labels else IGNORE)
        label_slots[(id(node), 0)] = node.slot
    for node in order:
        for k, label in enumerate(node.labels[1:], start=1):
            slot = len(tokens)
            copy_of[slot] = node.slot
            tokens.append(node.token)
            depths.append(node.depth)
            ends.append(slot + 1)
            labels.append(label)
            label_slots[(id(node), k)] = slot
    return Pack(tokens, depths, ends, labels, copy_of), label_slots


def sees(query, key, anchor, key_end, nodes):
    """Whether slot `query` attends to slot `key` (tensors, broadcast): itself, or a node that is a strict ancestor
    of the query's anchor. So a node sees its ancestors and itself; a copy what its node sees except the node, and
    itself; padding only itself (no fully masked softmax row). In preorder, node j is a strict ancestor of node a
    exactly when j < a < end_j."""
    return (key == query) | ((key < nodes) & (key < anchor) & (anchor < key_end))


def pack_rows(rows: Sequence[Sequence[int]], prompt_lengths: Sequence[int], width: int,
              max_length: int | None, length_multiple: int = 1) -> PackedBatch:
    """Pack `rows` (real tokens: prompt then completion) into tries of at most `max_length` slots each (a row longer
    than that gets a pack of its own; a tree too large for one pack is split, its shared ancestors repeated in each).
    `prompt_lengths[r]` >= 1 tokens of row r are its prompt; completion token t of row r is token
    prompt_lengths[r] + t, and `width` is TRL's completion width T. The packs' common length is rounded up to a
    multiple of `length_multiple` with padding slots that see only themselves."""
    tries: list[_Trie] = [_Trie()]
    readers: list[tuple[int, list[tuple[_Node, int]]]] = []
    for row, prompt_length in zip(rows, prompt_lengths):
        trie = tries[-1]
        if max_length is not None and trie.size() and trie.size() + trie.cost(row, prompt_length) > max_length:
            trie = _Trie()
            tries.append(trie)
        readers.append((len(tries) - 1, trie.insert(row, prompt_length)))
    packs = [_layout(trie) for trie in tries]
    length = -(-max(len(pack.tokens) for pack, _ in packs) // length_multiple) * length_multiple
    input_ids = torch.zeros(len(packs), length, dtype=torch.long)
    position_ids = torch.zeros(len(packs), length, dtype=torch.long)
    labels = torch.full((len(packs), length), IGNORE, dtype=torch.long)
    anchors = torch.arange(length).repeat(len(packs), 1)
    ends = anchors + 1
    nodes = torch.tensor([len(pack.tokens) - len(pack.copy_of) for pack, _ in packs], dtype=torch.long)
    for p, (pack, _) in enumerate(packs):
        n = len(pack.tokens)
        input_ids[p, :n] = torch.tensor(pack.tokens)
        position_ids[p, :n] = torch.tensor(pack.depths)
        labels[p, :n] = torch.tensor(pack.labels)
        ends[p, :n] = torch.tensor(pack.ends)
        for copy, node in pack.copy_of.items():
            anchors[p, copy] = node
    zero_slot = len(packs) * length
    gather_index = torch.full((len(rows), width), zero_slot, dtype=torch.long)
    for r, (p, row_readers) in enumerate(readers):
        label_slots = packs[p][1]
        slots = [p * length + label_slots[(id(node), k)] for node, k in row_readers]
        gather_index[r, : len(slots)] = torch.tensor(slots, dtype=torch.long)
    return PackedBatch(input_ids, position_ids, anchors, ends, nodes, labels, gather_index,
                       [len(pack.tokens) for pack, _ in packs])


# ---- whether a pack pays -----------------------------------------------------------------------------------------
# Whether a packed forward is cheaper than TRL's padded rows: a FLOP estimate of both layouts of one chunk.
#
# A pack saves the positions its rows share, but all its slots attend within one sequence: with a dense mask (SDPA,
# eager) attention costs L² pairs per pack of L slots, and every pack is padded to the longest. A row longer than
# `tree_packing_max_length`, or rows that share little, can make the packs dearer than TRL's rows (B rows of the
# batch's width W: B·W positions, B·W² pairs). FlexAttention skips fully masked blocks, so there both layouts pay
# roughly the pairs they see: a slot sees its depth + 1 tokens, a padded row its causal triangle.
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
