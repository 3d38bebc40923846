"""torchft's heals as the torchft check sees them: the scaler's part of a healed state, and when the
heal check (the comparison of the state across replica groups) is due.

A heal check is due on every group from a quorum change, or a step where some group of the quorum
did not participate (it healed), until a step where every group participates and no group that
healed is named. A group that healed compares as ``REJOINED`` until it passes one.
"""

from __future__ import annotations

from typing import Any

from .._scaler import GradScaler

__all__ = ["Heal"]


class Heal:
    """One replica group's heals, on its ``manager`` (a torchft ``Manager``); ``key``: the
    scaler's entry in torchft's healed state."""

    def __init__(self, scaler: GradScaler, manager: Any, key: str) -> None:
        self.scaler, self.manager, self.key = scaler, manager, key
        self.preloaded: Any = None
        self.seen_quorum: Any = None
        self.due = True  # a new process: its first step where every group participates
        self.rejoined = False

    def preload(self) -> None:
        """With the async quorum torchft applies a healing group's staged state only inside
        ``should_commit()``, after the check would have unscaled by the stale scale: the scaler's
        part is taken now (the rest follows in should_commit). Waits for the quorum."""
        manager = self.manager
        if getattr(manager, "_quorum_future", None) is None:
            return  # no quorum started (start_quorum / OptimizerWrapper.zero_grad not called)
        manager.wait_quorum()  # the gradient average already waited for it
        if not manager._healing:
            return
        pending = manager._pending_state_dict
        state = None if pending is None else pending.get("user", {}).get(self.key)
        if state is not None:
            self.scaler.load_state_dict(state)
            self.preloaded = state

    def load(self, state: Any) -> None:
        """torchft's load function for ``key``: this group healed, so its next step where every
        group participates compares its state."""
        self.rejoined = self.due = True
        if state is self.preloaded:  # taken before the check (`preload`)
            self.preloaded = None
        else:
            self.scaler.load_state_dict(state)

    def note_quorum(self, replica_rank: int | None, num_participants: int) -> None:
        """The step's quorum: a heal check is due from a new quorum or a group that healed."""
        quorum = getattr(self.manager, "_quorum_id", None)
        if (quorum != self.seen_quorum or replica_rank is None
                or num_participants < self.quorum_size()):  # fmt: skip
            self.due = True
        self.seen_quorum = quorum

    def checked(self, verified: bool, keep_due: bool) -> None:
        """A heal check ran: it stays due where a group that healed was named (``keep_due``);
        this group compares as a reference once it passed (``verified``)."""
        self.due = self.due and keep_due
        self.rejoined = self.rejoined and not verified

    def quorum_size(self) -> int:
        """The replica groups in the quorum, participating or healing (torchft's cross-replica
        group)."""
        try:
            return int(self.manager._pg.size())
        except Exception:  # noqa: BLE001 - a group not configured yet: only the participants known
            return int(self.manager.num_participants())
