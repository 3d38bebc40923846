"""Skip accounting kept on the device, reported through ``logging`` when the host reads anyway.

``update()`` folds each iteration's agreed ``found_inf`` into a small device tensor with tensor ops
only (no host read). The record is read, and new skips are logged on rank 0, when the host reads the
scaler anyway (``get_scale()``, ``state_dict()``, ``step_was_skipped``) or every ``log_interval``
updates (one host read then).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

__all__ = ["SkipRecord", "logger"]

logger = logging.getLogger("distscaler")

# Layout of the record tensor (float64 so that step numbers stay exact).
_NUM_SKIPPED, _LAST_STEP, _LAST_SCALE_BEFORE, _LAST_SCALE_AFTER = range(4)


class SkipRecord:
    """Device-side counters of skipped steps. ``record_`` never reads a value on the host."""

    def __init__(self) -> None:
        self._record: torch.Tensor | None = None  # (4,) float64 on the scale's device
        self._num_reported = 0
        self._init_num_skipped = 0  # restored from a checkpoint, folded in on the first update
        self.num_updates = 0  # host-side count of update() calls that consumed a verdict

    def record_(
        self, found_inf: torch.Tensor, scale_before: torch.Tensor, scale_after: torch.Tensor
    ) -> None:
        """Fold one iteration in. ``found_inf``, ``scale_*``: 0-dim float32 on one device."""
        self.num_updates += 1
        device = found_inf.device
        if self._record is None:
            self._record = torch.zeros(4, dtype=torch.float64, device=device)
            self._record[_NUM_SKIPPED] = self._init_num_skipped
        skipped = found_inf > 0
        candidate = torch.stack(
            [
                self._record[_NUM_SKIPPED] + 1,
                torch.full((), self.num_updates, dtype=torch.float64, device=device),
                scale_before.to(torch.float64),
                scale_after.to(torch.float64),
            ]
        )
        self._record = torch.where(skipped, candidate, self._record)

    def host_values(self) -> list[float] | None:
        """The record as host floats (a host read), or None before the first update."""
        return None if self._record is None else self._record.tolist()

    def report(self, values: list[float] | None, world_size: int) -> None:
        """Log skips not reported yet (rank 0 only). ``values`` comes from ``host_values()``."""
        if values is None:
            return
        num_skipped = int(values[_NUM_SKIPPED])
        if num_skipped <= self._num_reported:
            return
        new = num_skipped - self._num_reported
        self._num_reported = num_skipped
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        logger.info(
            "distscaler: %d optimizer step(s) skipped for inf/NaN gradients since the last report, "
            "agreed on all %d rank(s) (%d skipped in %d steps so far); the last at step %d: "
            "loss scale %g -> %g",
            new,
            world_size,
            num_skipped,
            self.num_updates,
            int(values[_LAST_STEP]),
            values[_LAST_SCALE_BEFORE],
            values[_LAST_SCALE_AFTER],
        )

    def num_skipped(self, values: list[float] | None) -> int:
        """Total skipped steps, from ``host_values()`` (or the restored count before any update)."""
        return self._init_num_skipped if values is None else int(values[_NUM_SKIPPED])

    def restore(self, num_updates: int, num_skipped: int) -> None:
        """Continue the counts of a checkpointed run (step numbers in the log stay global)."""
        self.num_updates = num_updates
        self._init_num_skipped = num_skipped
        self._num_reported = num_skipped
        if self._record is not None:
            self._record[_NUM_SKIPPED] = num_skipped
