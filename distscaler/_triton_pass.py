"""One read of every gradient: a multi-tensor Triton kernel for the scaler's phase.

What it replaces (the torch path of the inf check): torch's check kernel or ``_foreach_norm`` for
the non-finite flag and the norm, ``_foreach_norm`` again for the per-tensor flags, the replica
check's own sums (one reduction per tensor), each a pass or a launch group of its own.

**What is read once.** `grad_pass()` reads every element of every gradient exactly once, in one
launch over all tensors (all dtypes: a block looks up its tensor's dtype and takes one of three
compiled branches), and from that read writes per-block partials of

* the largest magnitude (as the int32 bits of ``|x|`` in float32: ordered like the values, and
  NaN's bits sort above inf's, so one integer max gives the max, the inf flag and the NaN flag),
* ``sum |x|**p`` in float32 (p = 2 or 1; nothing for p = inf, which is the max),
* the replica fingerprint's two exact integer moments of the tensor's 16-bit words.

A second launch reduces the partials **in a fixed order** (each tensor's blocks by tiles, each tile
by ``tl.sum``'s fixed tree; no atomics, so the same bits on every run) into the step's collective
buffer ``stat = [found, norm_stat]``, the per-tensor statistics and the fingerprint moments.

**Launches per phase** (`LAUNCHES`): 2 for `grad_pass()` (read + reduce; plus one host-to-device
copy of the address table when the tensors' addresses, sizes or dtypes changed since the last
call), 1 for `finish()` after the collective (``found_inf``, ``grad_scale``, the total norm), 1
for `scale_()`/`div_()` where gradients are unscaled or clipped in place (``factor_in_dtype``
picks which of torch's roundings of a 16-bit gradient it reproduces, bit for bit). So a clipped step
without a fused optimizer is 4 launches + the all_reduce at any number of tensors; with a fused
optimizer (it divides by ``grad_scale``) 3. With no collective (one rank: `phase()` with
``reduce=None``) the reduction computes `finish()`'s values itself: 3 and 2.

**The tables.** Tensor addresses (``data_ptr``), element counts, dtype codes, weights (float32
bits) and each tensor's first block in one int64 array; per block its tensor, first element,
element count and whether it starts 16-byte aligned (int64). A block covers at most ``chunk``
elements of one tensor (``chunk`` a multiple of ``BLOCK * INNER``, larger for larger totals so that
the partials stay few: `_chunk_for()`; a head block fewer, the Alignment below). The tables are
cached per (addresses, sizes, dtypes, weights, chunk): a step whose gradients sit where they sat at
the last step launches the two kernels and nothing else.

**int64 addressing.** A block's first element is addressed as ``address + e0 * element size``
with ``e0`` loaded from the int64 table, so in int64 arithmetic, and every element of the block
from there by an offset below its ``chunk`` (at most 2**22): a tensor of 2**31 elements or more is
addressed without wrapping (``tests/test_triton_pass.py`` runs the kernels over a fake table whose
tensor starts 2**33 elements before real memory and whose blocks start past 2**31, 2**32 and
2**33). Word indices of the fingerprint (up to 2**35) are int64 too and enter only modulo ``P``.

**Exactness of the fingerprint.** For tensor ``t`` with 16-bit words ``w_k`` (signed; ``L = numel *
element_size / 2``; a float32 element holds words ``2e`` (low half) and ``2e + 1`` (high half)),
``moments[t] = [A mod P1, A mod P2, B mod P1, B mod P2]`` with ``A = sum_k w_k`` and ``B = sum_k k
* w_k`` as exact integers. Per element the kernel forms ``u = sum of its words`` (``|u| <= 2**16``)
and ``c = sum_j j * word_j`` (the high half for float32, 0 for 16-bit types): ``A = sum u`` and ``B
= m * sum_e e * u_e + sum_e c_e`` with ``m`` words per element. The kernel keeps its int32 sums per
row of ``VW`` consecutive elements (16 bytes: 4 float32 or 8 16-bit elements, all held by one
thread), tile position ``l = VW * row + col``, not per position: 62 registers per thread instead of
124 on sm_90 (``launch/kernel_ptx.py``), so twice the warps fit an SM. Over ``INNER <= 128``
iterations ``it``, with ``r = sum`` of a row's ``u`` in one tile (``|r| <= 2**18``): ``W = sum r``
(``<= INNER * 2**18``), ``V = sum it * r`` (``<= INNER (INNER - 1) / 2 * 2**18``) and ``C = sum col
* u`` (``< INNER * 2**20``), all below 2**31 in magnitude (a test fills whole flushes with the
extreme words at ``INNER`` 16 and 128); every ``INNER`` iterations they are summed over the block's
rows in int64 (``sum_l l * u = VW * sum row * W + C``) into the block's ``U = sum u`` and ``J = sum
(e - e0) * u + c`` (``|J| < 2**61`` for a chunk of at most 2**22 elements). The reduction takes
each block's ``U mod P``, ``J mod P`` and its first word ``K0 = m * e0`` modulo ``P``: ``B =
sum_blocks (K0 * U + J)``, every product of two residues below ``2**48``, every sum reduced modulo
``P`` before it could reach 2**63. No float, no wrap, any order: exact (tests compare with Python
integers).

**The norm's rounding.** ``sum x**2`` (or ``sum |x|``) is accumulated in float32: each lane adds
its elements sequentially (at most ``INNER`` per flush, ``chunk / BLOCK`` in all), then ``tl.sum``
adds the block's ``BLOCK`` positions (a tree of depth ``log2 BLOCK``), then the reduction adds a
tensor's blocks per lane (``ceil(blocks / RT)`` sequentially) and by tree (``log2 RT``); the total
adds all blocks the same way. A float32 sum of non-negative terms computed along a tree of depth
``d`` differs from the exact sum by at most ``gamma_d = d*u / (1 - d*u)`` of it (``u = 2**-24``;
Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2), plus ``u`` for each square.
`norm_bound()` returns that relative bound for the sum of squares (``d + 1`` terms); the 2-norm's
is about half of it plus ``u`` (the ``sqrt``). torch's ``_foreach_norm`` obeys a bound of the same
form with its own ``d``; the tests hold both to their bound against the float64 sum and to the sum
of the two bounds against each other. At 1.5e9 elements in one tensor (chunk 2**16): ``d`` = 32 +
11 + 23 + 10 + 2, a relative error below 5e-6.

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
so did this kernel when it was measured below (2.66 TB/s), where a one-tensor kernel of the same
arithmetic, with 16-byte loads, read at 3.15 TB/s on an H100 the same day.

**Cost.** One read of the bytes (no write), about ten integer ops per element for the
fingerprint, and the partials: 20 bytes per block (``chunk`` elements, at least 32,768), re-read
once by the reduction. On the host: per call, the tensors' addresses, sizes and dtypes gathered
in C (``map`` over ``Tensor``'s methods: the tables' cache key) and two or three Triton launches
(about 25 us each on the H100's host), which bound small cases in eager mode (a captured CUDA
graph replays without them). The scaler's own call skips the argument checks (``validate=False``).

Measured (``python launch/kernel_bench.py --iters 10``, NVIDIA H100 80GB HBM3, torch
2.11.0+cu130, Triton 3.6.0, 2026-11-27; ten calls queued back to back, CUDA events): one
1.536e9-element bfloat16 gradient, ``grad_pass`` + ``finish`` 1.16 ms (2.66 TB/s; one
``torch.sum`` read of the same bytes 1.01 ms, torch's unscale + clip recipe 10.2 ms), 2.35 ms with
the fingerprint; 500 mixed-dtype matrices of 225M elements 0.70 ms (0.73 ms with the
fingerprint); 2 GB of float32 0.75 ms (1.07x the read). These figures are of the kernels before
``tl.multiple_of`` (scalar loads) and before the fingerprint's row sums (124 registers per thread
then, 16 warps per SM); the kernels as they are now are not yet timed on a GPU.

Where it runs: `available()` (a CUDA tensor and Triton importable, or the CPU under
``TRITON_INTERPRET=1``, Triton's interpreter: the tests). float64 gradients are passed to torch's
ops (`_torch_pass()`, several launches), as are norm types other than 1, 2 and inf
(`grad_pass()` refuses them). The functions are registered as custom ops
(``distscaler::grad_pass``, ``distscaler::grad_pass_finished``, ``distscaler::scale_``,
``distscaler::finish``) with fake implementations, so ``torch.compile(fullgraph=True)`` traces a
phase that calls them (opaque to the compiler: the host builds the address tables from
``data_ptr()``, which a traced function cannot read).
"""

from __future__ import annotations

import collections
import functools
import math
import operator
import os
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from .attribution import INF_CODE, NAN_CODE, flag_tensors

__all__ = [
    "LAUNCHES",
    "FinishResult",
    "PassResult",
    "available",
    "div_",
    "finish",
    "phase",
    "grad_pass",
    "norm_bound",
    "scale_",
]

#: Kernel launches per call: `grad_pass()` (read + reduce), `finish()`, `scale_()`/`div_()`.
LAUNCHES = {"grad_pass": 2, "finish": 1, "scale_": 1, "div_": 1}

#: Elements per tile (``BLOCK``), tiles per int32 flush (``INNER``), warps per block of the read
#: and write kernels; ``RT`` partials per tile of the reduction. ``launch/kernel_bench.py`` sweeps
#: ``BLOCK`` and ``num_warps``.
_CONFIG: dict[str, int] = {"BLOCK": 2048, "INNER": 16, "num_warps": 8, "RT": 1024}
#: The reduction aims at about this many blocks; a chunk is at most this many elements (the bound
#: of the fingerprint's int64 block sums, see the module docstring).
_TARGET_BLOCKS = 32768
_MAX_CHUNK = 1 << 22

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SIZE = {0: 4, 1: 2, 2: 2}  # bytes per element
#: norm_type -> the kernels' NORM: 0 none, 1 sum |x|, 2 sum x**2, 3 max |x|.
_NORM_MODE = {1.0: 1, 2.0: 2, math.inf: 3}
_PRIME_LIMIT = 1 << 24
_INF_BITS = 0x7F800000


# ---------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class PassResult:
    """What `grad_pass()` read, on the tensors' device.

    Attributes:
        stat: float32 ``(2,)``: ``[found, norm_stat]``, the buffer the step all-reduces (``found``
            is a 0/1 flag: a SUM or a MAX over ranks is > 0 exactly when some rank saw inf/NaN).
        per_tensor: float32 ``(n,)``: each tensor's 2-norm (``norm_type == 2``) or largest
            magnitude (otherwise), NaN for a tensor holding a NaN, else inf for one holding an
            inf (torch's ``_foreach_norm`` values; with `phase()`'s ``report_flags``, the
            overflow report's flags of them instead); None when ``flags=False``.
        moments: int64 ``(n, 4)``: ``[A mod P1, A mod P2, B mod P1, B mod P2]`` per tensor (the
            module docstring); None without ``primes``.
        has_norm: whether ``norm_type`` was given (else ``stat[1]`` is 0.0).
    """

    stat: torch.Tensor
    per_tensor: torch.Tensor | None
    moments: torch.Tensor | None
    has_norm: bool

    @property
    def found(self) -> torch.Tensor:
        """float32 0-dim: 1.0 if an element of a tensor is inf/NaN, else 0.0 (a view of ``stat``)."""
        return self.stat[0]

    @property
    def norm_stat(self) -> torch.Tensor | None:
        """float32 0-dim: ``sum_t weights[t] * sum |g|**p`` (``max |g|`` for p = inf; NaN when an
        element is NaN), a view of ``stat``; None without ``norm_type``."""
        return self.stat[1] if self.has_norm else None


@dataclass(frozen=True, slots=True)
class FinishResult:
    """What `finish()` computed: float32 0-dim views of one ``(3,)`` buffer ``out``.

    Attributes:
        out: ``[found_inf, grad_scale, total_norm]``.
    """

    out: torch.Tensor

    @property
    def found_inf(self) -> torch.Tensor:
        """Exactly 1.0 if the reduced flag is > 0 or the norm is inf/NaN, else 0.0."""
        return self.out[0]

    @property
    def grad_scale(self) -> torch.Tensor:
        """``max(scale, T / max_norm)`` (``scale / clip_coef``), ``scale`` on an overflow or
        without ``max_norm``: what a fused optimizer divides the gradients by."""
        return self.out[1]

    @property
    def total_norm(self) -> torch.Tensor:
        """The norm of the unscaled gradients, ``T / scale`` (``T``: the norm of the scaled ones,
        ``norm_stat ** (1/p)``); 0.0 without a norm."""
        return self.out[2]


# ---------------------------------------------------------------------- where it runs


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (a missing libcuda stub, say)
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the kernels run on ``device``: a CUDA device with Triton importable, or the CPU
    with ``TRITON_INTERPRET=1`` set and an interpreter that runs them (Triton's, for tests: slow;
    `_interpreter_runs()`: 3.9's does, 3.6's does not). Imports Triton on its first call; never
    raises."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and _triton_importable()
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1" and _interpreter_runs()
    return False


@functools.cache
def _interpreter_runs() -> bool:
    """Whether Triton's interpreter, here, runs the kernels: it must take a loop's bound loaded
    from memory, as every kernel here does (Triton 3.9's does; 3.6's stops there with "only
    0-dimensional arrays can be converted to Python scalars"). One tiny interpreted launch, once.
    Tests use it to skip the CPU's runs."""
    if not _triton_importable():
        return False
    try:
        out = torch.zeros(1, dtype=torch.int64)
        _kernels(True)._probe_kernel[(1,)](torch.tensor([4], dtype=torch.int64), out)
        return int(out[0]) == 6
    except Exception:  # the interpreter's error, whatever its type
        return False


# ---------------------------------------------------------------------- the kernels

if TYPE_CHECKING:  # bound by `_kernels()` in the kernels' own namespace
    tl: Any = None
    _SUM: Any = None
    _MAX: Any = None
#
# Plain functions here; `_kernels()` wraps them for Triton in a namespace of their own (Triton
# resolves the names a kernel uses through its globals), so that this module imports without
# Triton and the compiled and the interpreted set live in one process. The annotations stay strings (``from __future__ import annotations``); Triton
# reads "constexpr" in them. Reductions call ``tl.reduce`` with Triton's own combine functions
# (``_SUM``, ``_MAX``: what ``tl.sum``/``tl.max`` call), ``tl.full`` stands for ``tl.zeros`` and
# the bodies are inlined (a branch per dtype and alignment, ``tl.static_range``): under the interpreter every call of a jit function re-patches
# ``triton.language`` (milliseconds), which made 10,000 tiny tensors take minutes.


def _read_kernel(tab, blk, part_s, part_i, num_blocks, num_tensors, NORM: tl.constexpr,
                 MOMENTS: tl.constexpr, BLOCK: tl.constexpr, INNER: tl.constexpr,
                 DYNAMIC: tl.constexpr):  # fmt: skip
    """Grid: one program per block (at most ``chunk`` elements of one tensor). Writes
    ``part_s[b]`` (float32 ``sum |x|**p``), ``part_i[b]`` (max ``|x|`` as float32 bits),
    ``part_i[nb + b]`` (``U``) and ``part_i[2 nb + b]`` (``J``; the module docstring). A
    compiled branch per dtype and alignment: where the host found the block's first element
    16-byte aligned (the block table says so) it is stated to the compiler, and full tiles are
    read in 16-byte vectors (the module docstring's Alignment); a tile is masked only where it
    passes the block's end."""
    pid = tl.program_id(0)
    t = tl.load(blk + pid)
    e0 = tl.load(blk + num_blocks + pid)  # int64, as the address arithmetic below
    n_left = tl.load(blk + 2 * num_blocks + pid).to(tl.int32)  # the block's elements (<= chunk)
    addr = tl.load(tab + t)
    code = tl.load(tab + 2 * num_tensors + t) + 3 * tl.load(blk + 3 * num_blocks + pid)
    lane = tl.arange(0, BLOCK)
    span = INNER * BLOCK
    num_flush = (n_left + (span - 1)) // span
    for CODE in tl.static_range(6):  # a branch per dtype and alignment: the block takes its own
        if code == CODE:
            DT: tl.constexpr = CODE % 3
            if DT == 0:  # the block's first element, addressed in int64
                first32 = (addr + 4 * e0).to(tl.pointer_type(tl.float32))
                if CODE >= 3:  # 16-byte aligned (checked on the host): 16-byte vector loads
                    first32 = tl.multiple_of(first32, 16)
            else:
                first16 = (addr + 2 * e0).to(tl.pointer_type(tl.int16))
                if CODE >= 3:
                    first16 = tl.multiple_of(first16, 16)
            # The moments' int32 sums are kept per row of VW consecutive elements (16 bytes, all
            # one thread's: a row's sum is that thread's adds, no shuffle), not per element: fewer
            # registers, more warps per SM (the module docstring's Exactness).
            VW: tl.constexpr = 4 if DT == 0 else 8
            ROWS: tl.constexpr = BLOCK // VW
            row = tl.arange(0, ROWS)
            col = tl.arange(0, VW)
            s_acc = tl.full([BLOCK], 0, tl.float32)
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
                    offs = base + it * BLOCK + lane
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
                    abits = bits & 0x7FFFFFFF  # |x|: NaN's bits above inf's above any finite
                    mx_acc = tl.maximum(mx_acc, abits)
                    if NORM == 2:
                        a = abits.to(tl.float32, bitcast=True)
                        s_acc += a * a
                    elif NORM == 1:
                        s_acc += abits.to(tl.float32, bitcast=True)
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


def _reduce_kernel(tab, blk, part_s, part_i, stat, per_tensor, moments, terms, slots, num_blocks,
                   num_tensors, p1, p2, scale, max_norm, out, NORM: tl.constexpr,
                   PER_TENSOR: tl.constexpr, MOMENTS: tl.constexpr, SLOTS: tl.constexpr,
                   RT: tl.constexpr, FINISH: tl.constexpr, CLIP: tl.constexpr,
                   AS_FLAGS: tl.constexpr, NAN_AS: tl.constexpr, INF_AS: tl.constexpr):  # fmt: skip
    """Grid: program 0 the totals (``stat``; with ``FINISH``, what `_finish_kernel` computes from
    them, into ``out``), program ``1 + t`` tensor ``t``'s statistic and moments (with
    ``AS_FLAGS``, a NaN statistic written as ``NAN_AS`` and an inf one as ``INF_AS``: the overflow
    report's flags, as ``nan_to_num`` makes them), and with ``SLOTS`` its terms of the replica check's four
    slots (``terms``: its coefficient, word offset and shift modulo each prime), added into
    ``slots`` (int64 atomics: integers, exact in any order). Fixed order: tiles of ``RT`` partials
    in sequence, a tile's positions by the reduction's tree."""
    pid = tl.program_id(0)
    lane = tl.arange(0, RT)
    if pid == 0:
        s_acc = tl.full([RT], 0, tl.float32)
        mx_acc = tl.full([RT], 0, tl.int32)
        for start in range(0, num_blocks, RT):
            idx = start + lane
            m = idx < num_blocks
            mx_acc = tl.maximum(mx_acc, tl.load(part_i + idx, mask=m, other=0).to(tl.int32))
            if NORM == 1 or NORM == 2:
                owner = tl.load(blk + idx, mask=m, other=0)
                w_bits = tl.load(tab + 3 * num_tensors + owner, mask=m, other=0).to(tl.int32)
                s = tl.load(part_s + idx, mask=m, other=0.0)
                s_acc += w_bits.to(tl.float32, bitcast=True) * s
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
            _finish_values(flag, s, scale, max_norm, out, NORM, CLIP)
    else:
        t = pid - 1
        b0 = tl.load(tab + 4 * num_tensors + t)
        b1 = tl.load(tab + 4 * num_tensors + t + 1)
        words = tl.where(tl.load(tab + 2 * num_tensors + t) == 0, 2, 1).to(tl.int64)
        s_acc = tl.full([RT], 0, tl.float32)
        mx_acc = tl.full([RT], 0, tl.int32)
        a1 = tl.full([RT], 0, tl.int64)
        a2 = tl.full([RT], 0, tl.int64)
        c1 = tl.full([RT], 0, tl.int64)
        c2 = tl.full([RT], 0, tl.int64)
        for pos in range(b0, b1, RT):
            jdx = pos + lane
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
        if PER_TENSOR:
            if NORM == 2:
                v = tl.sqrt_rn(tl.reduce(s_acc, 0, _SUM))
            else:
                v = tl.reduce(mx_acc, 0, _MAX).to(tl.float32, bitcast=True)
            if AS_FLAGS:  # v >= 0, inf or NaN; above float32's largest finite value: inf
                v = tl.where(v != v, NAN_AS, tl.where(v > 3.4028234663852886e38, INF_AS, v))
            tl.store(per_tensor + t, v)
        if MOMENTS:
            ra1 = tl.reduce(a1, 0, _SUM) % p1
            ra2 = tl.reduce(a2, 0, _SUM) % p2
            rc1 = tl.reduce(c1, 0, _SUM) % p1
            rc2 = tl.reduce(c2, 0, _SUM) % p2
            tl.store(moments + 4 * t, ra1)
            tl.store(moments + 4 * t + 1, ra2)
            tl.store(moments + 4 * t + 2, rc1)
            tl.store(moments + 4 * t + 3, rc2)
            if SLOTS:  # replica_check.fingerprint_slots' terms of this tensor; products < 2**48
                k1 = tl.load(terms + 6 * t)
                k2 = tl.load(terms + 6 * t + 1)
                b1 = (rc1 + tl.load(terms + 6 * t + 2) * ra1) % p1  # positions made global
                b2 = (rc2 + tl.load(terms + 6 * t + 3) * ra2) % p2
                g1 = k1 * ((b1 + tl.load(terms + 6 * t + 4) * ra1) % p1) % p1
                g2 = k2 * ((b2 + tl.load(terms + 6 * t + 5) * ra2) % p2) % p2
                tl.atomic_add(slots, k1 * ra1 % p1, sem="relaxed")
                tl.atomic_add(slots + 1, k2 * ra2 % p2, sem="relaxed")
                tl.atomic_add(slots + 2, g1, sem="relaxed")
                tl.atomic_add(slots + 3, g2, sem="relaxed")


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
    code = tl.load(tab + 2 * num_tensors + t) + 3 * tl.load(blk + 3 * num_blocks + pid)
    f = tl.load(factor)
    lane = tl.arange(0, BLOCK)
    for CODE in tl.static_range(6):
        if code == CODE:
            DT: tl.constexpr = CODE % 3
            if DT == 0:
                first32 = (addr + 4 * e0).to(tl.pointer_type(tl.float32))
                if CODE >= 3:
                    first32 = tl.multiple_of(first32, 16)
            elif DT == 1:
                first16 = (addr + 2 * e0).to(tl.pointer_type(tl.float16))
                if CODE >= 3:
                    first16 = tl.multiple_of(first16, 16)
            else:
                first_w = (addr + 2 * e0).to(tl.pointer_type(tl.int16))
                if CODE >= 3:
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
                offs = start + lane
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


def _finish_kernel(stat, scale, max_norm, out, NORM: tl.constexpr, CLIP: tl.constexpr):
    """Grid (1,): ``out = [found_inf, grad_scale, total_norm]`` from the reduced ``stat``."""
    _finish_values(tl.load(stat), tl.load(stat + 1), scale, max_norm, out, NORM, CLIP)


def _finish_values(flag, s, scale, max_norm, out, NORM: tl.constexpr, CLIP: tl.constexpr):
    """``out = [found_inf, grad_scale, total_norm]`` from the flag and the norm statistic."""
    sc = tl.load(scale)
    if NORM == 2:
        norm = tl.sqrt_rn(s)
    elif NORM == 0:
        norm = s * 0.0
    else:
        norm = s
    total = tl.math.div_rn(norm, sc)
    bad = (flag > 0.0) | (norm != norm) | (norm == float("inf"))
    if NORM == 1 or NORM == 3:
        # p = 1, inf: the norm of the unscaled gradients too (a scale below 1 can take a finite
        # statistic past float32's range), as torch's path checks it; p = 2's sum of squares
        # overflows first (torch's path checks the scaled norm there)
        bad = bad | (total == float("inf"))
    tl.store(out, tl.where(bad, 1.0, 0.0))
    if CLIP:
        q = tl.math.div_rn(norm, tl.load(max_norm))
        tl.store(out + 1, tl.where(bad, sc, tl.maximum(q, sc)))
    else:
        tl.store(out + 1, sc)
    tl.store(out + 2, total)


def _probe_kernel(bound, out):
    """Grid (1,): ``out[0] = 0 + 1 + ... + (bound[0] - 1)``, a loop over a bound loaded from
    memory (`_interpreter_runs()`)."""
    n = tl.load(bound)
    acc = tl.full([], 0, tl.int64)
    for i in range(n):
        acc += i
    tl.store(out, acc)


def _add(a, b):
    return a + b


def _maximum(a, b):
    return tl.maximum(a, b)


_RAW: dict[str, Callable[..., Any]] = {
    "_read_kernel": _read_kernel,
    "_reduce_kernel": _reduce_kernel,
    "_scale_kernel": _scale_kernel,
    "_finish_kernel": _finish_kernel,
    "_finish_values": _finish_values,
    "_probe_kernel": _probe_kernel,
    "_add": _add,
    "_maximum": _maximum,
}


@functools.cache
def _kernels(interpret: bool) -> types.SimpleNamespace:
    """The kernels, compiled (``interpret=False``: CUDA tensors) or run by Triton's interpreter
    (CPU tensors), whatever ``TRITON_INTERPRET`` said when Triton was imported: each set is
    wrapped explicitly (``JITFunction``/``InterpretedFunction``) in a namespace of its own, and
    neither calls a jit function of ``triton.language`` (which that variable decides for). The
    interpreted reductions name Triton's own combine functions, which its interpreter runs as one
    numpy call (it matches them by identity); the compiled ones use ``_add``/``_maximum``, the same
    arithmetic. Imports Triton."""
    import triton
    import triton.language as tl

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    namespace: dict[str, Any] = {"tl": tl, "triton": triton, "__name__": __name__}
    for name, raw in _RAW.items():
        clone = types.FunctionType(raw.__code__, namespace, name, raw.__defaults__)
        clone.__doc__ = raw.__doc__
        clone.__annotations__ = dict(raw.__annotations__)
        clone.__qualname__ = raw.__qualname__
        namespace[name] = wrap(clone)
    if interpret:
        standard = tl.standard  # (a Triton without them: the same arithmetic, slower)
        namespace["_SUM"] = getattr(standard, "_sum_combine", None) or namespace["_add"]
        namespace["_MAX"] = getattr(standard, "_elementwise_max", None) or namespace["_maximum"]
    else:
        namespace["_SUM"] = namespace["_add"]
        namespace["_MAX"] = namespace["_maximum"]
    return types.SimpleNamespace(**{name: namespace[name] for name in _RAW})


def _can_compile_for_a_gpu() -> bool:
    """Whether `_compile_for_a_gpu()` can run here: Triton importable, with its CUDA backend and
    an ``ASTSource`` that takes ``constexprs`` (Triton >= 3.3)."""
    if not _triton_importable():
        return False
    import importlib.util
    import inspect

    from triton.compiler import ASTSource

    return (importlib.util.find_spec("triton.backends.nvidia") is not None
            and "constexprs" in inspect.signature(ASTSource).parameters)  # fmt: skip


def _compile_for_a_gpu(name: str, consts: dict[str, Any], arch: int = 90) -> Any:
    """Kernel ``name`` (``"_read_kernel"``, ``"_reduce_kernel"``, ``"_scale_kernel"``) compiled
    with the constexprs ``consts`` for an NVIDIA GPU of compute capability ``arch`` (90: H100), on
    any machine (Triton's compiler and its bundled ``ptxas``; no GPU): Triton's compiled kernel,
    whose ``asm`` holds the PTX and the cubin. Pointer arguments are declared 16-byte aligned (as
    Triton's launcher specializes torch's allocations), integers int32 (the primes int64);
    ``num_warps`` is `_CONFIG`'s. A diagnostic (`_ptx_accesses()`, `_registers()`)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(_kernels(False), name)
    sig: dict[str, str] = {}
    for arg in inspect.signature(_RAW[name]).parameters:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in ("num_blocks", "num_tensors", "chunk"):
            sig[arg] = "i32"
        elif arg in ("p1", "p2"):
            sig[arg] = "i64"
        elif arg in ("part_s", "factor", "stat", "per_tensor", "scale", "max_norm", "out"):
            sig[arg] = "*fp32"
        else:
            sig[arg] = "*i64"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    source = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": _CONFIG["num_warps"]})  # fmt: skip


def _ptx_accesses(compiled: Any) -> collections.Counter:
    """The global loads, stores, atomics and reductions of a `_compile_for_a_gpu()` kernel,
    counted by PTX instruction (``ld.global.v4.b32``: 16 bytes in one load)."""
    import re

    found = re.findall(r"\b(?:ld|st|red|atom)\.global[\w.]*", compiled.asm["ptx"])
    return collections.Counter(found)


def _registers(compiled: Any) -> dict[str, int]:
    """A `_compile_for_a_gpu()` kernel's resources per thread from its cubin (``REG``: registers,
    ``STACK``: bytes spilled), as the ``cuobjdump`` bundled with Triton reports them; empty where
    it cannot run."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        try:
            shown = subprocess.run([tool, "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return {}
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", shown)}


# ---------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class _Tables:
    tab: torch.Tensor  # int64 (5n + 1 + 4 nb,): addr | numel | dtype code | weight bits |
    #                    first block (n + 1) | the block rows
    blk: torch.Tensor  # a view of tab: per block its tensor | first element | element count |
    #                    aligned (1: its first element at a multiple of 16 bytes)
    num_blocks: int
    num_tensors: int
    chunk: int
    host: torch.Tensor  # the host copy (pinned where the copy is asynchronous)

    @property
    def aligned(self) -> torch.Tensor:
        """bool ``(num_blocks,)`` on the host: the block's first element sits at a multiple of 16
        bytes (the kernels' vector branches)."""
        nb = self.num_blocks
        return self.host[len(self.host) - nb :].bool()


_TABLE_CACHE: collections.OrderedDict[tuple, _Tables] = collections.OrderedDict()
_TABLE_CACHE_SIZE = 16


def _chunk_for(total: int, block: int, inner: int) -> int:
    """Elements per block: ``block * inner`` times a power of two, so that a total of ``total``
    elements makes about `_TARGET_BLOCKS` blocks at most, and never more than `_MAX_CHUNK`."""
    span = block * inner
    outer = 1
    while span * outer * _TARGET_BLOCKS < total and span * outer * 2 <= _MAX_CHUNK:
        outer *= 2
    return span * outer


def _build_tables(
    addrs: Sequence[int],
    numels: Sequence[int],
    codes: Sequence[int],
    weights: Sequence[float] | None,
    chunk: int,
    device: torch.device,
    block_starts: Sequence[Sequence[int]] | None = None,
) -> _Tables:
    """The int64 table on ``device`` (one copy). A tensor's blocks: where its address is not a
    multiple of 16 bytes, a *head* block of the elements before the first that is (fewer than 16
    bytes), then blocks of ``chunk`` elements from there (the last one shorter), each aligned
    where the address allows. ``block_starts`` (tests only) lists each tensor's block first
    elements instead (a block ends at the next one, or after ``chunk`` elements)."""
    n = len(addrs)
    numel_t = torch.tensor(list(numels), dtype=torch.int64)
    addr_t = torch.tensor(list(addrs), dtype=torch.int64)
    size_t = torch.tensor([_SIZE[c] for c in codes], dtype=torch.int64)
    if block_starts is None:
        off = addr_t % 16
        head = torch.where((off != 0) & (off % size_t == 0), (16 - off) // size_t, 0)
        head = torch.minimum(head, numel_t)
        has_head = (head > 0).to(torch.int64)
        nblk = has_head + (numel_t - head + (chunk - 1)) // chunk
        first = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(nblk, 0, out=first[1:])
        num_blocks = int(first[-1])
        blk_t = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), nblk)
        k = torch.arange(num_blocks, dtype=torch.int64) - first[blk_t]  # the block's place
        in_head = (has_head[blk_t] == 1) & (k == 0)
        blk_s = torch.where(in_head, 0, head[blk_t] + (k - has_head[blk_t]) * chunk)
        blk_n = torch.where(in_head, head[blk_t],
                            torch.minimum(numel_t[blk_t] - blk_s, torch.tensor(chunk)))  # fmt: skip
    else:
        nblk = torch.tensor([len(s) for s in block_starts], dtype=torch.int64)
        first = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(nblk, 0, out=first[1:])
        num_blocks = int(first[-1])
        blk_t = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), nblk)
        blk_s = torch.tensor([s for starts in block_starts for s in starts], dtype=torch.int64)
        ends = [e for starts, m in zip(block_starts, numels) for e in [*starts[1:], m]]
        blk_n = torch.minimum(torch.tensor(ends, dtype=torch.int64) - blk_s, torch.tensor(chunk))
    blk_a = ((addr_t[blk_t] + blk_s * size_t[blk_t]) % 16 == 0).to(torch.int64)
    w = (
        torch.ones(n, dtype=torch.float32)
        if weights is None
        else torch.tensor(list(weights), dtype=torch.float32)
    )
    host = torch.cat([
        addr_t,
        numel_t,
        torch.tensor(list(codes), dtype=torch.int64),
        w.view(torch.int32).to(torch.int64),
        first,
        blk_t,
        blk_s,
        blk_n,
        blk_a,
    ])  # fmt: skip
    if device.type == "cuda":
        host = host.pin_memory()
        tab = host.to(device, non_blocking=True)
    else:
        tab = host
    return _Tables(tab, tab[5 * n + 1 :], num_blocks, n, chunk, host)


def _tables(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None) -> _Tables:
    """The cached tables of ``tensors`` (contiguous, of `_DTYPE_CODE`'s dtypes, one device)."""
    return _tables_of(tensors, tuple(map(_DTYPE, tensors)), weights)


#: Unbound accessors: ``map()`` over them walks a list in C (a per-call cost of the host's).
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")


def _describe(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.dtype, ...], bool]:
    """The tensors' dtypes and whether every one is contiguous, gathered in C."""
    return tuple(map(_DTYPE, tensors)), all(map(_IS_CONTIGUOUS, tensors))


def _tables_of(
    tensors: Sequence[torch.Tensor],
    dtypes: tuple[torch.dtype, ...],
    weights: Sequence[float] | None,
) -> _Tables:
    block, inner = _CONFIG["BLOCK"], _CONFIG["INNER"]
    numels = tuple(map(_NUMEL, tensors))
    chunk = _chunk_for(sum(numels), block, inner)
    addrs = tuple(map(_DATA_PTR, tensors))
    device = tensors[0].device
    key = (device, chunk, addrs, numels, dtypes, None if weights is None else tuple(weights))
    cached = _TABLE_CACHE.get(key)
    if cached is not None:
        _TABLE_CACHE.move_to_end(key)
        return cached
    codes = [_DTYPE_CODE[d] for d in dtypes]
    tables = _build_tables(addrs, numels, codes, weights, chunk, device)
    _TABLE_CACHE[key] = tables
    while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return tables


# ---------------------------------------------------------------------- checks


def _check_tensors(tensors: Sequence[torch.Tensor], name: str = "tensors") -> torch.device | None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of tensors, got: {type(tensors).__name__}")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got: {type(t).__name__}")
        if t.dtype not in _DTYPE_CODE and t.dtype != torch.float64:
            raise TypeError(
                f"{name}[{i}] must be float32, float16, bfloat16 or float64, got: {t.dtype}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"{name} must all be on one device, got: {device} ({name}[0]) and {t.device} "
                f"({name}[{i}])"
            )
    return device


def _check_norm_type(norm_type: float | None) -> int:
    if norm_type is None:
        return 0
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a float or None, got: {norm_type!r}")
    mode = _NORM_MODE.get(float(norm_type))
    if mode is None:
        raise ValueError(
            f"norm_type must be 1.0, 2.0, inf or None for the Triton pass (other p: torch's "
            f"kernels), got: {norm_type!r}"
        )
    return mode


def _check_float32(*named: tuple[str, Any], device: torch.device | None = None) -> None:
    """Each ``(name, value)`` a float32 tensor (or None: skipped) on ``device`` (default: the
    first one's)."""
    for name, value in named:
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor, got: {value!r}")
        device = value.device if device is None else device
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got: {value.device}")


def _check_primes(primes: Sequence[int] | None) -> tuple[int, int] | None:
    if primes is None:
        return None
    if len(primes) != 2 or any(isinstance(p, bool) or not isinstance(p, int) for p in primes):
        raise ValueError(f"primes must be two ints (P1, P2), got: {primes!r}")
    if any(not (2 < p < _PRIME_LIMIT) or p % 2 == 0 for p in primes):
        raise ValueError(f"primes must be odd and in (2, 2**24), got: {tuple(primes)!r}")
    return int(primes[0]), int(primes[1])


def _check_weights(weights: Sequence[float] | None, n: int) -> tuple[float, ...] | None:
    if weights is None:
        return None
    values = tuple(float(w) for w in weights)
    if len(values) != n:
        raise ValueError(f"weights must have one float per tensor ({n}), got: {len(values)}")
    if not all(math.isfinite(w) and w >= 0 for w in values):
        raise ValueError(f"weights must be finite and >= 0, got: {values!r}")
    return values


# ---------------------------------------------------------------------- the read pass


def grad_pass(
    tensors: Sequence[torch.Tensor],
    *,
    weights: Sequence[float] | None = None,
    norm_type: float | None = None,
    flags: bool = True,
    primes: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> PassResult:
    """Read every element of ``tensors`` once: the non-finite flag, the norm statistic, the
    per-tensor statistics and the replica fingerprint, in 2 launches (read + reduce).

    Args:
        tensors: gradients on one device, float32/float16/bfloat16 in any mix (float64: torch's
            ops, several launches). Non-contiguous ones are read through a contiguous copy.
        weights: per tensor, the factor of its ``sum |g|**p`` in ``norm_stat`` (``1 / replicas``);
            default all 1.0; ignored for p = inf.
        norm_type: None (no norm: ``stat[1]`` is 0.0), 2.0, 1.0 or ``math.inf``.
        flags: compute ``per_tensor``.
        primes: ``(P1, P2)``, odd, below 2**24: compute ``moments``.
        device: where the outputs go when ``tensors`` is empty (default: the CPU).

    Returns:
        `PassResult`: fresh tensors on the tensors' device.

    Raises:
        TypeError, ValueError: bad arguments (named), before anything is launched.
    """
    dev, mode, ps, ws = _check_pass(tensors, norm_type, primes, weights, device)
    if torch.compiler.is_compiling() and _OPS is not None:
        stat, per_tensor, moments = _OPS.grad_pass(
            list(tensors), dev, None if ws is None else list(ws),
            None if norm_type is None else float(norm_type), flags,
            None if ps is None else list(ps),
        )  # fmt: skip
    else:
        stat, per_tensor, moments = _grad_pass_impl(list(tensors), dev, ws, mode, flags, ps)
    return PassResult(
        stat,
        per_tensor if flags else None,
        moments if ps is not None else None,
        norm_type is not None,
    )


def _check_pass(
    tensors: Sequence[torch.Tensor],
    norm_type: float | None,
    primes: Sequence[int] | None,
    weights: Sequence[float] | None,
    device: torch.device | str | None,
) -> tuple[torch.device, int, tuple[int, int] | None, tuple[float, ...] | None]:
    """`grad_pass()`'s checks of its arguments: the device, the norm's mode, the primes and the
    weights, as the pass takes them."""
    dev = _check_tensors(tensors)
    mode = _check_norm_type(norm_type)
    ps = _check_primes(primes)
    ws = _check_weights(weights, len(tensors))
    if dev is None:
        dev = torch.device("cpu" if device is None else device)
    return dev, mode, ps, ws


def _pass_finished(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    max_norm: torch.Tensor | None,
    weights: Sequence[float] | None,
    norm_type: float | None,
    flags: bool,
    primes: Sequence[int] | None,
    device: torch.device | str | None,
) -> tuple[PassResult, FinishResult]:
    """`grad_pass()` and then `finish()` with no collective between them, the arguments checked
    as they check them: the reduction computes `finish()`'s values itself (2 launches; traced, one
    custom op)."""
    dev, mode, ps, ws = _check_pass(tensors, norm_type, primes, weights, device)
    _check_float32(("scale", scale), ("max_norm", max_norm), device=dev)
    nt = None if norm_type is None else float(norm_type)
    if torch.compiler.is_compiling() and _OPS is not None:
        stat, per_tensor, moments, out = _OPS.grad_pass_finished(
            list(tensors), dev, None if ws is None else list(ws), nt, flags,
            None if ps is None else list(ps), scale, max_norm,
        )  # fmt: skip
    else:
        fin = _Finish(scale, max_norm, nt, torch.empty(3, dtype=torch.float32, device=dev))
        stat, per_tensor, moments = _grad_pass_impl(list(tensors), dev, ws, mode, flags, ps, fin)
        out = fin.out
    taken = PassResult(stat, per_tensor if flags else None, moments if ps is not None else None,
                       norm_type is not None)  # fmt: skip
    return taken, FinishResult(out)


def _grad_pass_impl(
    tensors: list[torch.Tensor],
    device: torch.device,
    weights: Sequence[float] | None,
    mode: int,
    flags: bool,
    primes: tuple[int, int] | None,
    finish: _Finish | None = None,
    slots: _Slots | None = None,
    as_flags: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of `grad_pass()`; with ``finish``, `finish()`'s too, written into
    ``finish.out`` by the reduction (no collective between them: one launch fewer); with
    ``slots`` (and ``primes``), the replica check's slot sums added into ``slots.sums``; with
    ``as_flags``, ``per_tensor`` as `distscaler.attribution.flag_tensors()` makes it of the
    statistics, written so by the reduction."""
    n = len(tensors)
    n_flags = n if flags else 0
    n_moments = n if primes is not None else 0
    dtypes, contiguous = _describe(tensors)
    if torch.float64 in dtypes:
        stat, per_tensor, moments = _torch_pass(tensors, device, weights, mode, n_flags, primes)
        if as_flags:
            per_tensor = flag_tensors(per_tensor)
        if finish is not None:
            finish.out.copy_(_finish_impl(stat, finish.scale, finish.max_norm, finish.norm_type))
        if slots is not None and primes is not None:
            slots.sums.add_(slot_sums(moments, slots.terms, primes))
        return stat, per_tensor, moments
    if not contiguous:
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    stat = torch.empty(2, dtype=torch.float32, device=device)
    per_tensor = torch.empty(n_flags, dtype=torch.float32, device=device)
    moments = torch.empty((n_moments, 4), dtype=torch.int64, device=device)
    if n == 0:
        stat.zero_()
        if finish is not None:
            finish.out.copy_(_finish_impl(stat, finish.scale, finish.max_norm, finish.norm_type))
        return stat, per_tensor, moments
    tables = _tables_of(tensors, dtypes, weights)
    _launch_pass(tables, stat, per_tensor, moments, mode, flags, primes, finish, slots, as_flags)
    return stat, per_tensor, moments


@dataclass(frozen=True, slots=True)
class _Slots:
    """The replica check's slot sums, for a reduction that adds them (`phase()`'s ``terms``)."""

    terms: torch.Tensor  # int64 (n, 6)
    sums: torch.Tensor  # int64 (4,), zeros, added into


def slot_sums(moments: torch.Tensor, terms: torch.Tensor, primes: tuple[int, int]) -> torch.Tensor:
    """The replica check's four slots before their last residue, int64 ``(4,)``: over tensors
    ``t``, ``k A``, and ``k ((B + o A) + s A)``, each term reduced modulo its prime, for
    ``P1, P2, P1, P2`` (`distscaler.replica_check.fingerprint_slots()` with the coefficients as
    residues; the sums modulo the primes are its slots). ``moments``: int64 ``(n, 4)``,
    `grad_pass()`'s; ``terms``: int64 ``(n, 6)``, per tensor ``[k mod P1, k mod P2, o mod P1,
    o mod P2, s mod P1, s mod P2]`` (its coefficient, word offset and shift). torch's int64 ops:
    what the reduction's atomics add, exactly (the reference of the tests, and float64
    gradients' path)."""
    p = torch.tensor(primes, dtype=torch.int64, device=moments.device)
    a, b_local = moments[:, :2], moments[:, 2:]
    k, o, sh = terms[:, 0:2], terms[:, 2:4], terms[:, 4:6]
    b = (b_local + o * a).remainder(p)
    g0 = (k * a).remainder(p).sum(0)
    g1 = (k * (b + sh * a).remainder(p)).remainder(p).sum(0)
    return torch.cat([g0, g1])


@dataclass(frozen=True, slots=True)
class _Finish:
    """What `finish()` takes, for a reduction that computes it (no collective in between)."""

    scale: torch.Tensor
    max_norm: torch.Tensor | None
    norm_type: float | None
    out: torch.Tensor  # float32 (3,), written


def _launch_pass(
    tables: _Tables,
    stat: torch.Tensor,
    per_tensor: torch.Tensor,
    moments: torch.Tensor,
    mode: int,
    flags: bool,
    primes: tuple[int, int] | None,
    finish: _Finish | None = None,
    slots: _Slots | None = None,
    as_flags: bool = False,
) -> None:
    """The two launches over ``tables`` (outputs written in place; with ``finish``, the
    reduction writes `finish()`'s ``out`` too; with ``slots``, it adds the slot sums; with
    ``as_flags``, ``per_tensor`` holds the overflow report's flags)."""
    k = _kernels(stat.device.type != "cuda")
    nb, n = tables.num_blocks, tables.num_tensors
    device = stat.device
    part_s = torch.empty(nb if mode in (1, 2) else 1, dtype=torch.float32, device=device)
    part_i = torch.empty(nb * (3 if primes is not None else 1), dtype=torch.int64, device=device)
    p1, p2 = primes if primes is not None else (3, 5)
    if nb:
        k._read_kernel[(nb,)](
            tables.tab, tables.blk, part_s, part_i, nb, n,
            NORM=mode, MOMENTS=primes is not None, BLOCK=_CONFIG["BLOCK"],
            INNER=_CONFIG["INNER"], DYNAMIC=device.type != "cuda", num_warps=_CONFIG["num_warps"],
        )  # fmt: skip
    per_program = flags or primes is not None
    if finish is None:
        scale, max_norm, out = stat, stat, stat  # not read
    else:
        scale, out = finish.scale, finish.out
        max_norm = stat if finish.max_norm is None else finish.max_norm
    with_slots = slots is not None and primes is not None
    terms, sums = (slots.terms, slots.sums) if slots is not None else (moments, moments)
    k._reduce_kernel[(1 + (n if per_program else 0),)](
        tables.tab, tables.blk, part_s, part_i, stat, per_tensor, moments, terms, sums, nb, n,
        p1, p2, scale, max_norm, out, NORM=mode, PER_TENSOR=flags, MOMENTS=primes is not None,
        SLOTS=with_slots, RT=_CONFIG["RT"], FINISH=finish is not None,
        CLIP=finish is not None and finish.max_norm is not None, AS_FLAGS=as_flags,
        NAN_AS=NAN_CODE, INF_AS=INF_CODE, num_warps=4,
    )  # fmt: skip


def _torch_pass(
    tensors: list[torch.Tensor],
    device: torch.device,
    weights: Sequence[float] | None,
    mode: int,
    n_flags: int,
    primes: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`grad_pass()`'s outputs with torch's ops (float64 gradients): several launches per tensor."""
    n = len(tensors)
    ws = [1.0] * n if weights is None else list(weights)
    stat = torch.zeros(2, dtype=torch.float32, device=device)
    amax = [t.abs().amax().double() if t.numel() else t.new_zeros((), dtype=torch.float64)
            for t in tensors]  # fmt: skip
    nonfinite = torch.stack([~t.isfinite().all() for t in tensors]).any()
    stat[0] = nonfinite.to(torch.float32)
    if mode == 3:
        stat[1] = torch.stack(amax).max().float()
        nan = torch.stack([t.isnan().any() for t in tensors]).any()
        stat[1] = torch.where(nan, torch.nan, stat[1])
    elif mode in (1, 2):
        p = 2 if mode == 2 else 1
        sums = [(t.double().abs() ** p).sum() * w for t, w in zip(tensors, ws)]
        stat[1] = torch.stack(sums).sum().float()
    per_tensor = torch.empty(n_flags, dtype=torch.float32, device=device)
    if n_flags:  # the largest magnitudes: an empty tensor's is 0.0 (_foreach_norm raises)
        maxima = torch._foreach_norm(tensors, 2.0) if mode == 2 else amax
        per_tensor.copy_(torch.stack(maxima).float())
    moments = torch.empty((n if primes else 0, 4), dtype=torch.int64, device=device)
    if primes is not None:
        for i, t in enumerate(tensors):
            moments[i] = _torch_moments(t, primes)
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


# ---------------------------------------------------------------------- the write pass


def scale_(
    tensors: Sequence[torch.Tensor], factor: torch.Tensor, *, factor_in_dtype: bool = False
) -> None:
    """Multiply every tensor in place by the 0-dim float32 ``factor`` (on their device), in
    float32, rounded once to the tensor's dtype. One launch over all tensors (float64 or
    non-contiguous tensors: torch's ``_foreach_mul_`` for those).

    Args:
        factor_in_dtype: False (default): the float32 factor itself, as torch's unscale kernel
            (``_amp_foreach_non_finite_check_and_unscale_``) and torch's CPU ``_foreach_mul_``
            do, bit for bit. True: the factor first rounded to each tensor's dtype, as torch's CUDA
            ``_foreach_mul_`` does for float16/bfloat16 tensors and a float32 0-dim factor (it
            takes its per-tensor ``mul_`` path there, which casts the factor to the tensor's
            dtype), bit for bit: what ``torch.nn.utils.clip_grad_norm_`` gives on a GPU. The two
            differ only for 16-bit tensors and a factor that 16-bit type does not hold exactly.
    """
    _scale_or_div(tensors, factor, divide=False, name="factor", in_dtype=factor_in_dtype)


def div_(
    tensors: Sequence[torch.Tensor], divisor: torch.Tensor, *, factor_in_dtype: bool = False
) -> None:
    """Divide every tensor in place by the 0-dim float32 ``divisor``: IEEE float32 division,
    rounded once; ``factor_in_dtype`` as in `scale_()` (True: torch's CUDA ``_foreach_div_``, bit
    for bit; False: its CPU one). One launch, as `scale_()`."""
    _scale_or_div(tensors, divisor, divide=True, name="divisor", in_dtype=factor_in_dtype)


def _scale_or_div(
    tensors: Sequence[torch.Tensor],
    factor: torch.Tensor,
    *,
    divide: bool,
    name: str,
    in_dtype: bool,
) -> None:
    dev = _check_tensors(tensors)
    if not isinstance(factor, torch.Tensor) or factor.numel() != 1 or factor.dim() != 0:
        raise ValueError(f"{name} must be a 0-dim float32 tensor, got: {factor!r}")
    if factor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got: {factor.dtype}")
    if dev is None:
        return
    if factor.device != dev:
        raise ValueError(f"{name} must be on the tensors' device {dev}, got: {factor.device}")
    if torch.compiler.is_compiling() and _OPS is not None:
        _OPS.scale_(list(tensors), factor, divide, in_dtype)
    else:
        _scale_impl(list(tensors), factor, divide, in_dtype)


def _write_checked(
    tensors: Sequence[torch.Tensor], factor: torch.Tensor, divide: bool, in_dtype: bool
) -> None:
    """`scale_()` or `div_()`, with their checks of the arguments (`_scale_impl`'s signature)."""
    name = "divisor" if divide else "factor"
    _scale_or_div(tensors, factor, divide=divide, name=name, in_dtype=in_dtype)


def _scale_impl(
    tensors: list[torch.Tensor], factor: torch.Tensor, divide: bool, in_dtype: bool = False
) -> None:
    dtypes, contiguous = _describe(tensors)
    if contiguous and all(d in _DTYPE_CODE for d in dtypes):
        if tensors:
            _launch_scale(_tables_of(tensors, dtypes, None), factor, divide, in_dtype)
        return
    ours = [t for t in tensors if t.dtype in _DTYPE_CODE and t.is_contiguous()]
    others = [t for t in tensors if not (t.dtype in _DTYPE_CODE and t.is_contiguous())]
    for t in others:  # float64 ones, non-contiguous ones: torch's ops, the same arithmetic
        if in_dtype or t.dtype == torch.float64:
            f = factor.to(t.dtype)
            t.div_(f) if divide else t.mul_(f)
        else:  # in float32 with the float32 factor, rounded once (copy_ rounds to nearest even)
            t.copy_(t.float().div_(factor) if divide else t.float().mul_(factor))
    if not ours:
        return
    tables = _tables(ours, None)
    _launch_scale(tables, factor, divide, in_dtype)


def _launch_scale(
    tables: _Tables, factor: torch.Tensor, divide: bool, in_dtype: bool = False
) -> None:
    k = _kernels(factor.device.type != "cuda")
    if tables.num_blocks:
        k._scale_kernel[(tables.num_blocks,)](
            tables.tab, tables.blk, factor, tables.num_blocks, tables.num_tensors,
            DIVIDE=divide, ROUND=in_dtype, BLOCK=_CONFIG["BLOCK"], num_warps=_CONFIG["num_warps"],
        )  # fmt: skip


# ---------------------------------------------------------------------- after the collective


def finish(
    stat: torch.Tensor,
    scale: torch.Tensor,
    *,
    max_norm: torch.Tensor | None = None,
    norm_type: float | None = 2.0,
) -> FinishResult:
    """From the all-reduced ``stat = [found, norm_stat]`` (float32 ``(2,)``), in one launch:
    ``found_inf`` (exactly 0.0 or 1.0: the flag > 0, or ``T`` inf/NaN, or for p = 1 and inf
    ``total_norm`` inf too, as torch's path of the scaler decides), ``grad_scale = max(scale, T /
    max_norm)`` (``scale`` on an overflow or without ``max_norm``) and ``total_norm = T / scale``,
    where ``T = norm_stat ** (1/p)`` (``sqrt`` for p = 2, correctly rounded; IEEE divisions: the
    values torch's ops give for the same ``stat``).

    Args:
        stat: the buffer of `PassResult.stat` after the collective.
        scale: 0-dim float32, the loss scale.
        max_norm: 0-dim float32 (clipping), or None.
        norm_type: the pass's ``norm_type`` (None: no norm; the total norm is 0.0).
    """
    _check_float32(("stat", stat), ("scale", scale), ("max_norm", max_norm))
    if stat.shape != (2,):
        raise ValueError(f"stat must have shape (2,), got: {tuple(stat.shape)}")
    _check_norm_type(norm_type)
    nt = None if norm_type is None else float(norm_type)
    if torch.compiler.is_compiling() and _OPS is not None:
        out = _OPS.finish(stat, scale, max_norm, nt)
    else:
        out = _finish_impl(stat, scale, max_norm, nt)
    return FinishResult(out)


def phase(
    tensors: Sequence[torch.Tensor],
    scale: torch.Tensor,
    reduce: Callable[..., object] | None,
    *,
    weights: Sequence[float] | None = None,
    norm_type: float | None = None,
    flags: bool = True,
    primes: Sequence[int] | None = None,
    terms: torch.Tensor | None = None,
    unscale: torch.Tensor | None = None,
    max_norm: torch.Tensor | None = None,
    clip: bool = False,
    factor_in_dtype: bool = False,
    device: torch.device | str | None = None,
    validate: bool = True,
    report_flags: bool = False,
) -> tuple[PassResult, FinishResult]:
    """The scaler's whole phase over ``tensors``, in order: `grad_pass()`, then
    ``reduce(stat, moments)`` (the caller's collective, which reduces ``stat`` in place and reads
    the fingerprint ``moments``, None without ``primes``), then `scale_()` by ``unscale`` (the 0-dim
    float32 inverse scale, where gradients are unscaled in place), `finish()`, and `div_()` by its
    ``grad_scale`` where ``clip`` (gradients clipped in place). Launches: 2 + 1 + 1 (+ 1 for
    ``unscale``; + 1 for ``clip``) and the collective ``reduce`` issues, whatever the number of
    tensors. ``reduce=None`` (no collective: one rank): the reduction computes `finish()`'s
    values itself, one launch fewer. Arguments as in those functions; ``validate=False`` skips
    their checks of the arguments (the scaler's own call: its gradients are checked where they
    are gathered, and the Python passes over the list are the host's cost of a small step).
    ``terms`` (with ``primes``): int64 ``(len(tensors), 6)``, the replica check's terms per
    tensor (`slot_sums()`): the reduction also sums its four slots (before their last residue)
    into a fresh int64 ``(4,)`` (one ``zeros`` more), which ``reduce`` gets third:
    ``reduce(stat, moments, sums)``. ``report_flags`` (with ``flags``):
    ``per_tensor`` holds the overflow report's flags of the statistics
    (`distscaler.attribution.flag_tensors()`: a NaN one as ``NAN_CODE``, an inf one as
    ``INF_CODE``), written so by the reduction: no op more.
    Returns the pass's and the finish's results.
    """
    checked = validate or (torch.compiler.is_compiling() and _OPS is not None)
    ts: Any = tensors if checked else list(tensors)  # checked: as given, for the checks
    write: Callable[[Any, torch.Tensor, bool, bool], None]
    write = _write_checked if checked else _scale_impl
    done = None
    sums = None
    if checked:
        if reduce is None:  # the reduction finishes (traced: one custom op)
            taken, done = _pass_finished(ts, scale, max_norm, weights, norm_type, flags, primes,
                                         device)  # fmt: skip
        else:
            taken = grad_pass(ts, weights=weights, norm_type=norm_type, flags=flags,
                              primes=primes, device=device)  # fmt: skip
        if terms is not None and taken.moments is not None and primes is not None:
            sums = slot_sums(taken.moments, terms, (int(primes[0]), int(primes[1])))
        if report_flags and taken.per_tensor is not None:
            taken = replace(taken, per_tensor=flag_tensors(taken.per_tensor))
    else:
        mode = _NORM_MODE[float(norm_type)] if norm_type is not None else 0
        ps = None if primes is None else (int(primes[0]), int(primes[1]))
        dev = torch.device(device) if device is not None else ts[0].device
        fin = None
        if reduce is None:
            nt = None if norm_type is None else float(norm_type)
            fin = _Finish(scale, max_norm, nt, torch.empty(3, dtype=torch.float32, device=dev))
            done = FinishResult(fin.out)
        slots = None
        if terms is not None and ps is not None:
            slots = _Slots(terms, torch.zeros(4, dtype=torch.int64, device=dev))
            sums = slots.sums
        stat, per_tensor, moments = _grad_pass_impl(ts, dev, weights, mode, flags, ps, fin, slots,
                                                    report_flags and flags)  # fmt: skip
        taken = PassResult(stat, per_tensor if flags else None,
                           moments if ps is not None else None, norm_type is not None)  # fmt: skip
    if reduce is not None:
        if sums is not None:
            reduce(taken.stat, taken.moments, sums)
        else:
            reduce(taken.stat, taken.moments)
    if unscale is not None:
        write(ts, unscale, False, False)
    if done is None:
        done = finish(taken.stat, scale, max_norm=max_norm, norm_type=norm_type)
    if clip:
        write(ts, done.grad_scale, True, factor_in_dtype)
    return taken, done


def _finish_impl(
    stat: torch.Tensor, scale: torch.Tensor, max_norm: torch.Tensor | None, norm_type: float | None
) -> torch.Tensor:
    out = torch.empty(3, dtype=torch.float32, device=stat.device)
    k = _kernels(stat.device.type != "cuda")
    k._finish_kernel[(1,)](
        stat, scale, stat if max_norm is None else max_norm, out,
        NORM=_check_norm_type(norm_type), CLIP=max_norm is not None, num_warps=1,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------- the norm's bound


def norm_bound(numels: Sequence[int], norm_type: float = 2.0) -> float:
    """The relative bound of `grad_pass()`'s float32 ``sum |g|**p`` (p = 2 or 1) against the exact
    sum, for tensors of these sizes: ``gamma_d = d*u / (1 - d*u)`` with ``u = 2**-24`` and ``d``
    the depth of the summation (module docstring), plus ``u`` for the squares (p = 2). Applies to
    ``norm_stat`` and, for each tensor, to the square of its ``per_tensor`` 2-norm before the
    ``sqrt`` (the norm itself: about half, plus ``u``)."""
    block, inner, rt = _CONFIG["BLOCK"], _CONFIG["INNER"], _CONFIG["RT"]
    chunk = _chunk_for(sum(numels), block, inner)
    blocks = sum(-(-int(n) // chunk) + 1 for n in numels)  # + a head block at most
    depth = (chunk // block) + math.ceil(math.log2(block)) + 1
    depth += -(-max(blocks, 1) // rt) + math.ceil(math.log2(rt)) + 1
    u = 2.0**-24
    return depth * u / (1 - depth * u) + (u if norm_type == 2.0 else 0.0)


# ---------------------------------------------------------------------- custom ops


def _register_ops() -> Any:
    """``distscaler::grad_pass``, ``distscaler::grad_pass_finished`` (the pass whose reduction
    finishes: no collective between them), ``distscaler::scale_``, ``distscaler::finish`` as
    custom ops with fake implementations (``torch.library.custom_op``, torch >= 2.4), so that a
    compiled phase traces them with ``fullgraph=True``; None where registering fails (then a
    traced phase calls the functions eagerly: a graph break)."""
    try:
        lib = "distscaler"

        @torch.library.custom_op(
            f"{lib}::grad_pass",
            mutates_args=(),
            schema="(Tensor[] tensors, Device device, float[]? weights, float? norm_type, "
            "bool flags, int[]? primes) -> (Tensor, Tensor, Tensor)",
        )
        def _grad_pass_op(tensors, device, weights, norm_type, flags, primes):  # type: ignore[no-untyped-def]
            mode = _check_norm_type(norm_type)
            ps = None if primes is None else (int(primes[0]), int(primes[1]))
            return _grad_pass_impl(list(tensors), device, weights, mode, flags, ps)

        @_grad_pass_op.register_fake
        def _grad_pass_fake(tensors, device, weights, norm_type, flags, primes):  # type: ignore[no-untyped-def]
            n = len(tensors)
            return (
                torch.empty(2, dtype=torch.float32, device=device),
                torch.empty(n if flags else 0, dtype=torch.float32, device=device),
                torch.empty((n if primes is not None else 0, 4), dtype=torch.int64, device=device),
            )

        @torch.library.custom_op(
            f"{lib}::grad_pass_finished",
            mutates_args=(),
            schema="(Tensor[] tensors, Device device, float[]? weights, float? norm_type, "
            "bool flags, int[]? primes, Tensor scale, Tensor? max_norm) -> "
            "(Tensor, Tensor, Tensor, Tensor)",
        )
        def _pass_finished_op(tensors, device, weights, norm_type, flags, primes, scale, max_norm):  # type: ignore[no-untyped-def]
            mode = _check_norm_type(norm_type)
            ps = None if primes is None else (int(primes[0]), int(primes[1]))
            fin = _Finish(scale, max_norm, norm_type, torch.empty(3, dtype=torch.float32,
                                                                  device=device))  # fmt: skip
            stat, per_tensor, moments = _grad_pass_impl(list(tensors), device, weights, mode,
                                                        flags, ps, fin)  # fmt: skip
            return stat, per_tensor, moments, fin.out

        @_pass_finished_op.register_fake
        def _(tensors, device, weights, norm_type, flags, primes, scale, max_norm):  # type: ignore[no-untyped-def]
            stat, per_tensor, moments = _grad_pass_fake(tensors, device, weights, norm_type, flags,
                                                        primes)  # fmt: skip
            return stat, per_tensor, moments, torch.empty(3, dtype=torch.float32, device=device)

        @torch.library.custom_op(
            f"{lib}::scale_",
            mutates_args=("tensors",),
            schema="(Tensor(a!)[] tensors, Tensor factor, bool divide, bool in_dtype) -> ()",
        )
        def _scale_op(tensors, factor, divide, in_dtype):  # type: ignore[no-untyped-def]
            _scale_impl(list(tensors), factor, divide, in_dtype)

        @_scale_op.register_fake
        def _(tensors, factor, divide, in_dtype):  # type: ignore[no-untyped-def]
            return None

        @torch.library.custom_op(
            f"{lib}::finish",
            mutates_args=(),
            schema="(Tensor stat, Tensor scale, Tensor? max_norm, float? norm_type) -> Tensor",
        )
        def _finish_op(stat, scale, max_norm, norm_type):  # type: ignore[no-untyped-def]
            return _finish_impl(stat, scale, max_norm, norm_type)

        @_finish_op.register_fake
        def _(stat, scale, max_norm, norm_type):  # type: ignore[no-untyped-def]
            return stat.new_empty(3)

        return types.SimpleNamespace(grad_pass=_grad_pass_op, scale_=_scale_op, finish=_finish_op,
                                     grad_pass_finished=_pass_finished_op)  # fmt: skip
    except Exception:  # an older torch without custom_op's schema=, a second registration
        return None


_OPS = _register_ops()
