"""Exception types raised by distscaler, in one place."""

from __future__ import annotations

__all__ = [
    "MIN_SCALE_MESSAGE",
    "CallOrderError",
    "LossScaleAtMinimumError",
    "ReplicaMismatchError",
    "TrainingCollapsedError",
    "UnknownLayoutError",
]

#: DeepSpeed's message (``deepspeed/runtime/fp16/loss_scaler.py``), kept word for word.
MIN_SCALE_MESSAGE = (
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
)


class CallOrderError(RuntimeError, AssertionError):
    """A scaler method was called out of order (for example ``update()`` before any ``step()``).

    torch's ``GradScaler`` raises ``RuntimeError`` for some call-order mistakes and ``AssertionError``
    for others ("No inf checks were recorded prior to update."). This class derives from both, so code
    written against either type of torch's keeps working, while the messages keep torch's wording.
    """


class LossScaleAtMinimumError(RuntimeError):
    """An overflow would lower a scale already at ``min_scale`` (``raise_error_at_min_scale``).

    DeepSpeed raises a bare ``Exception`` with the same message
    ([`MIN_SCALE_MESSAGE`][distscaler.errors.MIN_SCALE_MESSAGE]); this is a subclass of it.
    """


class UnknownLayoutError(ValueError):
    """The layout of some gradients across the scaler's process group cannot be determined.

    Raised by ``clip_grad_norm_`` on every rank, before anything changes and before any collective,
    instead of returning a norm off by a factor of the number of replicas (see
    [`distscaler.layouts`][distscaler.layouts]).
    """


class ReplicaMismatchError(RuntimeError):
    """Replicas that must hold bit-identical gradients (or parameters) did not
    (``on_replica_mismatch="raise"``; see [`distscaler.replica_check`][distscaler.replica_check]).

    Raised on every rank of the scaler's group at the same step, before the optimizer steps and
    before the scale is updated. ``mismatch`` is the
    [`ReplicaMismatch`][distscaler.replica_check.ReplicaMismatch]: the step, what differed and the
    ranks named.
    """

    def __init__(self, mismatch: object) -> None:
        self.mismatch = mismatch
        describe = getattr(mismatch, "describe", None)
        super().__init__(
            "replica mismatch (silent data corruption?) at "
            + (describe() if describe else str(mismatch))
        )


class TrainingCollapsedError(RuntimeError):
    """Every step of the last ``collapse_window`` updates was skipped, or a parameter is
    non-finite (``on_collapse="raise"``; ``GradScaler``'s collapse watch).

    Raised on every rank of the scaler's group at the same update. ``report`` is the
    [`CollapseReport`][distscaler.telemetry.CollapseReport]: since which update, the causes of the
    skips, the scale's path, the replica or rank named.
    """

    def __init__(self, report: object) -> None:
        self.report = report
        describe = getattr(report, "describe", None)
        super().__init__(describe() if callable(describe) else str(report))
