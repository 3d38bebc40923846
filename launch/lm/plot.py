"""``metrics.png``: loss and loss scale per step, skipped steps marked, from ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["PLOT_NAME", "plot_metrics"]

PLOT_NAME = "metrics.png"


def plot_metrics(records: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Draw training loss (top) and loss scale (bottom, log2 axis) against the step.

    Skipped steps (some rank found inf/NaN) are red crosses on the scale curve,
    held-out losses are dots on the loss curve. Uses matplotlib's non-interactive Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=0.8, label="train loss (rank 0 batch)")
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot(*zip(*evals, strict=True), "o-", ms=4, label="held-out loss")
    ax_loss.set_ylabel("loss (nats/byte)")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)

    ax_scale.step(steps, [r["scale"] for r in records], where="post", lw=1.0, label="loss scale")
    skipped = [(r["step"], r["scale"]) for r in records if r["skipped"]]
    if skipped:
        ax_scale.plot(
            *zip(*skipped, strict=True),
            "rx",
            ms=6,
            label=f"skipped step ({len(skipped)}), every rank",
        )
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("optimizer step")
    ax_scale.legend(loc="lower right")
    ax_scale.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
