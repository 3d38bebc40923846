"""The host's side of the skip record: totals folded in from the device, and the skip log.

``update()`` folds each iteration's agreed ``found_inf`` into a record kept on the device, with
tensor ops only. The host reads the record, adds its counts to the totals kept
here and logs new skips on rank 0 (logger ``"distscaler"``, INFO) whenever it reads the scaler
anyway (``get_scale()``, ``state_dict()``, ``step_was_skipped``...) and every ``skip_log_interval``
updates (one host read then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["SkipLog", "SkipTotals", "logger"]

logger = logging.getLogger("distscaler")


@dataclass(frozen=True, slots=True)
class SkipTotals:
    """Counts of a run so far (also across a resume).

    Attributes:
        num_updates: ``update()`` calls that consumed an agreed ``found_inf``.
        num_skipped: of those, the ones whose optimizer step(s) were skipped.
        last_skipped: the number (1-based) of the last skipped update, 0 before any.
        last_skipped_scale: the loss scale that update used (0.0 before any).
    """

    num_updates: int = 0
    num_skipped: int = 0
    last_skipped: int = 0
    last_skipped_scale: float = 0.0


class SkipLog:
    """Totals folded in from the device record, and which skips were logged already."""

    def __init__(self) -> None:
        self.folded = SkipTotals()
        self.num_reported = 0

    def totals(self, record: list[float] | None) -> SkipTotals:
        """The folded totals plus a device record read as host floats (None: nothing to add)."""
        t = self.folded
        if record is None:
            return t
        nu, ns, last, scale = record
        return SkipTotals(
            num_updates=t.num_updates + int(nu),
            num_skipped=t.num_skipped + int(ns),
            last_skipped=t.num_updates + int(last) if last > 0 else t.last_skipped,
            last_skipped_scale=scale if last > 0 else t.last_skipped_scale,
        )

    def fold(self, record: list[float]) -> None:
        """Keep the record's counts on the host (the device then zeroes its own)."""
        self.folded = self.totals(record)

    def restore(self, num_updates: int, num_skipped: int) -> None:
        """Continue the counts of a checkpointed run (step numbers in the log stay global)."""
        self.folded = SkipTotals(num_updates=num_updates, num_skipped=num_skipped)
        self.num_reported = num_skipped

    def report(self, totals: SkipTotals, scale_now: float, world_size: int) -> None:
        """Log skips not reported yet (rank 0 only)."""
        if totals.num_skipped <= self.num_reported:
            return
        new = totals.num_skipped - self.num_reported
        self.num_reported = totals.num_skipped
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        logger.info(
            "%d optimizer step(s) skipped for inf/NaN gradients since the last report, "
            "agreed on all %d rank(s) (%d skipped in %d steps so far); the last at step %d, at "
            "loss scale %g (now %g)",
            new,
            world_size,
            totals.num_skipped,
            totals.num_updates,
            totals.last_skipped,
            totals.last_skipped_scale,
            scale_now,
        )
