"""The replica check: ranks that hold the same gradients prove it on the step's one collective.

After DDP's all_reduce (HSDP's reduce over its replicate dimension, the same over any group of
replicas) every replica holds **bit-identical** gradients. A rank whose gradients differ from its
replicas' after the reduce has had its memory or its compute corrupted (silent data corruption).
The check compares them where the scaler already reads every gradient and runs one collective:

1. **Checksum**: the replicated gradients of each of this rank's replica sets read as one stream
   of 16-bit words ``w_k`` (their bytes as signed ``int16``, in memory order: two words per
   float32 element, one per fp16/bf16 element; each tensor from a 32-word row's start), and four
   exact weighted sums of them, each modulo two primes ``P1 = 16,777,213``, ``P2 = 16,777,199``:
   the plain sum ``A``, the sum ``B`` weighted by position (shifted per replica), the sum ``C``
   weighted by the replica set's identity (its lowest and highest rank) and the sum ``R`` with
   keyed pseudo-random weights (per column of a row, and per row, replica and set, drawn from a
   secret that the group's first rank draws at the run's first check and broadcasts, once).
2. **Combined** so that each set's replicas cancel: each replica weighs its sums by a
   *coefficient* ``c`` (the set's sum to 0, never 0), shifts its positions by a distinct offset
   (``sum c * offset == 0``), and its keyed weights are the difference of its own and the next
   replica's; the eight residues, integers in ``[0, P)``, go into the step's collective as float32
   *limbs* (pieces of ``24 - ceil(log2 world_size)`` bits: 16 values up to 4,096 ranks, 32 at
   131,072), whose sum over the group is exact in any order.
3. **Reading**: the reduced limbs, put back together. When every replica holds the same gradients
   every residue is 0, on every rank alike (a function of the reduced values only). Otherwise the
   step is a replica mismatch.

**What is caught**, fault class by fault class with the counts measured by the tests:
[Silent data corruption](../silent-data-corruption.md#what-is-caught-and-what-is-not). In short:
any change of at most two 16-bit words always (one rank, two replicas, two replica sets; every
world size up to `MAX_WORLD_SIZE`; a rank's checked words per set below 2.1e9 at the largest set,
far more at smaller ones); any other change missed with probability at most ``(3 / P1) (3 /
P2) < 2**-44`` over the secret, at every check with torch's kernels and at every `INTERVAL`-th
update with the Triton kernels (their read takes ``A, B, C`` at every check and ``R``, keyed per
16-bit word, at those updates). A change the unscale erases before the checksum reads it is not
reported, and loses nothing.

**Exact, no float64.** Every sum is exact: float32 products whose sums stay below ``2**24`` in the
read, int64 residues after it, float32 limbs in the collective. The ops are float32 and int64
(CUDA, XPU, MPS and the CPU have them).

**On a mismatch only**, one gather over the group (``all_gather_single``; every rank calls it,
since every rank reads the same slots) exchanges each rank's per-set checksums (``A, B`` and the
keyed sum with the set's first replica's weights, modulo each prime, without coefficients) in a fixed-size int64 row on the collective's device (no pickling, so no
numpy); within each replica set the ranks that differ from the majority are named, and with no
majority (two replicas) all of the set's ranks are.

**Which gradients** (`LayoutResolver.replica_set()`): the layouts already know the replicas: DDP
(`GradScaler.register_model()`), FSDP1 ``NO_SHARD``/``HYBRID_SHARD``, DTensor gradients with
``Replicate`` placements (HSDP's replicate dimension, FSDP2 + TP's norms), ``grad_layout=
"replicated"`` (the whole group). Others (sharded gradients, Megatron's registered parameters)
take no part (coefficient 0): a rank holding none still sends its zeros.

**Parameters and optimizer state** every ``param_check_interval`` updates: the same checksum
over each replicated parameter and every tensor of its optimizer state, in as many more slots of
the same collective: drift from a corrupted optimizer step, a bad checkpoint load. A non-finite
parameter seen there is reported too (the read is free).

What is **not** caught: a corruption before the reduce (it is averaged into every replica's
gradients alike and looks like a real gradient; the overflow check and the loss curve are what
see it); a corruption after the check (between the scaler's pass and the optimizer's read);
replicas on different kinds of GPU, whose kernels may not produce bit-equal gradients (detected at
the first checked step: turn the check off with ``replica_check=False``).

**When the reading waits** (a *deferred reading*): on CUDA with the Triton kernels
(``kernels="triton"``), a fused optimizer, the default ``replica_check_interval`` and a periodic
read (``skip_log_interval > 0``), the checksum is computed in the kernel's one read of the
gradients, and the reading is not taken on the host at the step: the mismatch flag (a few int64
ops on the reduced limbs) is 1.0 or 0.0 on the device, the fused step takes ``max(found_inf, mismatch flag)``, and the update
counts a skip and, where ``found_inf`` is 0.0, puts the scale, the growth tracker and the policy's
counters back as they were (`DeferredReading`; the same result as a reading at the step, bit for
bit, as the tests check). So the check runs at every update with no host read and no sync. The host
takes the mismatch flags at its next read of the scaler (``skip_totals``, ``state_dict``,
``metrics``, ``step_was_skipped``, the periodic read: `ReplicaCheck.count()`, no collective), which
counts the skips by cause and the ledger's ``skipped``; the ranks are named at the next periodic
read, every ``skip_log_interval`` updates, where every rank is (`ReplicaCheck.name()`: the ledger's
mismatches, `ReplicaMismatch`, the log line, the callback, and ``"raise"`` from that update once it
is complete). Under CUDA graph capture the replays skip and hold alike on the device; the skip
counters count them, under the cause ``overflow`` (the host never learns theirs: a replay runs no
Python), and they are not named.

**Cost** on a clean checked step, torch's kernels (the CPU and other devices): one read of the
checked gradients' bytes (a ``cat`` into rows of 512 words, one int8 matrix product by 16
columns), int64 ops on one value per row and a few per replica set, one host read of the reduced
limbs; the collective grows by 64 bytes up to 4,096 ranks (twice that with the parameter check).
With the Triton kernels the words are summed in the kernel's read (no pass of their own) and the
residues in its reduction (`ReplicaSlots.kernel_terms()`: each tensor's coefficient, offset, shift
and identity as residues; `ReplicaSlots.kernel_keys()`: the keyed weights, made once per layout;
integer atomics, the same sum in any order), so a checked step adds a few small ops and each
tensor's checksum for naming is made only on a mismatch; a deferred reading adds a dozen more and
no host read (counted on the CPU, `tests/test_kernels.py`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch.distributed as dist

__all__ = [
    "GPU_INTERVAL",
    "INTERVAL",
    "MAX_WORLD_SIZE",
    "SUSPECT_EVENTS",
    "SUSPECT_WINDOW",
    "OnMismatch",
    "ReplicaLedger",
    "ReplicaMismatch",
    "ReplicaSet",
]

logger = logging.getLogger("distscaler")

#: The largest group the replica check takes (four float32 limbs per residue there).
MAX_WORLD_SIZE = 1 << 17
#: A rank alone at fault (an overflow only it saw, a replica mismatch it was named in) this many
#: times within `SUSPECT_WINDOW` updates is named a suspect.
SUSPECT_EVENTS = 3
#: The window, in updates, of `SUSPECT_EVENTS`.
SUSPECT_WINDOW = 1000
#: ``replica_check_interval=None``: every update where the Triton kernels take the checksum in
#: their read (a fused step keeps the mismatch flag on the device, another reads it beside its
#: own ``found_inf``), else every this many: where torch's kernels read the words (the CPU, a GPU
#: without the Triton kernels), a checked step costs a read pass of its own (and a host sync on a
#: GPU), 1.1x the scaler phase at this cadence on a CPU (docs/benchmarks.md#replica-check).
INTERVAL = 32
#: `INTERVAL` (the name it had when it applied to GPUs only).
GPU_INTERVAL = INTERVAL

class ReplicaSet(NamedTuple):
    """The ranks holding the same values of a gradient, and this rank's place among them.

    Attributes:
        ranks: global ranks of the replicas, in replica order (the same tuple on each of them).
        position: this rank's place in ``ranks``.
    """

    ranks: tuple[int, ...]
    position: int


# ---------------------------------------------------------------------- what a check found


@dataclass(frozen=True, slots=True)
class ReplicaMismatch:
    """Replicas of the same gradients (or parameters) that differed, identical on every rank.

    Attributes:
        step: the 1-based number of the ``update()`` call of the iteration (the skipped one).
        what: ``"gradients"`` or ``"parameters"`` (parameters and their optimizer state).
        ranks: the global ranks that differ from their replica set's majority (with no majority,
            every rank of the set); sorted.
        sets: each replica set that disagreed: (its ranks, each rank's checksum as
            ``(A mod P1, A mod P2, B mod P1, B mod P2)`` in the same order).
        action: what was done: ``"skip"``, ``"raise"`` or ``"callback"``.
        nonfinite: the ranks whose checked tensors held inf/NaN at that step (then the step is an
            overflow too where the overflow check saw them, and every rank backs off alike; a
            finite value the unscale took past float32's range, below a loss scale of 1, it did
            not see); empty when every value was finite (the scale does not move).
    """

    step: int
    what: Literal["gradients", "parameters"]
    ranks: tuple[int, ...]
    sets: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...] = ()
    action: str = "skip"
    nonfinite: tuple[int, ...] = ()

    def describe(self) -> str:
        """``step 12: gradients of rank(s) 3 differ from their replicas' (replica set of ranks
        [0, 1, 2, 3])``."""
        who = ", ".join(str(r) for r in self.ranks)
        sets = "; ".join(f"replica set of ranks {list(s)}" for s, _ in self.sets[:4])
        return f"step {self.step}: {self.what} of rank(s) {who} differ from their replicas' ({sets})"


#: What to do at a replica mismatch (``on_replica_mismatch``): skip the step on every rank, raise
#: `distscaler.errors.ReplicaMismatchError` on every rank, or call a function with the
#: `ReplicaMismatch` (and skip).
OnMismatch = Literal["skip", "raise"] | Callable[[ReplicaMismatch], Any]


@dataclass
class ReplicaLedger:
    """Counts over the run, the same on every rank of the scaler's group.

    Attributes:
        checks: gradient comparisons across replicas (one per optimizer per checked update).
        param_checks: updates whose parameters and optimizer state were compared.
        mismatch_events: replica mismatches found, one per check that found one (each counted
            once, however many ranks it names), whatever the skip's cause: a mismatch where some
            rank held inf/NaN that the overflow check saw is an overflow in the skip account.
        mismatches: per global rank, the mismatch events it was named in.
        lone_overflow_reports: per rank of the group, the overflow reports (`last_overflow`: the
            last skipped step of each periodic read) where it alone held inf/NaN; overflows
            between two reports are not attributed, so this counts reports, not overflows.
        skipped: skipped steps whose cause is a replica mismatch, counted as
            ``skip_totals.causes["replica_mismatch"]`` counts them (a deferred reading's at the
            host's next read of the scaler), from the scaler's start (the skip account also
            carries a loaded checkpoint's). A mismatch that is an overflow too counts as an
            overflow there, not here.
        suspects: ranks alone at fault `SUSPECT_EVENTS` times within `SUSPECT_WINDOW` updates.
        last_mismatch: the most recent mismatch, or None.
    """

    checks: int = 0
    param_checks: int = 0
    mismatch_events: int = 0
    mismatches: collections.Counter = field(default_factory=collections.Counter)
    lone_overflow_reports: collections.Counter = field(default_factory=collections.Counter)
    skipped: int = 0
    suspects: tuple[int, ...] = ()
    last_mismatch: ReplicaMismatch | None = None
    events: collections.deque = field(default_factory=collections.deque, repr=False)
    """(update, rank) of the faults of the last `SUSPECT_WINDOW` updates (suspects' evidence)."""
    param_checks_at: int = 0
    """The update of the last parameter check across replicas (0: none yet)."""

    def note_mismatch(self, mismatch: ReplicaMismatch) -> None:
        """Count one mismatch event, and one for each rank it names (alone at fault when it names
        one)."""
        self.last_mismatch = mismatch
        self.mismatch_events += 1
        for rank in mismatch.ranks:
            self.mismatches[rank] += 1
        if len(mismatch.ranks) == 1:  # two replicas name both: no one alone at fault
            self._event(mismatch.step, mismatch.ranks[0])

    @property
    def lone_overflows(self) -> collections.Counter:
        """`lone_overflow_reports`, under its former name."""
        return self.lone_overflow_reports

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a ledger pickled before lone_overflows was named lone_overflow_reports)
        if "lone_overflows" in state:
            state["lone_overflow_reports"] = state.pop("lone_overflows")
        self.__dict__.update(state)

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        """An overflow report: when one rank alone held the inf/NaN, count it."""
        if len(ranks) == 1:
            (rank,) = ranks
            self.lone_overflow_reports[rank] += 1
            self._event(step, rank)

    def _event(self, step: int, rank: int) -> None:
        events = self.events
        events.append((step, rank))
        while events and events[0][0] <= step - SUSPECT_WINDOW:
            events.popleft()
        counts = collections.Counter(r for _, r in events)
        new = sorted(r for r, n in counts.items() if n >= SUSPECT_EVENTS)
        for rank in new:
            if rank not in self.suspects:
                warn_rank0(
                    "rank %d is a suspect: alone at fault %d times in the last %d "
                    "updates (overflows only it saw, replica mismatches it was named in)",
                    rank, counts[rank], SUSPECT_WINDOW,
                )  # fmt: skip
        self.suspects = tuple(sorted(set(self.suspects) | set(new)))

    def as_dict(self) -> dict[str, int]:
        """Plain numbers: ``replica_checks`` (`checks`), ``replica_param_checks``
        (`param_checks`), ``replica_mismatches`` (`mismatch_events`), ``replica_mismatched_ranks``
        (ranks named, summed over events), ``replica_skipped`` (`skipped`),
        ``lone_overflow_reports`` (total), ``suspects`` (count)."""
        return {
            "replica_checks": self.checks,
            "replica_param_checks": self.param_checks,
            "replica_mismatches": self.mismatch_events,
            "replica_mismatched_ranks": sum(self.mismatches.values()),
            "replica_skipped": self.skipped,
            "lone_overflow_reports": sum(self.lone_overflow_reports.values()),
            "suspects": len(self.suspects),
        }

    def metrics(self, prefix: str = "distscaler/") -> dict[str, int]:
        """`as_dict()` with each key prefixed, empty before the first check (nothing
        replicated: nothing logged)."""
        if not self.checks and not self.param_checks:
            return {}
        return {f"{prefix}{k}": v for k, v in self.as_dict().items()}


def warn_rank0(msg: str, *args: Any) -> None:
    """Log ``msg % args`` as a warning on rank 0 of the default group (or without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(msg, *args)
