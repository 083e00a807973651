"""Draws docs/images/tree_packing.png from the real packer: `python docs/images/tree_packing.py`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from arpo_trl.training.packing import IGNORE, pack_rows  # noqa: E402

NAMES = ["p1", "p2", "p3", "a", "<r>", "</r>", "b", "c", "d", "e", "f"]  # 4,5: a tool result inside the trunk
ROWS = [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 8, 9], [0, 1, 2, 10, 7]]  # ARPO fork after the tool result,
PROMPT = 3  # and a global path that shares only the prompt


def main() -> None:
    packed = pack_rows(ROWS, [PROMPT] * len(ROWS), max(map(len, ROWS)) - PROMPT, None)
    n = packed.lengths[0]
    tokens, depths = packed.input_ids[0, :n].tolist(), packed.position_ids[0, :n].tolist()
    labels, visible = packed.labels[0, :n].tolist(), packed.visible()[0, 0, :n, :n]
    copies = {i for i in range(n) for j in range(i)  # a copy: its node's token, depth and ancestors, not the node
              if (tokens[j], depths[j]) == (tokens[i], depths[i]) and not visible[i, j]
              and bool((visible[i, :j] == visible[j, :j]).all())}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1, 1.25]})
    for slot in range(n):
        parents = [j for j in range(slot) if visible[slot, j] and depths[j] == depths[slot] - 1]
        for parent in parents:
            left.plot([depths[parent], depths[slot]], [-parent, -slot], color="0.6", zorder=1,
                      linestyle="--" if slot in copies else "-")
        colour = "#f4a261" if slot in copies else "#8ecae6" if tokens[slot] < PROMPT else "#bde0a8"
        left.scatter(depths[slot], -slot, s=900, color=colour, edgecolor="k", zorder=2)
        left.text(depths[slot], -slot, NAMES[tokens[slot]], ha="center", va="center", fontsize=9, zorder=3)
        label = NAMES[labels[slot]] if labels[slot] != IGNORE else "–"
        left.text(depths[slot] + 0.35, -slot, f"slot {slot}, reads → {label}", va="center", fontsize=8)
    left.set_title("3 rows packed: the prompt (blue) and the trunk with its tool\nresult <r>…</r> once; "
                   "copies (orange) read a fork's other children", fontsize=10)
    left.set_xlabel("depth = position id")
    left.set_xlim(-0.6, max(depths) + 2.6)
    left.set_yticks([])
    for side in ("top", "right", "left"):
        left.spines[side].set_visible(False)
    right.imshow(visible.numpy(), cmap="Greens", vmin=-0.3, vmax=1.2)
    names = [NAMES[t] + ("'" if i in copies else "") for i, t in enumerate(tokens)]
    right.set_xticks(range(n), names, fontsize=8)
    right.set_yticks(range(n), [f"{i} {name}" for i, name in enumerate(names)], fontsize=8)
    right.set_title("Tree mask: query slot i sees key slot j iff j is i or an ancestor of i", fontsize=10)
    right.set_xlabel("key slot")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
