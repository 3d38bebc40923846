"""The launches: from the tensors to their tables to the kernels (torch's ops where the kernels
do not apply: float64 gradients, non-contiguous ones), as the entry points and their custom ops
call them.

**Launches per phase** (`LAUNCHES`): 2 for `grad_pass()` (read + reduce; plus one host-to-device
copy of the address table when the tensors' addresses, sizes or dtypes changed since the last
call), 1 for `finish()` after the collective (``found_inf``, ``grad_scale``, the total norm), 1
for `scale_()`/`div_()` where gradients are unscaled or clipped in place (``factor_in_dtype``
picks which of torch's roundings of a 16-bit gradient it reproduces, bit for bit). So a clipped step
without a fused optimizer is 4 launches + the all_reduce at any number of tensors; with a fused
optimizer (it divides by ``grad_scale``) 3. With no collective (one rank: `phase()` with
``reduce=None``) the reduction computes `finish()`'s values itself: 3 and 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attribution import INF_CODE, NAN_CODE, flag_tensors
from . import runtime
from .checks import check_norm_type, stat_dtype
from .reference import slot_sums, torch_pass
from .tables import (
    CONFIG,
    DTYPE_KIND,
    KEY_ROW_WORDS,
    Tables,
    describe,
    tables_for,
    tables_of,
)

__all__ = [
    "LAUNCHES",
    "Finish",
    "Slots",
    "finish_impl",
    "grad_pass_impl",
    "launch_pass",
    "launch_scale",
    "scale_impl",
]

#: Kernel launches per call: `grad_pass()` (read + reduce), `finish()`, `scale_()`/`div_()`.
LAUNCHES = {"grad_pass": 2, "finish": 1, "scale_": 1, "div_": 1}


@dataclass(frozen=True, slots=True)
class Slots:
    """The replica check's slot sums, for a reduction that adds them (`phase()`'s ``terms``)."""

    terms: torch.Tensor  # int64 (n, 8)
    sums: torch.Tensor  # int64 (8,), zeros, added into (the keyed sums' two: 0 without keys)


@dataclass(frozen=True, slots=True)
class Finish:
    """What `finish()` takes, for a reduction that computes it (no collective in between)."""

    scale: torch.Tensor
    max_norm: torch.Tensor | None
    norm_type: float | None
    out: torch.Tensor  # float32 (3,), written
    #: the statistic is of the unscaled gradients (the pass read them with ``unscale_by``)
    unscaled: bool = False


def grad_pass_impl(
    tensors: list[torch.Tensor],
    device: torch.device,
    weights: Sequence[float] | None,
    mode: int,
    flags: bool,
    primes: tuple[int, int] | None,
    finish: Finish | None = None,
    slots: Slots | None = None,
    as_flags: bool = False,
    unscale_by: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of `grad_pass()`; with ``keys`` (and ``primes``), the moments' keyed sums
    (``(n, 6)``; the kernels' Keyed sums); with ``finish``, `finish()`'s too, written into
    ``finish.out`` by the reduction (no collective between them: one launch fewer); with
    ``slots`` (and ``primes``), the replica check's slot sums added into ``slots.sums``; with
    ``as_flags``, ``per_tensor`` as `distscaler.attribution.flag_tensors()` makes it of the
    statistics, written so by the reduction; with ``unscale_by`` (the 0-dim float32 loss scale;
    p = 1, 2), the norm statistic and the per-tensor 2-norms are of the gradients divided by it
    (the scaler's phase: docs/pass-semantics.md)."""
    n = len(tensors)
    n_flags = n if flags else 0
    n_moments = n if primes is not None else 0
    dtypes, contiguous = describe(tensors)
    unscaled = unscale_by is not None and mode in (1, 2)
    if torch.float64 in dtypes:
        stat, per_tensor, moments = torch_pass(tensors, device, weights, mode, n_flags, primes,
                                               unscale_by if unscaled else None, keys)  # fmt: skip
        if as_flags:
            per_tensor = flag_tensors(per_tensor)
        if finish is not None:
            finish.out.copy_(finish_impl(stat, finish.scale, finish.max_norm, finish.norm_type,
                                         finish.unscaled))  # fmt: skip
        if slots is not None and primes is not None:
            slots.sums.add_(slot_sums(moments, slots.terms, primes))
        return stat, per_tensor, moments
    if not contiguous:
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    stat = torch.empty(2, dtype=stat_dtype(mode), device=device)
    per_tensor = torch.empty(n_flags, dtype=torch.float32, device=device)
    keyed = keys is not None and primes is not None
    moments = torch.empty((n_moments, 6 if keyed else 4), dtype=torch.int64, device=device)
    if n == 0:
        stat.zero_()
        if finish is not None:
            finish.out.copy_(finish_impl(stat, finish.scale, finish.max_norm, finish.norm_type,
                                         finish.unscaled))  # fmt: skip
        return stat, per_tensor, moments
    tables = tables_of(tensors, dtypes, weights)
    launch_pass(tables, stat, per_tensor, moments, mode, flags, primes, finish, slots, as_flags,
                unscale_by if unscaled else None, keys if keyed else None)  # fmt: skip
    return stat, per_tensor, moments


def launch_pass(
    tables: Tables,
    stat: torch.Tensor,
    per_tensor: torch.Tensor,
    moments: torch.Tensor,
    mode: int,
    flags: bool,
    primes: tuple[int, int] | None,
    finish: Finish | None = None,
    slots: Slots | None = None,
    as_flags: bool = False,
    unscale_by: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> None:
    """The two launches over ``tables`` (outputs written in place; with ``finish``, the
    reduction writes `finish()`'s ``out`` too; with ``slots``, it adds the slot sums; with
    ``as_flags``, ``per_tensor`` holds the overflow report's flags; with ``unscale_by``, the sums
    are of the gradients divided by it; with ``keys`` (and ``primes``), the keyed sums too)."""
    k = runtime.get_kernels(stat.device.type != "cuda")
    nb, n = tables.num_blocks, tables.num_tensors
    device = stat.device
    part_s = torch.empty(nb if mode in (1, 2) else 1, dtype=torch.float64, device=device)
    keyed = keys is not None and primes is not None
    rows = 5 if keyed else 3 if primes is not None else 1
    part_i = torch.empty(nb * rows, dtype=torch.int64, device=device)
    p1, p2 = primes if primes is not None else (3, 5)
    block, inner = CONFIG["BLOCK"], CONFIG["INNER"]
    if keyed and inner <= 64 and block >= 16:
        # half the tile, twice the tiles per flush (the same span, so the same blocks): the
        # keyed products' registers (100 per thread on sm_90 at 1024, 166 at 2048;
        # launch/kernel_ptx.py)
        block, inner = block // 2, inner * 2
    if nb:
        k._read_kernel[(nb,)](
            tables.tab, tables.blk, part_s, part_i, nb, n,
            part_s if unscale_by is None else unscale_by, keys if keyed else part_i, p1, p2,
            NORM=mode, MOMENTS=primes is not None, BLOCK=block, INNER=inner,
            DYNAMIC=device.type != "cuda", UNSCALED=unscale_by is not None,
            KEYED=keyed, ROW=KEY_ROW_WORDS, num_warps=CONFIG["num_warps"],
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
        SLOTS=with_slots, RT=CONFIG["RT"], FINISH=finish is not None,
        CLIP=finish is not None and finish.max_norm is not None, AS_FLAGS=as_flags,
        NAN_AS=NAN_CODE, INF_AS=INF_CODE, UNSCALED=finish is not None and finish.unscaled,
        KEYED=keyed, num_warps=4,
    )  # fmt: skip


def scale_impl(
    tensors: list[torch.Tensor], factor: torch.Tensor, divide: bool, in_dtype: bool = False
) -> None:
    """`scale_()` or `div_()` without their checks: one launch over the contiguous tensors of the
    kernels' dtypes, torch's ops for the others."""
    dtypes, contiguous = describe(tensors)
    if contiguous and all(d in DTYPE_KIND for d in dtypes):
        if tensors:
            launch_scale(tables_of(tensors, dtypes, None), factor, divide, in_dtype)
        return
    ours = [t for t in tensors if t.dtype in DTYPE_KIND and t.is_contiguous()]
    others = [t for t in tensors if not (t.dtype in DTYPE_KIND and t.is_contiguous())]
    for t in others:  # float64 ones, non-contiguous ones: torch's ops, the same arithmetic
        if in_dtype or t.dtype == torch.float64:
            f = factor.to(t.dtype)
            t.div_(f) if divide else t.mul_(f)
        else:  # in float32 with the float32 factor, rounded once (copy_ rounds to nearest even)
            t.copy_(t.float().div_(factor) if divide else t.float().mul_(factor))
    if not ours:
        return
    tables = tables_for(ours, None)
    launch_scale(tables, factor, divide, in_dtype)


def launch_scale(
    tables: Tables, factor: torch.Tensor, divide: bool, in_dtype: bool = False
) -> None:
    """The write pass's one launch over ``tables`` (in place)."""
    k = runtime.get_kernels(factor.device.type != "cuda")
    if tables.num_blocks:
        k._scale_kernel[(tables.num_blocks,)](
            tables.tab, tables.blk, factor, tables.num_blocks, tables.num_tensors,
            DIVIDE=divide, ROUND=in_dtype, BLOCK=CONFIG["BLOCK"], num_warps=CONFIG["num_warps"],
        )  # fmt: skip


def finish_impl(
    stat: torch.Tensor,
    scale: torch.Tensor,
    max_norm: torch.Tensor | None,
    norm_type: float | None,
    unscaled: bool = False,
) -> torch.Tensor:
    """`finish()` without its checks: one launch, a fresh float32 ``(3,)``. ``unscaled``: the
    statistic is of the unscaled gradients (p = 1, 2; `grad_pass_impl()`'s ``unscale_by``)."""
    out = torch.empty(3, dtype=torch.float32, device=stat.device)
    k = runtime.get_kernels(stat.device.type != "cuda")
    k._finish_kernel[(1,)](
        stat, scale, stat if max_norm is None else max_norm, out,
        NORM=check_norm_type(norm_type), CLIP=max_norm is not None, UNSCALED=unscaled,
        num_warps=1,
    )  # fmt: skip
    return out
