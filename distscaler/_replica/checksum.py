"""The replica check's checksum: exact weighted sums of 16-bit words modulo two primes, some of
the weights fixed (a certainty for two changed words), some keyed by a per-run secret (a bound
for every other change), carried through the collective in float32 limbs.

What [`distscaler.replica_check`][distscaler.replica_check] describes for users, as arithmetic.
Each rank reads its checked tensors (the replicated gradients, in the optimizer's order) as one
stream of signed 16-bit words ``w_k``; each tensor starts at a multiple of `ROW_WORDS` in the
stream (its *padded* offset), so ``k`` is a word's padded position. A tensor of replica set ``S``
(``m`` ranks, this rank its ``i``-th) weighs word ``k`` with, modulo each prime ``P`` of
`PRIMES`:

- ``A``: ``c_i``, the replica coefficient (`coefficient()`: ``+1, -1, ...``, or ``1, 1, -2, +1,
  -1, ...``; the set's coefficients sum to 0, none is 0, none above 2 in magnitude);
- ``B``: ``c_i * (k + D_m * v_i)``, with ``v_i`` the replica's distinct offset (`offsets()`,
  ``sum_i c_i v_i = 0``) and ``D_m`` the spacing `spacing()` (``P1 * P2 // (max v + 1)``);
- ``C``: ``c_i * z_S``, the set's identity (`set_identity()`: its lowest and highest rank);
- ``R``: ``a_(k mod 64) * (b_(S,i)(k div 64) - b_(S,i+1 mod m)(k div 64))``: keyed weights, ``a``
  per column of a 64-word row and ``b`` per row, replica and set, uniform modulo ``P`` and drawn
  from the secret (`Key`).

Every set's weights sum to 0 over its replicas, word by word, so a clean set adds a multiple of
``P`` to every slot; the reduced slots are read by `mismatched()` on the host or
`mismatch_flag()` on the device.

**Certainty, two words** (any ranks, any replica sets, modulo both primes so modulo ``P1 * P2``;
a change ``d`` of a 16-bit word is below ``2**16`` in magnitude, ``|c d| < P``): one changed word
gives ``A = c d != 0``. Two changed words ``d1, d2`` with ``A = 0`` have ``c1 d1 = -c2 d2``, and
then ``B = c1 d1 (x1 - x2)`` and ``C = c1 d1 (z1 - z2)``, with ``x = k + D_m v_i``: zero only
where the two words have the same ``x`` and the same set identity, that is the same word of two
replicas changed alike in a set of two (the replicas then agree) or the same word of one replica
(one word). ``x`` is distinct for distinct replicas and positions while a rank's padded stream
holds fewer than ``D_m`` words (`words_limit()`: 2**48 words in a set of two, 2.1e9 in one set of
131,072 ranks). Set identities are distinct for the replica sets of a device mesh (the lowest and
the highest rank of a sub-mesh name it); two sets of other layouts that share both are told apart
by ``R`` only.

**Every other change** is missed with probability at most ``(2 / P1) * (2 / P2) < 2**-46`` over
the secret: ``R`` sums, over sets and replicas, ``b_(S,i)(row) * sum_col a_col (d_(S,i) -
d_(S,i-1))[row, col]``, a polynomial of degree 2 in independent uniform weights that is nonzero
wherever two replicas of a set changed differently (Schwartz-Zippel), and the two primes draw
their weights independently.

Nothing here knows the scaler, the plan or the collective: `distscaler._replica.check` uses it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..replica_check import ReplicaSet

__all__ = [
    "PRIMES",
    "RESIDUES",
    "ROW_WORDS",
    "Key",
    "coefficient",
    "digest",
    "from_limbs",
    "layout_terms",
    "limbs",
    "mismatch_flag",
    "mismatched",
    "moduli_tensor",
    "offsets",
    "padded",
    "rank_slots",
    "set_identity",
    "set_key",
    "slot_numel",
    "slot_residues",
    "spacing",
    "to_limbs",
    "word_moments",
    "word_weights",
    "words",
    "words_limit",
]

#: The two largest primes below ``2**24``: every residue is exact in float32 and every product of
#: two residues exact in int64.
PRIMES = (16_777_213, 16_777_199)
#: Residues of one checksum: ``A, B, C, R`` modulo ``P1`` and ``P2``, in that order
#: (``[A1, A2, B1, B2, C1, C2, R1, R2]``).
RESIDUES = 8
#: Words of a row: of the keyed weights (``a`` per column, ``b`` per row) and of the sums.
ROW_WORDS = 64
#: Bits of a residue (each below ``2**24``).
_RESIDUE_BITS = 24
#: A set identity's factor: ``z = lowest * 2**24 + highest`` (ranks below 2**24).
_IDENTITY_BASE = 1 << 24
_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------- the fixed weights


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


def _pairs(count: int, base: int) -> list[int]:
    """Values for ``count`` replicas of coefficients ``+1, -1, ...`` (``count`` even), distinct,
    from ``base`` up, whose signed sum is 0: blocks of four ``(b, b+1, b+3, b+2)`` (``-1 + 1``),
    with three pairs ``(0, 1, 4, 2, 5, 6)`` first (``-1 + 2 - 1``) when the pairs are odd."""
    out: list[int] = []
    pairs = count // 2
    if pairs % 2 == 1:
        if pairs == 1:
            raise ValueError("one pair cannot sum to 0 with distinct values")
        out += [base + v for v in (0, 1, 4, 2, 5, 6)]
        base, pairs = base + 7, pairs - 3
    for j in range(pairs // 2):
        b = base + 4 * j
        out += [b, b + 1, b + 3, b + 2]
    return out


@functools.lru_cache(maxsize=64)
def offsets(replicas: int) -> tuple[int, ...]:
    """Each replica's offset ``v_i`` in a set of ``replicas``: distinct (from 3 replicas on; two
    replicas share 0, as their coefficients ``1, -1`` force), at most ``replicas + 1``, and
    ``sum_i coefficient(i) * v_i == 0``, so that a clean set's ``B`` cancels. Closed form, linear
    in ``replicas``."""
    if replicas < 3:
        return (0,) * max(replicas, 0)
    if replicas % 2 == 0:
        return tuple(_pairs(replicas, 0)) if replicas != 2 else (0, 0)
    rest = replicas - 3
    if rest == 2:  # 1, 1, -2 then +1, -1: (0, 3, 2) sums -1, (5, 4) +1
        return (0, 3, 2, 5, 4)
    return (0, 2, 1, *_pairs(rest, 3))  # 0 + 2 - 2 * 1 == 0


@functools.lru_cache(maxsize=64)
def spacing(replicas: int) -> int:
    """``D_m``: the distance between two replicas' positions in ``B`` (``P1 * P2 // (max offset
    + 1)``); a rank's padded stream of fewer words keeps every word's position distinct."""
    return (PRIMES[0] * PRIMES[1]) // (max(offsets(replicas), default=0) + 1)


def words_limit(replicas: int) -> int:
    """The padded words a rank may check with two changed words still caught with certainty in a
    set of ``replicas`` (`spacing()`)."""
    return spacing(replicas)


def set_identity(ranks: Sequence[int]) -> int:
    """``z_S`` of the set of ``ranks``: ``lowest * 2**24 + highest``, below ``P1 * P2``. Distinct
    for the sets of a device mesh (a sub-mesh's lowest and highest ranks name it)."""
    return min(ranks) * _IDENTITY_BASE + max(ranks)


def set_key(ranks: Sequence[int]) -> int:
    """A set's key for its keyed weights and for naming ranks: a polynomial hash of its ranks
    modulo ``2**61 - 1``, the same on every process (no Python ``hash()``)."""
    m = (1 << 61) - 1
    h = len(ranks)
    for r in ranks:
        h = (h * 1_000_003 + r + 1) % m
    return h


# ---------------------------------------------------------------------- the keyed weights


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A bijection of 32-bit values held in int64 (every product below 2**59).
    x = ((x >> 16) ^ x).mul_(0x45D9F3B).bitwise_and_(_M32)
    x = ((x >> 16) ^ x).mul_(0x45D9F3B).bitwise_and_(_M32)
    return (x >> 16) ^ x


def _hashed(index: torch.Tensor, words: tuple[int, int, int, int], prime: int) -> torch.Tensor:
    """A keyed pseudo-random residue modulo ``prime`` per ``index`` (int64, ``0 <= index <
    2**56``): four rounds of a 32-bit mixing bijection keyed by ``words``, 56 bits, reduced."""
    x = _mix32((index & _M32) ^ words[0])
    x = _mix32(x ^ (index >> 32) ^ words[1])
    y = _mix32(x ^ words[2])
    z = _mix32(y ^ words[3])
    return ((y << 24) ^ z).remainder_(prime)


class Key:
    """The keyed weights of one secret: ``a`` per column (`columns()`) and ``b`` per row, replica
    and set (`rows()`), for each prime independently. Host arithmetic for the key words; the
    weights are torch int64 ops on the device asked for."""

    def __init__(self, secret: int) -> None:
        self.secret = int(secret) & ((1 << 64) - 1)

    def _words(self, *what: int | str) -> tuple[int, int, int, int]:
        raw = hashlib.blake2b(repr((self.secret, *what)).encode(), digest_size=16).digest()
        w = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 16, 4)]
        return w[0], w[1], w[2], w[3]

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a few devices per key, for the key's life
    def columns(self, device: torch.device) -> torch.Tensor:
        """``a``: int64 ``(2, ROW_WORDS)``, the column weights modulo each prime."""
        cols = torch.arange(ROW_WORDS, dtype=torch.int64, device=device)
        return torch.stack([_hashed(cols, self._words("a", q), p) for q, p in enumerate(PRIMES)])

    def rows(self, key: int, replica: int, rows: torch.Tensor) -> torch.Tensor:
        """``b_(S,i)`` of the set of `set_key()` ``key``, replica ``replica``, at row indices
        ``rows`` (int64 ``(n,)``, global in the padded stream): int64 ``(n, 2)``."""
        return torch.stack([_hashed(rows, self._words("b", q, key, replica), p)
                            for q, p in enumerate(PRIMES)], 1)  # fmt: skip


# ---------------------------------------------------------------------- words and their sums


def words(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as 16-bit signed words, flat (no copy when contiguous); None for a tensor
    that is not a dense floating-point one."""
    if not tensor.is_floating_point() or tensor.layout is not torch.strided:
        return None
    tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor.detach().reshape(-1).view(torch.int16)


def padded(n: int) -> int:
    """``n`` words rounded up to whole rows (a tensor's span in the padded stream)."""
    return -(-n // ROW_WORDS) * ROW_WORDS


_PRIMES_T: dict[tuple, torch.Tensor] = {}


def moduli_tensor(
    device: torch.device, numel: int = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``[P1, P2, P1, P2, ...]``, ``(numel,)`` of ``dtype`` on ``device``, made once per device."""
    key = (device, numel, dtype)
    cached = _PRIMES_T.get(key)
    if cached is None:
        values = [PRIMES[i % 2] for i in range(numel)]
        cached = _PRIMES_T[key] = torch.tensor(values, dtype=dtype, device=device)
    return cached


class _Rows(NamedTuple):
    owners: torch.Tensor  # int64 (rows,): the tensor of each row
    starts: torch.Tensor  # int64 (rows, 2): each row's first word position in its tensor, mod P


_ROWS: dict[tuple, _Rows] = {}
_COLUMNS: dict[tuple, torch.Tensor] = {}


def _rows(sizes: tuple[int, ...], device: torch.device) -> _Rows:
    key = (sizes, device)
    cached = _ROWS.get(key)
    if cached is not None:
        return cached
    counts = [-(-n // ROW_WORDS) for n in sizes]
    owners = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), torch.tensor(counts, device=device)
    )
    local = torch.cat([torch.arange(c, dtype=torch.int64, device=device) for c in counts]) \
        if counts else torch.zeros(0, dtype=torch.int64, device=device)  # fmt: skip
    starts = (local * ROW_WORDS).unsqueeze(1).remainder(moduli_tensor(device))
    if len(_ROWS) > 8:
        _ROWS.clear()
    _ROWS[key] = rows = _Rows(owners, starts)
    return rows


def _column_matrix(key: Key | None, device: torch.device) -> torch.Tensor:
    """float64 ``(ROW_WORDS, 4)``: the columns ``1``, ``col``, ``a1``, ``a2`` (zeros without a
    key) by which a row of words is multiplied."""
    cache_key = (None if key is None else key.secret, device)
    cached = _COLUMNS.get(cache_key)
    if cached is None:
        cols = torch.arange(ROW_WORDS, dtype=torch.float64, device=device)
        a = (torch.zeros(2, ROW_WORDS, dtype=torch.float64, device=device) if key is None
             else key.columns(device).to(torch.float64))  # fmt: skip
        cached = torch.stack([torch.ones_like(cols), cols, a[0], a[1]], 1)
        if len(_COLUMNS) > 8:
            _COLUMNS.clear()
        _COLUMNS[cache_key] = cached
    return cached


def word_moments(
    tensors: Sequence[torch.Tensor], device: torch.device, key: Key | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each tensor's moments and, with a ``key``, each row's keyed column sum.

    Returns:
        int64 ``(len(tensors), 4)`` on ``device``: ``[A mod P1, A mod P2, B mod P1, B mod P2]``
        with ``A = sum_k w_k`` and ``B = sum_k k * w_k`` over the tensor's 16-bit words ``w_k``
        (positions from 0 in each tensor), exact; and with ``key``, int64 ``(rows, 2)``: each
        row's ``sum_col a_col w_col`` modulo each prime, rows of `ROW_WORDS` words in the padded
        stream of ``tensors`` (None without a key).

    Torch's kernels: one ``cat`` of every word into zero-padded rows, converted to float64 (exact:
    words below ``2**15``), one matrix product by the columns ``1, col, a1, a2`` (each row's sums,
    below ``2**46``: exact), then int64 residues per row and per tensor (``index_add_``). A
    tensor that is not dense floating point counts as empty."""
    views = [words(t) for t in tensors]
    sizes = tuple(0 if w is None else w.numel() for w in views)
    out = torch.zeros(len(tensors), 4, dtype=torch.int64, device=device)
    if not any(sizes):
        return out, (torch.zeros(0, 2, dtype=torch.int64, device=device) if key else None)
    rows = _rows(sizes, device)
    primes = moduli_tensor(device)
    pieces: list[torch.Tensor] = []
    for w, n in zip(views, sizes):
        if w is None or n == 0:
            continue
        pieces.append(w.to(device, non_blocking=True))
        pad = -n % ROW_WORDS
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.int16, device=device))
    flat = torch.cat(pieces).view(-1, ROW_WORDS).to(torch.float32).to(torch.float64)
    sums = (flat @ _column_matrix(key, device)).to(torch.int64)  # (rows, 4), exact
    a_mod = sums[:, :1].remainder(primes)  # (rows, 2)
    # B of a row's words at their positions in the tensor: sum j*w + start * sum w (mod P).
    b_mod = (sums[:, 1:2] + rows.starts * a_mod).remainder(primes)
    out.index_add_(0, rows.owners, torch.cat([a_mod, b_mod], 1))
    keyed = sums[:, 2:4].remainder(primes) if key is not None else None
    return out.remainder_(moduli_tensor(device, 4)), keyed


# ---------------------------------------------------------------------- the slots


def layout_terms(
    sizes: Sequence[int], sets: Sequence[ReplicaSet | None], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """Per tensor of ``sizes`` words in its replica set (None: not checked), int64 ``(n, 8)`` on
    ``device``: ``[c, padded offset, D_m * v_i, c * z_S]`` each modulo ``P1`` then ``P2``
    (``c`` as a residue), the terms of `slot_residues()` and of the kernel's slot sums; and each
    tensor's padded offset (the first row's index is it over `ROW_WORDS`). Offsets count checked
    tensors only. Host arithmetic."""
    terms, starts = [], []
    offset = 0
    for n, s in zip(sizes, sets):
        checked = s is not None and n > 0
        starts.append(offset)
        if not checked:
            terms.append([0] * 8)
            continue
        m, i = len(s.ranks), s.position  # type: ignore[union-attr]
        c = coefficient(i, m)
        shift = spacing(m) * offsets(m)[i]
        ident = c * set_identity(s.ranks)  # type: ignore[union-attr]
        terms.append([v % p for v in (c, offset, shift, ident) for p in PRIMES])
        offset += padded(n)
    return torch.tensor(terms, dtype=torch.int64, device=device).reshape(-1, 8), starts


def slot_residues(moments: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """``A, B, C`` of a rank's tensors, int64 ``(6,)``: ``[A1, A2, B1, B2, C1, C2]`` summed over
    tensors, each below ``P`` (``moments``: `word_moments()`' int64 ``(n, 4)``; ``terms``:
    `layout_terms()`' int64 ``(n, 8)``). Torch's int64 ops, every product of two residues below
    ``2**48``; what the Triton reduction's slot sums hold before their last residue."""
    p = moduli_tensor(moments.device)
    a, b_local = moments[:, :2], moments[:, 2:]
    c, o, sh, cz = terms[:, 0:2], terms[:, 2:4], terms[:, 4:6], terms[:, 6:8]
    b = (b_local + o * a).remainder(p)
    sa = (c * a).remainder(p).sum(0)
    sb = (c * (b + sh * a).remainder(p)).remainder(p).sum(0)
    sc = (cz * a).remainder(p).sum(0)
    return torch.cat([sa, sb, sc]).remainder(moduli_tensor(moments.device, 6))


def global_rows(moments: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Each tensor's ``[A mod P1, A mod P2, B mod P1, B mod P2]`` with ``B`` at padded positions
    global over the checked tensors, int64 ``(n, 4)`` (for naming ranks)."""
    p = moduli_tensor(moments.device)
    a = moments[:, :2]
    return torch.cat([a, (moments[:, 2:] + terms[:, 2:4] * a).remainder(p)], 1)


def _row_weights(
    key: Key, sizes: Sequence[int], sets: Sequence[ReplicaSet | None], starts: Sequence[int],
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Per row of the padded stream of tensors of ``sizes``, int64 ``(rows, 4)``: ``b_(S,i) -
    b_(S,i+1)`` modulo each prime (zero for a tensor not checked), then ``b_(S,0)`` (the
    replica-independent weight of the naming rows). Three keyed draws per replica set."""
    counts = [-(-n // ROW_WORDS) for n in sizes]
    out = torch.zeros(sum(counts), 4, dtype=torch.int64, device=device)
    by_set: dict[ReplicaSet, tuple[list[int], list[int]]] = {}
    first = 0
    for count, s, start in zip(counts, sets, starts):
        if s is not None and count:
            places, rows = by_set.setdefault(s, ([], []))
            places += range(first, first + count)
            rows += range(start // ROW_WORDS, start // ROW_WORDS + count)
        first += count
    for s, (places, rows) in by_set.items():
        at = torch.tensor(rows, dtype=torch.int64, device=device)
        k, m, i = set_key(s.ranks), len(s.ranks), s.position
        own, nxt, zero = key.rows(k, i, at), key.rows(k, (i + 1) % m, at), key.rows(k, 0, at)
        out[torch.tensor(places, device=device)] = torch.cat(
            [(own - nxt).remainder(moduli_tensor(device)), zero], 1)
    return out


class RankSums(NamedTuple):
    """A rank's checksum of its checked tensors (`rank_slots()`)."""

    #: int64 ``(RESIDUES,)``: ``[A1, A2, B1, B2, C1, C2, R1, R2]``, residues.
    residues: torch.Tensor
    #: int64 ``(n, 6)``: per tensor ``A, B`` (global positions) and the keyed ``H`` (replica
    #: independent weights), modulo each prime: equal on replicas that hold equal words.
    rows: torch.Tensor


def rank_slots(
    tensors: Sequence[torch.Tensor],
    sets: Sequence[ReplicaSet | None],
    key: Key,
    device: torch.device,
    row_weights: dict | None = None,
) -> RankSums:
    """This rank's residues of ``tensors`` (each in its replica set, None: not checked) and its
    naming rows, on ``device``: `word_moments()` (one read), `layout_terms()`, the keyed rows.
    ``row_weights``: a cache for the keyed row weights of a layout (the caller's)."""
    sizes = tuple(0 if w is None else w.numel() for w in map(words, tensors))
    moments, keyed = word_moments(tensors, device, key)
    terms, starts = layout_terms(sizes, sets, device)
    p = moduli_tensor(device)
    cache_key = (key.secret, sizes, tuple(sets), device)
    weights = None if row_weights is None else row_weights.get(cache_key)
    if weights is None:
        weights = _row_weights(key, [n if n else 0 for n in sizes], sets, starts, device)
        if row_weights is not None:
            if len(row_weights) > 4:
                row_weights.clear()
            row_weights[cache_key] = weights
    assert keyed is not None
    r = (weights[:, :2] * keyed).remainder(p).sum(0).remainder(p)
    h_rows = (weights[:, 2:] * keyed).remainder(p)
    rows_of = _rows(sizes, device).owners
    h = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    h.index_add_(0, rows_of, h_rows)
    naming = torch.cat([global_rows(moments, terms), h.remainder(p)], 1)
    return RankSums(torch.cat([slot_residues(moments, terms), r]), naming)


def word_weights(
    positions: torch.Tensor, replica: ReplicaSet, key: Key
) -> torch.Tensor:
    """The weights of single words of one tensor of replica set ``replica`` at padded
    ``positions`` (int64 ``(n,)``), int64 ``(n, RESIDUES)``: a changed word's slot residues are
    its change times these (modulo each prime). The sparse form of `rank_slots()` (the same
    arithmetic; tests evaluate a model of any size through it)."""
    device = positions.device
    p = moduli_tensor(device)
    m, i = len(replica.ranks), replica.position
    c = coefficient(i, m)
    shift = c * spacing(m) * offsets(m)[i]
    ident = c * set_identity(replica.ranks)
    cp = torch.tensor([c % q for q in PRIMES], dtype=torch.int64, device=device)
    x = (positions.unsqueeze(1).remainder(p) * cp
         + torch.tensor([shift % q for q in PRIMES], device=device)).remainder(p)  # fmt: skip
    z = torch.tensor([ident % q for q in PRIMES], device=device).expand(len(positions), 2)
    rows, cols = positions // ROW_WORDS, positions % ROW_WORDS
    k = set_key(replica.ranks)
    b = (key.rows(k, i, rows) - key.rows(k, (i + 1) % m, rows)).remainder(p)
    a = key.columns(device).t()[cols]  # (n, 2)
    r = (a * b).remainder(p)
    return torch.cat([cp.expand(len(positions), 2), x, z, r], 1)


# ---------------------------------------------------------------------- limbs and readings


@functools.lru_cache(maxsize=64)
def limbs(world_size: int) -> tuple[int, int]:
    """(limbs per residue, bits per limb) for a collective that sums ``world_size`` ranks in
    float32: a limb below ``2**bits`` with ``world_size * 2**bits <= 2**24``, so every partial
    sum is exact in any order. 2 limbs up to 4,096 ranks, 4 at 131,072."""
    n = max(int(world_size), 2)
    bits = 24 - math.ceil(math.log2(n))
    if bits < 6:
        raise ValueError(f"world_size must be at most {1 << 18} for the replica check, got: {n}")
    return -(-_RESIDUE_BITS // bits), bits


def slot_numel(world_size: int) -> int:
    """float32 slots of one checksum in the collective at ``world_size`` ranks."""
    return RESIDUES * limbs(world_size)[0]


def to_limbs(residues: torch.Tensor, world_size: int) -> torch.Tensor:
    """``residues`` (int64 ``(RESIDUES,)``) as float32 limbs ``(slot_numel(world_size),)``,
    residue-major. Three ops."""
    count, bits = limbs(world_size)
    shifts = torch.arange(count, dtype=torch.int64, device=residues.device) * bits
    return ((residues.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1).to(torch.float32)


def from_limbs(reduced: torch.Tensor, world_size: int) -> torch.Tensor:
    """The residues of reduced limbs (float32 ``(k * slot_numel,)``, each an exact integer), int64
    ``(k * RESIDUES,)``, each modulo its prime."""
    count, bits = limbs(world_size)
    shifts = torch.arange(count, dtype=torch.int64, device=reduced.device) * bits
    values = (reduced.reshape(-1, count).to(torch.int64) << shifts).sum(1)
    return values.remainder(moduli_tensor(reduced.device, values.numel()))


def mismatched(reduced: Sequence[float], world_size: int) -> bool:
    """The reading of reduced limbs (host floats): True when some residue is not 0. Exact."""
    count, bits = limbs(world_size)
    for r in range(len(reduced) // count):
        value = sum(int(reduced[r * count + j]) << (bits * j) for j in range(count))
        if value % PRIMES[r % 2]:
            return True
    return False


def mismatch_flag(reduced: torch.Tensor, world_size: int) -> torch.Tensor:
    """`mismatched()` on the device, no host read: 0-dim float32, exactly 1.0 when some residue
    of ``reduced`` is not 0 (the replicas differ), else 0.0. Int64 ops (XPU and MPS have them)."""
    return from_limbs(reduced, world_size).amax().clamp_(max=1).to(torch.float32)


def digest(tensors: Sequence[torch.Tensor], key: Key, device: torch.device) -> torch.Tensor:
    """``tensors`` read as one padded stream, unweighted by any replica: float32 ``(6,)``,
    ``[A, B, R]`` modulo each prime with ``R = sum a_col b(row) w`` (``b`` of a set of one
    replica): equal for equal words; two streams differing in at most two words never equal;
    any other difference equal with probability at most ``(1 / P1) (1 / P2)`` over the key
    (degree 1 in the row weights, Schwartz-Zippel). Residues below 2**24: exact in float32, for
    an exchange that compares rather than sums. No host read."""
    tensors = [t.to(device) for t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.zeros(6, dtype=torch.float32, device=device)
    moments, keyed = word_moments(tensors, device, key)
    sizes = [t.numel() * t.element_size() // 2 for t in tensors]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + padded(n))
    p = moduli_tensor(device)
    offs = torch.tensor([[s % q for q in PRIMES] for s in starts], dtype=torch.int64, device=device)
    a = moments[:, :2].sum(0).remainder(p)
    b = (moments[:, 2:] + offs * moments[:, :2]).remainder(p).sum(0).remainder(p)
    assert keyed is not None
    rows = torch.arange(keyed.shape[0], dtype=torch.int64, device=device)
    r = (key.rows(0, 0, rows) * keyed).remainder(p).sum(0).remainder(p)
    return torch.cat([a, b, r]).to(torch.float32)
