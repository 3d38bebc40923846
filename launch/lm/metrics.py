"""``metrics.jsonl`` (one JSON object per optimizer step) and ``summary.json``."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "METRICS_NAME",
    "SUMMARY_NAME",
    "PhaseTimer",
    "finite_or_none",
    "read_metrics",
    "step_record",
    "summarize",
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
    """One ``metrics.jsonl`` line: ``loss`` and ``grad_norm`` are None where non-finite."""
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


class PhaseTimer:
    """Wall time of a region (the job's scaler phase, a benchmark call) between ``start()`` and
    ``stop()``, in seconds. CUDA events on GPUs: no host sync until :meth:`seconds`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: tuple[Any, Any] | None = None
        self._t0 = 0.0
        self._dt = 0.0

    def start(self) -> None:
        if self.cuda:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._dt = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """Read after the step's own host reads (on CUDA it waits for the end event)."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._dt
