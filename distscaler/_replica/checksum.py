"""The replica check's checksum: exact weighted sums of 16-bit words modulo two primes, some of
the weights fixed (a certainty for two changed words), some keyed by a per-run secret (a bound
for every other change), carried through the collective in float32 limbs.

What [`distscaler.replica_check`][distscaler.replica_check] describes for users, as arithmetic.
Each rank reads the checked tensors of each of its replica sets (the replicated gradients, in the
optimizer's order) as one stream of 16-bit words ``w_k`` per set; each tensor starts at a multiple
of `ROW_WORDS` in its set's stream (its *padded* offset), so ``k`` is a word's padded position
there, the same on every replica of the set. A word's value is an injective integer of its 16
bits: on torch's path ``256 * high + low`` of its signed bytes (`row_sums()`), in the Triton
kernel its signed ``int16`` (`word_moments()`); the ranks of one run take one path. A tensor of
replica set ``S`` (``m`` ranks, this rank its ``i``-th) weighs word ``k`` with, modulo each prime
``P`` of `PRIMES`:

- ``A``: ``c_i``, the replica coefficient (`coefficient()`: ``+1, -1, ...``, or ``1, 1, -2, +1,
  -1, ...``; the set's coefficients sum to 0, none is 0, none above 2 in magnitude);
- ``B``: ``c_i * (k + D_m * v_i)``, with ``v_i`` the replica's distinct offset (`offsets()`,
  ``sum_i c_i v_i = 0``) and ``D_m`` the spacing `spacing()` (``P1 * P2 // (max v + 1)``);
- ``C``: ``c_i * z_S``, the set's identity (`set_identity()`: its lowest and highest rank);
- ``R`` (per byte, on torch's path): ``a_col * (b_(S,i)(row) - b_(S,i+1 mod m)(row))`` for each of
  the word's two signed bytes, by its row of `ROW_WORDS` words and its byte column there: keyed
  weights, ``a`` per byte column and ``b(row) = e[row div BLOCK_ROWS] * f[row mod BLOCK_ROWS]``
  per replica and set, uniform modulo ``P`` and drawn from the secret (`Key`). In the Triton
  kernel, per word: ``a`` per word column (`Key.word_columns()`) times the same row weights, on
  the word's signed ``int16`` (`kernel_keys()`: the table it reads).

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

**Every other change** is missed with probability at most ``(3 / P1) * (3 / P2) < 2**-44`` over
the secret: ``R`` sums, over sets and replicas, ``e_(S,i)[hi] f_(S,i)[lo] sum_col a_col (d_(S,i) -
d_(S,i-1))[row, col]``, a polynomial of degree 3 in independent uniform weights that is nonzero
wherever two replicas of a set changed differently (Schwartz-Zippel), and the two primes draw
their weights independently.

**Cost.** A rank's words are read once per check by torch's kernels: its bytes in rows of
``2 * ROW_WORDS``, one int8 matrix product by 16 columns (`row_sums()`: each row's byte sums,
their sums by word index, the 7-bit pieces of the keyed sum, every sum exact in int32), then int64
ops on one value per row; the keyed weights are a few thousand values per set, drawn once. The
Triton pass takes ``A, B, C`` in its own read at every check and ``R`` at every ``INTERVAL``-th
update (``distscaler.replica_check.INTERVAL``; 0 at the others, on every rank: the two-word
certainty holds at every check, the bound on other changes at those updates); its keyed read
reads 2 int32 per row of ``ROW_WORDS`` words besides the gradients (`kernel_keys()`).

Nothing here knows the scaler, the plan or the collective: `distscaler._replica.check` uses it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..replica_check import ReplicaSet

__all__ = [
    "BLOCK_ROWS",
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
    "global_rows",
    "kernel_keys",
    "moduli_tensor",
    "naming_rows",
    "offsets",
    "padded",
    "rank_slots",
    "row_sums",
    "row_weights",
    "set_identity",
    "set_key",
    "slot_numel",
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
#: Words of a row of the sums (its bytes each keyed by ``a``; ``b`` per row).
ROW_WORDS = 512
#: Rows of a block of the keyed row weights (``b(row) = e[row div BLOCK_ROWS] f[row mod
#: BLOCK_ROWS]``).
BLOCK_ROWS = 1024
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
    """The keyed weights of one secret, modulo each prime independently: ``a`` per column of a
    row (`columns()`) and, per replica set and replica, ``b(row) = e[row div BLOCK_ROWS] *
    f[row mod BLOCK_ROWS]`` (`blocks()`, `lows()`). Host arithmetic for the key words; the
    weights are torch int64 ops on the device asked for, a few hundred values each."""

    def __init__(self, secret: int) -> None:
        self.secret = int(secret) & ((1 << 64) - 1)
        self._cache: dict[tuple, torch.Tensor] = {}

    def _words(self, *what: int | str) -> tuple[int, int, int, int]:
        raw = hashlib.blake2b(repr((self.secret, *what)).encode(), digest_size=16).digest()
        w = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 16, 4)]
        return w[0], w[1], w[2], w[3]

    def _draw(self, what: tuple, n: int, device: torch.device) -> torch.Tensor:
        # int64 (n, 2): keyed residues at 0..n-1, modulo P1 then P2; cached (small).
        cache_key = (what, n, device)
        cached = self._cache.get(cache_key)
        if cached is None:
            at = torch.arange(n, dtype=torch.int64, device=device)
            cached = torch.stack([_hashed(at, self._words(*what, q), p)
                                  for q, p in enumerate(PRIMES)], 1)  # fmt: skip
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[cache_key] = cached
        return cached

    def columns(self, device: torch.device) -> torch.Tensor:
        """``a``: int64 ``(2 * ROW_WORDS, 2)``, the weights of a row's bytes modulo each prime."""
        return self._draw(("a",), 2 * ROW_WORDS, device)

    def word_columns(self, device: torch.device) -> torch.Tensor:
        """The Triton pass's ``a``: int64 ``(ROW_WORDS, 2)``, the weights of a row's words (its
        kernel keys a word by its 16 bits, not by its bytes) modulo each prime."""
        return self._draw(("w",), ROW_WORDS, device)

    def lows(self, key: int, replica: int, device: torch.device) -> torch.Tensor:
        """``f`` of set ``key`` (`set_key()`), replica ``replica``: int64 ``(BLOCK_ROWS, 2)``."""
        return self._draw(("f", key, replica), BLOCK_ROWS, device)

    def blocks(self, key: int, replica: int, n: int, device: torch.device) -> torch.Tensor:
        """``e`` of set ``key``, replica ``replica``, for ``n`` blocks of rows: int64 ``(n, 2)``
        (drawn for a power of two of blocks, cached, and sliced)."""
        size = 1 << max(n - 1, 0).bit_length()
        return self._draw(("e", key, replica), size, device)[:n]


# ---------------------------------------------------------------------- words and their sums


def words(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as 16-bit signed words, flat (no copy when contiguous); None for a tensor
    that is not a dense floating-point one."""
    if not tensor.is_floating_point() or tensor.layout is not torch.strided:
        return None
    tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor.detach().reshape(-1).view(torch.int16)


def padded(n: int) -> int:
    """``n`` words rounded up to whole rows (a tensor's span in its set's padded stream)."""
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


#: Bytes of a row (`ROW_WORDS` words).
_ROW_BYTES = 2 * ROW_WORDS
#: Bits of a piece of a keyed column weight (an int8 factor of the product).
_PIECE_BITS = 7
_PIECES = -(-_RESIDUE_BITS // _PIECE_BITS)
#: Columns of the product: low and high bytes; ``j mod 128`` and ``j div 128`` on each; the
#: keyed weights' pieces for each prime; two zero columns (16 in all).
_NUM_COLUMNS = 16
_COLUMNS: dict[tuple, torch.Tensor] = {}
_INT_MM: dict[str, bool] = {}


def _column_matrix(key: Key | None, device: torch.device) -> torch.Tensor:
    """int8 ``(2 * ROW_WORDS, 16)`` by which a row of bytes is multiplied (`row_sums()`): ``1`` on
    the low bytes, ``1`` on the high bytes; the word index ``j`` (``b div 2``) in two 7-bit pieces
    on the low and on the high bytes; the keyed byte weights ``a`` modulo ``P1`` then ``P2`` in
    four 7-bit pieces each (zeros without a key); two zero columns."""
    cache_key = (None if key is None else key.secret, device)
    cached = _COLUMNS.get(cache_key)
    if cached is None:
        b = torch.arange(_ROW_BYTES, dtype=torch.int64, device=device)
        low, high = (b % 2 == 0).long(), (b % 2 == 1).long()
        j = b // 2
        a = (key.columns(device) if key is not None
             else torch.zeros(_ROW_BYTES, 2, dtype=torch.int64, device=device))  # fmt: skip
        shifts = torch.arange(_PIECES, dtype=torch.int64, device=device) * _PIECE_BITS
        pieces = (a.unsqueeze(2) >> shifts) & ((1 << _PIECE_BITS) - 1)  # (bytes, 2, 4)
        fixed = [low, high, low * (j & 127), low * (j >> 7), high * (j & 127), high * (j >> 7)]
        columns = torch.cat([torch.stack(fixed, 1), pieces.reshape(_ROW_BYTES, -1)], 1)
        pad = _NUM_COLUMNS - columns.shape[1]
        cached = torch.cat([columns, columns.new_zeros(_ROW_BYTES, pad)], 1).to(torch.int8)
        if len(_COLUMNS) > 8:
            _COLUMNS.clear()
        _COLUMNS[cache_key] = cached
    return cached


def _product(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``rows @ columns`` of int8 ``(n, 2 * ROW_WORDS)`` and ``(2 * ROW_WORDS, 16)``, int32, exact:
    torch's int8 matrix product where the device has it, else in float32 (every sum below
    ``128 * 127 * 1024 < 2**24``: the same integers)."""
    kind = rows.device.type
    if _INT_MM.get(kind, True) and hasattr(torch, "_int_mm"):
        try:
            out = torch._int_mm(rows, columns)
            _INT_MM[kind] = True
            return out
        except (RuntimeError, NotImplementedError):
            _INT_MM[kind] = False
    return (rows.to(torch.float32) @ columns.to(torch.float32)).to(torch.int32)


def _bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    w = words(tensor)
    return None if w is None else w.view(torch.int8)


def row_sums(
    tensors: Sequence[torch.Tensor], device: torch.device, key: Key | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row sums of ``tensors`` read as one padded stream of 16-bit words, each tensor from a
    row's start, each word valued ``v = 256 * high + low`` of its signed bytes (an injective
    value of its 16 bits): int64 ``(rows, 2)`` ``[sum v, sum j * v]`` per row (``j`` the word's
    index in the row), exact; and int64 ``(rows, 2)``: ``sum a_b * byte_b`` over the row's signed
    bytes, modulo each prime (zeros without a ``key``).

    Torch's kernels, one read: a ``cat`` of every byte into zero-padded rows of ``2 *
    ROW_WORDS``, one int8 matrix product by `_column_matrix()` (int32, exact), int64 ops on the
    rows. A tensor that is not dense floating point counts as empty."""
    pieces: list[torch.Tensor] = []
    for t in tensors:
        b = _bytes(t)
        if b is None or not b.numel():
            continue
        pieces.append(b.to(device, non_blocking=True))
        pad = -b.numel() % _ROW_BYTES
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.int8, device=device))
    if not pieces:
        empty = torch.zeros(0, 2, dtype=torch.int64, device=device)
        return empty, empty
    flat = torch.cat(pieces).view(-1, _ROW_BYTES)
    n = flat.shape[0]
    if n < 32:  # the int8 product's smallest shape on some devices
        flat = torch.cat([flat, flat.new_zeros(32 - n, _ROW_BYTES)])
    sums = _product(flat, _column_matrix(key, device))[:n].to(torch.int64)  # (rows, 16)
    a = sums[:, 0] + 256 * sums[:, 1]
    b = sums[:, 2] + 128 * sums[:, 3] + 256 * (sums[:, 4] + 128 * sums[:, 5])
    shifts = torch.arange(_PIECES, dtype=torch.int64, device=device) * _PIECE_BITS
    keyed = (sums[:, 6 : 6 + 2 * _PIECES].view(-1, 2, _PIECES) << shifts).sum(2)
    return torch.stack([a, b], 1), keyed.remainder(moduli_tensor(device))


def word_moments(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's moments as the Triton pass computes them in its read: int64 ``(len(tensors),
    4)`` on ``device``, ``[A mod P1, A mod P2, B mod P1, B mod P2]`` with ``A = sum_k w_k`` and
    ``B = sum_k k * w_k`` over the tensor's 16-bit words ``w_k`` as signed ``int16`` (positions from
    0 in each tensor), exact. int64 ops in chunks of 2**22 words (a tensor's naming row at a
    mismatch; the reference of the kernel's tests)."""
    p = moduli_tensor(device)
    out = torch.zeros(len(tensors), 4, dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        w = words(t)
        if w is None or not w.numel():
            continue
        w = w.to(device)
        acc = torch.zeros(4, dtype=torch.int64, device=device)
        for start in range(0, w.numel(), 1 << 22):
            chunk = w[start : start + (1 << 22)].to(torch.int64).unsqueeze(1)  # (n, 1)
            k = torch.arange(start, start + chunk.shape[0], dtype=torch.int64, device=device)
            a = chunk.remainder(p).sum(0)
            b = (k.unsqueeze(1).remainder(p) * chunk.remainder(p)).remainder(p).sum(0)
            acc = (acc + torch.cat([a, b])).remainder(moduli_tensor(device, 4))
        out[i] = acc
    return out



# ---------------------------------------------------------------------- the slots


def _grouped(
    sizes: Sequence[int], sets: Sequence[ReplicaSet | None]
) -> dict[ReplicaSet, list[int]]:
    """The indices of the checked tensors (nonzero size, a set) of each replica set, in order."""
    groups: dict[ReplicaSet, list[int]] = {}
    for i, (n, s) in enumerate(zip(sizes, sets)):
        if s is not None and n > 0:
            groups.setdefault(s, []).append(i)
    return groups


def layout_terms(
    sizes: Sequence[int], sets: Sequence[ReplicaSet | None], device: torch.device
) -> torch.Tensor:
    """Per tensor of ``sizes`` words in its replica set (None: not checked), int64 ``(n, 8)`` on
    ``device``: ``[c, o, D_m * v_i, c * z_S]`` each modulo ``P1`` then ``P2``: the coefficient
    (as a residue), the tensor's padded offset in its set's stream (the set's checked tensors, in
    order), the replica's shift and the coefficient times the set identity. Zeros for a tensor not
    checked. The terms of the Triton reduction's slot sums. Host
    arithmetic."""
    terms = [[0] * 8 for _ in sizes]
    for s, members in _grouped(sizes, sets).items():
        m, i = len(s.ranks), s.position
        c = coefficient(i, m)
        shift = spacing(m) * offsets(m)[i]
        ident = c * set_identity(s.ranks)
        offset = 0
        for t in members:
            terms[t] = [v % p for v in (c, offset, shift, ident) for p in PRIMES]
            offset += padded(sizes[t])
    return torch.tensor(terms, dtype=torch.int64, device=device).reshape(-1, 8)


def global_rows(moments: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Each tensor's ``[A mod P1, A mod P2, B mod P1, B mod P2]`` with ``B`` at positions in its
    set's padded stream, int64 ``(n, 4)`` (for naming ranks)."""
    p = moduli_tensor(moments.device)
    a = moments[:, :2]
    return torch.cat([a, (moments[:, 2:4] + terms[:, 2:4] * a).remainder(p)], 1)


def _keyed_sum(
    keyed: torch.Tensor, key: Key, set_k: int, replica: int
) -> torch.Tensor:
    """``sum_row e[row div BLOCK_ROWS] f[row mod BLOCK_ROWS] keyed[row]`` of replica ``replica`` of
    set ``set_k``, int64 ``(2,)`` residues (``keyed``: int64 ``(rows, 2)`` residues)."""
    device = keyed.device
    p = moduli_tensor(device)
    rows = keyed.shape[0]
    blocks = -(-rows // BLOCK_ROWS)
    pad = blocks * BLOCK_ROWS - rows
    if pad:
        keyed = torch.cat([keyed, keyed.new_zeros(pad, 2)])
    f, e = key.lows(set_k, replica, device), key.blocks(set_k, replica, blocks, device)
    inner = (keyed.view(blocks, BLOCK_ROWS, 2) * f).remainder(p).sum(1).remainder(p)  # (blocks, 2)
    return (inner * e).remainder(p).sum(0).remainder(p)


def row_weights(
    key: Key, set_k: int, replica: int, replicas: int, rows: int, device: torch.device
) -> torch.Tensor:
    """The telescoped row weights ``b_i(row) - b_(i+1 mod m)(row)`` of replica ``replica`` of a
    set of ``replicas`` (key ``set_k``) for ``rows`` rows: int64 ``(rows, 2)`` residues."""
    p = moduli_tensor(device)
    blocks = -(-rows // BLOCK_ROWS)
    at = torch.arange(rows, dtype=torch.int64, device=device)

    def b(r: int) -> torch.Tensor:
        e = key.blocks(set_k, r, blocks, device)[at // BLOCK_ROWS]
        return (e * key.lows(set_k, r, device)[at % BLOCK_ROWS]).remainder(p)

    return (b(replica) - b((replica + 1) % replicas)).remainder(p)


def kernel_keys(
    sizes: Sequence[int], sets: Sequence[ReplicaSet | None], key: Key, device: torch.device
) -> torch.Tensor:
    """The keyed weights the Triton pass reads for ``R`` (per tensor of ``sizes`` words in its
    replica set; None: not checked), one int32 tensor on ``device``: ``[a (ROW_WORDS, 2) | first
    row (n,) | d (rows, 2)]``, flat. ``a[c]``: the word column ``c``'s weights (`Key.word_columns()`)
    modulo ``P1``, ``P2``; a tensor's first row in ``d`` (-1: not checked); ``d``: the telescoped
    row weights (`row_weights()`) of every checked set's padded stream, the sets one after
    another. The kernel sums ``a[k mod ROW_WORDS] * d[first + k div ROW_WORDS] * w_k`` over a
    tensor's words ``w_k`` (signed ``int16``), modulo each prime. Torch's ops, once per layout
    (`distscaler._replica.check.ReplicaCheck.kernel_keys()` caches it): ``d`` holds 2 int32 per
    row of ``ROW_WORDS`` words, 1/256 of the gradients' bytes (float32)."""
    first = [-1] * len(sizes)
    parts = [key.word_columns(device).reshape(-1)]
    base = 0
    for s, members in _grouped(sizes, sets).items():
        offset = 0
        for t in members:
            first[t] = base + offset // ROW_WORDS
            offset += padded(sizes[t])
        rows = offset // ROW_WORDS
        parts.append(row_weights(key, set_key(s.ranks), s.position, len(s.ranks), rows,
                                 device).reshape(-1))  # fmt: skip
        base += rows
    parts.insert(1, torch.tensor(first, dtype=torch.int64, device=device))
    return torch.cat(parts).to(torch.int32)


class RankSums(NamedTuple):
    """A rank's checksum of its checked tensors (`rank_slots()`)."""

    #: int64 ``(RESIDUES,)``: ``[A1, A2, B1, B2, C1, C2, R1, R2]``, residues.
    residues: torch.Tensor
    #: Each tensor's naming row, made on demand (a mismatch): int64 ``(n, 6)``, ``A, B`` (`global_rows()`)
    #: and the keyed sum of the set's first replica's weights, modulo each prime: equal on
    #: replicas that hold equal words.
    rows: Callable[[], torch.Tensor]


def rank_slots(
    tensors: Sequence[torch.Tensor],
    sets: Sequence[ReplicaSet | None],
    key: Key,
    device: torch.device,
) -> RankSums:
    """This rank's residues of ``tensors`` (each in its replica set, None: not checked) on
    ``device``: per replica set, one `row_sums()` of its tensors' stream (one read of every
    checked word), then int64 ops on the rows and a few per set. The naming rows are made only
    when asked for (`RankSums.rows`: one more read)."""
    sizes = [0 if w is None else w.numel() for w in map(words, tensors)]
    p = moduli_tensor(device)
    total = torch.zeros(RESIDUES, dtype=torch.int64, device=device)
    for s, members in _grouped(sizes, sets).items():
        moments, keyed = row_sums([tensors[t] for t in members], device, key)
        m, i = len(s.ranks), s.position
        c = coefficient(i, m)
        at = torch.arange(moments.shape[0], dtype=torch.int64, device=device) * ROW_WORDS
        sa = moments[:, 0].sum().remainder(p)  # (2,)
        sb = ((at.unsqueeze(1) * moments[:, :1]).remainder(p).sum(0)
              + moments[:, 1].sum()).remainder(p)  # fmt: skip
        shift = torch.tensor([spacing(m) * offsets(m)[i] % q for q in PRIMES], device=device)
        ident = torch.tensor([c * set_identity(s.ranks) % q for q in PRIMES], device=device)
        k = set_key(s.ranks)
        r = _keyed_sum(keyed, key, k, i) - _keyed_sum(keyed, key, k, (i + 1) % m)
        part = torch.cat([c * sa, c * (sb + shift * sa).remainder(p), ident * sa, r])
        total = total + part.remainder(moduli_tensor(device, RESIDUES))
    residues = total.remainder(moduli_tensor(device, RESIDUES))
    return RankSums(residues, functools.partial(naming_rows, tensors, sets, key, device))


def naming_rows(
    tensors: Sequence[torch.Tensor],
    sets: Sequence[ReplicaSet | None],
    key: Key | None,
    device: torch.device,
) -> torch.Tensor:
    """Each tensor's naming row, int64 ``(n, 6)``: ``A, B`` at positions in its set's stream and,
    with a ``key``, ``H``, the keyed sum with the set's first replica's weights (the same on
    every replica), modulo each prime (zeros for a tensor not checked). One read."""
    sizes = [0 if w is None else w.numel() for w in map(words, tensors)]
    terms = layout_terms(sizes, sets, device)
    rows = global_rows(word_moments(tensors, device), terms)
    h = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    if key is not None:
        for s, members in _grouped(sizes, sets).items():
            k = set_key(s.ranks)
            offset = 0  # the tensor's rows sit at its offset in the set's stream
            for t in members:
                _, keyed = row_sums([tensors[t]], device, key)
                lead = keyed.new_zeros(offset // ROW_WORDS, 2)
                h[t] = _keyed_sum(torch.cat([lead, keyed]), key, k, 0)
                offset += padded(sizes[t])
    return torch.cat([rows, h], 1)


def word_weights(
    positions: torch.Tensor, replica: ReplicaSet, key: Key
) -> torch.Tensor:
    """The weights of single words of replica set ``replica`` at ``positions`` in its padded
    stream (int64 ``(n,)``), int64 ``(n, RESIDUES, 2)``: a changed word's slot residues are the
    change of its low signed byte times ``[..., 0]`` plus that of its high signed byte times
    ``[..., 1]`` (modulo each prime). The sparse form of `rank_slots()` (the same arithmetic;
    tests evaluate a model of any size through it)."""
    device = positions.device
    p = moduli_tensor(device)
    m, i = len(replica.ranks), replica.position
    c = coefficient(i, m)
    shift = c * spacing(m) * offsets(m)[i]
    ident = c * set_identity(replica.ranks)
    n = len(positions)
    cp = torch.tensor([c % q for q in PRIMES], dtype=torch.int64, device=device)
    x = (positions.unsqueeze(1).remainder(p) * cp
         + torch.tensor([shift % q for q in PRIMES], device=device)).remainder(p)  # fmt: skip
    z = torch.tensor([ident % q for q in PRIMES], device=device).expand(n, 2)
    rows, cols = positions // ROW_WORDS, positions % ROW_WORDS
    hi, lo = rows // BLOCK_ROWS, rows % BLOCK_ROWS
    blocks = int(hi.max()) + 1 if n else 0
    k = set_key(replica.ranks)

    def b(r: int) -> torch.Tensor:
        return (key.blocks(k, r, blocks, device)[hi] * key.lows(k, r, device)[lo]).remainder(p)

    d = (b(i) - b((i + 1) % m)).remainder(p)
    a = key.columns(device)
    fixed = torch.cat([cp.expand(n, 2), x, z], 1)  # per word value v = 256 high + low
    low = torch.cat([fixed, (a[2 * cols] * d).remainder(p)], 1)
    high = torch.cat([(256 * fixed).remainder(moduli_tensor(device, 6)),
                      (a[2 * cols + 1] * d).remainder(p)], 1)  # fmt: skip
    return torch.stack([low, high], 2)


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
    ``[A, B, R]`` modulo each prime with ``R`` the keyed sum of one replica's weights: equal for
    equal words; two streams differing in at most two words never equal; any other difference
    equal with probability at most ``(3 / P1) (3 / P2)`` over the key (Schwartz-Zippel, degree 3
    in the keyed weights). Residues below 2**24: exact in float32, for an exchange that compares
    rather than sums. One read; no host read."""
    tensors = [t.to(device) for t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.zeros(6, dtype=torch.float32, device=device)
    p = moduli_tensor(device)
    moments, keyed = row_sums(tensors, device, key)
    at = torch.arange(moments.shape[0], dtype=torch.int64, device=device) * ROW_WORDS
    a = moments[:, 0].sum().remainder(p)
    b = ((at.unsqueeze(1) * moments[:, :1]).remainder(p).sum(0) + moments[:, 1].sum()).remainder(p)
    r = _keyed_sum(keyed, key, 0, 0)
    return torch.cat([a, b, r]).to(torch.float32)
