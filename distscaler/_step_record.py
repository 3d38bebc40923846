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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .attribution import StepFlags, TensorFlags

if TYPE_CHECKING:
    from ._inf_check import StepResult
    from ._state import NextCounters
    from .checks import Reading

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
    #: What the checks that rode the collective read (`distscaler.checks.Reading`), settled by
    #: ``update()``.
    readings: list[Reading] = field(default_factory=list)
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
        self.readings += result.readings
        self.keep_flags(optimizer, result)

    @property
    def host_skip(self) -> bool:
        """A check's reading skips the step, known on the host (a step that is not fused skips)."""
        return any(reading.host_skip for reading in self.readings)

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """What the optimizer's step takes as ``found_inf``: ``found_inf`` as each check's reading
        gives it (`distscaler.checks.Reading.step_flag()`: 1.0 after a mismatch read on the host,
        a device maximum with a waiting reading's flag). A skip a check causes is not an overflow:
        the update still takes the agreed ``found_inf``."""
        for reading in self.readings:
            found_inf = reading.step_flag(found_inf, one)
        return found_inf

    def keep_flags(self, optimizer: torch.optim.Optimizer, result: StepResult) -> None:
        """Keep the per-tensor flags ``result`` took, if it took them (an iteration whose check
        already agreed reads the gradients again only for these)."""
        if result.flags_taken:
            flags = result.per_tensor_flags
            taken = None
            if flags is not None or result.clean_read:
                taken = TensorFlags(result.params, flags, result.flag_weights)
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
