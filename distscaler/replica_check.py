"""The replica check: ranks that hold the same gradients prove it on the step's one collective.

After DDP's all_reduce (HSDP's reduce over its replicate dimension, the same over any group of
replicas) every replica holds **bit-identical** gradients. A rank whose gradients differ from its
replicas' after the reduce has had its memory or its compute corrupted (silent data corruption).
The check compares them where the scaler already reads every gradient and runs one collective:

1. **Fingerprint** (`bit_sums()`): each replicated gradient tensor's elements read as integers
   (their bit patterns: ``int32`` for float32, ``int16`` for fp16/bf16, ``int64`` for float64)
   and summed in that width, wrapping: ``C_t``, the exact sum modulo ``2**w`` (the order of the
   additions does not matter, and the native width runs at the speed of a float sum: a 64-bit
   accumulation is ~15x slower on a CPU). Flipping bit ``j`` of one element changes ``C_t`` by
   ``±2**j``, or by ``±2**j ∓ 2**w`` where the sum wraps.
2. **Folded** into two residues (`local_residues()`): with primes ``P1 > P2`` (`moduli()`) and each
   replica set's *coefficients* (`coefficient()`: ``+1/-1`` alternating over the set's replicas,
   ``(1, 1, -2)`` for the first three of an odd number, so that they sum to 0), this rank sends
   ``x = sum_t coef_t * C_t mod P`` for both primes: two float32 integers in ``[0, P)``, appended
   to the step's collective (`fold_into()`), which becomes a SUM where it was a MAX of 0/1 flags.
3. **Verdict** (`verdict()`): the reduced ``S = sum over ranks of x``. When every replica holds
   the same gradients each set's terms cancel, so ``S mod P == 0`` for both primes, on every
   rank alike (the verdict is a function of the reduced values only). A single flipped bit on one
   rank adds ``coef * 2**j`` (or ``coef * 2**j * (1 - 2**(w-j))``), never a multiple of ``P``:
   ``P`` is an odd prime above 2, and 2's multiplicative order modulo ``P`` exceeds 64, so ``P``
   divides no ``2**m - 1`` for ``m <= 64`` (`moduli()` picks them so). So **every single-bit flip
   is caught**: sign, exponent and mantissa bits alike (also a sign flip of 0.0,
   which changes no value). Several corrupted elements are missed only when their changes cancel
   modulo both primes: probability about ``1 / (P1 * P2)`` for unrelated changes (2**-46 at 2
   ranks, 2**-20 at 16,384 ranks).

**Exact in float32, no float64.** Each ``x`` is an integer below ``P`` and ``P * world_size <=
2**24``, so every partial sum of the all-reduce, in any order, is an integer below 2**24, exact
in float32; ``S mod P`` is then exact too (read on the host as integers).

**On a mismatch only**, one ``all_gather_object`` over the group (every rank calls it, since
every rank reaches the same verdict) exchanges each rank's per-set fingerprints
(``sum_t C_t mod P``, without coefficients); within each replica set the ranks that differ from
the majority are named, and with no majority (two replicas) all of the set's ranks are.

**Which gradients** (`LayoutResolver.replica_set()`): the layouts already know the replicas: DDP
(`GradScaler.register_model()`), FSDP1 ``NO_SHARD``/``HYBRID_SHARD``, DTensor gradients with
``Replicate`` placements (HSDP's replicate dimension, FSDP2 + TP's norms), ``grad_layout=
"replicated"`` (the whole group). Others (sharded gradients, Megatron's registered parameters)
take no part (coefficient 0): a rank holding none still sends its zeros.

**Parameters and optimizer state** every ``param_check_interval`` updates: the same fingerprint
over each replicated parameter and every tensor of its optimizer state, in two more slots of the
same collective: drift from a corrupted optimizer step, a bad checkpoint load.

What is **not** caught: a corruption before the reduce (it is averaged into every replica's
gradients alike and looks like a real gradient; the overflow check and the loss curve are what
see it); a corruption after the check (between the scaler's pass and the optimizer's read);
replicas on different kinds of GPU, whose kernels may not produce bit-equal gradients (detected at
the first checked step: turn the check off with ``replica_check=False``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from .errors import ReplicaMismatchError

__all__ = [
    "GPU_INTERVAL",
    "MAX_WORLD_SIZE",
    "SUSPECT_EVENTS",
    "SUSPECT_WINDOW",
    "ReplicaLedger",
    "ReplicaMismatch",
    "ReplicaSet",
    "bit_sums",
    "coefficient",
    "local_residues",
    "mismatched",
    "moduli",
]

logger = logging.getLogger("distscaler")

#: Largest integer float32 holds exactly with all below it (its significand's 24 bits).
FLOAT32_EXACT = 1 << 24
#: The largest group the replica check takes: its primes (below 2**24 / world size) must keep a
#: 2-order above 64, and 101 and 107 are the last two such below 128.
MAX_WORLD_SIZE = 1 << 17
#: A rank alone at fault (an overflow only it saw, a replica mismatch it was named in) this many
#: times within `SUSPECT_WINDOW` updates is named a suspect.
SUSPECT_EVENTS = 3
#: The window, in updates, of `SUSPECT_EVENTS`.
SUSPECT_WINDOW = 1000

OnMismatch = Literal["skip", "raise"] | Callable[["ReplicaMismatch"], Any]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------- the arithmetic


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


_MODULI: dict[int, tuple[int, int]] = {}


def _order_of_two_exceeds(p: int, bound: int) -> bool:
    """2's multiplicative order modulo ``p`` exceeds ``bound``: ``p`` divides no ``2**m - 1``."""
    return all(pow(2, m, p) != 1 for m in range(1, bound + 1))


def moduli(world_size: int) -> tuple[int, int]:
    """The two largest primes ``P1 > P2`` with ``P * max(world_size, 2) <= 2**24`` (a sum of
    ``world_size`` residues below them is exact in float32) whose 2-order exceeds 64 (a wrapped
    bit flip, ``2**j * (2**m - 1)``, is never a multiple of them). Host arithmetic, cached per
    size.

    Raises:
        ValueError: ``world_size`` above `MAX_WORLD_SIZE` (131,072).
    """
    n = max(int(world_size), 2)
    cached = _MODULI.get(n)
    if cached is not None:
        return cached
    if n > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size must be at most {MAX_WORLD_SIZE} for the replica check, got: {n}"
        )
    found: list[int] = []
    p = FLOAT32_EXACT // n
    while len(found) < 2 and p > 2:
        if _is_prime(p) and _order_of_two_exceeds(p, 64):
            found.append(p)
        p -= 1
    _MODULI[n] = (found[0], found[1])
    return _MODULI[n]


def coefficient(index: int, replicas: int) -> int:
    """Replica ``index``'s coefficient in a set of ``replicas``: the set's coefficients sum to 0,
    are never 0 and never more than 2 in magnitude. ``+1, -1`` alternating; with an odd number of
    replicas the first three are ``1, 1, -2``. 0 when ``replicas < 2`` (nothing to compare)."""
    if replicas < 2:
        return 0
    if replicas % 2 == 1:
        if index < 3:
            return (1, 1, -2)[index]
        index -= 3  # an even number of replicas follows
    return 1 if index % 2 == 0 else -1


def _int_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s elements as signed integers of the same width (no copy), or None for a tensor
    that is not floating point."""
    if not tensor.is_floating_point():
        return None
    return tensor.view(_INT_VIEW[tensor.element_size()])


def bit_sums(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's elements read as signed integers of their width (their bit patterns) and
    summed in that width, wrapping (the exact sum modulo ``2**w``, whatever the order of the
    additions): int64 ``(len(tensors),)`` on ``device``. One read of every byte: one reduction
    per tensor, then per (integer width, device) one ``stack`` and one cast to int64 (more than one
    such group adds a ``cat`` and an ``index_select``). A non-floating tensor sums to 0."""
    groups: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        ints = _int_view(t)
        total = (
            torch.zeros((), dtype=torch.int32, device=t.device)
            if ints is None
            else ints.sum(dtype=ints.dtype)
        )
        order, sums = groups.setdefault((total.dtype, total.device), ([], []))
        order.append(i)
        sums.append(total)
    if not groups:
        return torch.zeros(0, dtype=torch.int64, device=device)
    parts = [torch.stack(sums).to(device, torch.int64, non_blocking=True)
             for _, sums in groups.values()]  # fmt: skip
    if len(parts) == 1:
        return parts[0]
    order = [i for indices, _ in groups.values() for i in indices]
    inverse = torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=device)
    return torch.cat(parts).index_select(0, inverse)


def local_residues(
    sums: torch.Tensor, coefficients: torch.Tensor, primes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's two slots of the collective, float32 ``(2,)``: ``sum_t coef_t * C_t mod P`` for
    both primes, and the per-tensor residues (int64 ``(n, 2)``, ``C_t mod P``, for naming ranks).
    ``coefficients`` int64 ``(n,)`` and ``primes`` int64 ``(2,)`` on the sums' device. 5 ops."""
    residues = sums.unsqueeze(1).remainder(primes)  # (n, 2), in [0, P)
    folded = (residues * coefficients.unsqueeze(1)).sum(0).remainder(primes)
    return folded.to(torch.float32), residues


def mismatched(reduced: Sequence[float], primes: tuple[int, int]) -> bool:
    """The verdict from reduced slots (host floats, pairs for ``primes``): True when some slot is
    not a multiple of its prime. Exact: each is an integer below 2**24."""
    return any(int(v) % primes[i % 2] != 0 for i, v in enumerate(reduced))


# ---------------------------------------------------------------------- replica sets


class ReplicaSet(NamedTuple):
    """The ranks holding the same values of a gradient, and this rank's place among them.

    Attributes:
        ranks: global ranks of the replicas, in replica order (the same tuple on each of them).
        position: this rank's place in ``ranks``.
    """

    ranks: tuple[int, ...]
    position: int

    @property
    def coefficient(self) -> int:
        """This rank's coefficient in the set (`coefficient()`)."""
        return coefficient(self.position, len(self.ranks))


# ---------------------------------------------------------------------- what a check found


@dataclass(frozen=True, slots=True)
class ReplicaMismatch:
    """Replicas of the same gradients (or parameters) that differed, identical on every rank.

    Attributes:
        step: the 1-based number of the ``update()`` call of the iteration (the skipped one).
        what: ``"gradients"`` or ``"parameters"`` (parameters and their optimizer state).
        ranks: the global ranks that differ from their replica set's majority (with no majority,
            every rank of the set); sorted.
        sets: each replica set that disagreed: (its ranks, each rank's fingerprint as
            ``(C mod P1, C mod P2)`` in the same order).
        action: what was done: ``"skip"``, ``"raise"`` or ``"callback"``.
    """

    step: int
    what: Literal["gradients", "parameters"]
    ranks: tuple[int, ...]
    sets: tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...] = ()
    action: str = "skip"

    def describe(self) -> str:
        """``step 12: gradients of rank 3 differ from their replicas' (replica set ranks 0-3)``."""
        who = ", ".join(str(r) for r in self.ranks)
        sets = "; ".join(f"replica set of ranks {list(s)}" for s, _ in self.sets[:4])
        return f"step {self.step}: {self.what} of rank(s) {who} differ from their replicas' ({sets})"


@dataclass
class ReplicaLedger:
    """Per-rank counts over the run, the same on every rank of the scaler's group.

    Attributes:
        checks: gradient comparisons across replicas (one per optimizer per checked update).
        param_checks: updates whose parameters and optimizer state were compared.
        mismatches: per global rank, the replica mismatches it was named in.
        lone_overflows: per rank of the group, overflow reports where it alone held inf/NaN.
        skipped: steps skipped because of a replica mismatch (not counted as overflows).
        suspects: ranks alone at fault `SUSPECT_EVENTS` times within `SUSPECT_WINDOW` updates.
        last_mismatch: the most recent mismatch, or None.
    """

    checks: int = 0
    param_checks: int = 0
    mismatches: collections.Counter = field(default_factory=collections.Counter)
    lone_overflows: collections.Counter = field(default_factory=collections.Counter)
    skipped: int = 0
    suspects: tuple[int, ...] = ()
    last_mismatch: ReplicaMismatch | None = None
    _events: collections.deque = field(default_factory=collections.deque, repr=False)

    def note_mismatch(self, mismatch: ReplicaMismatch) -> None:
        """Count a mismatch for each rank it names (alone at fault when it names one)."""
        self.last_mismatch = mismatch
        for rank in mismatch.ranks:
            self.mismatches[rank] += 1
        if len(mismatch.ranks) == 1:  # two replicas name both: no one alone at fault
            self._event(mismatch.step, mismatch.ranks[0])

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        """An overflow report: when one rank alone held the inf/NaN, count it."""
        if len(ranks) == 1:
            (rank,) = ranks
            self.lone_overflows[rank] += 1
            self._event(step, rank)

    def _event(self, step: int, rank: int) -> None:
        events = self._events
        events.append((step, rank))
        while events and events[0][0] <= step - SUSPECT_WINDOW:
            events.popleft()
        counts = collections.Counter(r for _, r in events)
        new = sorted(r for r, n in counts.items() if n >= SUSPECT_EVENTS)
        for rank in new:
            if rank not in self.suspects:
                _warn_rank0(
                    "distscaler: rank %d is a suspect: alone at fault %d times in the last %d "
                    "updates (overflows only it saw, replica mismatches it was named in)",
                    rank, counts[rank], SUSPECT_WINDOW,
                )  # fmt: skip
        self.suspects = tuple(sorted(set(self.suspects) | set(new)))

    def metrics(self, prefix: str = "distscaler/") -> dict[str, int]:
        """The integrations' log entries (``distscaler/replica_checks``,
        ``distscaler/replica_mismatches``, ``distscaler/replica_skipped``,
        ``distscaler/suspects``), empty before the first check (nothing replicated: nothing
        logged)."""
        if not self.checks and not self.param_checks:
            return {}
        return {
            f"{prefix}replica_checks": self.checks,
            f"{prefix}replica_mismatches": sum(self.mismatches.values()),
            f"{prefix}replica_skipped": self.skipped,
            f"{prefix}suspects": len(self.suspects),
        }

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for metrics: ``replica_checks``, ``replica_mismatches`` (total),
        ``replica_skipped``, ``lone_overflows`` (total), ``suspects`` (count)."""
        return {
            "replica_checks": self.checks,
            "replica_param_checks": self.param_checks,
            "replica_mismatches": sum(self.mismatches.values()),
            "replica_skipped": self.skipped,
            "lone_overflows": sum(self.lone_overflows.values()),
            "suspects": len(self.suspects),
        }


def _warn_rank0(msg: str, *args: Any) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(msg, *args)


# ---------------------------------------------------------------------- one step's fold


@dataclass
class Fold:
    """One check's local fingerprints, folded into the step's collective (`fold_into()`).

    Attributes:
        local: float32 ``(2,)`` or ``(4,)`` (gradients, then parameters): this rank's slots.
        primes: the two moduli of this world size.
        residues: per part (``"gradients"``, ``"parameters"``): (int64 ``(n, 2)`` residues,
            each tensor's replica set), for naming ranks on a mismatch.
        reduced: the slots after the collective (set by `fold_into()`).
    """

    local: torch.Tensor
    primes: tuple[int, int]
    residues: dict[str, tuple[torch.Tensor, list[ReplicaSet | None]]]
    reduced: torch.Tensor | None = None


def fold_into(buffer: torch.Tensor, fold: Fold) -> torch.Tensor:
    """``buffer`` (the collective's, flattened) with ``fold.local`` appended: one ``cat``."""
    return torch.cat([buffer.reshape(-1), fold.local.to(buffer.device, non_blocking=True)])


# ---------------------------------------------------------------------- the scaler's part


def check_settings(
    replica_check: object, interval: object, param_interval: object, on_mismatch: object
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the argument, the value and the valid range."""
    if not isinstance(replica_check, bool):
        raise TypeError(f"replica_check must be a bool, got: {replica_check!r}")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                 or interval < 1):  # fmt: skip
        raise ValueError(
            f"replica_check_interval must be an int >= 1 or None (auto), got: {interval!r}"
        )
    if isinstance(param_interval, bool) or not isinstance(param_interval, int) or param_interval < 0:
        raise ValueError(
            f"param_check_interval must be an int >= 0 (0: never), got: {param_interval!r}"
        )
    if not (on_mismatch in ("skip", "raise") or callable(on_mismatch)):
        raise ValueError(
            "on_replica_mismatch must be 'skip', 'raise' or a callable taking a ReplicaMismatch, "
            f"got: {on_mismatch!r}"
        )


#: ``replica_check_interval=None``: every update where a host read is free (the CPU), else every
#: this many (on a GPU a checked step costs a read pass and a host sync).
GPU_INTERVAL = 32


class ReplicaCheck:
    """The scaler's replica check: when it is due, the fingerprints, the verdict and its
    consequences. See the module docstring; the settings are `GradScaler`'s."""

    def __init__(
        self,
        enabled: bool,
        interval: int | None,
        param_interval: int,
        on_mismatch: OnMismatch,
    ) -> None:
        self.enabled = enabled
        #: The setting; None: `interval()` decides from where host reads are free.
        self.interval_setting = interval
        self.param_interval = param_interval
        self.on_mismatch = on_mismatch
        self.ledger = ReplicaLedger()
        #: Updates so far (the same count on every rank).
        self.iteration = 0
        #: Whether the last iteration's steps were skipped for a replica mismatch.
        self.last_skipped = False
        self._coefs: dict[tuple, tuple[torch.Tensor, list[ReplicaSet | None]]] = {}
        self._primes: dict[tuple, torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_coefs"], state["_primes"] = {}, {}
        if not isinstance(self.on_mismatch, str):
            state["on_mismatch"] = "skip"  # a callable is not copied
        return state

    def interval(self, host_reads: bool) -> int:
        """Updates between two gradient checks: the setting, or 1 where a host read is free (the
        CPU) and `GPU_INTERVAL` elsewhere."""
        if self.interval_setting is not None:
            return self.interval_setting
        return 1 if host_reads else GPU_INTERVAL

    def due(self, world_size: int, dynamic: bool, host_reads: bool) -> tuple[bool, bool]:
        """(compare gradients, compare parameters) at this iteration: the same on every rank
        (the update count, the settings and the group's size). Never over a group whose
        membership changes (torchft's: a healing replica's contribution is zeroed there, which
        would read as a mismatch), nor above `MAX_WORLD_SIZE` ranks."""
        if not self.enabled or world_size < 2 or dynamic or world_size > MAX_WORLD_SIZE:
            return False, False
        n = self.iteration + 1
        params = self.param_interval > 0 and n % self.param_interval == 0
        return n % self.interval(host_reads) == 0, params

    def fingerprint(
        self,
        layouts: Any,
        optimizer: torch.optim.Optimizer,
        grads: dict,
        params: tuple[torch.Tensor, ...],
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
        with_grads: bool,
        with_params: bool,
    ) -> Fold | None:
        """This rank's slots: gradients (as gathered, in ``params``' order) and, with
        ``with_params``, the parameters and their optimizer state. None when none of ``params``
        is replicated: the ranks of a group are alike in this (DDP, HSDP, FSDP2 + TP, pipeline
        stages each replicated or none), which the collective's size relies on."""
        primes = moduli(world_size)
        key = (device, primes)
        primes_t = self._primes.get(key)
        if primes_t is None:
            primes_t = self._primes[key] = torch.tensor(primes, dtype=torch.int64, device=device)
        coefs, sets = self._sets(layouts, params, group, world_size, device)
        if all(s is None for s in sets):
            return None  # nothing replicated here (and, ranks being alike, anywhere)
        parts: list[torch.Tensor] = []
        residues: dict[str, tuple[torch.Tensor, list[ReplicaSet | None]]] = {}
        if with_grads:
            flat = [g for gs in grads.values() for g in gs]
            local, res = local_residues(bit_sums(flat, device), coefs, primes_t)
            parts.append(local)
            residues["gradients"] = (res, sets)
        else:  # the parameters' slots stay the 3rd and 4th
            parts.append(torch.zeros(2, dtype=torch.float32, device=device))
        if with_params:
            tensors, owners = [], []
            for i, p in enumerate(params):
                if sets[i] is None:
                    continue
                for t in (p, *optimizer.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor):
                        tensors.append(getattr(t, "_local_tensor", t))
                        owners.append(i)
            idx = torch.tensor(owners, dtype=torch.int64, device=device)
            local, res = local_residues(bit_sums(tensors, device), coefs[idx], primes_t)
            parts.append(local)
            residues["parameters"] = (res, [sets[i] for i in owners])
        return Fold(parts[0] if len(parts) == 1 else torch.cat(parts), primes, residues)

    def _sets(
        self,
        layouts: Any,
        params: tuple[torch.Tensor, ...],
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, list[ReplicaSet | None]]:
        key = (id(params), len(params), layouts.version, world_size, id(group), device)
        cached = self._coefs.get(key)
        if cached is not None and len(cached[1]) == len(params):
            return cached
        sets = [layouts.replica_set(p, p.grad, group, world_size) for p in params]
        coefs = torch.tensor(
            [0 if s is None else s.coefficient for s in sets], dtype=torch.int64, device=device
        )
        self._coefs = {key: (coefs, sets)}  # one plan at a time
        return coefs, sets

    def settle(
        self, fold: Fold, *, group: dist.ProcessGroup | None, world_size: int
    ) -> ReplicaMismatch | None:
        """Read the verdict (one host read); on a mismatch name the ranks (one
        ``all_gather_object``, every rank together), count it and act: ``"raise"`` raises
        `ReplicaMismatchError`, a callable is called; the caller skips the step."""
        assert fold.reduced is not None
        reduced = fold.reduced.tolist()
        step = self.iteration + 1
        self.ledger.checks += "gradients" in fold.residues
        self.ledger.param_checks += "parameters" in fold.residues
        parts = [("gradients", reduced[0:2]), ("parameters", reduced[2:4])]
        bad = [what for what, slots in parts if slots and mismatched(slots, fold.primes)]
        if not bad:
            return None
        what = bad[0]
        ranks, sets = _name_ranks(fold, what, group)
        action = self.on_mismatch if isinstance(self.on_mismatch, str) else "callback"
        mismatch = ReplicaMismatch(step, what, ranks, sets, action)  # type: ignore[arg-type]
        self.ledger.note_mismatch(mismatch)
        self.ledger.skipped += 1
        _warn_rank0("distscaler: replica mismatch at %s; the step is skipped on every rank",
                    mismatch.describe())  # fmt: skip
        if self.on_mismatch == "raise":
            raise ReplicaMismatchError(mismatch)
        if callable(self.on_mismatch):
            self.on_mismatch(mismatch)
        return mismatch

    def end_iteration(self, skipped: bool) -> None:
        """``update()``: the iteration ends (``skipped``: for a replica mismatch)."""
        self.iteration += 1
        self.last_skipped = skipped


def _name_ranks(
    fold: Fold, what: str, group: dist.ProcessGroup | None
) -> tuple[tuple[int, ...], tuple]:
    """Exchange per-set fingerprints (one ``all_gather_object``) and name each set's outliers."""
    residues, sets = fold.residues[what]
    rows = residues.cpu().tolist()
    mine: dict[tuple[int, ...], list[int]] = {}
    for row, rs in zip(rows, sets):
        if rs is None:
            continue
        acc = mine.setdefault(rs.ranks, [0, 0])
        acc[0] += row[0]
        acc[1] += row[1]
    me = dist.get_rank() if dist.is_initialized() else 0
    local = {key: (a % fold.primes[0], b % fold.primes[1]) for key, (a, b) in mine.items()}
    gathered: list[Any] = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (me, local), group=group)
    else:
        gathered = [(me, local)]
    by_set: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}
    for rank, per_set in gathered:
        for key, fp in per_set.items():
            by_set.setdefault(key, {})[rank] = fp
    named: set[int] = set()
    bad_sets = []
    for members, fps in sorted(by_set.items()):
        counts = collections.Counter(fps.values())
        if len(counts) <= 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if n * 2 > len(fps) else None
        named |= {r for r, fp in fps.items() if fp != majority}
        bad_sets.append((members, tuple(fps.get(r, (-1, -1)) for r in members)))
    if not named:  # the sets agree as wholes: the cancellation lies across sets
        named = {r for r, _ in gathered}
    return tuple(sorted(named)), tuple(bad_sets)
