"""What one iteration decided for one optimizer: the scaler's typed per-step record.

`StepRecord` keeps what the inf check of ``GradScaler``'s entry points found (`keep()`:
``unscale_``, ``clip_grad_norm_``, the check ``step`` runs) and is read by ``step`` (the hand-off:
``found_inf``, ``grad_scale``) and ``update`` (``found_inf``, the next counters, the per-tensor
flags); ``update`` drops every record.

torch's ``GradScaler`` keeps its own per-optimizer state in ``_per_optimizer_states``, a
``defaultdict`` of ``{"stage", "found_inf_per_device"}`` dicts, which code written against torch
reads (torch's own tests, an optimizer of the deprecated ``grad_scaler=`` contract through
``_found_inf_per_device``). `torch_states()` gives that view of the records, so the records can hold
what torch's dicts do not without changing what torch's readers see.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .attribution import StepFlags, TensorFlags
from .replica_check import DeferredReading

if TYPE_CHECKING:
    from ._state import NextCounters

if TYPE_CHECKING:
    from ._inf_check import StepResult

__all__ = ["StepRecord", "torch_states"]


@dataclass(slots=True)
class StepRecord:
    """One optimizer's record of this iteration (between two ``update()`` calls)."""

    #: torch's call-order stage: READY, UNSCALED (an inf check ran) or STEPPED.
    stage: OptState = OptState.READY
    #: The agreed flag (0-dim float32, exactly 0.0 or 1.0), None before an inf check.
    found_inf: torch.Tensor | None = None
    #: What a fused step divides the gradients by (``scale / clip_coef``); None when they are
    #: already unscaled (after `unscale_()`, or a non-fused clip).
    grad_scale: torch.Tensor | None = None
    #: `clip_grad_norm_()` ran.
    clipped: bool = False
    #: The update's next counters, made by the inf check (None: the update makes them).
    next_counters: NextCounters | None = None
    #: The gradients' per-tensor flags for the overflow report; None: not taken yet.
    flags: StepFlags | None = None
    #: The replica check found replicas that differ: the step is skipped (not an overflow).
    replica_mismatch: bool = False
    #: The replica check's reading where it waits (`DeferredReading`): its mismatch flag, on the
    #: device, skips the step and holds the update.
    replica_pending: DeferredReading | None = None
    #: The optimizer of the record (its parameters, for the parameter check).
    optimizer: torch.optim.Optimizer | None = None

    def keep(
        self,
        optimizer: torch.optim.Optimizer,
        result: StepResult,
        *,
        stage: OptState | None = None,
        grad_scale: bool = True,
        counters: bool = True,
        clipped: bool = False,
    ) -> None:
        """Keep what an inf check found (`StepResult`): its ``found_inf``; its ``grad_scale`` (None
        where ``grad_scale`` is False: the gradients are already unscaled) and the update's counters
        it made (unless ``counters`` is False); its per-tensor flags for the overflow report where
        it took them; and the new ``stage``."""
        assert result.found_inf is not None
        self.optimizer = optimizer
        self.found_inf = result.found_inf
        self.grad_scale = result.grad_scale if grad_scale else None
        if counters:
            self.next_counters = result.next_counters
        if stage is not None:
            self.stage = stage
        if clipped:
            self.clipped = True
        reading = result.readings.get("replica")  # the replica check's
        if isinstance(reading, DeferredReading):
            self.replica_pending = reading
        elif reading is not None:
            self.replica_mismatch = True
        self.keep_flags(optimizer, result)

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """What the optimizer's step takes as ``found_inf``: 1.0 (``one``) after a replica mismatch
        read on the host, the maximum of ``found_inf`` and a deferred reading's mismatch flag (one
        op, on the device), else ``found_inf``. A mismatch is not an overflow: the update still
        takes the agreed ``found_inf``."""
        if self.replica_mismatch:
            return one
        if self.replica_pending is not None:
            return torch.fmax(found_inf, self.replica_pending.mismatch)
        return found_inf

    def keep_flags(self, optimizer: torch.optim.Optimizer, result: StepResult) -> None:
        """Keep the per-tensor flags ``result`` took, if it took them (an iteration whose check
        already agreed reads the gradients again only for these)."""
        if result.flags_taken:
            flags = result.per_tensor_flags
            taken = None
            if flags is not None or result.clean_read:
                taken = TensorFlags(result.params, flags)
            self.flags = StepFlags(optimizer, taken, result.flags_after_read)


def torch_states(records: dict[int, StepRecord]) -> defaultdict[int, dict[str, Any]]:
    """torch's ``_per_optimizer_states`` for ``records``: a ``defaultdict`` of torch's fresh
    state (``torch.amp.grad_scaler._refresh_per_optimizer_state``), one entry per record with its
    stage and ``found_inf_per_device`` (``{device: flag}``, empty before an inf check). A copy: torch's
    readers read it, nothing writes through it."""
    states: defaultdict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
    for key, record in records.items():
        found = record.found_inf
        states[key] = {
            "stage": record.stage,
            "found_inf_per_device": {} if found is None else {found.device: found},
        }
    return states
