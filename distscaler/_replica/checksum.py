"""The replica check's checksum: exact position-weighted sums of 16-bit words, modulo two primes.

What [`distscaler.replica_check`][distscaler.replica_check] describes for users, as arithmetic:
each replicated tensor read as its 16-bit words ``w_k``, the sums ``A = sum_k w_k`` and
``B = sum_k k * w_k`` modulo two primes ``P1 > P2`` (`moduli()`), combined per replica set with
coefficients that sum to zero (`coefficient()`) and shifts that keep a clean set cancelling
(`shifts()`), into four float32 slots whose sum over the group is exact (`checksum_slots()`);
the reduced slots are read by `mismatched()` on the host or `mismatch_flag()` on the device.

Nothing here knows the scaler, the plan or the collective: `distscaler._replica.check` uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..replica_check import MAX_WORLD_SIZE

if TYPE_CHECKING:
    from ..replica_check import ReplicaSet

__all__ = [
    "FLOAT32_EXACT",
    "ROW_WORDS",
    "SLOTS",
    "coefficient",
    "checksum_slots",
    "global_rows",
    "layout_terms",
    "mismatch_flag",
    "mismatched",
    "moduli",
    "moduli_tensor",
    "primes_tensor",
    "set_coefficient",
    "set_shift",
    "shift_spacing",
    "shifts",
    "word_moments",
    "words",
]

#: Largest integer float32 holds exactly with all below it (its significand's 24 bits).
FLOAT32_EXACT = 1 << 24
#: Words per row of the exact sums: a row's ``sum w`` is below ``2**22`` and its ``sum j * w``
#: (``j < 128``) below ``2**28`` in magnitude, exact in ``int32``.
ROW_WORDS = 128
#: Slots of one checksum in the collective: (G0, G1) for each of the two primes.
SLOTS = 4


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


def words(tensor: torch.Tensor) -> torch.Tensor | None:
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
    """Each tensor's global checksum, int64 ``(n, 4)``: ``A``, and ``B`` at positions global
    over the checked tensors (`checksum_slots()`' second result), from `word_moments()` and
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
    """Each tensor's checksum: int64 ``(len(tensors), 4)`` on ``device``,
    ``[A mod P1, A mod P2, B mod P1, B mod P2]`` with ``A = sum_k w_k`` and ``B = sum_k k * w_k``
    over the tensor's 16-bit words ``w_k`` (positions ``k`` from 0 in each tensor), exact.

    ``primes``: odd primes below ``2**24`` (`moduli()`). Torch's kernels: one ``cat`` of every
    word into zero-padded rows of `ROW_WORDS` (``int32``), the row sums ``sum w`` and ``sum j * w``
    (exact in ``int32``), then per row and per tensor ``int64`` residues (``index_add_``). A tensor
    that is not dense floating point counts as empty."""
    views = [words(t) for t in tensors]
    sizes = tuple(0 if w is None else w.numel() for w in views)
    out = torch.zeros(len(tensors), 4, dtype=torch.int64, device=device)
    if not any(sizes):
        return out
    rows = _rows(sizes, primes, device)
    primes_t = primes_tensor(primes, device)
    pieces: list[torch.Tensor] = []
    for w, n in zip(views, sizes):
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


def checksum_slots(
    moments: torch.Tensor,
    offsets: torch.Tensor,
    coefs: torch.Tensor,
    shift: torch.Tensor,
    primes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's four slots, float32 ``(4,)``: ``[G0 mod P1, G0 mod P2, G1 mod P1, G1 mod P2]``
    (module docstring), and each tensor's global checksum, int64 ``(n, 4)`` (``A``, and ``B``
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
    inputs of `checksum_slots()`. Offsets count the checked tensors' words only. Host arithmetic."""
    coefs, offsets, shift = [], [], []
    offset = 0
    for n, s in zip(sizes, sets):
        checked = s is not None and n > 0
        coefs.append(set_coefficient(s) if checked else 0)  # type: ignore[arg-type]
        offsets.append([offset % primes[0], offset % primes[1]])
        shift.append(list(set_shift(s, primes)) if checked else [0, 0])  # type: ignore[arg-type]
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


def set_coefficient(members: ReplicaSet) -> int:
    """This rank's coefficient in its replica set ``members`` (`coefficient()` at its position)."""
    return coefficient(members.position, len(members.ranks))


def set_shift(members: ReplicaSet, primes: tuple[int, int]) -> tuple[int, int]:
    """This rank's shift in its replica set ``members`` modulo both primes (`shifts()` at its
    position)."""
    return shifts(len(members.ranks), primes)[members.position]
