"""Plot a run's metrics.jsonl: loss and loss scale per step, skipped steps marked.

    python launch/plot_metrics.py runs/default            # writes runs/default/metrics.png
    python launch/plot_metrics.py runs/default -o out.png

launch/train.py writes the same plot at the end of every run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lm.metrics import METRICS_NAME, read_metrics
from lm.plot import PLOT_NAME, plot_metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the --out folder of a training run")
    parser.add_argument(
        "-o", "--output", type=Path, help=f"PNG to write (default: RUN_DIR/{PLOT_NAME})"
    )
    args = parser.parse_args(argv)
    metrics = args.run_dir / METRICS_NAME
    if not metrics.is_file():
        parser.error(f"{metrics} not found: is {args.run_dir} the --out folder of a run?")
    records = read_metrics(metrics, upto_step=10**12)
    if not records:
        parser.error(f"{metrics} holds no step")
    out = plot_metrics(records, args.output or args.run_dir / PLOT_NAME, title=str(args.run_dir))
    print(out)


if __name__ == "__main__":
    main()
