"""Draws misc/dataflow.png: routing before and after sorting, and the fused tile pipeline.

    python misc/make_diagram.py        (needs matplotlib: pip install -e .[plot])

The routing panel is computed, not drawn by hand: it runs the pure-torch sorting reference on
the README's worked example and lays out exactly the arrays moe_sorting returns.
"""
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from fmoe2.reference import moe_sorting_reference  # noqa: E402

COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2"]
PAD = "#dddddd"


def cell(ax, x, y, text, color, w=1.0, h=1.0, fontsize=9):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
            color="white" if color != PAD else "black")


def routing_panel(ax):
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 2]])
    topk_weights = torch.tensor([[.6, .4], [.7, .3], [.5, .5], [.9, .1]])
    E, block_m, M = 4, 4, 4
    per_expert, _ = moe_sorting_reference(topk_ids, topk_weights, E, block_m)
    ax.text(0, 7.6, "token-by-token (router output)", fontsize=11, weight="bold")
    for t in range(M):
        ax.text(-0.3, 6.5 - t * 1.1 + 0.5, f"token {t}", ha="right", va="center", fontsize=9)
        for k in range(2):
            e = int(topk_ids[t, k])
            cell(ax, k * 1.6, 6.5 - t * 1.1, f"e{e}\n{float(topk_weights[t, k]):.1f}", COLORS[e], w=1.5)
    ax.text(5.2, 7.6, f"expert-by-expert after moe_sorting (block_m={block_m}, pad id = M = {M})",
            fontsize=11, weight="bold")
    col = 5.2
    for e in range(E):
        entries = per_expert[e]
        if not entries:
            ax.text(col, 4.0, f"expert {e}:\nno tokens,\nno tile", fontsize=8, color="gray")
            col += 1.3
            continue
        tiles = math.ceil(len(entries) / block_m)
        for tile in range(tiles):
            for r in range(block_m):
                i = tile * block_m + r
                y = 6.5 - r * 1.1
                if i < len(entries):
                    tok, w = entries[i]
                    cell(ax, col, y, f"t{tok}\n{w:.1f}", COLORS[e], w=1.1)
                else:
                    cell(ax, col, y, f"{M}\n0", PAD, w=1.1)
            ax.text(col + 0.55, 2.0, f"tile e{e}", ha="center", fontsize=8)
            col += 1.3
    ax.text(5.2, 0.9, "sorted_token_ids (actual token ids), sorted_weights travel with them;\n"
                      "sorted_expert_ids: one per tile; num_sorted_tiles stays on the device",
            fontsize=8.5)
    ax.set_xlim(-2, col + 0.5)
    ax.set_ylim(0.5, 8.2)
    ax.axis("off")


def pipeline_panel(ax):
    ax.text(0, 5.3, "one program of the fused kernel = (sorted tile of BLOCK_M tokens of expert e) "
                    "x (slice of BLOCK_N intermediate columns)", fontsize=11, weight="bold")
    boxes = [
        (0.0, "gather x rows\n[BLOCK_M, H]\nby sorted_token_ids", "#9c9ede"),
        (3.2, "gate+up GEMM over H\nfp32 acc [BLOCK_M, 2*BLOCK_N]\n(one dot: interleaved w13)", COLORS[0]),
        (6.4, "act(gate) * up\n* routing weight\n(registers)", COLORS[2]),
        (9.6, "down GEMM of the slice\n[BLOCK_M, BLOCK_N] x [BLOCK_N, H]\nin BLOCK_H chunks", COLORS[1]),
        (12.8, "relaxed atomic add\ninto out rows\n(zeroed by the sort)", COLORS[3]),
    ]
    for x, text, color in boxes:
        ax.add_patch(Rectangle((x, 1.5), 2.7, 2.4, facecolor=color, edgecolor="black", alpha=0.9))
        ax.text(x + 1.35, 2.7, text, ha="center", va="center", fontsize=8.5, color="white")
    for (x0, _, _), (x1, _, _) in zip(boxes, boxes[1:]):
        ax.add_patch(FancyArrowPatch((x0 + 2.7, 2.7), (x1, 2.7), arrowstyle="-|>", mutation_scale=15))
    ax.text(0, 0.6, "launch 1: moe_sorting (sort + zero out)    launch 2: this kernel over "
                    "num_tiles x ceil(I / BLOCK_N) programs    no intermediate buffer: y never leaves registers",
            fontsize=9)
    ax.set_xlim(-0.2, 15.8)
    ax.set_ylim(0, 5.8)
    ax.axis("off")


def main(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "dataflow.png")):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(16, 10), gridspec_kw={"height_ratios": [1.5, 1]})
    routing_panel(top)
    pipeline_panel(bottom)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
