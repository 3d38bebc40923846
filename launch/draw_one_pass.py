"""Draw the scaler phase on the Triton path as one picture: every gradient read once, the one
collective, the finish and the write pass (docs/one_pass.png, shown on the Concepts page).

    python launch/draw_one_pass.py --out docs/one_pass.png

The launch counts drawn are those `distscaler._triton.LAUNCHES` declares and
`tests/test_kernels.py` counts; nothing is measured here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from distscaler._triton import LAUNCHES  # noqa: E402

#: (title, body, face colour): the phase's stages, left to right.
STAGES = [
    (
        "gradients",
        "N tensors on one device\nfp32 / fp16 / bf16 mixed\n(addresses, sizes, dtypes\nin one device table)",
        "#eeeeee",
    ),
    (
        f"read kernel ({LAUNCHES['grad_pass'] - 1} launch)",
        "blocks spread over all tensors;\nevery element read once:\nmax |g| (inf/NaN flag),\n"
        "sum |g|^p (p = 1, 2; max for inf),\nchecksum moments A, B",
        "#cfe2f3",
    ),
    (
        "reduce kernel (1 launch)",
        "per-block partials summed\nin a fixed order (no float\natomics: the same bits\n"
        "every run) -> [found, norm_stat],\nper-tensor flags, moments,\n"
        "replica slots (integer sums)",
        "#cfe2f3",
    ),
    (
        "the one all_reduce",
        "[found, norm_stat]\n+ each contribution's slots\n(replica checksum, ...)\n"
        "SUM (or MAX, or one all_gather\nbeside a p = inf MAX)",
        "#fce5cd",
    ),
    (
        f"finish kernel ({LAUNCHES['finish']} launch)",
        "found_inf (0.0 / 1.0)\ntotal_norm = T / scale\n"
        "grad_scale =\nmax(scale, T / max_norm)\n(T = norm_stat ** (1/p))",
        "#cfe2f3",
    ),
    (
        f"write pass ({LAUNCHES['div_']} launch)",
        "only for a non-fused optimizer:\ngradients unscaled or clipped\nin place\n"
        "(a fused optimizer divides\nby grad_scale itself)",
        "#d9ead3",
    ),
]


def draw(out: Path) -> None:
    """Write the picture to ``out`` (PNG)."""
    width, height, gap = 3.4, 2.3, 0.5
    fig, ax = plt.subplots(figsize=(len(STAGES) * (width + gap) * 0.62, 2.6))
    for i, (title, body, colour) in enumerate(STAGES):
        x = i * (width + gap)
        ax.add_patch(
            FancyBboxPatch((x, 0), width, height, boxstyle="round,pad=0.04,rounding_size=0.12",
                           facecolor=colour, edgecolor="#444444", linewidth=1.0)  # fmt: skip
        )
        ax.text(x + width / 2, height - 0.22, title, ha="center", va="top", fontsize=8.5,
                fontweight="bold")  # fmt: skip
        ax.text(x + width / 2, height - 0.58, body, ha="center", va="top", fontsize=7.2,
                linespacing=1.35)  # fmt: skip
        if i:
            ax.add_patch(
                FancyArrowPatch((x - gap + 0.05, height / 2), (x - 0.05, height / 2),
                                arrowstyle="-|>", mutation_scale=12, color="#444444")  # fmt: skip
            )
    total = len(STAGES) * (width + gap) - gap
    ax.text(total / 2, -0.3,
            "the whole phase: 3 launches (fused optimizer) or 4 (unscale or clip in place) "
            "+ the collective, at any number of tensors",
            ha="center", va="top", fontsize=8.5, style="italic")  # fmt: skip
    ax.set_xlim(-0.1, total + 0.1)
    ax.set_ylim(-0.65, height + 0.1)
    ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/one_pass.png"),
                        help="the PNG to write (default: docs/one_pass.png)")  # fmt: skip
    draw(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
