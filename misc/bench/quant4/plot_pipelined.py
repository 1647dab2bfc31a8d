"""The picture of H200-pipelined-6429fa1.md: each weight-only format's forward speed over the bf16 forward's, before
and after the weight-only loops were pipelined (issues 57, 58).

    python misc/bench/quant4/plot_pipelined.py   # writes misc/NVIDIA_H200_weight_only_pipelined.png
"""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "H200-pipelined-6429fa1.md")
OUT = os.path.join(HERE, "..", "..", "NVIDIA_H200_weight_only_pipelined.png")


def rows():
    """``(shape, format, M, x bf16 before, x bf16 after)`` of the table."""
    for line in open(TABLE):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[2].isdigit():
            yield cells[0], cells[1], int(cells[2]), float(cells[5]), float(cells[8])


def main():
    data = list(rows())
    shapes = list(dict.fromkeys(r[0] for r in data))
    formats = list(dict.fromkeys(r[1].split("-")[0] for r in data))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), sharey=True)
    for ax, shape in zip(axes, shapes):
        points = [r for r in data if r[0] == shape]
        ms = sorted({r[2] for r in points})
        width = 0.8 / len(formats)
        for i, fmt in enumerate(formats):
            of = {r[2]: r for r in points if r[1].split("-")[0] == fmt}
            xs = [j + (i - (len(formats) - 1) / 2) * width for j in range(len(ms))]
            label = next(r[1] for r in points if r[1].split("-")[0] == fmt)
            ax.bar(xs, [of[m][4] for m in ms], width, label=f"{label}, pipelined", color=f"C{i}")
            ax.scatter(xs, [of[m][3] for m in ms], color="black", marker="_", s=200, zorder=3,
                       label="before" if i == 0 else None)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(ms)), [f"M={m}" for m in ms])
        ax.set_title(shape)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("speed over the bf16 forward (same run)")
    fig.suptitle("Weight-only forwards on one H200 (Triton 3.6), before and after the pipelined loads")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
