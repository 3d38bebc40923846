"""``metrics.jsonl`` (one JSON object per optimizer step) and ``summary.json``."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

__all__ = [
    "METRICS_NAME",
    "SUMMARY_NAME",
    "MetricsLog",
    "finite_or_none",
    "read_metrics",
    "step_record",
    "summarize",
    "write_summary",
]

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"


def finite_or_none(x: float) -> float | None:
    """``x``, or None where it is inf / NaN (JSON has no such numbers)."""
    return x if math.isfinite(x) else None


def step_record(
    step: int,
    *,
    loss: float,
    scale: float,
    skipped: bool,
    grad_norm: float,
    lr: float,
    **extra: Any,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: ``loss`` and ``grad_norm`` are None where non-finite. A skipped
    step's line also has ``overflow`` (in ``extra``): ``{"rank", "param", "kind"}`` for each
    gradient tensor that held inf/NaN (``GradScaler.report_overflow``)."""
    return {
        "step": step,
        "loss": finite_or_none(loss),
        "scale": scale,
        "skipped": skipped,
        "grad_norm": finite_or_none(grad_norm),
        "lr": lr,
        **extra,
    }


def read_metrics(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """The records of ``path`` with step <= upto_step (later ones were not checkpointed).

    A line that does not parse (a job killed while writing it) is dropped with a warning.
    """
    if not path.is_file():
        logger.warning("%s not found; the summary covers this run's steps only", path)
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON; dropped: %r", path, num, line[:80])
    return [r for r in records if r["step"] <= upto_step]


def summarize(records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The figures of ``summary.json`` computed from the metrics records, plus ``extra``."""
    scales = [r["scale"] for r in records]
    return {
        "steps": records[-1]["step"] if records else 0,
        "skipped_steps": sum(r["skipped"] for r in records),
        "num_growths": sum(b > a for a, b in zip(scales, scales[1:], strict=False)),
        "num_backoffs": sum(b < a for a, b in zip(scales, scales[1:], strict=False)),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        **extra,
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """``summary.json``, written atomically (a kill leaves the previous one or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


class MetricsLog:
    """``metrics.jsonl`` of a run, on rank 0: one line per step, each written as it completes.

    A resumed run keeps the lines up to its checkpoint's step and drops the later ones (they are
    run again), so the file holds every step exactly once. ``records`` holds them all.
    """

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        self.records = read_metrics(path, resume_step) if resume_step is not None else []
        # Rewrite rather than append: lines after the checkpoint are about to be run again.
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.records)
        tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def close(self) -> None:
        self._file.close()
