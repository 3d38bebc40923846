"""What the torchft check reports: the errors it reports to torchft and the reports it keeps.

The errors go to ``manager.report_error`` (the group does not commit and heals or retries); the
reports are what [`distscaler.integrations.torchft`][distscaler.integrations.torchft] exports and
the scaler's properties and skip report give. Plain values: no torch, no torchft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "STATE_PARTS",
    "HealMismatch",
    "NonFiniteAfterAverage",
    "NotCommitted",
    "ReplicaDivergence",
    "ReplicaGradientMismatch",
    "ReplicaOverflow",
]

#: The parts of the state compared at the first step after a heal, in row order.
STATE_PARTS = ("parameters", "optimizer", "scaler")


class NonFiniteAfterAverage(RuntimeError):
    """Reported to torchft by the one group non-finite after the average (``report_lone_replica``)
    or by a healing group whose own gradients were: it does not commit and heals from a peer."""


class HealMismatch(RuntimeError):
    """Reported to torchft by a group whose state after a heal differs from its peers'."""


class ReplicaGradientMismatch(RuntimeError):
    """Reported to torchft by a group whose averaged gradients differ from its peers' (finite)."""


@dataclass(frozen=True, slots=True)
class ReplicaOverflow:
    """The replica group that alone held inf/NaN gradients after the average, at one step.

    Attributes:
        step: the manager step (``manager.current_step()`` before the step).
        replica_rank: its participating replica rank in that step's quorum (-1: healing).
        this_group: whether it is the group of this process.
        num_participants: replica groups participating in that step.
        reported: reported to torchft: that group did not commit and heals, the others stepped.
        healing: it was this group's heal step (torchft zeroes a healing group's part).
    """

    step: int
    replica_rank: int
    this_group: bool
    num_participants: int
    reported: bool
    healing: bool = False

    def describe(self) -> str:
        """One line for a log."""
        if self.healing:
            return (f"this replica group held inf/NaN gradients after the cross-replica average in "
                    f"its heal step {self.step}; it does not step or commit and heals again from a "
                    "peer, the others stepped")  # fmt: skip
        who = "this replica group" if self.this_group else f"replica group {self.replica_rank}"
        then = ("reported to torchft: it heals from a peer, the others stepped" if self.reported
                else "every group skipped the step")  # fmt: skip
        return (f"{who} (replica rank {self.replica_rank} of {self.num_participants}) alone held "
                f"inf/NaN gradients after the cross-replica average at step {self.step}; {then}")  # fmt: skip


@dataclass(frozen=True, slots=True)
class NotCommitted:
    """A step torchft did not commit on this replica group (``should_commit()`` returned False):
    the report of a ``not_committed`` skip ([`report_skip()`][distscaler.GradScaler.report_skip]).

    Attributes:
        step: the manager step (``manager.current_step()`` before the step).
        replica_id: this replica group's id as given to torchft's ``Manager``, or None.
        num_participants: replica groups participating in that step's quorum.
        error: what this rank reported to torchft in that step (``manager.errored()``), None
            where another rank of the group did (should_commit is the group's answer).
    """

    step: int
    replica_id: str | None
    num_participants: int
    error: str | None

    def describe(self) -> str:
        """One line for a log (the same on every rank of every group that did not commit)."""
        return (f"torchft did not commit step {self.step} on this replica group "
                f"({self.num_participants} replica groups took part): one of its ranks reported an "
                "error (manager.report_error), or too few replica groups took part; the scale did "
                "not move and the group heals or retries at the next quorum")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ReplicaDivergence:
    """Participating replica groups whose values differed at one step, the same on every group
    that compared them.

    Attributes:
        step: the manager step (``manager.current_step()`` before the step).
        what: ``"healed state"`` (the first step after a heal: parameters, optimizer state and
            scaler state) or ``"gradients"`` (the averaged gradients, every value finite).
        replica_ranks: the participating replica ranks named: the groups that healed and differ
            from the reference groups; else those that differ from the majority (with no
            majority, every group compared).
        this_group: whether this process's group is named.
        parts: the parts of the state that differed (``"parameters"``, ``"optimizer"``,
            ``"scaler"``) as seen by this group against the reference; empty for gradients.
        num_participants: replica groups participating in that step.
        reported: whether the named groups reported it to torchft: then they did not commit and
            heal again (or retry the step), the others stepped.
    """

    step: int
    what: Literal["healed state", "gradients"]
    replica_ranks: tuple[int, ...]
    this_group: bool
    parts: tuple[str, ...]
    num_participants: int
    reported: bool

    def describe(self) -> str:
        """One line for a log."""
        who = ", ".join(str(r) for r in self.replica_ranks)
        if self.what == "healed state":
            names = {"parameters": "parameters", "optimizer": "optimizer state",
                     "scaler": "scaler state"}  # fmt: skip
            parts = ", ".join(names[p] for p in self.parts) or "state"
            then = "they do not commit and heal again" if self.reported else "reported only"
            return (f"replica group(s) {who} (replica rank, of {self.num_participants}) differ in "
                    f"{parts} at step {self.step}, the first after their heal, from the groups they "
                    f"healed from; {then}")  # fmt: skip
        then = "they do not commit" if self.reported else "reported only"
        return (f"the averaged gradients of replica group(s) {who} (replica rank, of "
                f"{self.num_participants}) differ from the other groups' at step {self.step} "
                f"(every value finite: a silent corruption); {then}")  # fmt: skip
