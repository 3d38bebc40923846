"""The replica check's working part, behind [`distscaler.replica_check`][distscaler.replica_check]
(the ledger and the mismatch users see): `checksum` (the arithmetic), `check` (the check the
scaler holds, its contribution to the step's collective and its readings) and `naming` (the ranks
of a mismatch)."""

from .check import DeferredReading, MismatchReading, ReplicaCheck, ReplicaSlots

__all__ = ["DeferredReading", "MismatchReading", "ReplicaCheck", "ReplicaSlots"]
