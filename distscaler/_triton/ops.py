"""The entry points: `grad_pass()`, `finish()`, `scale_()`, `div_()` and the whole phase,
`phase()`, with their results, and their registration as custom ops.

float64 gradients are passed to torch's ops (`distscaler._triton.reference.torch_pass()`, several
launches), as are norm types other than 1, 2 and inf (`grad_pass()` refuses them). The functions are registered as custom ops
(``distscaler::grad_pass``, ``distscaler::grad_pass_finished``, ``distscaler::scale_``,
``distscaler::finish``) with fake implementations, so ``torch.compile(fullgraph=True)`` traces a
phase that calls them (opaque to the compiler: the host builds the address tables from
``data_ptr()``, which a traced function cannot read).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..attribution import flag_tensors
from .checks import (
    NORM_MODE,
    check_float32,
    check_keys,
    check_norm_type,
    check_pass,
    check_tensors,
    stat_dtype,
)
from .launch import Finish, Slots, finish_impl, grad_pass_impl, scale_impl
from .reference import slot_sums

__all__ = ["OPS", "FinishResult", "PassResult", "div_", "finish", "grad_pass", "phase", "scale_"]


# ---------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class PassResult:
    """What `grad_pass()` read, on the tensors' device.

    Attributes:
        stat: ``(2,)``: ``[found, norm_stat]``, the buffer the step all-reduces (``found`` is a 0/1
            flag: a SUM or a MAX over ranks is > 0 exactly when some rank saw inf/NaN); float64
            for p = 1, 2 (a sum of float32 gradients never overflows it), else float32.
        per_tensor: float32 ``(n,)``: each tensor's 2-norm (``norm_type == 2``) or largest
            magnitude (otherwise), NaN for a tensor holding a NaN, else inf for one holding an
            inf (torch's ``_foreach_norm`` values; with `phase()`'s ``report_flags``, the
            overflow report's flags of them instead); None when ``flags=False``.
        moments: int64 ``(n, 4)``: ``[A mod P1, A mod P2, B mod P1, B mod P2]`` per tensor
            (`distscaler._triton.kernels`' docstring); None without ``primes``.
        has_norm: whether ``norm_type`` was given (else ``stat[1]`` is 0.0).
    """

    stat: torch.Tensor
    per_tensor: torch.Tensor | None
    moments: torch.Tensor | None
    has_norm: bool

    @property
    def found(self) -> torch.Tensor:
        """0-dim, ``stat``'s dtype: 1.0 if an element of a tensor is inf/NaN, else 0.0 (a view of
        ``stat``)."""
        return self.stat[0]

    @property
    def norm_stat(self) -> torch.Tensor | None:
        """0-dim, ``stat``'s dtype: ``sum_t weights[t] * sum |g|**p`` (float64; ``max |g|`` for p
        = inf, float32; NaN when an element is NaN), a view of ``stat``; None without
        ``norm_type``."""
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
        ``norm_stat ** (1/p)``), or ``T`` itself where the statistic is of the unscaled
        gradients (`phase()`, ``finish(unscaled=True)``); 0.0 without a norm."""
        return self.out[2]


# ---------------------------------------------------------------------- the read pass


def grad_pass(
    tensors: Sequence[torch.Tensor],
    *,
    weights: Sequence[float] | None = None,
    norm_type: float | None = None,
    flags: bool = True,
    primes: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    unscale_by: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> PassResult:
    """Read every element of ``tensors`` once: the non-finite flag, the norm statistic, the
    per-tensor statistics and the replica checksum, in 2 launches (read + reduce).

    Args:
        tensors: gradients on one device, float32/float16/bfloat16 in any mix (float64: torch's
            ops, several launches). Non-contiguous ones are read through a contiguous copy.
        weights: per tensor, the factor of its ``sum |g|**p`` in ``norm_stat`` (``1 / replicas``);
            default all 1.0; ignored for p = inf.
        norm_type: None (no norm: ``stat[1]`` is 0.0), 2.0, 1.0 or ``math.inf``.
        flags: compute ``per_tensor``.
        primes: ``(P1, P2)``, odd, below 2**24: compute ``moments``.
        device: where the outputs go when ``tensors`` is empty (default: the CPU).
        unscale_by: the 0-dim float32 loss scale, or None: for p = 1 and 2, ``norm_stat`` and
            the per-tensor 2-norms are of the tensors divided by it (the statistics of the
            unscaled gradients, docs/pass-semantics.md), as `phase()` reads them; finish them
            with ``finish(..., unscaled=True)``.
        keys: with ``primes``, the int32 table of the replica check's keyed weights
            (`distscaler._replica.checksum.kernel_keys()`): ``moments`` gets each tensor's keyed
            sums as columns 4 and 5 (`distscaler._triton.kernels`' Keyed sums).

    Returns:
        `PassResult`: fresh tensors on the tensors' device.

    Raises:
        TypeError, ValueError: bad arguments (named), before anything is launched.
    """
    dev, mode, ps, ws = check_pass(tensors, norm_type, primes, weights, device)
    check_float32(("unscale_by", unscale_by), device=dev)
    check_keys(keys, len(tensors), dev)
    if torch.compiler.is_compiling() and OPS is not None:
        stat, per_tensor, moments = OPS.grad_pass(
            list(tensors), dev, None if ws is None else list(ws),
            None if norm_type is None else float(norm_type), flags,
            None if ps is None else list(ps), unscale_by, keys,
        )  # fmt: skip
    else:
        stat, per_tensor, moments = grad_pass_impl(list(tensors), dev, ws, mode, flags, ps,
                                                   unscale_by=unscale_by, keys=keys)  # fmt: skip
    return PassResult(
        stat,
        per_tensor if flags else None,
        moments if ps is not None else None,
        norm_type is not None,
    )


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
    custom op). The statistics are of the unscaled gradients (``unscale_by=scale``)."""
    dev, mode, ps, ws = check_pass(tensors, norm_type, primes, weights, device)
    check_float32(("scale", scale), ("max_norm", max_norm), device=dev)
    nt = None if norm_type is None else float(norm_type)
    if torch.compiler.is_compiling() and OPS is not None:
        stat, per_tensor, moments, out = OPS.grad_pass_finished(
            list(tensors), dev, None if ws is None else list(ws), nt, flags,
            None if ps is None else list(ps), scale, max_norm,
        )  # fmt: skip
    else:
        fin = Finish(scale, max_norm, nt, torch.empty(3, dtype=torch.float32, device=dev), True)
        stat, per_tensor, moments = grad_pass_impl(list(tensors), dev, ws, mode, flags, ps, fin,
                                                   unscale_by=scale)  # fmt: skip
        out = fin.out
    taken = PassResult(stat, per_tensor if flags else None, moments if ps is not None else None,
                       norm_type is not None)  # fmt: skip
    return taken, FinishResult(out)


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
    dev = check_tensors(tensors)
    if not isinstance(factor, torch.Tensor) or factor.numel() != 1 or factor.dim() != 0:
        raise ValueError(f"{name} must be a 0-dim float32 tensor, got: {factor!r}")
    if factor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got: {factor.dtype}")
    if dev is None:
        return
    if factor.device != dev:
        raise ValueError(f"{name} must be on the tensors' device {dev}, got: {factor.device}")
    if torch.compiler.is_compiling() and OPS is not None:
        OPS.scale_(list(tensors), factor, divide, in_dtype)
    else:
        scale_impl(list(tensors), factor, divide, in_dtype)


def _write_checked(
    tensors: Sequence[torch.Tensor], factor: torch.Tensor, divide: bool, in_dtype: bool
) -> None:
    """`scale_()` or `div_()`, with their checks of the arguments (`scale_impl`'s signature)."""
    name = "divisor" if divide else "factor"
    _scale_or_div(tensors, factor, divide=divide, name=name, in_dtype=in_dtype)


# ---------------------------------------------------------------------- after the collective


def finish(
    stat: torch.Tensor,
    scale: torch.Tensor,
    *,
    max_norm: torch.Tensor | None = None,
    norm_type: float | None = 2.0,
    unscaled: bool = False,
) -> FinishResult:
    """From the all-reduced ``stat = [found, norm_stat]`` (`PassResult.stat`: ``(2,)``, float64
    for p = 1, 2), in one launch: ``found_inf`` (exactly 0.0 or 1.0: the flag > 0, ``T`` NaN, or
    ``total_norm`` or ``grad_scale`` past float32's range, as torch's path of the scaler decides),
    ``grad_scale = max(scale, T / max_norm)`` (``scale`` on an overflow or without ``max_norm``)
    and ``total_norm = T / scale``, where ``T = norm_stat ** (1/p)`` (p = 1, 2: computed in
    float64, correctly rounded, and rounded once to float32; p = inf: IEEE float32 divisions).

    Args:
        stat: the buffer of `PassResult.stat` after the collective.
        scale: 0-dim float32, the loss scale.
        max_norm: 0-dim float32 (clipping), or None.
        norm_type: the pass's ``norm_type`` (None: no norm; the total norm is 0.0).
        unscaled: ``stat`` is of the unscaled gradients (`grad_pass()`'s ``unscale_by``; p = 1,
            2): ``T`` is then the total norm itself, and ``grad_scale = max(scale, T / max_norm *
            scale)``, divided first (the product overflows first).
    """
    check_float32(("scale", scale), ("max_norm", max_norm))
    want = stat_dtype(check_norm_type(norm_type))
    if not isinstance(stat, torch.Tensor) or stat.dtype != want or stat.device != scale.device:
        raise ValueError(f"stat must be a {want} tensor on {scale.device}, got: {stat!r}")
    if stat.shape != (2,):
        raise ValueError(f"stat must have shape (2,), got: {tuple(stat.shape)}")
    nt = None if norm_type is None else float(norm_type)
    if torch.compiler.is_compiling() and OPS is not None:
        out = OPS.finish(stat, scale, max_norm, nt, unscaled)
    else:
        out = finish_impl(stat, scale, max_norm, nt, unscaled)
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
    keys: torch.Tensor | None = None,
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
    the checksum ``moments``, None without ``primes``), then `scale_()` by ``unscale`` (the 0-dim
    float32 inverse scale, where gradients are unscaled in place), `finish()`, and `div_()` by its
    ``grad_scale`` where ``clip`` (gradients clipped in place). Launches: 2 + 1 + 1 (+ 1 for
    ``unscale``; + 1 for ``clip``) and the collective ``reduce`` issues, whatever the number of
    tensors. ``reduce=None`` (no collective: one rank): the reduction computes `finish()`'s
    values itself, one launch fewer. Arguments as in those functions; ``validate=False`` skips
    their checks of the arguments (the scaler's own call: its gradients are checked where they
    are gathered, and the Python passes over the list are the host's cost of a small step).
    ``terms`` (with ``primes``): int64 ``(len(tensors), 8)``, the replica check's terms per
    tensor (`slot_sums()`): the reduction also sums its eight residues (before their last
    reduction; the keyed sums last, 0 without ``keys``, `grad_pass()`'s) into a fresh int64
    ``(8,)`` (one ``zeros`` more), which ``reduce`` gets third: ``reduce(stat, moments, sums)``. For p = 1 and 2 the pass reads the statistics of the
    unscaled gradients (`grad_pass()`'s ``unscale_by=scale``: each magnitude multiplied by
    float32's ``1 / scale`` before the sum, as torch's recipe sums them; docs/pass-semantics.md),
    and the finish takes them so. ``report_flags`` (with ``flags``):
    ``per_tensor`` holds the overflow report's flags of the statistics
    (`distscaler.attribution.flag_tensors()`: a NaN one as ``NAN_CODE``, an inf one as
    ``INF_CODE``), written so by the reduction: no op more.
    Returns the pass's and the finish's results.
    """
    checked = validate or (torch.compiler.is_compiling() and OPS is not None)
    ts: Any = tensors if checked else list(tensors)  # checked: as given, for the checks
    write: Callable[[Any, torch.Tensor, bool, bool], None]
    write = _write_checked if checked else scale_impl
    done = None
    sums = None
    if checked:
        if reduce is None:  # the reduction finishes (traced: one custom op)
            taken, done = _pass_finished(ts, scale, max_norm, weights, norm_type, flags, primes,
                                         device)  # fmt: skip
        else:
            taken = grad_pass(ts, weights=weights, norm_type=norm_type, flags=flags,
                              primes=primes, device=device, unscale_by=scale,
                              keys=keys)  # fmt: skip
        if terms is not None and taken.moments is not None and primes is not None:
            sums = slot_sums(taken.moments, terms, (int(primes[0]), int(primes[1])))
        if report_flags and taken.per_tensor is not None:
            taken = replace(taken, per_tensor=flag_tensors(taken.per_tensor))
    else:
        mode = NORM_MODE[float(norm_type)] if norm_type is not None else 0
        ps = None if primes is None else (int(primes[0]), int(primes[1]))
        dev = torch.device(device) if device is not None else ts[0].device
        fin = None
        if reduce is None:
            nt = None if norm_type is None else float(norm_type)
            fin = Finish(scale, max_norm, nt, torch.empty(3, dtype=torch.float32, device=dev),
                         True)  # fmt: skip
            done = FinishResult(fin.out)
        slots = None
        if terms is not None and ps is not None:
            slots = Slots(terms, torch.zeros(8, dtype=torch.int64, device=dev))
            sums = slots.sums
        stat, per_tensor, moments = grad_pass_impl(ts, dev, weights, mode, flags, ps, fin, slots,
                                                    report_flags and flags, scale,
                                                    keys)  # fmt: skip
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
        done = finish(taken.stat, scale, max_norm=max_norm, norm_type=norm_type, unscaled=True)
    if clip:
        write(ts, done.grad_scale, True, factor_in_dtype)
    return taken, done


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
            "bool flags, int[]? primes, Tensor? unscale_by=None, Tensor? keys=None) -> "
            "(Tensor, Tensor, Tensor)",
        )
        def _grad_pass_op(tensors, device, weights, norm_type, flags, primes, unscale_by=None,  # type: ignore[no-untyped-def]
                          keys=None):  # fmt: skip
            mode = check_norm_type(norm_type)
            ps = None if primes is None else (int(primes[0]), int(primes[1]))
            return grad_pass_impl(list(tensors), device, weights, mode, flags, ps,
                                  unscale_by=unscale_by, keys=keys)  # fmt: skip

        @_grad_pass_op.register_fake
        def _grad_pass_fake(tensors, device, weights, norm_type, flags, primes, unscale_by=None,  # type: ignore[no-untyped-def]
                            keys=None):  # fmt: skip
            n = len(tensors)
            width = 6 if keys is not None and primes is not None else 4
            return (
                torch.empty(2, dtype=stat_dtype(check_norm_type(norm_type)), device=device),
                torch.empty(n if flags else 0, dtype=torch.float32, device=device),
                torch.empty((n if primes is not None else 0, width), dtype=torch.int64,
                            device=device),  # fmt: skip
            )

        @torch.library.custom_op(
            f"{lib}::grad_pass_finished",
            mutates_args=(),
            schema="(Tensor[] tensors, Device device, float[]? weights, float? norm_type, "
            "bool flags, int[]? primes, Tensor scale, Tensor? max_norm) -> "
            "(Tensor, Tensor, Tensor, Tensor)",
        )
        def _pass_finished_op(tensors, device, weights, norm_type, flags, primes, scale, max_norm):  # type: ignore[no-untyped-def]
            mode = check_norm_type(norm_type)
            ps = None if primes is None else (int(primes[0]), int(primes[1]))
            fin = Finish(scale, max_norm, norm_type, torch.empty(3, dtype=torch.float32,
                                                                  device=device), True)  # fmt: skip
            stat, per_tensor, moments = grad_pass_impl(list(tensors), device, weights, mode,
                                                        flags, ps, fin, unscale_by=scale)  # fmt: skip
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
            scale_impl(list(tensors), factor, divide, in_dtype)

        @_scale_op.register_fake
        def _(tensors, factor, divide, in_dtype):  # type: ignore[no-untyped-def]
            return None

        @torch.library.custom_op(
            f"{lib}::finish",
            mutates_args=(),
            schema="(Tensor stat, Tensor scale, Tensor? max_norm, float? norm_type, "
            "bool unscaled=False) -> Tensor",
        )
        def _finish_op(stat, scale, max_norm, norm_type, unscaled=False):  # type: ignore[no-untyped-def]
            return finish_impl(stat, scale, max_norm, norm_type, unscaled)

        @_finish_op.register_fake
        def _(stat, scale, max_norm, norm_type, unscaled=False):  # type: ignore[no-untyped-def]
            return torch.empty(3, dtype=torch.float32, device=stat.device)

        return types.SimpleNamespace(grad_pass=_grad_pass_op, scale_=_scale_op, finish=_finish_op,
                                     grad_pass_finished=_pass_finished_op)  # fmt: skip
    except Exception:  # an older torch without custom_op's schema=, a second registration
        return None


#: The custom ops (None where registering failed: a traced phase then calls the functions
#: eagerly).
OPS = _register_ops()
