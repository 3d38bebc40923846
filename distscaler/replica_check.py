"""The replica check: ranks that hold the same gradients prove it on the step's one collective.

After DDP's all_reduce (HSDP's reduce over its replicate dimension, the same over any group of
replicas) every replica holds **bit-identical** gradients. A rank whose gradients differ from its
replicas' after the reduce has had its memory or its compute corrupted (silent data corruption).
The check compares them where the scaler already reads every gradient and runs one collective:

1. **Fingerprint** (`word_moments()`): each replicated gradient tensor read as its 16-bit words
   ``w_k`` (its bytes as signed ``int16``, in memory order: two words per float32 element, one per
   fp16/bf16 element), and two exact integer sums of them: ``A = sum_k w_k`` and
   ``B = sum_k k * w_k`` (``k`` the word's position), each modulo two primes ``P1 > P2``
   (`moduli()`). The sums are computed exactly (``int32`` over rows of 128 words, whose sums are
   bounded below ``2**31``, then ``int64`` residues), never wrapped.
2. **Combined** into four float32 slots (`fingerprint_slots()`): the positions are made global over the
   rank's checked tensors (a tensor's ``B`` plus its word offset times its ``A``), and each replica
   set gives its members *coefficients* ``c`` (`coefficient()`: they sum to 0, never 0) and
   *shifts* ``s`` (`shift()`: ``sum c * s == 0 mod P``, pairwise distinct from 3 replicas on). This
   rank sends ``G0 = sum_t c_t * A_t`` and ``G1 = sum_t c_t * (B_t + s_t * A_t)``, each ``mod P``
   for both primes: four integers in ``[0, P)``, appended to the step's collective as a SUM.
3. **Reading** (`mismatched()`): the reduced slots. When every replica holds the same gradients
   each set's terms cancel and every slot is a multiple of its prime, on every rank alike (a
   function of the reduced values only). Otherwise the step is a replica mismatch.

**What is caught with certainty** (while ``P2 > 2**17``, i.e. up to 64 ranks, and a rank's
checked tensors hold fewer than ``P1 * P2`` words, about ``2**46`` at 2 ranks): any change of one
16-bit word (every bit flip of one fp16/bf16 element, any corruption of one fp16/bf16 element),
any corruption confined to two words (one float32 element, whatever its bits; two flipped bits
anywhere: one tensor, two tensors, two ranks), because the two sums are the first two rows of a
Vandermonde system in the distinct word positions: ``d1 + d2 = 0`` and ``k1 d1 + k2 d2 = 0`` force
``d1 = d2 = 0`` (across ranks the distinct shifts play the part of the positions). Two flips of the
same bit in opposite directions, which cancel in a plain sum, do not cancel here. A corruption of
three or more words is missed only when both sums cancel modulo both primes: about ``1 / (P1 P2)``
at worst for a chosen pattern, far less for unrelated changes (measured in the tests: 10,000 random
and every constructed pair caught). Above 64 ranks the primes shrink (``P * world_size <= 2**24``)
and these bounds hold with ``P1 P2`` in place of certainty.

**Exact in float32, no float64.** Each slot a rank sends is an integer below ``P`` and ``P *
world_size <= 2**24``, so every partial sum of the all-reduce, in any order, is an integer below
2**24, exact in float32; ``S mod P`` is then exact too (read on the host as integers).

**On a mismatch only**, one ``all_gather_into_tensor`` (``all_gather_single`` from torch 2.13)
over the group (every rank calls it, since
every rank reads the same slots) exchanges each rank's per-set fingerprints (``(A, B) mod P``
without coefficients) in a fixed-size int64 row on the collective's device (`NAMED_SETS` sets per
rank; no pickling, so no numpy); within each replica set the ranks that differ from the majority
are named, and with no majority (two replicas) all of the set's ranks are.

**Which gradients** (`LayoutResolver.replica_set()`): the layouts already know the replicas: DDP
(`GradScaler.register_model()`), FSDP1 ``NO_SHARD``/``HYBRID_SHARD``, DTensor gradients with
``Replicate`` placements (HSDP's replicate dimension, FSDP2 + TP's norms), ``grad_layout=
"replicated"`` (the whole group). Others (sharded gradients, Megatron's registered parameters)
take no part (coefficient 0): a rank holding none still sends its zeros.

**Parameters and optimizer state** every ``param_check_interval`` updates: the same fingerprint
over each replicated parameter and every tensor of its optimizer state, in four more slots of the
same collective: drift from a corrupted optimizer step, a bad checkpoint load. A non-finite
parameter seen there is reported too (the read is free).

What is **not** caught: a corruption before the reduce (it is averaged into every replica's
gradients alike and looks like a real gradient; the overflow check and the loss curve are what
see it); a corruption after the check (between the scaler's pass and the optimizer's read);
replicas on different kinds of GPU, whose kernels may not produce bit-equal gradients (detected at
the first checked step: turn the check off with ``replica_check=False``).

**When the reading waits** (a *deferred reading*): on CUDA with the Triton kernels
(``kernels="triton"``), a fused optimizer, the default ``replica_check_interval`` and a periodic
read (``skip_log_interval > 0``), the fingerprint is computed in the kernel's one read of the
gradients, and the reading is not taken on the host at the step: `mismatch_flag()` (3 ops) gives
1.0 or 0.0 on the device, the fused step takes ``max(found_inf, mismatch flag)``, and the update
counts a skip and, where ``found_inf`` is 0.0, puts the scale, the growth tracker and the policy's
counters back as they were (`DeferredReading`; the same result as a reading at the step, bit for
bit, as the tests check). So the check runs at every update with no host read and no sync. The host
takes the mismatch flags at its next read of the scaler (``skip_totals``, ``state_dict``,
``metrics``, ``step_was_skipped``, the periodic read: `ReplicaCheck.count()`, no collective), which
counts the skips by cause and the ledger's ``skipped``; the ranks are named at the next periodic
read, every ``skip_log_interval`` updates, where every rank is (`ReplicaCheck.name()`: the ledger's
mismatches, `ReplicaMismatch`, the log line, the callback, and ``"raise"`` from that update once it
is complete). Under CUDA graph capture the replays skip and hold alike on the device; the skip
record counts them, under the cause ``overflow`` (the host never learns theirs: a replay runs no
Python), and they are not named.

**Cost** on a clean checked step, torch's kernels (the CPU and other devices): one copy of the
checked gradients' words (a ``cat`` to ``int32`` rows), two row reductions, a dozen small ops on
per-row and per-tensor sums (1/128 of the words), one host read of the four reduced slots; the
collective grows by 16 bytes (32 with the parameter check). With the Triton kernels the words are
summed in the kernel's read (no pass of their own) and the four slots in its reduction
(`ReplicaSlots.kernel_terms()`: each tensor's coefficient, offset and shift as residues; integer
atomics, the same sum in any order), so a checked step adds 6 small ops (the sums' zeros, their
residues in float32, the collective's ``cat``, copy back and clamp) and each tensor's global
fingerprint is made only on a mismatch; a deferred reading adds 12 more and no host read (counted
on the CPU, `tests/test_kernels.py`).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from .errors import ReplicaMismatchError

if TYPE_CHECKING:
    from ._plan import StepPlan

__all__ = [
    "GPU_INTERVAL",
    "MAX_WORLD_SIZE",
    "SUSPECT_EVENTS",
    "SUSPECT_WINDOW",
    "ReplicaLedger",
    "ReplicaMismatch",
    "ReplicaSet",
]

logger = logging.getLogger("distscaler")

#: Largest integer float32 holds exactly with all below it (its significand's 24 bits).
FLOAT32_EXACT = 1 << 24
#: The largest group the replica check takes (its primes stay above 100).
MAX_WORLD_SIZE = 1 << 17
#: Words per row of the exact sums: a row's ``sum w`` is below ``2**22`` and its ``sum j * w``
#: (``j < 128``) below ``2**28`` in magnitude, exact in ``int32``.
ROW_WORDS = 128
#: A rank alone at fault (an overflow only it saw, a replica mismatch it was named in) this many
#: times within `SUSPECT_WINDOW` updates is named a suspect.
SUSPECT_EVENTS = 3
#: The window, in updates, of `SUSPECT_EVENTS`.
SUSPECT_WINDOW = 1000
#: Slots of one fingerprint in the collective: (G0, G1) for each of the two primes.
SLOTS = 4

OnMismatch = Literal["skip", "raise"] | Callable[["ReplicaMismatch"], Any]


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


def moduli(world_size: int) -> tuple[int, int]:
    """The two largest primes ``P1 > P2`` with ``P * max(world_size, 2) <= 2**24``: a sum of
    ``world_size`` residues below them is exact in float32. Host arithmetic, cached per size.

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
        if _is_prime(p):
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


_SHIFTS: dict[tuple[int, int, int], tuple[tuple[int, int], ...]] = {}


def _shift_steps(replicas: int) -> tuple[int, ...]:
    """Small distinct integers ``m_r`` with ``sum_r coefficient(r) * m_r == 0`` (``(0, 0)`` for
    two replicas, whose coefficients ``(1, -1)`` force them equal)."""
    if replicas < 3:
        return (0,) * max(replicas, 0)
    coefs = [coefficient(i, replicas) for i in range(replicas)]
    base = list(range(replicas - 2))
    free = replicas - 2
    while True:  # the second-to-last step free, the last one solving the sum
        partial = sum(c * m for c, m in zip(coefs, [*base, free]))
        if partial % coefs[-1] == 0:
            last = -partial // coefs[-1]
            steps = (*base, free, last)
            if len(set(steps)) == replicas:
                return steps
        free += 1


def shifts(replicas: int, primes: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Each replica's shift ``(S_r mod P1, S_r mod P2)``, with ``S_r = m_r * D`` for the small
    distinct integers of `_shift_steps()` (``sum_r c_r S_r == 0``: a clean set still cancels) and
    the spacing ``D = P1 * P2 // (2 * (max m - min m) + 2)``: any two replicas' shifts differ, modulo
    ``P1 * P2``, by at least ``D`` either way. A corruption on two replicas then cancels only at
    word positions ``D`` or more apart, more than a rank's checked words (the certainty bound of
    the module docstring). Two replicas take ``(0, 0)``: they cancel only when corrupted
    identically, and then they agree. Host arithmetic, cached."""
    key = (replicas, *primes)
    cached = _SHIFTS.get(key)
    if cached is not None:
        return cached
    steps = _shift_steps(replicas)
    spread = (max(steps) - min(steps)) if steps else 0
    spacing = (primes[0] * primes[1]) // (2 * spread + 2)
    out = tuple(((m * spacing) % primes[0], (m * spacing) % primes[1]) for m in steps)
    _SHIFTS[key] = out
    return out


def shift_spacing(replicas: int, primes: tuple[int, int]) -> int:
    """The least distance, modulo ``P1 * P2``, between two replicas' shifts (`shifts()`); the
    certainty of two corrupted words on two replicas holds while a rank checks fewer words."""
    steps = _shift_steps(replicas)
    spread = (max(steps) - min(steps)) if steps else 0
    return (primes[0] * primes[1]) // (2 * spread + 2)


def _words(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as 16-bit signed words, flat (no copy when contiguous); None for a tensor
    that is not a dense floating-point one."""
    if not tensor.is_floating_point() or tensor.layout is not torch.strided:
        return None
    tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor.detach().reshape(-1).view(torch.int16)


class _Rows(NamedTuple):
    owners: torch.Tensor  # int64 (rows,): the tensor of each row
    starts: torch.Tensor  # int64 (rows, 2): each row's first word position in its tensor, mod P
    weights: torch.Tensor  # int32 (128,): 0..127
    moduli: torch.Tensor  # int64 (4,): P1, P2, P1, P2


_ROWS: dict[tuple, _Rows] = {}
_PRIMES: dict[tuple, torch.Tensor] = {}


def primes_tensor(primes: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``primes`` as int64 ``(2,)`` on ``device``, made once per device."""
    key = (primes, device)
    cached = _PRIMES.get(key)
    if cached is None:
        cached = _PRIMES[key] = torch.tensor(primes, dtype=torch.int64, device=device)
    return cached


def moduli_tensor(
    primes: tuple[int, int],
    device: torch.device,
    numel: int = SLOTS,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """The slots' moduli ``[P1, P2, P1, P2, ...]``, ``(numel,)`` of ``dtype`` on ``device``,
    made once per device."""
    key = (primes, device, numel, dtype)
    cached = _PRIMES.get(key)
    if cached is None:
        values = [primes[i % 2] for i in range(numel)]
        cached = _PRIMES[key] = torch.tensor(values, dtype=dtype, device=device)
    return cached


def global_rows(moments: torch.Tensor, offsets: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """Each tensor's global fingerprint, int64 ``(n, 4)``: ``A``, and ``B`` at positions global
    over the checked tensors (`fingerprint_slots()`' second result), from `word_moments()` and
    the word offsets of `layout_terms()`."""
    a, b_local = moments[:, :2], moments[:, 2:]
    return torch.cat([a, (b_local + offsets * a).remainder(primes)], 1)


def _rows(sizes: tuple[int, ...], primes_t: tuple[int, int], device: torch.device) -> _Rows:
    key = (sizes, device, primes_t)
    cached = _ROWS.get(key)
    if cached is not None:
        return cached
    counts = [-(-n // ROW_WORDS) for n in sizes]
    primes = primes_tensor(primes_t, device)
    owners = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), torch.tensor(counts, device=device)
    )
    local = torch.cat([torch.arange(c, dtype=torch.int64, device=device) for c in counts]) \
        if counts else torch.zeros(0, dtype=torch.int64, device=device)  # fmt: skip
    starts = (local * ROW_WORDS).unsqueeze(1).remainder(primes)
    weights = torch.arange(ROW_WORDS, dtype=torch.int32, device=device)
    if len(_ROWS) > 8:
        _ROWS.clear()
    _ROWS[key] = rows = _Rows(owners, starts, weights, moduli_tensor(primes_t, device))
    return rows


def word_moments(
    tensors: Sequence[torch.Tensor], primes: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """Each tensor's fingerprint: int64 ``(len(tensors), 4)`` on ``device``,
    ``[A mod P1, A mod P2, B mod P1, B mod P2]`` with ``A = sum_k w_k`` and ``B = sum_k k * w_k``
    over the tensor's 16-bit words ``w_k`` (positions ``k`` from 0 in each tensor), exact.

    ``primes``: odd primes below ``2**24`` (`moduli()`). Torch's kernels: one ``cat`` of every
    word into zero-padded rows of `ROW_WORDS` (``int32``), the row sums ``sum w`` and ``sum j * w``
    (exact in ``int32``), then per row and per tensor ``int64`` residues (``index_add_``). A tensor
    that is not dense floating point counts as empty."""
    words = [_words(t) for t in tensors]
    sizes = tuple(0 if w is None else w.numel() for w in words)
    out = torch.zeros(len(tensors), 4, dtype=torch.int64, device=device)
    if not any(sizes):
        return out
    rows = _rows(sizes, primes, device)
    primes_t = primes_tensor(primes, device)
    pieces: list[torch.Tensor] = []
    for w, n in zip(words, sizes):
        if w is None or n == 0:
            continue
        pieces.append(w.to(device, non_blocking=True))
        pad = -n % ROW_WORDS
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.int16, device=device))
    flat = torch.cat(pieces).view(-1, ROW_WORDS).to(torch.int32)
    a = flat.sum(1, dtype=torch.int32)
    b = flat.mul_(rows.weights).sum(1, dtype=torch.int32)
    a_mod = a.to(torch.int64).unsqueeze(1).remainder(primes_t)  # (rows, 2)
    # B of a row's words at their positions in the tensor: sum j*w + start * sum w (mod P).
    b_mod = (b.to(torch.int64).unsqueeze(1) + rows.starts * a_mod).remainder(primes_t)
    out.index_add_(0, rows.owners, torch.cat([a_mod, b_mod], 1))
    return out.remainder_(rows.moduli)


def fingerprint_slots(
    moments: torch.Tensor,
    offsets: torch.Tensor,
    coefs: torch.Tensor,
    shift: torch.Tensor,
    primes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's four slots, float32 ``(4,)``: ``[G0 mod P1, G0 mod P2, G1 mod P1, G1 mod P2]``
    (module docstring), and each tensor's global fingerprint, int64 ``(n, 4)`` (``A``, and ``B``
    at positions global over the checked tensors; for naming ranks).

    Args:
        moments: `word_moments()` of the tensors, int64 ``(n, 4)``.
        offsets: int64 ``(n, 2)``: each tensor's first word position among the checked tensors,
            mod P1 and mod P2.
        coefs: int64 ``(n,)``: each tensor's replica coefficient (0: not checked).
        shift: int64 ``(n, 2)``: each tensor's replica shift, mod P1 and P2.
        primes: int64 ``(2,)``.
    """
    rows = global_rows(moments, offsets, primes)
    a, b = rows[:, :2], rows[:, 2:]
    c = coefs.unsqueeze(1)
    g0 = (c * a).sum(0).remainder(primes)
    g1 = (c * (b + shift * a).remainder(primes)).sum(0).remainder(primes)
    return torch.cat([g0, g1]).to(torch.float32), rows


def layout_terms(
    sizes: Sequence[int],
    sets: Sequence[ReplicaSet | None],
    primes: tuple[int, int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(coefficients int64 ``(n,)``, word offsets int64 ``(n, 2)``, shifts int64 ``(n, 2)``) of
    tensors of ``sizes`` words in their replica ``sets`` (None: not checked, coefficient 0), the
    inputs of `fingerprint_slots()`. Offsets count the checked tensors' words only. Host arithmetic."""
    coefs, offsets, shift = [], [], []
    offset = 0
    for n, s in zip(sizes, sets):
        checked = s is not None and n > 0
        coefs.append(s.coefficient if checked else 0)  # type: ignore[union-attr]
        offsets.append([offset % primes[0], offset % primes[1]])
        shift.append(list(s.shift(primes)) if checked else [0, 0])  # type: ignore[union-attr]
        if checked:
            offset += n
    return (
        torch.tensor(coefs, dtype=torch.int64, device=device),
        torch.tensor(offsets, dtype=torch.int64, device=device).reshape(-1, 2),
        torch.tensor(shift, dtype=torch.int64, device=device).reshape(-1, 2),
    )


def mismatched(reduced: Sequence[float], primes: tuple[int, int]) -> bool:
    """The reading of reduced slots (host floats, pairs for ``primes``): True when some slot is
    not a multiple of its prime. Exact: each is an integer below 2**24."""
    return any(int(v) % primes[i % 2] != 0 for i, v in enumerate(reduced))


def mismatch_flag(reduced: torch.Tensor, primes: tuple[int, int]) -> torch.Tensor:
    """`mismatched()` on the device, no host read: 0-dim float32 on ``reduced``'s device,
    exactly 1.0 when some slot of ``reduced`` (float32 ``(4,)`` or ``(8,)``, pairs for ``primes``)
    is not a multiple of its prime (the replicas differ), else 0.0. Three ops (``fmod``,
    ``amax``, ``clamp_``); exact, as each slot is a non-negative integer below 2**24."""
    mods = moduli_tensor(primes, reduced.device, reduced.numel(), torch.float32)
    return torch.fmod(reduced, mods).amax().clamp_(max=1.0)


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
        """This rank's coefficient in the set (its replicas' coefficients sum to 0)."""
        return coefficient(self.position, len(self.ranks))

    def shift(self, primes: tuple[int, int]) -> tuple[int, int]:
        """This rank's shift in the set modulo both primes (`shifts()`)."""
        return shifts(len(self.ranks), primes)[self.position]


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
        skipped: skipped steps whose cause is a replica mismatch:
            ``skip_totals.causes["replica_mismatch"]``, the same number (the scaler brings it up to
            date at each read of its account: `GradScaler.replica_ledger`, ``skip_totals``,
            ``metrics()``). A mismatch that is an overflow too counts as an overflow there, not
            here.
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
                _warn_rank0(
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


def _warn_rank0(msg: str, *args: Any) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning(msg, *args)


# ---------------------------------------------------------------------- one step's part


class ReplicaSlots:
    """The replica check's contribution to one step's collective (a `Contribution` of the
    step's plan): its local part, the fingerprint slots of this rank's replicated gradients (and,
    when due, parameters and optimizer state), summed over the group; its reading, the mismatch
    (or None), with its consequences (the ledger, the log line, ``"raise"``, the callback).

    Made by `ReplicaCheck.contribution()` when the plan is built; the pass computes `local()`
    from the gradients it reads, and `read()` takes the reduced slots (one host read; on a
    mismatch one ``all_gather_into_tensor`` on every rank together), or, ``deferred``, keeps them with
    their mismatch flag on the device for `ReplicaCheck.count()` and `ReplicaCheck.name()`."""

    name: str = "replica"
    combine: Literal["sum", "max"] = "sum"

    def __init__(
        self,
        check: ReplicaCheck,
        sets: dict[int, ReplicaSet | None],
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
        with_grads: bool,
        with_params: bool,
        deferred: bool = False,
    ) -> None:
        self.check = check
        #: The reading waits for `ReplicaCheck.count()` (`DeferredReading`): no host read.
        self.deferred = deferred
        self.sets = sets
        self.optimizer = optimizer
        self.group = group
        self.primes = moduli(world_size)
        self.device = device
        self.with_grads = with_grads
        self.with_params = with_params
        #: Slots in the collective: the gradients' four, then the parameters' four (zeros when
        #: not checked this step: the slots' places stay fixed).
        self.numel = SLOTS * (2 if with_params else 1)
        #: Per checked kind, each tensor's global fingerprint rows (or what makes them, on a
        #: mismatch only) and its replica set, for naming the ranks.
        self._global: dict[str, tuple[Any, list[ReplicaSet | None]]] = {}
        self._grads: Sequence[torch.Tensor] = ()
        self.param_nonfinite: torch.Tensor | None = None

    # -- the local part

    def kernel_terms(
        self, params: tuple[torch.Tensor, ...], grads: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """The gradients' terms for a pass that sums this check's four slots in its own
        reduction (`distscaler._triton_pass.slot_sums()`): int64 ``(len(grads), 6)`` on the
        device, per tensor its coefficient, word offset and shift modulo each prime; made once
        per layout. None where the gradients are not compared at this step. ``grads`` in the
        order of ``params``; the pass gives the sums to `local()`."""
        if not self.with_grads:
            return None
        sets = [self.sets.get(id(p)) for p in params]
        primes = primes_tensor(self.primes, self.device)
        return self.check.kernel_terms(grads, sets, self.primes, primes)

    def local(
        self, params: tuple[torch.Tensor, ...], grads: Sequence[torch.Tensor],
        moments: torch.Tensor | None = None, sums: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's slots, float32 ``(numel,)`` on the device. ``grads``: the gathered
        gradients in the order of ``params`` (as the pass reads them); ``moments``: their
        `word_moments()` when the pass computed them in its read (the Triton kernel), else
        computed here; ``sums``: the gradients' four slots before their last residue, int64
        ``(4,)``, where the pass summed them from `kernel_terms()` (then two ops make the slots,
        and each tensor's global fingerprint is made only on a mismatch)."""
        primes = primes_tensor(self.primes, self.device)
        sets = [self.sets.get(id(p)) for p in params]
        self._grads = grads  # read again only on a mismatch: whether a value is inf/NaN
        parts: list[torch.Tensor] = []
        if self.with_grads and sums is not None and moments is not None:
            _, offsets, _ = self.check.layout_terms("gradients", grads, sets, self.primes, primes)
            parts.append(sums.remainder(moduli_tensor(self.primes, self.device)).to(torch.float32))
            self._global["gradients"] = (functools.partial(global_rows, moments, offsets, primes),
                                         list(sets))  # fmt: skip
        elif self.with_grads:
            if moments is None:
                moments = word_moments(grads, self.primes, self.device)
            parts.append(self._slots("gradients", moments, grads, sets, primes))
        else:
            parts.append(torch.zeros(SLOTS, dtype=torch.float32, device=self.device))
        if self.with_params:
            tensors: list[torch.Tensor] = []
            owners: list[ReplicaSet | None] = []
            weights: list[torch.Tensor] = []
            for p, s in zip(params, sets):
                if s is None:
                    continue
                weights.append(getattr(p, "_local_tensor", p))
                for t in (p, *self.optimizer.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        tensors.append(getattr(t, "_local_tensor", t))
                        owners.append(s)
            if weights:  # a non-finite parameter, for the collapse report
                self.param_nonfinite = torch.stack(
                    [w.detach().isfinite().all() for w in weights]
                ).all().logical_not()
            moments = word_moments(tensors, self.primes, self.device)
            parts.append(self._slots("parameters", moments, tensors, owners, primes))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _slots(
        self,
        what: str,
        moments: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        sets: Sequence[ReplicaSet | None],
        primes: torch.Tensor,
    ) -> torch.Tensor:
        coefs, offsets, shift = self.check.layout_terms(what, tensors, sets, self.primes, primes)
        slots, fingerprints = fingerprint_slots(moments, offsets, coefs, shift, primes)
        self._global[what] = (fingerprints, list(sets))
        return slots

    # -- the reading

    def read(
        self, reduced: torch.Tensor, local: torch.Tensor | None = None
    ) -> ReplicaMismatch | DeferredReading | None:
        """What the reduced slots show, counted in the ledger. At once (one host read): the
        mismatch (or None when the replicas agree), acted on (``"raise"``: `ReplicaMismatchError`;
        a callable is called); every rank reads the same slots, so every rank returns the same.
        Where the check is ``deferred``: a `DeferredReading` holding the mismatch flag on the
        device (no host read; ``local``: this rank's buffer before the reduce, its non-finite flag
        first), read by `ReplicaCheck.count()` and named by `ReplicaCheck.name()` later."""
        check = self.check
        step = check.iteration + 1
        ledger = check.ledger
        ledger.checks += self.with_grads
        ledger.param_checks += self.with_params
        if self.with_params:
            ledger.param_checks_at = step
        if self.deferred:
            assert local is not None
            self._grads = ()  # nothing is read again: the flag before the reduce says it
            return DeferredReading(self, step, reduced, mismatch_flag(reduced, self.primes),
                                   local.reshape(-1)[:1])  # fmt: skip
        values = reduced.tolist()
        if self.param_nonfinite is not None and bool(self.param_nonfinite):
            check.nonfinite_parameters = True  # for the collapse report at the next read
        if not self.differs(values):
            return None
        local_nonfinite = any(
            not bool(g.isfinite().all()) for g in self._grads if g.is_floating_point()
        )  # a mismatch's one more read: an inf/NaN makes it an overflow too
        mismatch = self.settle(step, values, local_nonfinite)
        if check.on_mismatch == "raise":
            raise ReplicaMismatchError(mismatch)
        return mismatch

    def differs(self, values: Sequence[float]) -> list[str]:
        """What the reduced slots (host floats) show differing: ``"gradients"``, ``"parameters"``
        or both, in that order; empty when the replicas agree."""
        parts = [("gradients", values[0:SLOTS]), ("parameters", values[SLOTS : 2 * SLOTS])]
        return [what for what, slots in parts if slots and mismatched(slots, self.primes)]

    def settle(self, step: int, values: Sequence[float], local_nonfinite: bool) -> ReplicaMismatch:
        """The mismatch the reduced slots (``values``, host floats, some differing) show at update
        ``step``: the ranks named (one ``all_gather_into_tensor`` on every rank together), noted in the
        ledger, logged on rank 0; a callable ``on_mismatch`` is called. ``local_nonfinite``: this
        rank's checked tensors held inf/NaN."""
        check = self.check
        what = self.differs(values)[0]
        rows, owners = self._global[what]
        if callable(rows):
            rows = rows()
        ranks, sets, nonfinite = _name_ranks((rows, owners), self.primes, self.group,
                                             local_nonfinite)  # fmt: skip
        on_mismatch = check.on_mismatch
        action = on_mismatch if isinstance(on_mismatch, str) else "callback"
        mismatch = ReplicaMismatch(step, what, ranks, sets, action, nonfinite)  # type: ignore[arg-type]
        check.ledger.note_mismatch(mismatch)
        _warn_rank0("replica mismatch at %s; the step is skipped on every rank",
                    mismatch.describe())  # fmt: skip
        if callable(on_mismatch):
            on_mismatch(mismatch)
        return mismatch


class DeferredReading(NamedTuple):
    """A replica check whose reading waits (a fused step on CUDA with the Triton kernels, the
    default cadence): the mismatch flag on the device, which the step and the update take without a
    host read, and what the later reading needs. Made by `ReplicaSlots.read()`."""

    #: The check's part of the step (its fingerprints, for naming the ranks).
    slots: ReplicaSlots
    #: The 1-based update the check belongs to (as `ReplicaMismatch.step`).
    step: int
    #: The reduced slots, float32 ``(numel,)`` on the device.
    reduced: torch.Tensor
    #: `mismatch_flag()` of ``reduced``: 0-dim float32, 1.0 where the replicas differ.
    mismatch: torch.Tensor
    #: This rank's non-finite flag before the reduce, float32 ``(1,)`` (1.0: it held inf/NaN).
    local_found: torch.Tensor


# ---------------------------------------------------------------------- the scaler's part


#: ``replica_check_interval=None``: every update where a host read is free (the CPU) or the Triton
#: kernels read the fingerprint (a fused step keeps the mismatch flag on the device, another reads
#: it beside its own ``found_inf``), else every this many (a checked step costs a read pass and a
#: host sync there).
GPU_INTERVAL = 32


class ReplicaCheck:
    """The scaler's replica check: when it is due, its contribution to the step's collective, the
    ledger. See the module docstring; the settings are `ScalerConfig`'s."""

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
        #: The parameter check saw a non-finite parameter (the collapse watch takes it).
        self.nonfinite_parameters = False
        self._terms: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._kernel_terms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sets: dict[tuple, dict[int, ReplicaSet | None]] = {}
        #: Deferred readings of updates done, with the update's number, its agreed found_inf and
        #: whether its mismatch flag held the update (`defer()`), not read on the host yet.
        self.pending: list[tuple[int, DeferredReading, torch.Tensor, bool]] = []
        #: Mismatches counted by `count()`, to be named by `name()`: (update, reading, the
        #: reduced slots as host floats, whether this rank held inf/NaN).
        self.unnamed: list[tuple[int, DeferredReading, list[float], bool]] = []

    def configure(
        self, enabled: bool, interval: int | None, param_interval: int, on_mismatch: OnMismatch
    ) -> None:
        """Take new settings (a config replaced); the ledger and the count stay."""
        self.enabled, self.interval_setting = enabled, interval
        self.param_interval, self.on_mismatch = param_interval, on_mismatch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_terms"], state["_sets"], state["_kernel_terms"] = {}, {}, {}
        state["pending"], state["unnamed"] = [], []  # device tensors and a process group
        if not isinstance(self.on_mismatch, str):
            state["on_mismatch"] = "skip"  # a callable is not copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a check pickled before deferred readings and kernel terms existed)
        state.setdefault("_kernel_terms", {})
        state.setdefault("pending", [])
        state.setdefault("unnamed", [])
        self.__dict__.update(state)

    def interval(self, host_reads: bool) -> int:
        """Updates between two gradient checks: the setting, or 1 where a check costs no host
        sync (``host_reads``: the CPU, or a reading that waits) and `GPU_INTERVAL` elsewhere."""
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

    def contribution(
        self,
        plan: StepPlan,
        layouts: Any,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> ReplicaSlots | None:
        """The check's part of this step's collective, or None when it is not due or nothing of
        ``optimizer`` is replicated (the ranks of a group are alike in this: DDP, HSDP, FSDP2 +
        TP, pipeline stages each replicated or none, which the collective's size relies on).
        How it may be read is the ``plan``'s (`distscaler._plan.StepPlan`): with
        ``plan.reading_free`` (no sync of its own at the step: the CPU; with the Triton kernels, a
        step that reads ``found_inf`` on the host anyway) the default interval checks every
        update, read at the step; with ``plan.reading_may_wait`` (a fused step with the Triton
        kernels, a periodic read to come) it checks every update and its reading waits on the
        device (`DeferredReading`); else every `GPU_INTERVAL` updates, read at the step."""
        world = plan.world
        group, world_size = world.group, world.size
        free = plan.reading_free
        deferred = plan.reading_may_wait and not free and self.interval_setting is None
        with_grads, with_params = self.due(world_size, world.dynamic, free or deferred)
        if not (with_grads or with_params):
            return None
        params = tuple(p for g in optimizer.param_groups for p in g["params"])
        sets = self._replica_sets(layouts, params, group, world_size)
        if all(s is None for s in sets.values()):
            return None
        return ReplicaSlots(self, sets, optimizer, group=group, world_size=world_size,
                            device=device, with_grads=with_grads, with_params=with_params,
                            deferred=deferred)  # fmt: skip

    # -- deferred readings

    def defer(
        self,
        update: int,
        readings: Sequence[DeferredReading],
        found_inf: torch.Tensor,
        *,
        counted: bool = True,
    ) -> None:
        """Keep the deferred ``readings`` of update ``update`` (1-based, the host's count) and its
        agreed ``found_inf`` for `count()`; ``counted``: their mismatch flag held the update
        (False: the update did not run on it, ``update(new_scale)`` or a mismatch read at the step:
        the ledger takes them, no skip is reported). Not under CUDA graph capture: a replay runs no
        Python (its mismatch flag still skips the step and holds the update on the device)."""
        if found_inf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self.pending += [(update, r, found_inf, counted) for r in readings]

    def count(self) -> list[tuple[int, bool]]:
        """Read the pending mismatch flags on the host (one transfer; nothing when none are
        pending, no collective: safe on one rank): each mismatch is kept for `name()`. Returns ``(update, overflow)`` per mismatch,
        ``overflow`` where some rank also held inf/NaN (the agreed ``found_inf``: the update backed
        off)."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        parts = []
        for _, r, found, _ in pending:
            nonfinite = r.slots.param_nonfinite
            parts += [r.mismatch.reshape(1), found.reshape(1).to(r.mismatch.dtype), r.local_found,
                      (r.mismatch if nonfinite is None else nonfinite).reshape(1).to(torch.float32),
                      r.reduced]  # fmt: skip
        values = torch.cat([p.to(torch.float64) for p in parts]).tolist()
        events, i = [], 0
        for update, r, _, counted in pending:
            mismatch, found, local, param_nonfinite = values[i : i + 4]
            slots = values[i + 4 : i + 4 + r.reduced.numel()]
            i += 4 + r.reduced.numel()
            if r.slots.param_nonfinite is not None and param_nonfinite:
                self.nonfinite_parameters = True
            if mismatch:
                self.unnamed.append((update, r, slots, bool(local)))
                if counted:
                    events.append((update, bool(found)))
        return events

    def forget_deferred(self) -> None:
        """Drop the deferred readings not yet counted or named (a loaded state replaces the run
        they belong to)."""
        self.pending, self.unnamed = [], []

    def name(self) -> tuple[list[tuple[int, ReplicaMismatch]], ReplicaMismatchError | None]:
        """Name the ranks of each mismatch `count()` kept (one ``all_gather_into_tensor`` each, on
        every rank together: call it where every rank is, the periodic read), note them in the
        ledger, log them, call a callable ``on_mismatch``. Returns ``(update, mismatch)`` for each
        and, for ``"raise"``, the error to raise (the first mismatch's) once the caller's update
        is complete."""
        unnamed, self.unnamed = self.unnamed, []
        named = [(u, r.slots.settle(r.step, slots, local)) for u, r, slots, local in unnamed]
        error = None
        if named and self.on_mismatch == "raise":
            error = ReplicaMismatchError(named[0][1])
        return named, error

    def _replica_sets(
        self, layouts: Any, params: tuple[torch.Tensor, ...], group: Any, world_size: int
    ) -> dict[int, ReplicaSet | None]:
        # Each parameter's replica set by id(), looked up once per layout.
        key = (tuple(id(p) for p in params), layouts.version, world_size, id(group))
        cached = self._sets.get(key)
        if cached is None:
            cached = {id(p): layouts.replica_set(p, p.grad, group, world_size) for p in params}
            if len(self._sets) > 8:
                self._sets.clear()
            self._sets[key] = cached
        return cached

    def layout_terms(
        self,
        what: str,
        tensors: Sequence[torch.Tensor],
        sets: Sequence[ReplicaSet | None],
        primes: tuple[int, int],
        primes_t: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`layout_terms()`, cached per layout (host arithmetic once)."""
        sizes = tuple(0 if w is None else w.numel() for w in map(_words, tensors))
        key = (what, sizes, tuple(sets), primes, primes_t.device)
        cached = self._terms.get(key)
        if cached is None:
            if len(self._terms) > 4:
                self._terms.clear()
            cached = self._terms[key] = layout_terms(sizes, sets, primes, primes_t.device)
        return cached

    def kernel_terms(
        self,
        tensors: Sequence[torch.Tensor],
        sets: Sequence[ReplicaSet | None],
        primes: tuple[int, int],
        primes_t: torch.Tensor,
    ) -> torch.Tensor:
        """`layout_terms()` of the gradients as one int64 ``(n, 6)`` for a kernel: per tensor
        ``[c mod P1, c mod P2, offset mod P1, offset mod P2, shift mod P1, shift mod P2]``, the
        coefficient as a residue; cached per layout (the ops once)."""
        coefs, offsets, shift = self.layout_terms("gradients", tensors, sets, primes, primes_t)
        key = (id(coefs), primes)
        cached = self._kernel_terms.get(key)
        if cached is None or cached[0] is not coefs:
            residues = coefs.unsqueeze(1).remainder(primes_t)
            if len(self._kernel_terms) > 4:
                self._kernel_terms.clear()
            cached = self._kernel_terms[key] = (coefs, torch.cat([residues, offsets, shift], 1))
        return cached[1]

    def take_nonfinite_parameters(self) -> bool:
        """Whether the parameter check saw a non-finite parameter since the last call."""
        seen, self.nonfinite_parameters = self.nonfinite_parameters, False
        return seen

    def end_iteration(self, skipped: bool, optimizers: Sequence[Any] = ()) -> None:
        """``update()``: the iteration ends (``skipped``: for a replica mismatch). Where the
        parameter check was due but could not compare replicas (one rank; a group whose
        membership changes, torchft's), the parameters of ``optimizers`` are still checked for
        non-finite values, locally (one read of them, one host read), for the collapse report."""
        n = self.iteration + 1
        due = self.param_interval > 0 and n % self.param_interval == 0
        if due and optimizers and self.ledger.param_checks_at != n:
            params = [getattr(p, "_local_tensor", p).detach()
                      for opt in optimizers for g in opt.param_groups for p in g["params"]]  # fmt: skip
            if params and not bool(torch.stack([p.isfinite().all() for p in params]).all()):
                self.nonfinite_parameters = True
        self.iteration = n
        self.last_skipped = skipped


#: Replica sets a rank lists when ranks are named (`_name_ranks()`): a fixed row per rank.
NAMED_SETS = 8
#: Per rank: its global rank, whether its tensors held inf/NaN, its number of replica sets.
_HEAD = 3
#: Per set: its size, this rank's position in it, its key (`_set_key()`), its four residues.
_PER_SET = 7


def _set_key(ranks: tuple[int, ...]) -> int:
    """A replica set's key in the exchange of `_name_ranks()`: a polynomial hash of its ranks
    modulo the prime ``2**61 - 1``, the same on every process (no Python ``hash()``). Two
    distinct sets of one size share it with probability about ``2**-61``, and then they merge
    visibly (two ranks at one position): their ranks are all named."""
    m = (1 << 61) - 1
    h = len(ranks)
    for r in ranks:
        h = (h * 1_000_003 + r + 1) % m
    return h


def _name_ranks(
    fingerprints: tuple[torch.Tensor, list[ReplicaSet | None]],
    primes: tuple[int, int],
    group: dist.ProcessGroup | None,
    nonfinite: bool = False,
) -> tuple[tuple[int, ...], tuple, tuple[int, ...]]:
    """Exchange per-set fingerprints and whether this rank's tensors hold inf/NaN; name each
    set's outliers and the ranks that held inf/NaN.

    One ``all_gather_into_tensor`` of a fixed row per rank, int64 on the fingerprints' device
    (no pickling, no numpy): ``[rank, nonfinite, number of sets]`` then, for up to `NAMED_SETS`
    sets, ``[size, position, key, A mod P1, A mod P2, B mod P1, B mod P2]`` (zeros after the
    last). The per-set sums are made on the device; one host read of the gathered rows."""
    rows_t, sets = fingerprints
    device = rows_t.device
    mine: dict[ReplicaSet, int] = {}
    owner = []
    for rs in sets:
        owner.append(-1 if rs is None else mine.setdefault(rs, len(mine)))
    listed = list(mine)[:NAMED_SETS]
    me = dist.get_rank() if dist.is_initialized() else 0
    head = [me, int(nonfinite), len(mine)]
    meta = [[len(rs.ranks), rs.position, _set_key(rs.ranks)] for rs in listed]
    row = torch.zeros(_HEAD + NAMED_SETS * _PER_SET, dtype=torch.int64, device=device)
    static = torch.tensor(head + [v for m in meta for v in m], dtype=torch.int64)
    if listed:
        checked = [i for i, o in enumerate(owner) if 0 <= o < NAMED_SETS]
        index = torch.tensor([owner[i] for i in checked], dtype=torch.int64, device=device)
        sums = torch.zeros(len(listed), 4, dtype=torch.int64, device=device)
        sums.index_add_(0, index, rows_t[index.new_tensor(checked)])
        sums = sums.remainder(moduli_tensor(primes, device))  # (sets, 4)
        table = torch.cat([static[_HEAD:].reshape(-1, 3).to(device), sums], 1)
        row[_HEAD : _HEAD + table.numel()] = table.reshape(-1)
    row[:_HEAD] = static[:_HEAD].to(device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        gathered = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
        # torch >= 2.13 names it all_gather_single (the older name warns there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, row, group=group)
    else:
        gathered = row
    table_all = gathered.reshape(world, -1).tolist()  # the exchange's one host read
    by_set: dict[tuple[int, int], dict[int, list[tuple[int, tuple[int, ...]]]]] = {}
    ranks_seen: list[int] = []
    held_list: list[int] = []
    for r in table_all:
        rank, bad, count = r[0], r[1], r[2]
        ranks_seen.append(rank)
        if bad:
            held_list.append(rank)
        for i in range(min(count, NAMED_SETS)):
            size, position, key, *fp = r[_HEAD + i * _PER_SET : _HEAD + (i + 1) * _PER_SET]
            by_set.setdefault((size, key), {}).setdefault(position, []).append((rank, tuple(fp)))
    named: set[int] = set()
    bad_sets = []
    for positions in by_set.values():
        entries = [e for p in sorted(positions) for e in positions[p]]
        members = tuple(rank for rank, _ in entries)
        fps = dict(entries)
        if any(len(e) > 1 for e in positions.values()):  # two sets under one key: name them all
            named |= set(members)
            bad_sets.append((members, tuple(fps[r] for r in members)))
            continue
        counts = collections.Counter(fps.values())
        if len(counts) <= 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if n * 2 > len(fps) else None
        named |= {r for r, fp in fps.items() if fp != majority}
        bad_sets.append((members, tuple(fps[r] for r in members)))
    if not named:  # the sets agree as wholes: the difference lies across sets
        named = set(ranks_seen)
    bad_sets.sort()
    return tuple(sorted(named)), tuple(bad_sets), tuple(sorted(held_list))
