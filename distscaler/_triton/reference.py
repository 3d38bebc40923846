"""What the kernels compute, with torch's ops (the pass for float64 gradients, the replica
check's slot sums; the tests' references), and a bound of the kernels' norm against the
exact one (`norm_bound()`).

**The norm's rounding.** ``sum x**2`` (or ``sum |x|``) is accumulated in float64: each square of
a float32 is exact there; each thread adds its row of elements, then its rows over the tiles
(at most ``INNER`` per flush, ``chunk / BLOCK`` in all), then ``tl.sum`` adds the block's rows (a
tree), then the reduction adds a tensor's blocks per position (``ceil(blocks / RT)``
sequentially) and by tree (``log2 RT``); the total adds all blocks the same way. A sum of
non-negative terms computed along a tree of depth ``d`` differs from the exact sum by at most
``gamma_d = d*u / (1 - d*u)`` of it (``u`` the unit roundoff, ``2**-53`` in float64; Higham,
*Accuracy and Stability of Numerical Algorithms*, 4.2); the per-tensor 2-norm is then rounded once
to float32. `norm_bound()` returns the bound of the same summation in float32 (``u = 2**-24``, plus
``u`` for each square): the form torch's float32 ``_foreach_norm`` obeys with its own ``d``, and a
bound far above the kernels' float64 sums; the tests hold both to it against the float64 sum. At
1.5e9 elements in one tensor (chunk 2**16): ``d`` = 32 + 11 + 23 + 10 + 2, a relative bound below
5e-6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .checks import stat_dtype
from .tables import CONFIG, KEY_ROW_WORDS, chunk_for

__all__ = ["keyed_sums", "norm_bound", "slot_sums", "torch_pass"]

_FLOAT32_MAX = 3.4028234663852886e38


def slot_sums(moments: torch.Tensor, terms: torch.Tensor, primes: tuple[int, int]) -> torch.Tensor:
    """The replica check's residues before their last reduction, int64 ``(8,)``: over tensors ``t``,
    ``k A``, ``k ((B + o A) + s A)``, ``kz A`` and the keyed sums ``R`` (0 where ``moments`` has
    none), each term reduced modulo its prime, for ``P1, P2`` in turn (the checksum of
    `distscaler._replica.checksum`). ``moments``: int64 ``(n, 4)`` or ``(n, 6)``, `grad_pass()`'s;
    ``terms``: int64 ``(n, 8)``, per tensor ``[k, o, s, kz]`` modulo ``P1`` then ``P2`` (its
    coefficient, padded word offset, replica shift and coefficient times set identity). torch's
    int64 ops: what the reduction's atomics add, exactly (the reference of the tests, and float64
    gradients' path)."""
    p = torch.tensor(primes, dtype=torch.int64, device=moments.device)
    a, b_local = moments[:, :2], moments[:, 2:4]
    k, o, sh, kz = terms[:, 0:2], terms[:, 2:4], terms[:, 4:6], terms[:, 6:8]
    b = (b_local + o * a).remainder(p)
    g0 = (k * a).remainder(p).sum(0)
    g1 = (k * (b + sh * a).remainder(p)).remainder(p).sum(0)
    g2 = (kz * a).remainder(p).sum(0)
    # the keyed sums ``R`` (`grad_pass()`'s ``keys``), added as they are; 0 without
    g3 = moments[:, 4:6].sum(0) if moments.shape[1] == 6 else a.new_zeros(2)
    return torch.cat([g0, g1, g2, g3])


def keyed_sums(
    tensors: Sequence[torch.Tensor], keys: torch.Tensor, primes: tuple[int, int]
) -> torch.Tensor:
    """Each tensor's keyed sums as the read kernel takes them (``keys``: the int32 table of
    `distscaler._triton.kernels`' Keyed sums), int64 ``(n, 2)``: ``sum_k a[k mod ROW] * d[first +
    k div ROW] * w_k`` over the tensor's 16-bit words ``w_k`` (signed ``int16``, any dtype's),
    modulo ``P1`` then ``P2``; zeros where ``first`` is -1. torch's int64 ops, exact: per row of
    ``ROW`` words a sum below ``2**49``, reduced, then times ``d``, products below ``2**48``."""
    row = KEY_ROW_WORDS
    device = keys.device
    p = torch.tensor(primes, dtype=torch.int64, device=device)
    k = keys.to(torch.int64)
    a = k[: 2 * row].view(row, 2)
    first = k[2 * row : 2 * row + len(tensors)]
    d = k[2 * row + len(tensors) :].view(-1, 2)
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        start = int(first[i])
        if start < 0 or not t.numel():
            continue
        w = t.detach().contiguous().view(-1).view(torch.int16).to(device, torch.int64)
        w = torch.cat([w, w.new_zeros(-w.numel() % row)]).view(-1, row)  # (rows, ROW)
        per_row = (w.unsqueeze(2) * a).sum(1).remainder(p)  # (rows, 2)
        out[i] = (per_row * d[start : start + w.shape[0]]).remainder(p).sum(0).remainder(p)
    return out


def torch_pass(
    tensors: list[torch.Tensor],
    device: torch.device,
    weights: Sequence[float] | None,
    mode: int,
    n_flags: int,
    primes: tuple[int, int] | None,
    unscale_by: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`grad_pass()`'s outputs with torch's ops (float64 gradients): several launches per tensor.
    ``unscale_by`` (p = 1, 2): the sums and the per-tensor 2-norms of the tensors divided by it,
    as the kernels' ``UNSCALED`` read gives them; ``keys`` (with ``primes``): the moments' keyed
    sums too (`keyed_sums()`, ``(n, 6)``)."""
    n = len(tensors)
    ws = [1.0] * n if weights is None else list(weights)
    stat = torch.zeros(2, dtype=stat_dtype(mode), device=device)
    amax = [t.abs().amax().double() if t.numel() else t.new_zeros((), dtype=torch.float64)
            for t in tensors]  # fmt: skip
    nonfinite = torch.stack([~t.isfinite().all() for t in tensors]).any()
    stat[0] = nonfinite.to(torch.float32)
    if mode == 3:
        stat[1] = torch.stack(amax).max().float()
        nan = torch.stack([t.isnan().any() for t in tensors]).any()
        stat[1] = torch.where(nan, torch.nan, stat[1])
    inv = 1.0 if unscale_by is None else unscale_by.double().reciprocal().float().double()
    if mode in (1, 2):
        p = 2 if mode == 2 else 1
        sums = [((t.double().abs() * inv) ** p).sum() * w for t, w in zip(tensors, ws)]
        stat[1] = torch.stack(sums).sum()
    per_tensor = torch.empty(n_flags, dtype=torch.float32, device=device)
    if n_flags:  # the largest magnitudes: an empty tensor's is 0.0 (_foreach_norm raises)
        if mode == 2:
            maxima = torch.stack(torch._foreach_norm([t.double() * inv for t in tensors], 2.0))
        else:
            maxima = torch.stack(amax)
        # a finite statistic past float32's range saturates (an inf one is a tensor's inf/NaN)
        finite = torch.stack([t.isfinite().all() for t in tensors])
        maxima = torch.where(finite, maxima.clamp(max=_FLOAT32_MAX), maxima)
        per_tensor.copy_(maxima.float())
    moments = torch.empty((n if primes else 0, 4), dtype=torch.int64, device=device)
    if primes is not None:
        for i, t in enumerate(tensors):
            moments[i] = _torch_moments(t, primes)
        if keys is not None:
            moments = torch.cat([moments, keyed_sums(tensors, keys, primes)], 1)
    return stat, per_tensor, moments


def _torch_moments(t: torch.Tensor, primes: tuple[int, int]) -> torch.Tensor:
    """``[A mod P1, A mod P2, B mod P1, B mod P2]`` of one tensor with int64 ops, exactly: the
    word indices taken modulo P, products below 2**39, summed in slices of 2**20 (< 2**59)."""
    words = t.contiguous().view(-1).view(torch.int16).to(torch.int64)
    out = []
    a = words.sum()
    for p in primes:
        out.append(a.remainder(p))
    for p in primes:
        idx = torch.arange(words.numel(), dtype=torch.int64, device=t.device).remainder_(p)
        prod = idx * words
        b = torch.zeros((), dtype=torch.int64, device=t.device)
        for piece in prod.split(1 << 20):
            b = (b + piece.sum().remainder(p)).remainder(p)
        out.append(b)
    return torch.stack(out)


def norm_bound(numels: Sequence[int], norm_type: float = 2.0) -> float:
    """A relative bound of `grad_pass()`'s ``sum |g|**p`` (p = 2 or 1) against the exact sum, for
    tensors of these sizes: that of the same summation in float32, ``gamma_d = d*u / (1 - d*u)``
    with ``u = 2**-24`` and ``d`` its depth (module docstring), plus ``u`` for the squares (p = 2),
    far above the kernels' float64 sums. Applies to ``norm_stat`` and, for each tensor, to the
    square of its ``per_tensor`` 2-norm (rounded once to float32 after the ``sqrt``)."""
    block, inner, rt = CONFIG["BLOCK"], CONFIG["INNER"], CONFIG["RT"]
    chunk = chunk_for(sum(numels), block, inner)
    blocks = sum(-(-int(n) // chunk) + 1 for n in numels)  # + a head block at most
    depth = (chunk // block) + math.ceil(math.log2(block)) + 1
    depth += -(-max(blocks, 1) // rt) + math.ceil(math.log2(rt)) + 1
    u = 2.0**-24
    return depth * u / (1 - depth * u) + (u if norm_type == 2.0 else 0.0)
