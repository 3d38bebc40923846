"""The host's side of the skip counters: totals folded in from the device, and the skip log.

``update()`` folds each iteration's agreed ``found_inf`` into a record kept on the device, with
tensor ops only. The host reads the record, adds its counts to the totals kept
here and logs new skips on rank 0 (logger ``"distscaler"``, INFO) whenever it reads the scaler
anyway (``get_scale()``, ``state_dict()``, ``step_was_skipped``...) and every ``skip_log_interval``
updates (one host read then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch.distributed as dist

__all__ = ["CollapseReport", "CollapseWatch", "SkipLog", "SkipReport", "SkipTotals", "logger"]

logger = logging.getLogger("distscaler")


@dataclass(frozen=True, slots=True)
class SkipTotals:
    """Counts of a run so far (also across a resume).

    Attributes:
        num_updates: ``update()`` calls that consumed an agreed ``found_inf``.
        num_skipped: of those, the ones whose optimizer step(s) were skipped, each counted once
            under one cause (`causes`), whatever else the step saw.
        last_skipped: the number (1-based) of the last skipped update, 0 before any.
        last_skipped_scale: the loss scale that update used (0.0 before any).
        replica_mismatches: skipped steps whose cause was a replica mismatch with no agreed
            inf/NaN (the scale did not move); the replica ledger's ``skipped``, the same number.
            A mismatch where some rank held inf/NaN that the overflow check saw is an overflow.
        not_committed: skipped steps whose cause was torchft not committing them (the scale did
            not move).
        other_causes: skipped steps of the other causes a check on the collective gave
            ([`distscaler.checks`][distscaler.checks]; the scale did not move), as ``(cause,
            count)`` pairs.
    """

    num_updates: int = 0
    num_skipped: int = 0
    last_skipped: int = 0
    last_skipped_scale: float = 0.0
    replica_mismatches: int = 0
    not_committed: int = 0
    other_causes: tuple[tuple[str, int], ...] = ()

    @property
    def overflows(self) -> int:
        """Skipped steps whose cause was inf/NaN gradients: the agreed ``found_inf`` was 1.0 and
        the scale backed off (a replica mismatch that held the inf/NaN too is one)."""
        other = sum(n for _, n in self.other_causes)
        return self.num_skipped - self.replica_mismatches - self.not_committed - other

    @property
    def causes(self) -> dict[str, int]:
        """Skipped steps per cause: ``overflow``, ``replica_mismatch``, ``not_committed``, then
        any other cause a check gave; they sum to ``num_skipped``."""
        return {
            "overflow": self.overflows,
            "replica_mismatch": self.replica_mismatches,
            "not_committed": self.not_committed,
            **dict(self.other_causes),
        }

    def describe(self) -> str:
        """``skipped steps: 3 of 50 (overflow 1, replica_mismatch 1, not_committed 1)``."""
        causes = ", ".join(f"{k} {v}" for k, v in self.causes.items() if v)
        return f"skipped steps: {self.num_skipped} of {self.num_updates}" + (
            f" ({causes})" if causes else ""
        )


#: The causes `SkipTotals` names with a field of their own (``overflow`` is what is left).
_NAMED_CAUSES = ("replica_mismatch", "not_committed")


class SkipLog:
    """Totals folded in from the device record, and which skips were logged already."""

    def __init__(self) -> None:
        self.folded = SkipTotals()
        self.num_reported = 0
        #: Skips whose cause only the host knows (a replica mismatch, an uncommitted step).
        self.host_causes: dict[str, int] = {"replica_mismatch": 0, "not_committed": 0}

    def note_cause(self, cause: str) -> None:
        """Count a skipped update of a cause the host knows (its record is counted on the
        device like any skip)."""
        self.host_causes[cause] = self.host_causes.get(cause, 0) + 1

    def totals(self, counts: list[float] | None) -> SkipTotals:
        """The folded totals plus the skip counters read as host floats (None: nothing to add)."""
        t = self.folded
        causes = self.host_causes
        other = tuple((k, n) for k, n in causes.items() if k not in _NAMED_CAUSES)
        if counts is None:
            return replace(t, replica_mismatches=causes["replica_mismatch"],
                           not_committed=causes["not_committed"], other_causes=other)  # fmt: skip
        nu, ns, last, scale = counts
        return SkipTotals(
            num_updates=t.num_updates + int(nu),
            num_skipped=t.num_skipped + int(ns),
            last_skipped=t.num_updates + int(last) if last > 0 else t.last_skipped,
            last_skipped_scale=scale if last > 0 else t.last_skipped_scale,
            replica_mismatches=causes["replica_mismatch"],
            not_committed=causes["not_committed"],
            other_causes=other,
        )

    def fold(self, counts: list[float]) -> None:
        """Keep the skip counters' counts on the host (the device then zeroes its own)."""
        self.folded = self.totals(counts)

    def restore(self, num_updates: int, num_skipped: int, causes: dict[str, int]) -> None:
        """Continue the counts of a checkpointed run (step numbers in the log stay global),
        ``causes`` the skips of a cause the host knows among ``num_skipped``."""
        self.folded = SkipTotals(num_updates=num_updates, num_skipped=num_skipped)
        self.host_causes = {"replica_mismatch": 0, "not_committed": 0, **causes}
        self.num_reported = num_skipped

    def report(self, totals: SkipTotals, scale_now: float, world_size: int) -> None:
        """Log skips not reported yet (rank 0 only)."""
        if totals.num_skipped <= self.num_reported:
            return
        new = totals.num_skipped - self.num_reported
        self.num_reported = totals.num_skipped
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        causes = ", ".join(f"{k} {v}" for k, v in totals.causes.items() if v)
        if totals.overflows == totals.num_skipped:
            causes = ""  # inf/NaN only, as it says
        logger.info(
            "%d optimizer step(s) skipped for %s since the last report, agreed on all "
            "%d rank(s) (%d skipped in %d steps so far%s); the last at step %d, at loss scale %g "
            "(now %g)",
            new,
            "inf/NaN gradients" if not causes else "inf/NaN gradients or other causes",
            world_size,
            totals.num_skipped,
            totals.num_updates,
            f": {causes}" if causes else "",
            totals.last_skipped,
            totals.last_skipped_scale,
            scale_now,
        )


@dataclass(frozen=True, slots=True)
class CollapseReport:
    """A run that stopped training: every step of ``collapse_window`` updates in a row skipped,
    or a parameter non-finite. Identical on every rank of the scaler's group.

    Attributes:
        update: the update (1-based) at which it was seen.
        since: the first update of the run of skipped steps (``update`` for a non-finite
            parameter).
        causes: skipped steps per cause over that run (``overflow``, ``replica_mismatch``,
            ``not_committed``).
        scales: ``(update, loss scale)`` at each periodic read of the run, oldest first: the
            scale's path.
        named: what the scaler last named at fault: ranks of the last overflow report or replica
            mismatch, a torchft replica group (``"replica group 1"``); empty when nothing did.
        nonfinite_parameters: the parameter check saw a non-finite parameter.
    """

    update: int
    since: int
    causes: dict[str, int]
    scales: tuple[tuple[int, float], ...]
    named: tuple[str, ...] = ()
    nonfinite_parameters: bool = False

    def describe(self) -> str:
        """One paragraph for a log or an exception."""
        if self.nonfinite_parameters:
            what = f"a replicated parameter is non-finite at update {self.update}"
        else:
            n = self.update - self.since + 1
            causes = ", ".join(f"{k} {v}" for k, v in self.causes.items() if v)
            what = (
                f"every optimizer step was skipped for {n} updates in a row, since update "
                f"{self.since} ({causes})"
            )
        path = " -> ".join(f"{s:g}" for _, s in self.scales[-8:])
        who = f"; named at fault: {', '.join(self.named)}" if self.named else ""
        return f"distscaler: training collapsed: {what}; loss scale {path}{who}"


class CollapseWatch:
    """Watches the skip totals at each periodic read (the same update on every rank) for a run
    of skipped updates at least ``window`` long (0: never)."""

    def __init__(self) -> None:
        self.since = 0  # first update of the current run of skipped updates, 0: none
        self.seen = SkipTotals()
        self.scales: list[tuple[int, float]] = []
        self.fired = False
        self.start_causes: dict[str, int] = {}

    def observe(self, totals: SkipTotals, scale: float, window: int) -> tuple[int, dict[str, int]] | None:
        """Take the totals of a periodic read; returns ``(since, causes over the run)`` once when a
        run of skipped updates reaches ``window`` (again only after a clean update)."""
        updates = totals.num_updates - self.seen.num_updates
        skipped = totals.num_skipped - self.seen.num_skipped
        previous, self.seen = self.seen, totals
        if updates <= 0:
            return None
        if skipped < updates:  # a clean update in between: the run (if any) ended
            self.since, self.fired, self.scales = 0, False, []
            return None
        if not self.since:
            self.since = previous.num_updates + 1
            self.start_causes = previous.causes
        self.scales.append((totals.num_updates, scale))
        run = totals.num_updates - self.since + 1
        if window and run >= window and not self.fired:
            self.fired = True
            causes = {k: v - self.start_causes.get(k, 0) for k, v in totals.causes.items()}
            return self.since, causes
        return None


@dataclass(frozen=True, slots=True)
class SkipReport:
    """The most recent skipped optimizer step, whatever its cause
    ([`GradScaler.report_skip()`][distscaler.GradScaler.report_skip]); identical on every rank.

    Attributes:
        cause: ``"overflow"`` (inf/NaN gradients: the scale backed off), ``"replica_mismatch"``
            (replicas' gradients or parameters differed: the scale did not move) or
            ``"not_committed"`` (torchft did not commit the step: the scale did not move).
        update: the number (1-based) of that update.
        detail: the cause's own report: an ``OverflowReport`` (ranks and parameters; None with
            ``skip_log_interval=0``), a ``ReplicaMismatch`` (ranks), or for an uncommitted step
            the torchft integration's ``ReplicaOverflow`` when its own inf/NaN was the reason
            (else None).
    """

    cause: str
    update: int
    detail: object = None

    def describe(self) -> str:
        """One line: the cause and what its report names."""
        head = f"step {self.update} was skipped ({self.cause.replace('_', ' ')})"
        describe = getattr(self.detail, "describe", None)
        return f"{head}: {describe()}" if callable(describe) else head
