"""The kernels, as plain Python functions in Triton's language: the read of every gradient
(`_read_kernel`), the fixed-order reduction of its partials (`_reduce_kernel`), the write pass
(`_scale_kernel`) and the finish (`_finish_kernel`). `distscaler._triton.runtime.get_kernels()`
wraps them for Triton, compiled or interpreted; this module imports neither Triton nor torch.

**int64 addressing.** A block's first element is addressed as ``address + e0 * element size``
with ``e0`` loaded from the int64 table, so in int64 arithmetic, and every element of the block
from there by an offset below its ``chunk`` (at most 2**22): a tensor of 2**31 elements or more is
addressed without wrapping (``tests/test_triton_pass.py`` runs the kernels over a fake table whose
tensor starts 2**33 elements before real memory and whose blocks start past 2**31, 2**32 and
2**33). Word indices of the checksum (up to 2**35) are int64 too and enter only modulo ``P``.

**Exactness of the checksum.** For tensor ``t`` with 16-bit words ``w_k`` (signed; ``L = numel *
element_size / 2``; a float32 element holds words ``2e`` (low half) and ``2e + 1`` (high half)),
``moments[t] = [A mod P1, A mod P2, B mod P1, B mod P2]`` with ``A = sum_k w_k`` and ``B = sum_k k *
w_k`` as exact integers. Per element the kernel forms ``u = sum of its words`` (``|u| <= 2**16``)
and ``c = sum_j j * word_j`` (the high half for float32, 0 for 16-bit types): ``A = sum u`` and ``B
= m * sum_e e * u_e + sum_e c_e`` with ``m`` words per element. The kernel keeps its int32 sums per
row of ``VW`` consecutive elements (16 bytes: 4 float32 or 8 16-bit elements, all held by one
thread), tile position ``l = VW * row + col``, not per position: 62 registers per thread instead of
124 on sm_90 (``launch/kernel_ptx.py``, with the scaler's unscaling multiply, ``UNSCALED``, and the
float64 sums of squares kept per row too), 32 warps per SM, so twice the warps fit an SM. Over
``INNER <= 128`` iterations ``it``, with ``r = sum`` of a row's ``u`` in one tile (``|r| <=
2**18``): ``W = sum r`` (``<= INNER * 2**18``), ``V = sum it * r`` (``<= INNER (INNER - 1) / 2 *
2**18``) and ``C = sum col * u`` (``< INNER * 2**20``), all below 2**31 in magnitude (a test fills
whole flushes with the extreme words at ``INNER`` 16 and 128); every ``INNER`` iterations they are
summed over the block's rows in int64 (``sum_l l * u = VW * sum row * W + C``) into the block's ``U
= sum u`` and ``J = sum (e - e0) * u + c`` (``|J| < 2**61`` for a chunk of at most 2**22 elements).
The reduction takes each block's ``U mod P``, ``J mod P`` and its first word ``K0 = m * e0`` modulo
``P``: ``B = sum_blocks (K0 * U + J)``, every product of two residues below ``2**48``, every sum
reduced modulo ``P`` before it could reach 2**63. No float, no wrap, any order: exact (tests compare
with Python integers).

**Keyed sums** (``KEYED``, the replica check's ``R``; `distscaler._replica.checksum`). The table
``keys`` (int32): ``a[c]`` for each of a row's ``ROW`` word columns modulo ``P1``, ``P2`` (``2 *
ROW`` values), each tensor's first row (-1: not keyed), then per row its weights ``d`` modulo
``P1``, ``P2``. A tensor's keyed sum is ``sum_k a[k mod ROW] * d[first + k div ROW] * w_k`` over
its words (signed ``int16``; positions from the tensor's first word, which starts a row). Per
element the kernel forms its words' products with ``a`` in int64 (``|w a| < 2**39``); a tile is
cut into spans of ``min(BLOCK, elements per row)`` elements, each within one row or across one
row's end (a block's first element need not start a row: a head block, a chunk not a multiple of
a row), and each side of the cut is summed (``< 2**49`` in magnitude), reduced modulo ``P`` and
multiplied by its row's ``d`` (``< 2**48``). The block's two residues go to ``part_i[3 nb + b]``
and ``part_i[4 nb + b]``; the reduction adds a tensor's. Exact, any order (tests compare with
Python integers at every offset and tile size). The launch takes this variant on half tiles (the
same span per flush): its products hold registers (100 per thread on sm_90 there, 166 on whole
tiles; ``launch/kernel_ptx.py``).

**Alignment.** Each block's row in the table says whether its first element sits at a multiple
of 16 bytes (the host computes it from the address). A tensor whose address is not such a
multiple (a view at an odd offset: a bucket's, a flat buffer's) gets a *head* block of the
elements before its first 16-byte boundary (fewer than 16 bytes), and its other blocks start
from there, aligned. The kernels compile a branch per dtype and alignment, six in all, and a
block takes its own; the aligned branches state the alignment to the compiler (``tl.multiple_of``
on the block's first element's pointer, made in the branch, so nothing of it reaches the
others), and every full tile there is read (and written) in 16-byte vectors without a mask, one
``ld.global.v4.b32`` per 16 bytes a thread holds; heads and a block's last, partial tile take
scalar loads (``tests/test_triton_pass.py`` compiles the kernels for an H100 on the CPU and counts
the PTX's accesses; ``launch/kernel_ptx.py`` shows them). Without the statement the compiler
cannot follow an address through the integer-to-pointer cast and loads 16-bit words one by one:
so did this kernel when it was measured (2.66 TB/s; the package's docstring), where a one-tensor kernel of the same
arithmetic, with 16-byte loads, read at 3.15 TB/s on an H100 the same day.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["RAW"]

if TYPE_CHECKING:  # bound by `get_kernels()` in the kernels' own namespace
    tl: Any = None
    _SUM: Any = None
    _MAX: Any = None
#
# Plain functions here; `get_kernels()` wraps them for Triton in a namespace of their own (Triton
# resolves the names a kernel uses through its globals), so that this module imports without
# Triton and the compiled and the interpreted set live in one process. The annotations stay strings (``from __future__ import annotations``); Triton
# reads "constexpr" in them. Reductions call ``tl.reduce`` with Triton's own combine functions
# (``_SUM``, ``_MAX``: what ``tl.sum``/``tl.max`` call), ``tl.full`` stands for ``tl.zeros`` and
# the bodies are inlined (a branch per dtype and alignment, ``tl.static_range``): under the interpreter every call of a jit function re-patches
# ``triton.language`` (milliseconds), which made 10,000 tiny tensors take minutes.


def _read_kernel(tab, blk, part_s, part_i, num_blocks, num_tensors, scale, keys, p1, p2,
                 NORM: tl.constexpr, MOMENTS: tl.constexpr, BLOCK: tl.constexpr,
                 INNER: tl.constexpr, DYNAMIC: tl.constexpr, UNSCALED: tl.constexpr,
                 KEYED: tl.constexpr, ROW: tl.constexpr):  # fmt: skip
    """Grid: one program per block (at most ``chunk`` elements of one tensor). Writes
    ``part_s[b]`` (float64 ``sum |x|**p``), ``part_i[b]`` (max ``|x|`` as float32 bits),
    ``part_i[nb + b]`` (``U``) and ``part_i[2 nb + b]`` (``J``; the module docstring). A
    compiled branch per dtype and alignment: where the host found the block's first element
    16-byte aligned (the block table says so) it is stated to the compiler, and full tiles are
    read in 16-byte vectors (the module docstring's Alignment); a tile is masked only where it
    passes the block's end. ``UNSCALED`` (p = 1, 2): ``|x|`` is multiplied by float32's
    ``1 / scale[0]`` before it is summed, so that the sum is of the unscaled gradients, as torch's
    recipe sums them (docs/pass-semantics.md); the largest magnitude stays as held. ``KEYED``
    (with ``MOMENTS``): the block's keyed sums modulo ``p1`` and ``p2`` into ``part_i[3 nb + b]``
    and ``part_i[4 nb + b]`` (the module docstring's Keyed sums; ``keys`` their int32 table, ``ROW``
    its words per row)."""
    pid = tl.program_id(0)
    if UNSCALED:
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(scale))
    else:
        inv = tl.full([], 1.0, tl.float32)
    t = tl.load(blk + pid)
    e0 = tl.load(blk + num_blocks + pid)  # int64, as the address arithmetic below
    n_left = tl.load(blk + 2 * num_blocks + pid).to(tl.int32)  # the block's elements (<= chunk)
    addr = tl.load(tab + t)
    kind = tl.load(tab + 2 * num_tensors + t) + 3 * tl.load(blk + 3 * num_blocks + pid)
    iota = tl.arange(0, BLOCK)
    span = INNER * BLOCK
    if KEYED:  # the tensor's first row of keyed weights (-1: not checked)
        first_row = tl.load(keys + 2 * ROW + t).to(tl.int64)
        keyed_on = first_row >= 0
        numel = tl.load(tab + num_tensors + t)
        d_at = keys + 2 * ROW + num_tensors  # the row weights, 2 per row
        r1_tot = tl.full([], 0, tl.int64)
        r2_tot = tl.full([], 0, tl.int64)
    num_flush = (n_left + (span - 1)) // span
    for KIND in tl.static_range(6):  # a branch per dtype and alignment: the block takes its own
        if kind == KIND:
            DT: tl.constexpr = KIND % 3
            if DT == 0:  # the block's first element, addressed in int64
                first32 = (addr + 4 * e0).to(tl.pointer_type(tl.float32))
                if KIND >= 3:  # 16-byte aligned (checked on the host): 16-byte vector loads
                    first32 = tl.multiple_of(first32, 16)
            else:
                first16 = (addr + 2 * e0).to(tl.pointer_type(tl.int16))
                if KIND >= 3:
                    first16 = tl.multiple_of(first16, 16)
            # The moments' int32 sums are kept per row of VW consecutive elements (16 bytes, all
            # one thread's: a row's sum is that thread's adds, no shuffle), not per element: fewer
            # registers, more warps per SM (the module docstring's Exactness).
            VW: tl.constexpr = 4 if DT == 0 else 8
            ROWS: tl.constexpr = BLOCK // VW
            if KEYED:  # a keyed row's elements; tiles cut into spans of at most one row
                EPR: tl.constexpr = ROW // 2 if DT == 0 else ROW
                VWID: tl.constexpr = BLOCK if BLOCK < EPR else EPR
                NV: tl.constexpr = BLOCK // VWID
                shift = (e0 % EPR).to(tl.int32)  # the block's first element in its row
                row0 = first_row + e0 // EPR  # that row, in the table
                vcol = tl.arange(0, VWID)
                vidx = tl.arange(0, NV)
            row = tl.arange(0, ROWS)
            col = tl.arange(0, VW)
            # p = 1, 2: float64 sums (no sum of float32 overflows them), one per row of VW
            # elements (a thread's: its sum takes no shuffle): fewer registers than per element
            s_acc = tl.full([ROWS], 0, tl.float64)
            mx_acc = tl.full([BLOCK], 0, tl.int32)
            u_tot = tl.full([], 0, tl.int64)
            j_tot = tl.full([], 0, tl.int64)
            h_tot = tl.full([], 0, tl.int64)
            for f in range(num_flush):
                base = f * span  # relative to the block's first element, as every offset below
                w_acc = tl.full([ROWS], 0, tl.int32)  # W: sum r, a row's u per tile
                v_acc = tl.full([ROWS], 0, tl.int32)  # V: sum it * r
                c_acc = tl.full([ROWS], 0, tl.int32)  # C: sum col * u
                h_acc = tl.full([ROWS], 0, tl.int32)  # sum of the hi words (float32)
                num_it = INNER
                if DYNAMIC:  # the interpreter: skip the fully masked tiles of a short chunk
                    num_it = tl.minimum((n_left - base + (BLOCK - 1)) // BLOCK, INNER)
                for it in range(num_it):
                    offs = base + it * BLOCK + iota
                    full = base + it * BLOCK + BLOCK <= n_left  # a whole tile: no mask
                    if DT == 0:
                        ptr32 = first32 + offs
                        if full:
                            x = tl.load(ptr32)
                        else:
                            x = tl.load(ptr32, mask=offs < n_left, other=0.0)
                        bits = x.to(tl.int32, bitcast=True)
                        if MOMENTS:
                            hi = bits >> 16  # arithmetic shift: the high word, signed
                            lo = (bits << 16) >> 16  # the low word, signed
                            u = tl.reshape(lo + hi, [ROWS, VW])
                            r = tl.reduce(u, 1, _SUM)
                            w_acc += r
                            v_acc += it * r
                            c_acc += tl.reduce(u * col[None, :], 1, _SUM)
                            h_acc += tl.reduce(tl.reshape(hi, [ROWS, VW]), 1, _SUM)
                            if KEYED:  # 4 int32 weights per element: its 2 words' a
                                ka = keys + 4 * ((shift + offs) % EPR)
                                lo64 = lo.to(tl.int64)
                                hi64 = hi.to(tl.int64)
                                k1 = (lo64 * tl.load(ka).to(tl.int64)
                                      + hi64 * tl.load(ka + 2).to(tl.int64))  # fmt: skip
                                k2 = (lo64 * tl.load(ka + 1).to(tl.int64)
                                      + hi64 * tl.load(ka + 3).to(tl.int64))  # fmt: skip
                    else:
                        # 16-bit types read as their words (int16): bfloat16's float32 bits are
                        # the word shifted up (exact), float16's come from its conversion
                        ptr16 = first16 + offs
                        if full:
                            word = tl.load(ptr16).to(tl.int32)
                        else:
                            word = tl.load(ptr16, mask=offs < n_left, other=0).to(tl.int32)
                        if DT == 1:
                            bits = word.to(tl.int16).to(tl.float16, bitcast=True).to(
                                tl.float32).to(tl.int32, bitcast=True)  # fmt: skip
                        else:
                            bits = word << 16
                        if MOMENTS:
                            u = tl.reshape(word, [ROWS, VW])
                            r = tl.reduce(u, 1, _SUM)
                            w_acc += r
                            v_acc += it * r
                            c_acc += tl.reduce(u * col[None, :], 1, _SUM)
                            if KEYED:  # 2 int32 weights per element: its word's a
                                ka = keys + 2 * ((shift + offs) % EPR)
                                w64 = word.to(tl.int64)
                                k1 = w64 * tl.load(ka).to(tl.int64)
                                k2 = w64 * tl.load(ka + 1).to(tl.int64)
                    if KEYED:
                        if keyed_on:
                            # The tile's keyed sum: per span of VWID elements (within one row,
                            # or across a row's end at `cut`) its products' sums on each side of
                            # the cut, each below 2**49, reduced, times its row's weights.
                            g = shift + base + it * BLOCK + vidx * VWID  # from row0's start
                            vrow = g // EPR
                            upper = vcol[None, :] >= (EPR - g % EPR)[:, None]  # the next row's
                            q1 = tl.reshape(k1, [NV, VWID])
                            q2 = tl.reshape(k2, [NV, VWID])
                            h1 = tl.reduce(tl.where(upper, q1, 0), 1, _SUM)
                            h2 = tl.reduce(tl.where(upper, q2, 0), 1, _SUM)
                            l1 = tl.reduce(q1, 1, _SUM) - h1
                            l2 = tl.reduce(q2, 1, _SUM) - h2
                            l1 = (l1 % p1 + p1) % p1
                            l2 = (l2 % p2 + p2) % p2
                            h1 = (h1 % p1 + p1) % p1
                            h2 = (h2 % p2 + p2) % p2
                            at = row0 + vrow.to(tl.int64)
                            start = e0 - shift + vrow.to(tl.int64) * EPR  # the row's first element
                            m_lo = start < numel  # rows past the tensor's end: weights 0
                            m_hi = start + EPR < numel
                            d_lo = d_at + 2 * at
                            d_hi = d_lo + 2
                            t1 = (l1 * tl.load(d_lo, mask=m_lo, other=0).to(tl.int64) % p1
                                  + h1 * tl.load(d_hi, mask=m_hi, other=0).to(tl.int64) % p1)  # fmt: skip
                            t2 = (l2 * tl.load(d_lo + 1, mask=m_lo, other=0).to(tl.int64) % p2
                                  + h2 * tl.load(d_hi + 1, mask=m_hi, other=0).to(tl.int64) % p2)  # fmt: skip
                            r1_tot = (r1_tot + tl.reduce(t1, 0, _SUM)) % p1
                            r2_tot = (r2_tot + tl.reduce(t2, 0, _SUM)) % p2
                    abits = bits & 0x7FFFFFFF  # |x|: NaN's bits above inf's above any finite
                    mx_acc = tl.maximum(mx_acc, abits)
                    if NORM == 2:
                        a = abits.to(tl.float32, bitcast=True)
                        if UNSCALED:
                            a = a * inv
                        wide = a.to(tl.float64)
                        # a float32's square is exact in float64
                        s_acc += tl.reduce(tl.reshape(wide * wide, [ROWS, VW]), 1, _SUM)
                    elif NORM == 1:
                        a = abits.to(tl.float32, bitcast=True)
                        if UNSCALED:
                            a = a * inv
                        s_acc += tl.reduce(tl.reshape(a.to(tl.float64), [ROWS, VW]), 1, _SUM)
                if MOMENTS:  # the flush: int64 sums over the block's rows
                    w64 = w_acc.to(tl.int64)
                    u_f = tl.reduce(w64, 0, _SUM)
                    u_tot += u_f
                    j_tot += (f * span).to(tl.int64) * u_f
                    j_tot += tl.reduce(VW * row.to(tl.int64) * w64 + c_acc.to(tl.int64), 0, _SUM)
                    j_tot += BLOCK * tl.reduce(v_acc.to(tl.int64), 0, _SUM)
                    if DT == 0:
                        h_tot += tl.reduce(h_acc.to(tl.int64), 0, _SUM)
            if NORM == 1 or NORM == 2:
                tl.store(part_s + pid, tl.reduce(s_acc, 0, _SUM))
            tl.store(part_i + pid, tl.reduce(mx_acc, 0, _MAX).to(tl.int64))
            if MOMENTS:
                if DT == 0:
                    j_tot = 2 * j_tot + h_tot  # 2 words per element; the high word's index is odd
                tl.store(part_i + num_blocks + pid, u_tot)
                tl.store(part_i + 2 * num_blocks + pid, j_tot)
                if KEYED:
                    tl.store(part_i + 3 * num_blocks + pid, r1_tot)
                    tl.store(part_i + 4 * num_blocks + pid, r2_tot)


def _reduce_kernel(tab, blk, part_s, part_i, stat, per_tensor, moments, terms, slots, num_blocks,
                   num_tensors, p1, p2, scale, max_norm, out, NORM: tl.constexpr,
                   PER_TENSOR: tl.constexpr, MOMENTS: tl.constexpr, SLOTS: tl.constexpr,
                   RT: tl.constexpr, FINISH: tl.constexpr, CLIP: tl.constexpr,
                   AS_FLAGS: tl.constexpr, NAN_AS: tl.constexpr, INF_AS: tl.constexpr,
                   UNSCALED: tl.constexpr, KEYED: tl.constexpr):  # fmt: skip
    """Grid: program 0 the totals (``stat``; with ``FINISH``, what `_finish_kernel` computes from
    them, into ``out``), program ``1 + t`` tensor ``t``'s statistic and moments (with
    ``AS_FLAGS``, a NaN statistic written as ``NAN_AS`` and an inf one as ``INF_AS``: the overflow
    report's flags, as ``nan_to_num`` makes them), and with ``SLOTS`` its terms of the replica check's
    slots (``terms``: its coefficient, word offset and shift modulo each prime), added into
    ``slots`` (int64 atomics: integers, exact in any order). ``KEYED``: each tensor's keyed sums
    too, ``moments`` of 6 columns, added into ``slots[6:8]``. Fixed order: tiles of ``RT``
    partials in sequence, a tile's positions by the reduction's tree."""
    pid = tl.program_id(0)
    iota = tl.arange(0, RT)
    if pid == 0:
        s_acc = tl.full([RT], 0, tl.float64)
        mx_acc = tl.full([RT], 0, tl.int32)
        for start in range(0, num_blocks, RT):
            idx = start + iota
            m = idx < num_blocks
            mx_acc = tl.maximum(mx_acc, tl.load(part_i + idx, mask=m, other=0).to(tl.int32))
            if NORM == 1 or NORM == 2:
                owner = tl.load(blk + idx, mask=m, other=0)
                w_bits = tl.load(tab + 3 * num_tensors + owner, mask=m, other=0).to(tl.int32)
                s = tl.load(part_s + idx, mask=m, other=0.0)
                s_acc += w_bits.to(tl.float32, bitcast=True).to(tl.float64) * s
        mx = tl.reduce(mx_acc, 0, _MAX)
        flag = tl.where(mx >= 0x7F800000, 1.0, 0.0)
        if NORM == 3:
            s = mx.to(tl.float32, bitcast=True)
        elif NORM == 0:
            s = flag * 0.0
        else:
            s = tl.reduce(s_acc, 0, _SUM)
        tl.store(stat, flag)
        tl.store(stat + 1, s)
        if FINISH:
            _finish_values(flag, s, scale, max_norm, out, NORM, CLIP, UNSCALED)
    else:
        t = pid - 1
        b0 = tl.load(tab + 4 * num_tensors + t)
        b1 = tl.load(tab + 4 * num_tensors + t + 1)
        words = tl.where(tl.load(tab + 2 * num_tensors + t) == 0, 2, 1).to(tl.int64)
        s_acc = tl.full([RT], 0, tl.float64)
        mx_acc = tl.full([RT], 0, tl.int32)
        a1 = tl.full([RT], 0, tl.int64)
        a2 = tl.full([RT], 0, tl.int64)
        c1 = tl.full([RT], 0, tl.int64)
        c2 = tl.full([RT], 0, tl.int64)
        z1 = tl.full([RT], 0, tl.int64)
        z2 = tl.full([RT], 0, tl.int64)
        for pos in range(b0, b1, RT):
            jdx = pos + iota
            mj = jdx < b1
            if PER_TENSOR:
                mx_acc = tl.maximum(mx_acc, tl.load(part_i + jdx, mask=mj, other=0).to(tl.int32))
                if NORM == 2:
                    s_acc += tl.load(part_s + jdx, mask=mj, other=0.0)
            if MOMENTS:
                u = tl.load(part_i + num_blocks + jdx, mask=mj, other=0)
                j = tl.load(part_i + 2 * num_blocks + jdx, mask=mj, other=0)
                k0 = words * tl.load(blk + num_blocks + jdx, mask=mj, other=0)  # >= 0
                u1 = (u % p1 + p1) % p1  # C's % keeps the sign: make it a residue in [0, P)
                u2 = (u % p2 + p2) % p2
                a1 = (a1 + u1) % p1
                a2 = (a2 + u2) % p2
                c1 = (c1 + (k0 % p1) * u1 + (j % p1 + p1) % p1) % p1  # < 2**48 + 2**25
                c2 = (c2 + (k0 % p2) * u2 + (j % p2 + p2) % p2) % p2
                if KEYED:  # residues already
                    z1 = (z1 + tl.load(part_i + 3 * num_blocks + jdx, mask=mj, other=0)) % p1
                    z2 = (z2 + tl.load(part_i + 4 * num_blocks + jdx, mask=mj, other=0)) % p2
        if PER_TENSOR:
            mx = tl.reduce(mx_acc, 0, _MAX)
            big = mx.to(tl.float32, bitcast=True)  # the largest magnitude: inf/NaN as held
            if NORM == 2:
                # a finite tensor whose norm passes float32's range is not an inf one: its norm
                # saturates at float32's largest value (docs/pass-semantics.md)
                v = tl.sqrt(tl.reduce(s_acc, 0, _SUM))  # float64: correctly rounded
                v = tl.where(mx >= 0x7F800000, big, tl.minimum(v, 3.4028234663852886e38))
            else:
                v = big
            if AS_FLAGS:  # v >= 0, inf or NaN; above float32's largest finite value: inf
                v = tl.where(v != v, NAN_AS, tl.where(v > 3.4028234663852886e38, INF_AS, v))
            tl.store(per_tensor + t, v)
        if MOMENTS:
            ra1 = tl.reduce(a1, 0, _SUM) % p1
            ra2 = tl.reduce(a2, 0, _SUM) % p2
            rc1 = tl.reduce(c1, 0, _SUM) % p1
            rc2 = tl.reduce(c2, 0, _SUM) % p2
            MW: tl.constexpr = 6 if KEYED else 4
            tl.store(moments + MW * t, ra1)
            tl.store(moments + MW * t + 1, ra2)
            tl.store(moments + MW * t + 2, rc1)
            tl.store(moments + MW * t + 3, rc2)
            if KEYED:
                rz1 = tl.reduce(z1, 0, _SUM) % p1
                rz2 = tl.reduce(z2, 0, _SUM) % p2
                tl.store(moments + MW * t + 4, rz1)
                tl.store(moments + MW * t + 5, rz2)
                if SLOTS:
                    tl.atomic_add(slots + 6, rz1, sem="relaxed")
                    tl.atomic_add(slots + 7, rz2, sem="relaxed")
            if SLOTS:  # the replica checksum's terms of this tensor; products < 2**48
                k1 = tl.load(terms + 8 * t)
                k2 = tl.load(terms + 8 * t + 1)
                b1 = (rc1 + tl.load(terms + 8 * t + 2) * ra1) % p1  # positions made global
                b2 = (rc2 + tl.load(terms + 8 * t + 3) * ra2) % p2
                g1 = k1 * ((b1 + tl.load(terms + 8 * t + 4) * ra1) % p1) % p1
                g2 = k2 * ((b2 + tl.load(terms + 8 * t + 5) * ra2) % p2) % p2
                tl.atomic_add(slots, k1 * ra1 % p1, sem="relaxed")
                tl.atomic_add(slots + 1, k2 * ra2 % p2, sem="relaxed")
                tl.atomic_add(slots + 2, g1, sem="relaxed")
                tl.atomic_add(slots + 3, g2, sem="relaxed")
                tl.atomic_add(slots + 4, tl.load(terms + 8 * t + 6) * ra1 % p1, sem="relaxed")
                tl.atomic_add(slots + 5, tl.load(terms + 8 * t + 7) * ra2 % p2, sem="relaxed")


def _scale_kernel(tab, blk, factor, num_blocks, num_tensors, DIVIDE: tl.constexpr,
                  ROUND: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Grid: one program per block; multiplies (divides) its elements in place by ``factor[0]``
    (first rounded to the tensor's dtype where ``ROUND``), in float32, rounded once to the
    tensor's dtype. A branch per dtype and alignment as in `_read_kernel`; full tiles unmasked."""
    pid = tl.program_id(0)
    t = tl.load(blk + pid)
    e0 = tl.load(blk + num_blocks + pid)
    n_left = tl.load(blk + 2 * num_blocks + pid).to(tl.int32)
    addr = tl.load(tab + t)
    kind = tl.load(tab + 2 * num_tensors + t) + 3 * tl.load(blk + 3 * num_blocks + pid)
    f = tl.load(factor)
    iota = tl.arange(0, BLOCK)
    for KIND in tl.static_range(6):
        if kind == KIND:
            DT: tl.constexpr = KIND % 3
            if DT == 0:
                first32 = (addr + 4 * e0).to(tl.pointer_type(tl.float32))
                if KIND >= 3:
                    first32 = tl.multiple_of(first32, 16)
            elif DT == 1:
                first16 = (addr + 2 * e0).to(tl.pointer_type(tl.float16))
                if KIND >= 3:
                    first16 = tl.multiple_of(first16, 16)
            else:
                first_w = (addr + 2 * e0).to(tl.pointer_type(tl.int16))
                if KIND >= 3:
                    first_w = tl.multiple_of(first_w, 16)
            if ROUND:
                if DT == 1:
                    f = f.to(tl.float16).to(tl.float32)
                elif DT == 2:  # to bfloat16, nearest even, as below
                    fb = f.to(tl.int32, bitcast=True)
                    fm = fb & 0x7FFFFFFF
                    fnan = fm > 0x7F800000
                    fm = tl.where(fnan, 0x7FC00000, fm)
                    fm = tl.where(fnan, fm, fm + 0x7FFF + ((fm >> 16) & 1))
                    f = (((fm >> 16) << 16) | ((fb >> 31) << 31)).to(tl.float32, bitcast=True)
            for start in range(0, n_left, BLOCK):  # relative to the block's first element
                offs = start + iota
                mask = offs < n_left
                full = start + BLOCK <= n_left  # a whole tile: no mask
                if DT == 0:
                    ptr = first32 + offs
                    if full:
                        x = tl.load(ptr)
                    else:
                        x = tl.load(ptr, mask=mask, other=0.0)
                elif DT == 1:
                    ptr = first16 + offs
                    if full:
                        x = tl.load(ptr).to(tl.float32)
                    else:
                        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
                else:
                    ptr = first_w + offs
                    if full:
                        word = tl.load(ptr).to(tl.int32)
                    else:
                        word = tl.load(ptr, mask=mask, other=0).to(tl.int32)
                    x = (word << 16).to(tl.float32, bitcast=True)  # exact
                if DIVIDE:
                    y = tl.math.div_rn(x, f)  # IEEE division (Triton's `/` is approximate)
                else:
                    y = x * f
                if DT == 0:
                    out = y
                elif DT == 1:
                    out = y.to(tl.float16)
                else:
                    # float32 -> bfloat16, rounded to nearest even on the bits (torch's
                    # c10::BFloat16 rule; the interpreter's own cast truncates): int32 ops that
                    # cannot overflow, NaN made a quiet NaN of the same sign
                    b = y.to(tl.int32, bitcast=True)
                    mag = b & 0x7FFFFFFF
                    nan = mag > 0x7F800000
                    mag = tl.where(nan, 0x7FC00000, mag)
                    mag = tl.where(nan, mag, mag + 0x7FFF + ((mag >> 16) & 1))
                    out = ((mag >> 16) | ((b >> 16) & -32768)).to(tl.int16)
                if full:
                    tl.store(ptr, out)
                else:
                    tl.store(ptr, out, mask=mask)


def _finish_kernel(stat, scale, max_norm, out, NORM: tl.constexpr, CLIP: tl.constexpr,
                   UNSCALED: tl.constexpr):  # fmt: skip
    """Grid (1,): ``out = [found_inf, grad_scale, total_norm]`` from the reduced ``stat``."""
    _finish_values(tl.load(stat), tl.load(stat + 1), scale, max_norm, out, NORM, CLIP, UNSCALED)


def _finish_values(flag, s, scale, max_norm, out, NORM: tl.constexpr, CLIP: tl.constexpr,
                   UNSCALED: tl.constexpr):  # fmt: skip
    """``out = [found_inf, grad_scale, total_norm]`` from the flag and the norm statistic (of
    the unscaled gradients where ``UNSCALED`` and p = 1, 2; else of the scaled ones). p = 1, 2:
    the statistic is float64, and the total norm and ``scale / clip_coef`` are computed in it and
    rounded once to float32 (inf where past its range); p = inf: in float32, IEEE divisions."""
    sc = tl.load(scale)
    if NORM == 1 or NORM == 2:
        norm = tl.sqrt(s) if NORM == 2 else s  # float64: correctly rounded
        total = norm if UNSCALED else norm / sc.to(tl.float64)
    elif NORM == 0:
        norm = s * 0.0
        total = norm
    else:
        norm = s
        total = tl.math.div_rn(norm, sc)
    total = total.to(tl.float32)
    # inf/NaN as held, or a total norm past float32's range (a scale below 1 can take a finite
    # statistic there): an overflow
    bad = (flag > 0.0) | (norm != norm) | (total == float("inf"))
    if CLIP:
        if NORM == 1 or NORM == 2:
            q = norm / tl.load(max_norm).to(tl.float64)
            if UNSCALED:
                q = q * sc.to(tl.float64)  # scale / clip_coef
            q = q.to(tl.float32)
        else:
            q = tl.math.div_rn(norm, tl.load(max_norm))
        # scale / clip_coef past float32's range: an overflow, never a clean step divided by inf
        bad = bad | (q == float("inf"))
        tl.store(out + 1, tl.where(bad, sc, tl.maximum(q, sc)))
    else:
        tl.store(out + 1, sc)
    tl.store(out, tl.where(bad, 1.0, 0.0))
    tl.store(out + 2, total)


def _probe_kernel(bound, out):
    """Grid (1,): ``out[0] = 0 + 1 + ... + (bound[0] - 1)``, a loop over a bound loaded from
    memory (`interpreter_runs()`)."""
    n = tl.load(bound)
    acc = tl.full([], 0, tl.int64)
    for i in range(n):
        acc += i
    tl.store(out, acc)


def _add(a, b):
    return a + b


def _maximum(a, b):
    return tl.maximum(a, b)


#: The kernels and the functions they call, by name: what `runtime.get_kernels()` wraps.
RAW: dict[str, Callable[..., Any]] = {
    "_read_kernel": _read_kernel,
    "_reduce_kernel": _reduce_kernel,
    "_scale_kernel": _scale_kernel,
    "_finish_kernel": _finish_kernel,
    "_finish_values": _finish_values,
    "_probe_kernel": _probe_kernel,
    "_add": _add,
    "_maximum": _maximum,
}
