"""``GradScaler``'s overflow attribution: :attr:`last_overflow`, :meth:`report_overflow`, and the
hook the periodic report calls. The records and the report are in :mod:`distscaler.attribution`;
this mixin reads the scaler through the attributes of the face it declares, each with its type
(``_enabled``, ``_config``, ``_overflows``, ``_verdict``, ``_records``, ``_read``,
``_device_state``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .attribution import OverflowReport, OverflowTracker
from .errors import CallOrderError
from .telemetry import SkipTotals

if TYPE_CHECKING:
    from .config import ScalerConfig
    from .state import DeviceState
    from .step_record import StepRecord
    from .verdict import VerdictGroup

__all__ = ["OverflowReportingAPI"]


class OverflowReportingAPI:
    """The overflow report's face on :class:`~distscaler.GradScaler` (a mixin)."""

    _enabled: bool
    _config: ScalerConfig
    _overflows: OverflowTracker
    _verdict: VerdictGroup
    _records: dict[int, StepRecord]

    def _read(self, *extra: torch.Tensor) -> Any:  # provided by GradScaler
        raise NotImplementedError

    def _device_state(self, funcname: str) -> DeviceState:  # provided by GradScaler
        raise NotImplementedError

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Which ranks and parameters held inf/NaN at the most recent skipped step reported, or None.

        Filled by the periodic skip report (every ``skip_log_interval`` updates, at the same update
        on every rank; with ``skip_log_interval=1`` it is current after every :meth:`update`), so
        it is identical on every rank of ``process_group``; never with ``skip_log_interval=0``.
        Reading it costs nothing (see :mod:`distscaler.attribution` for what it costs to fill).
        """
        return self._overflows.last_overflow

    def report_overflow(self) -> OverflowReport | None:
        """Attribute the most recent skipped step now, instead of at the next periodic report,
        and return :attr:`last_overflow`.

        For a loop that already reads the agreed skip flag (:attr:`step_was_skipped`) and wants the
        report of that very step. Every rank of ``process_group`` must call it at the same
        iteration, after :meth:`update`. Cost: one host read; when a skipped step is not yet
        attributed, one more and, at world size > 1, one ``all_gather`` of a fixed size
        (:mod:`distscaler.attribution`). None when disabled, with ``skip_log_interval=0``, or
        before any skipped step.

        Raises:
            CallOrderError: called after a verdict and before :meth:`update`.
        """
        if not self._enabled:
            return None
        if self._records:
            raise CallOrderError("report_overflow() must be called after update().")
        self._report(self._read()[2])
        return self.last_overflow

    # ------------------------------------------------------------------ hooks of the face

    @property
    def _attributing(self) -> bool:
        # Records are kept only while a periodic report will read them.
        return self._config.skip_log_interval > 0

    def _report(self, totals: SkipTotals) -> None:
        # The periodic report's attribution (every rank at the same update), or report_overflow's.
        if totals.last_skipped and self._attributing:
            group, world_size = self._verdict.resolve()
            self._overflows.report(
                totals.last_skipped,
                totals.last_skipped_scale,
                group=group,
                world_size=world_size,
                device=self._device_state("update").device,
            )
