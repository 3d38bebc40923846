"""The inf check: one pass over this rank's gradients and the step's one collective.

`run()` carries out a `StepPlan` over the gradients `distscaler.layouts.local_grads()` gathered and
returns one `StepResult`: the agreed ``found_inf`` (every rank of the group gets the same), and as
the plan asks, the ``grad_scale`` a fused optimizer divides by, the global ``total_norm`` and the
per-tensor flags an overflow report reads. Each pass is torch's multi-tensor kernels, one launch per
(device, dtype) group, then at most one ``all_reduce`` of two values (`_Collective.reduce_()`, the
only collective of a step: float32, float64 when clipping), then a few small device ops that also
compute the counters the next ``update()`` needs (the state's ``counter_terms()`` ride in the
pass's own ``_foreach_addcdiv``).
Nothing is read on the host but where the plan says so.

Per-tensor flags: one float32 per gradient tensor, taken from the statistic the pass reads anyway
(its largest magnitude, or its norm when clipping), flagged by one ``nan_to_num``: the finite
statistic itself (saturated at float32's largest), ``-1.0`` for a NaN, ``-2.0`` for an inf
([`distscaler.attribution`][distscaler.attribution]).

Clipping: the statistics are float64 (`wide_dtype()`; per-tensor norms, the global norm, the sum of
squares the collective carries), and the norm and ``grad_scale`` are rounded once to float32 at the
end, inf where past its range: no finite gradient's statistic overflows, at any scale
(docs/pass-semantics.md).

Device ops per pass (world size 1, one (device, dtype) group; world size > 1 adds the one
``all_reduce``, and with clipping one ``sqrt``):

* ``CHECK`` without per-tensor flags, or on the CPU (flag read on the host): one
  ``_foreach_addcdiv`` (the flag's fresh zero and the update's counters), torch's check kernel with
  a factor of exactly 1.0 (values unchanged), and with flags the host read: 3 (+ ``_foreach_norm``,
  ``stack``, ``nan_to_num`` on a skip). On a GPU with flags: ``_foreach_norm`` with p = inf (each
  gradient's largest magnitude: read-only, inf/NaN exactly when the gradient holds one), ``stack``,
  ``nan_to_num``, ``amin``, the ``_foreach_addcdiv`` (``-min``), ``clamp`` for a flag of exactly
  0.0 or 1.0 (at world size 1 in one element per gradient: the overflow flags' weight,
  ``StepResult.flag_weights``): 6.
* ``NORM`` (2-norm): ``_foreach_norm``, ``stack``, ``linalg_vector_norm`` (float64), one ``div``
  (the norm and ``scaled norm / max_norm``) and its cast to float32, the ``_foreach_addcdiv`` for
  the flag's value and the update's counters; on the CPU (fused) the norms are float32 and ``T``
  read on the host (taken again in float64 where it is not finite: `_two_norm()`; the stack cast
  to float64), then the flag's host read and ``fmax`` for ``grad_scale``: 10 (on a skip also the
  float64 norms and the per-tensor flags: ``nan_to_num``, ``clamp_``, the cast). On
  a GPU: the float64 ``_foreach_norm``, ``stack`` and ``linalg_vector_norm``, one float32 ``stack``
  of the slots, the ``div`` into them, one ``_foreach_addcdiv_``, ``nan_to_num`` and ``sub`` for
  the flag's code, one ``clamp`` for the exact flag and ``grad_scale`` in one element per gradient,
  and the per-tensor flags' ``nan_to_num`` and ``fmin``: 11 (`_norm_on_device()`).

The 2-norm takes no 1e-6 guard: torch's ``clip_grad_norm_`` computes ``max_norm / (norm + 1e-6)``
to avoid dividing by zero; here ``clip_coef = min(1, max_norm / total_norm)`` is applied as
``grad_scale = max(scale, scaled_norm / max_norm)``, which never divides by the norm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._plan import GradPass
from ._torch_compat import amp_check_and_unscale_, wide_dtype
from .attribution import INF_CODE, NAN_CODE, flag_tensors

if TYPE_CHECKING:
    from ._plan import StepPlan
    from ._state import DeviceState, NextCounters
    from .checks import Contribution, Reading
    from .layouts import GradGroups

__all__ = ["STAT_NUMEL", "StepResult", "check_and_unscale_", "local_stat", "run", "triton_runs"]

#: Elements of the buffer a pass all-reduces: [non-finite flag, weighted sum of |g|**p (or max |g|
#: for p = inf)].
STAT_NUMEL = 2

#: float32's largest value as a float64 CPU scalar (an operand on any device, copied nowhere).
_FLOAT32_MAX_VALUE = torch.finfo(torch.float32).max
_FLOAT32_MAX = torch.tensor(_FLOAT32_MAX_VALUE, dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What `run()` found, all tensors 0-dim float32 on the scale's device unless said.

    Attributes:
        found_inf: exactly 1.0 if any rank of the group saw inf/NaN, else 0.0 (0.0 also when the
            plan steps through inf/NaN); None where no flag was agreed (a ``NORM_UNSCALED``
            pass with no earlier flag).
        grad_scale: what a fused optimizer divides the gradients by (``scale / clip_coef``), or
            None when they are already unscaled.
        total_norm: the global norm of the unscaled gradients (a ``NORM`` pass), else None.
        per_tensor_flags: float32 ``(len(params),)``: each gradient's statistic, ``-1.0`` for NaN,
            ``-2.0`` for inf; None when not taken, or taken on a clean step read on the host.
        params: the parameters of the gradients, in the order of ``per_tensor_flags``.
        flags_taken: whether this result speaks for the step's per-tensor flags (else a later
            pass of the iteration takes them).
        clean_read: ``found_inf`` was read on the host and no flags were taken for it (a clean
            step): the optimizer's overflow flags stays as it is.
        flags_after_read: the flags were taken after the host read ``found_inf`` (on a skip only).
        flag_weights: ``found_inf`` in every element of ``per_tensor_flags``' shape (a view of the
        op that made ``found_inf``), where the pass made it so: the weight that lets the overflow
        flags ride in the skip counters' one ``_foreach_lerp_`` (torch's CUDA foreach keeps its
        multi-tensor path where every tensor and its weight have the same sizes); None where it did
        not (then the flags take a ``lerp_`` of their own).
        next_counters: the update's counters made by this pass (``DeviceState.next_counters``), or None
            (the update makes them).
        skipped: ``found_inf`` as read on the host, None where it was not read.
        max_norm: the clip's ``max_norm`` (for `clip_coef`), else None.
        readings: the readings of the plan's contributions that found something to act on
            ([`Reading`][distscaler.checks.Reading]), in the plan's order.
    """

    found_inf: torch.Tensor | None
    grad_scale: torch.Tensor | None = None
    total_norm: torch.Tensor | None = None
    per_tensor_flags: torch.Tensor | None = None
    params: tuple[torch.Tensor, ...] = ()
    flags_taken: bool = False
    clean_read: bool = False
    flags_after_read: bool = False
    flag_weights: torch.Tensor | None = None
    next_counters: NextCounters | None = None
    skipped: bool | None = None
    max_norm: float | None = None
    readings: tuple[Reading, ...] = ()

    @property
    def clip_coef(self) -> torch.Tensor | None:
        """``min(1, max_norm / total_norm)``, torch's clip coefficient without its 1e-6 guard (one
        op when asked; the step itself applies it through ``grad_scale``); None without a norm."""
        if self.total_norm is None or self.max_norm is None:
            return None
        return torch.clamp(self.max_norm / self.total_norm, max=1.0)


def run(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState | None,
    *,
    found_inf: torch.Tensor | None = None,
    max_norm: torch.Tensor | None = None,
) -> StepResult:
    """Carry out ``plan`` over this rank's gradients.

    Args:
        plan: what to do (`distscaler._plan`).
        grads: the local gradients grouped by (device, dtype, replication weight), and ``params``
            their parameters in the same order (`distscaler.layouts.local_grads()`).
        state: the scale's device state (a disabled scaler runs no pass: its
            ``clip_grad_norm_`` is torch's).
            Every rank of ``plan.world`` must call ``run`` with the same plan kind: it issues
            the step's one collective when ``plan.world.collective``.
        found_inf: the flag an earlier check of this iteration agreed on (``GradPass.NONE``, and
            ``NORM_UNSCALED`` after ``unscale_``).
        max_norm: ``plan.max_norm`` as a 0-dim float32 tensor on the scale's device, for a
            ``NORM`` pass (``DeviceState.max_norm``: made once, not at every step).

    Returns:
        the `StepResult`, with ``readings`` holding the contributions' readings.

    Raises:
        ValueError: fp16 gradients where they are unscaled in place (torch's wording) are refused
            by the gathering; nothing here raises on user input.
    """
    coll = _Collective(plan, grads, params)
    result = None
    if plan.kernels == "triton":
        result = _run_triton(plan, grads, params, state, coll, max_norm)
    if result is None:
        result = _run(plan, grads, params, state, coll, found_inf, max_norm)
    if coll.readings:
        return replace(result, readings=tuple(coll.readings))
    return result


def _run(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState | None,
    coll: _Collective,
    found_inf: torch.Tensor | None,
    max_norm: torch.Tensor | None,
) -> StepResult:
    grad_pass = plan.grad_pass
    if grad_pass is GradPass.NORM_UNSCALED:
        return _norm_unscaled(plan, grads, params, state, coll, found_inf)
    assert state is not None
    if grad_pass is GradPass.NORM:
        assert max_norm is not None
        return _norm(plan, grads, params, state, max_norm, coll)
    if grad_pass is GradPass.CHECK:
        result = _check(plan, grads, params, state, coll)
        if not plan.skip_nonfinite:  # a static scale told to step through inf/NaN
            return replace(result, found_inf=state.zero, flag_weights=None)
        return result
    if grad_pass is GradPass.UNSCALE:
        found = coll.reduce_(
            check_and_unscale_(grads, inv_scale=_inv_scale(state.scale)), op=dist.ReduceOp.MAX
        )[0]
        if not plan.skip_nonfinite:
            found = state.zero
    else:  # GradPass.NONE: the iteration's check already agreed
        assert found_inf is not None
        found = found_inf
        if not plan.read_found_inf:  # a fused step after an explicit unscale_: flags at once
            flags = _flags(grads, state.device) if plan.per_tensor_flags else None
            return StepResult(found, per_tensor_flags=flags, params=params,
                              flags_taken=plan.per_tensor_flags)  # fmt: skip
    if not plan.read_found_inf:  # unscale_: no read, no flags (a later step takes them)
        return StepResult(found)
    skipped = bool(found.item())  # the step's one host read: the agreed flag
    taking = plan.per_tensor_flags and skipped
    flags = _flags(grads, state.device) if taking else None
    return StepResult(
        found,
        per_tensor_flags=flags,
        params=params,
        flags_taken=taking,
        flags_after_read=True,
        skipped=skipped,
    )


# ---------------------------------------------------------------------- the one collective


class _Collective:
    """The step's one collective for one plan: the pass's own buffer (the flag, the norm
    statistic) with the plan's contributions appended ([`Contribution`][distscaler.checks.Contribution]),
    reduced as ``plan.collective_op`` says, and the contributions' readings kept in ``readings``.
    Every rank of ``plan.world`` calls `reduce_()` once per pass (when
    ``plan.world.collective``)."""

    __slots__ = ("grads", "params", "plan", "readings", "summed_by")

    def __init__(self, plan: StepPlan, grads: GradGroups, params: tuple[torch.Tensor, ...]):
        self.plan = plan
        self.grads = grads
        self.params = params
        self.readings: list[Reading] = []
        #: The contribution whose slots the Triton pass summed in its reduction (its
        #: ``kernel_part``).
        self.summed_by: Contribution | None = None

    @property
    def active(self) -> bool:
        """Whether the pass issues the collective (more than one rank, or a changing group)."""
        return self.plan.world.collective

    def reduce_(
        self,
        buffer: torch.Tensor,
        moments: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
        *,
        op: Any,
    ) -> torch.Tensor:
        """``buffer`` reduced in place with ``op`` over the plan's group (the MAX callers ask for
        is over 0/1 flags, or over a p = inf norm's statistic). With contributions: one ``cat`` of
        their slots after ``buffer``; a SUM of the joint buffer (a MAX of flags clamped to 1 after
        it: one ``clamp_``), or, beside a MAX of values or with a contribution that combines by
        ``"max"``, one ``all_gather`` reduced here (amax of ``buffer``'s part, each contribution's
        slots summed or maxed as it declares, in rank order); one ``copy_`` back; then each
        contribution reads its reduced slots (one that keeps the local flag also takes this rank's
        flag from before the reduce: one ``clone``). ``moments``: the gradients' word sums where
        the pass computed them (the Triton kernel), for the contributions; ``sums``: the slot sums
        the pass made for ``summed_by`` (its ``kernel_part``). Returns ``buffer``."""
        plan = self.plan
        world = plan.world
        if not world.collective:
            return buffer
        # one rank of no group (a check's collective at every step: `Check.every_step`)
        alone = world.group is None and world.size == 1
        if not plan.contributions:
            if not alone:
                dist.all_reduce(buffer, op=op, group=world.group)
            return buffer
        flat = [g for gs in self.grads.values() for g in gs]
        parts = [
            c.local(self.params, flat, moments, sums if c is self.summed_by else None)
            .to(buffer.device, non_blocking=True)
            for c in plan.contributions
        ]  # fmt: skip
        n = buffer.numel()
        joint = torch.cat([buffer.reshape(-1), *parts])
        # a contribution may keep this rank's flag, which the reduce overwrites (one op)
        keep = any(c.keeps_local_flag for c in plan.contributions)
        local = joint[:1].clone() if keep else None
        reduced: list[torch.Tensor] = []
        if plan.collective_op == "gather":
            rows = joint.new_empty(world.size * joint.numel()) if not alone else joint
            if not alone:
                # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(rows, joint, group=world.group)
            table = rows.view(world.size, -1)
            buffer.copy_(table[:, :n].amax(0).view_as(buffer))
            start = n
            for c in plan.contributions:
                slots = table[:, start : start + c.numel]
                reduced.append(slots.amax(0) if c.combine == "max" else slots.sum(0))
                start += c.numel
        else:
            if not alone:
                dist.all_reduce(joint, op=dist.ReduceOp.SUM, group=world.group)
            buffer.copy_(joint[:n].view_as(buffer))
            if op == dist.ReduceOp.MAX:
                buffer.clamp_(max=1.0)
            reduced = list(joint[n:].split([c.numel for c in plan.contributions]))
        for c, part in zip(plan.contributions, reduced):
            reading = c.read(part, local if c.keeps_local_flag else None,
                             buffer if c.reads_agreed else None)  # fmt: skip
            if reading is not None:
                self.readings.append(reading)
        return buffer


# ---------------------------------------------------------------------- the Triton pass


def triton_runs(device: str) -> bool:
    """Whether the Triton pass runs on ``device`` (`distscaler._triton.available()`: a CUDA device
    with triton importable, or the CPU under ``TRITON_INTERPRET=1`` with an interpreter that runs
    the kernels). Imports the pass (and Triton) on its first call; never raises."""
    from . import _triton

    return _triton.available(device)


def _run_triton(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState | None,
    coll: _Collective,
    max_norm_t: torch.Tensor | None,
) -> StepResult | None:
    """The pass as one multi-tensor Triton read of every gradient (``distscaler._triton``):
    the flag, the per-tensor flags, the norm statistic and the contributions' checksum moments
    in 2 launches, the collective, then 1 launch for ``found_inf``, ``grad_scale`` and the norm,
    and 1 write pass where gradients are unscaled or clipped in place: at most 4 launches and the
    collective, at any number of tensors (where the host does not read ``found_inf``, the
    reduction writes the overflow report's per-tensor flags as `flag_tensors()` makes them; after
    a host read, that ``nan_to_num`` on a skip). None where it does not cover the plan (torch's
    pass runs)."""
    from . import _triton as kernels

    grad_pass = plan.grad_pass
    if state is None or grad_pass not in (GradPass.CHECK, GradPass.UNSCALE, GradPass.NORM):
        return None
    norm_type = plan.norm_type if grad_pass is GradPass.NORM else None
    if norm_type not in (None, 1.0, 2.0, math.inf):
        return None
    if any(key.device != state.device or key.dtype == torch.float64 for key in grads):
        return None
    flat = [g for gs in grads.values() for g in gs]
    weights = None  # all 1.0: the kernel's default, and a shorter key for its tables' cache
    if norm_type and any(key.weight != 1.0 for key in grads):
        weights = [key.weight for key, gs in grads.items() for _ in gs]
    max_of = norm_type is None or norm_type == math.inf
    op = dist.ReduceOp.MAX if max_of else dist.ReduceOp.SUM
    # the one contribution the kernel computes for: its word sums in the read, its slots' sums
    # in the reduction ([`KernelPart`][distscaler.checks.KernelPart])
    coll.summed_by = next((c for c in plan.contributions if c.kernel_part is not None), None)
    part = None if coll.summed_by is None else coll.summed_by.kernel_part
    primes = None if part is None else part.primes
    terms = keys = None
    in_pass = plan.per_tensor_flags and not plan.read_found_inf  # the flags made by the pass
    if part is not None and coll.active:
        terms = part.terms(params, flat)
        if terms is not None and part.keys is not None:
            keys = part.keys(params, flat)
    taken, done = kernels.phase(
        flat, state.scale, functools.partial(coll.reduce_, op=op) if coll.active else None,
        weights=weights, validate=False, norm_type=norm_type, flags=plan.per_tensor_flags,
        primes=primes, terms=terms, keys=keys,
        unscale=_inv_scale(state.scale) if grad_pass is GradPass.UNSCALE else None,
        max_norm=max_norm_t if norm_type else None,
        # torch's CUDA _foreach_div_ rounds the divisor to a 16-bit gradient's dtype first
        clip=grad_pass is GradPass.NORM and not plan.fused,
        factor_in_dtype=state.device.type == "cuda", device=state.device,
        report_flags=in_pass,  # written as the overflow report keeps them (no nan_to_num)
    )  # fmt: skip
    found = done.found_inf if plan.skip_nonfinite else state.zero
    per_tensor = taken.per_tensor
    grad_scale = done.grad_scale if norm_type else state.scale
    total = done.total_norm if norm_type else None
    if grad_pass is GradPass.UNSCALE and not plan.read_found_inf:
        return StepResult(found)  # unscale_: no flags (a later step takes them)
    if not plan.read_found_inf:
        flags = per_tensor if in_pass else None  # written as flag_tensors() gives them
        return StepResult(found, grad_scale=None if grad_pass is GradPass.UNSCALE else grad_scale,
                          total_norm=total, per_tensor_flags=flags, params=params,
                          flags_taken=True, max_norm=plan.max_norm)  # fmt: skip
    skipped = bool(found.item())  # the plan reads it (the host's word, or a free read)
    taking = plan.per_tensor_flags and skipped and per_tensor is not None
    if taking and grad_pass is GradPass.UNSCALE:
        per_tensor = per_tensor * _inv_scale(state.scale)  # type: ignore[operator]  # the flags of unscaled gradients
    return StepResult(
        found,
        grad_scale=None if grad_pass is GradPass.UNSCALE else grad_scale,
        total_norm=total,
        per_tensor_flags=flag_tensors(per_tensor) if taking else None,  # type: ignore[arg-type]
        params=params,
        flags_taken=True,
        clean_read=grad_pass is not GradPass.UNSCALE,
        flags_after_read=True,
        skipped=skipped,
        max_norm=plan.max_norm,
    )


# ---------------------------------------------------------------------- the read-only check


def _check(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    coll: _Collective,
) -> StepResult:
    """The agreed ``found_inf``, leaving the gradients as they are (a fused step).

    Without per-tensor flags, or where the flag is read on the host: torch's check kernel with a
    factor of exactly 1.0 (it writes back the values it read). Otherwise the largest magnitude of
    each gradient (``_foreach_norm`` with p = inf: inf or NaN exactly when the gradient holds one)
    gives the flags and, by their minimum, ``found_inf``: where no collective follows, clamped in
    one element per flag (``flag_weights``, found_inf the first), the weight that puts the overflow
    flags in the skip counters' ``_foreach_lerp_``.
    """
    kernel = not plan.per_tensor_flags or plan.read_found_inf
    if kernel and all(key.device == state.device for key in grads):
        return _check_kernel(plan, grads, params, state, coll)
    flags = _flags(grads, state.device)
    weights = None
    if flags is None:
        found = state.zero.clone()
        counters = None
    else:
        a, b, c = state.counter_terms()
        # The smallest flag is negative exactly when a gradient is inf/NaN: -min, clamped to
        # [0, 1], is found_inf; the update's counters come in the same op.
        neg_min, *next_values = torch._foreach_addcdiv(
            [state.zero, *a], [flags.amin(), *b], [state.minus_one, *c]
        )
        if coll.active:  # agreed after the clamp: elements clamped here would hold this rank's flag
            found = neg_min.clamp(0.0, 1.0)
        else:
            # The same clamp over -min in one element per flag (an expanded view: no op more), the
            # overflow flags' weight (`StepResult.flag_weights`), found_inf its first element.
            weights = neg_min.expand(flags.shape).clamp(0.0, 1.0)  # (num_grads,)
            found = weights[0]
        counters = state.next_counters(next_values)
    coll.reduce_(found, op=dist.ReduceOp.MAX)
    return StepResult(
        found,
        grad_scale=state.scale,
        per_tensor_flags=flags,
        params=params,
        flags_taken=True,
        flag_weights=weights,
        next_counters=counters,
    )


def _check_kernel(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    coll: _Collective,
) -> StepResult:
    """`_check()` with torch's check kernel (a factor of exactly 1.0: values unchanged).

    Ops: one ``_foreach_addcdiv`` (the flag's fresh zero and the update's counters), the kernel (one
    launch per group), the ``all_reduce(MAX)`` of one float32 at world size > 1; where the flag is
    read, one host read, and on a skip ``_foreach_norm``, ``stack``, ``nan_to_num``.
    """
    a, b, c = state.counter_terms()
    zero, one = state.zero, state.one
    found, *next_values = torch._foreach_addcdiv([zero, *a], [zero, *b], [one, *c])
    counters = state.next_counters(next_values)
    _check_and_unscale_into_(grads, found, one)
    coll.reduce_(found, op=dist.ReduceOp.MAX)
    if not plan.read_found_inf:
        return StepResult(found, grad_scale=state.scale, next_counters=counters,
                          params=params, flags_taken=True)  # fmt: skip
    skipped = bool(found.item())  # free: the plan reads only where no sync is needed
    return StepResult(
        found,
        grad_scale=state.scale,
        per_tensor_flags=_flags(grads, state.device) if skipped else None,
        params=params,
        flags_taken=True,
        clean_read=True,
        flags_after_read=True,
        next_counters=counters,
        skipped=skipped,
    )


def check_and_unscale_(groups: GradGroups, *, inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply gradients in place by ``inv_scale`` and flag non-finite values in the same pass.

    ``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
    uses, so unscaled values are bit-identical to torch's; with ``inv_scale`` exactly 1.0 the values
    are unchanged. Returns a fresh float32 ``(2,)`` tensor on ``inv_scale.device``: [exactly 1.0 if
    an element is inf/NaN else 0.0, 0.0].
    """
    stat = torch.zeros(STAT_NUMEL, dtype=torch.float32, device=inv_scale.device)
    _check_and_unscale_into_(groups, stat[0], inv_scale)
    return stat


def _check_and_unscale_into_(
    groups: GradGroups, found: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """torch's check-and-unscale kernel over every group (one launch each), its flag into the 0-dim
    ``found`` (set to 1.0 on inf/NaN, else left as it is). Groups on another device than ``found``
    get their own flag and factor there, merged into ``found`` after (a max)."""
    device = found.device
    others: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, grads in groups.items():
        if key.device == device:
            flag, factor = found, inv_scale  # the kernel writes into the buffer
        else:
            if key.device not in others:
                others[key.device] = (
                    torch.zeros((), dtype=torch.float32, device=key.device),
                    inv_scale.to(key.device, non_blocking=True),
                )
            flag, factor = others[key.device]
        amp_check_and_unscale_(grads, flag, factor)
    for flag, _ in others.values():
        found.copy_(torch.maximum(found, flag.to(device, non_blocking=True)))


def _flags(groups: GradGroups, device: torch.device) -> torch.Tensor | None:
    """Per-tensor flags of the gradients as they are (float32 ``(num_grads,)`` on ``device``): the
    largest magnitude of each (``_foreach_norm`` with p = inf, one launch per group), flagged. None
    without any gradient."""
    parts: list[torch.Tensor] = []
    wide: list[tuple[int, torch.Tensor]] = []  # float64 groups: flagged before the cast to float32
    for key, grads in groups.items():
        part = _max_magnitudes(grads, _accumulation_dtype(key.dtype))
        if key.dtype == torch.float64:
            # A finite float64 magnitude past float32's range must not turn into an inf flag.
            flagged = _saturated_flags(torch.stack(part))
            wide.append((len(parts), flagged.to(device, non_blocking=True)))
            part = [torch.zeros((), dtype=torch.float32, device=device)] * len(part)
        elif key.device != device:
            part = [n.to(device, torch.float32, non_blocking=True) for n in part]
        parts += part
    if not parts:
        return None
    flags = flag_tensors(torch.stack(parts))
    for start, flagged in wide:
        flags[start : start + flagged.numel()] = flagged
    return flags


# ---------------------------------------------------------------------- norms


def _inv_scale(scale: torch.Tensor) -> torch.Tensor:
    # As torch: the reciprocal in float64, so unscaled values match torch's bit for bit.
    return scale.double().reciprocal().float()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 at least: a large finite fp16 gradient's square never overflows it. (Not
    # torch.promote_types, which is a dispatched op.)
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Unbound: ``map()`` over it walks a list in C.
_NUMEL = torch.Tensor.numel


def _max_magnitudes(grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each gradient's largest magnitude, 0-dim ``dtype`` tensors on its device: ``_foreach_norm``
    with p = inf (inf or NaN exactly when the gradient holds one), where an empty gradient gives
    0.0. torch's ``_foreach_norm`` raises on an empty tensor for p = inf ("the operation does not
    have an identity"), and so does ``torch.nn.utils.clip_grad_norm_``; an empty gradient is what a
    rank holds of a parameter with fewer rows than ranks under FSDP2 or TP (a shard of nothing), and
    0.0, the identity of a maximum of magnitudes, is what the Triton pass gives it. Cost: one walk
    of the sizes on the host; with an empty gradient, one more op (the zero)."""
    if all(map(_NUMEL, grads)):
        return list(torch._foreach_norm(grads, math.inf, dtype=dtype))
    kept = [g for g in grads if g.numel()]
    maxima = iter(torch._foreach_norm(kept, math.inf, dtype=dtype) if kept else ())
    zero = torch.zeros((), dtype=dtype, device=grads[0].device)
    return [next(maxima) if g.numel() else zero for g in grads]


def _div_(groups: GradGroups, divisor: torch.Tensor) -> None:
    """Divide every gradient in place by a 0-dim tensor (one launch per (device, dtype) group)."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for key, grads in groups.items():
        if key.device not in per_device:
            per_device[key.device] = divisor.to(key.device, non_blocking=True)
        torch._foreach_div_(grads, per_device[key.device])


def _p_norm(stat: torch.Tensor, norm_type: float) -> torch.Tensor:
    # The norm from an agreed statistic: sum |g|**p, or max |g| for p = inf.
    return stat[1] if norm_type == math.inf else stat[1].pow(1.0 / norm_type)


def _two_norm(
    groups: GradGroups,
    device: torch.device,
    coll: _Collective,
    buffer2: torch.Tensor,
    tail: Sequence[torch.Tensor] = (),
    *,
    recheck: bool = False,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The per-tensor 2-norms and the global 2-norm ``T`` of the (still scaled) gradients, in
    float64: one buffer ``[per-tensor norms (num_grads) | tail]`` on ``device``, ``num_grads`` and
    ``T`` (0-dim).

    One ``_foreach_norm`` per (device, dtype) group, accumulated and returned in float64
    (`wide_dtype()`: no sum of squares of float32 gradients overflows it, at any scale; float32 on
    MPS), and one ``stack`` that also copies ``tail`` (0-dim tensors on ``device`` of the norms'
    dtype) after the per-tensor norms; then at world size 1 one ``linalg_vector_norm``, and
    otherwise the weighted sum of squares written into ``buffer2[1]`` (float64 ``(2,)``: one
    ``addmv_``), one ``all_reduce`` of ``buffer2``, and one ``sqrt``. A rank without gradients
    joins with zeros.

    ``recheck`` (where a host read is free: the CPU, whose float64 norm of float32 gradients takes
    about 4x its float32 one): the per-tensor norms are taken in float32 (torch's own
    ``clip_grad_norm_``'s), stacked with ``tail`` (float32) and cast to float64 (one op more), and
    this rank's ``T`` (world size 1) or sum of squares (before the collective) read on the host;
    only where it is not finite (an inf/NaN, or a finite tensor whose float32 norm overflows) are
    they taken again in float64. The same rules either way (docs/pass-semantics.md); ``T`` within
    float32's rounding of the per-tensor norms. Else ``tail`` is float64.
    """
    norms, weights = _per_tensor_norms(groups, device, exact=not recheck)
    num_grads = len(norms)
    wide = wide_dtype(device)
    if norms or tail:
        # One dtype in the stack (a stack of mixed dtypes copies tensor by tensor: on CUDA a
        # kernel each), then float64.
        buffer = torch.stack([*norms, *tail])
        if buffer.dtype != wide:
            buffer = buffer.to(wide)
    else:
        buffer = buffer2[:0]
    per_tensor = buffer[:num_grads]
    if not coll.active:
        if not num_grads:
            return buffer, 0, buffer2[0] * 0.0
        total = torch.linalg.vector_norm(per_tensor)
        if recheck and not math.isfinite(total.item()):  # a read, free on the CPU
            per_tensor.copy_(torch.stack(_per_tensor_norms(groups, device, exact=True)[0]))
            total = torch.linalg.vector_norm(per_tensor)
        return buffer, num_grads, total
    _local_sum_(buffer2, per_tensor, weights)
    if recheck and num_grads and not math.isfinite(buffer2[1].item()):  # free on the CPU
        per_tensor.copy_(torch.stack(_per_tensor_norms(groups, device, exact=True)[0]))
        _local_sum_(buffer2, per_tensor, weights)
    coll.reduce_(buffer2, op=dist.ReduceOp.SUM)
    return buffer, num_grads, torch.sqrt(buffer2[1])


def _per_tensor_norms(
    groups: GradGroups, device: torch.device, *, exact: bool
) -> tuple[list[torch.Tensor], list[tuple[int, int, float]]]:
    """Each gradient's 2-norm, 0-dim on ``device`` (one ``_foreach_norm`` per group): float64
    (`wide_dtype()`) where ``exact``, else float32 at least (torch's ``clip_grad_norm_``'s); and
    per group ``(first norm, end, weight)``."""
    wide = wide_dtype(device)
    norms: list[torch.Tensor] = []
    weights: list[tuple[int, int, float]] = []
    for key, grads in groups.items():
        dtype = wide_dtype(key.device) if exact else _accumulation_dtype(key.dtype)
        part = list(torch._foreach_norm(grads, 2.0, dtype=dtype))
        if key.device != device:
            part = [n.to(device, wide, non_blocking=True) for n in part]
        weights.append((len(norms), len(norms) + len(part), key.weight))
        norms += part
    return norms, weights


def _local_sum_(
    buffer2: torch.Tensor, per_tensor: torch.Tensor, weights: list[tuple[int, int, float]]
) -> None:
    """This rank's weighted sum of squares of ``per_tensor`` into ``buffer2[1]`` (one ``addmv_``;
    0.0 without gradients)."""
    out = buffer2[1:2]
    if not weights or not per_tensor.numel():
        out.zero_()
        return
    stacked, weight = per_tensor, weights[0][2]
    if any(w != weight for _, _, w in weights):  # groups of different replication
        stacked = torch.cat([stacked[s:e] * math.sqrt(w) for s, e, w in weights])
        weight = 1.0
    out.addmv_(stacked.unsqueeze(0), stacked, beta=0, alpha=weight)


def _saturated_flags(per_tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The per-tensor flags of float64 statistics, as float32: `flag_tensors()`'s values, then a
    finite statistic past float32's range saturated at float32's largest value (a finite tensor is
    never flagged as an inf one; docs/pass-semantics.md). Into ``out`` (float32, ``per_tensor``'s
    shape): ``nan_to_num``, then ``fmin`` writing float32; else ``nan_to_num``, ``clamp_``, the
    cast."""
    flagged = torch.nan_to_num(per_tensor, nan=NAN_CODE, posinf=INF_CODE, neginf=INF_CODE)
    if out is None:
        return flagged.clamp_(max=_FLOAT32_MAX_VALUE).to(torch.float32)
    return torch.fmin(flagged, _FLOAT32_MAX, out=out)  # a CPU scalar: no copy to the device


def local_stat(
    groups: GradGroups, inv_scale: torch.Tensor, norm_type: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's contribution to a p-norm, read-only over the gradients (any p).

    Args:
        groups: local gradients grouped by (device, dtype, weight), still multiplied by the loss
            scale. ``weight`` multiplies the group's ``sum |g|**p`` (``1 / replicas``, see
            [`distscaler.layouts`][distscaler.layouts]); it is not needed for p = inf (a max ignores
            repeats).
        inv_scale: 0-dim float32 tensor ``1 / scale`` on the scale's device.
        norm_type: ``p`` of the norm (``math.inf`` allowed).

    Returns:
        float64 tensor of shape ``(2,)`` on ``inv_scale.device``: [1.0 if a per-tensor norm is
        non-finite else 0.0, weighted ``sum |g / scale|**p`` (max for p = inf)], and the per-tensor
        norms (float64 ``(num_grads,)``, still scaled; None without gradients). float64 throughout
        (``_foreach_norm`` accumulates in it; `wide_dtype()`, float32 on MPS): no statistic of
        finite float32 gradients overflows it for p = 1 and 2, at any scale.
    """
    device = inv_scale.device
    ord_ = float(norm_type)
    wide = wide_dtype(device)
    parts = []
    weights = []
    for key, grads in groups.items():
        if ord_ == math.inf:
            norms = torch.stack(_max_magnitudes(grads, wide_dtype(key.device)))
        else:
            norms = torch.stack(torch._foreach_norm(grads, ord_, dtype=wide_dtype(key.device)))
        parts.append(norms.to(device, wide, non_blocking=True))
        weights.append(key.weight)
    if not parts:
        # A rank with no gradients still joins the collective, with zeros.
        return torch.zeros(STAT_NUMEL, dtype=wide, device=device), None
    per_tensor = parts[0] if len(parts) == 1 else torch.cat(parts)  # (num_grads,)
    flag = per_tensor.isfinite().all().logical_not().to(wide)
    if ord_ == math.inf:
        stat = (per_tensor * inv_scale).max()
    else:
        sums = [(part * inv_scale).pow(ord_).sum() * w for part, w in zip(parts, weights)]
        stat = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return torch.stack([flag, stat]), per_tensor


def _norm(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    max_norm_t: torch.Tensor,
    coll: _Collective,
) -> StepResult:
    """The global norm of the unscaled gradients, ``found_inf`` and ``grad_scale``, agreed.

    One read of every gradient byte, at most one ``all_reduce`` of 2 float32; a fused optimizer's
    gradients are not rewritten (it divides them by ``grad_scale``), others are divided by
    ``grad_scale`` in place (one multi-tensor op). A fused step on the CPU reads the flag instead
    (no sync there) and flags the per-tensor norms only on a skip.
    """
    assert plan.max_norm is not None
    max_norm, norm_type = plan.max_norm, plan.norm_type
    scale = state.scale
    if norm_type == 2.0 and plan.skip_nonfinite and not plan.read_found_inf:
        return _norm_on_device(plan, grads, params, state, max_norm_t, coll)
    counters: NextCounters | None = None
    if norm_type == 2.0:
        recheck = plan.host_read_free
        buffer, num_grads, total = _two_norm(
            grads, state.device, coll, state.norm_buffer,
            [scale, max_norm_t] if recheck else (), recheck=recheck,
        )  # fmt: skip
        per_tensor = buffer[:num_grads] if num_grads else None
        # norm = T / scale and q = T / max_norm (grad_scale where it clips), divided in float64
        # and rounded once to float32: inf where either passes float32's range
        den = buffer[num_grads:] if recheck else torch.stack([scale, max_norm_t])
        # (T as a (1,) view: a 0-dim float64 beside a float32 vector would be cast to float32)
        decided = torch.div(total.unsqueeze(0), den)
        norm, q = decided.to(torch.float32).unbind()
        a, b, c = state.counter_terms()
        # q + norm / inf: q, or NaN where the norm is inf or NaN; and the update's counters
        checked, *next_values = torch._foreach_addcdiv([q, *a], [norm, *b], [state.inf, *c])
        counters = state.next_counters(next_values)
        if plan.read_found_inf:  # others read it anyway
            # inf/NaN where T is (inf / inf is NaN: measuring only), inf where the norm or
            # scale / clip_coef passes float32's range: never a clean step divided by inf
            skipped = not math.isfinite(checked.item())
            found = state.one if skipped else state.zero
            grad_scale = scale if skipped else torch.fmax(q, scale)
            if not plan.fused:
                _div_(grads, grad_scale)
            taking = plan.per_tensor_flags and skipped and per_tensor is not None
            return StepResult(
                found,
                grad_scale=grad_scale,
                total_norm=norm,
                per_tensor_flags=_saturated_flags(per_tensor) if taking else None,  # type: ignore[arg-type]
                params=params,
                flags_taken=True,
                clean_read=plan.per_tensor_flags,
                flags_after_read=plan.per_tensor_flags,
                next_counters=counters,
                skipped=skipped,
                max_norm=max_norm,
            )
        found = state.zero  # a static scale told to step through inf/NaN
    else:
        local, per_tensor = local_stat(grads, _inv_scale(scale), norm_type)
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        coll.reduce_(local, op=op)
        # The norm and scale / clip_coef in float64, rounded once to float32: inf/NaN where the
        # norm is, and inf where either passes float32's range: an overflow either way (never a
        # clean step divided by inf); on a skip the gradients are only unscaled.
        norm64 = _p_norm(local, norm_type)
        norm, q = torch.stack([norm64, norm64 / max_norm_t * scale]).to(torch.float32).unbind()
        nonfinite_now = torch.logical_or(
            local[0] > 0, torch.logical_and(norm.isfinite(), q.isfinite()).logical_not()
        )
        found = nonfinite_now.to(torch.float32) if plan.skip_nonfinite else state.zero
        q = torch.where(nonfinite_now, scale, q)
    grad_scale = torch.fmax(q, scale)  # scale / min(1, max_norm / norm)
    if not plan.fused:
        _div_(grads, grad_scale)
    taking = plan.per_tensor_flags and per_tensor is not None
    return StepResult(
        found,
        grad_scale=grad_scale,
        total_norm=norm,
        per_tensor_flags=_saturated_flags(per_tensor) if taking else None,  # type: ignore[arg-type]
        params=params,
        flags_taken=True,
        next_counters=counters,
        max_norm=max_norm,
    )


def _norm_on_device(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    max_norm_t: torch.Tensor,
    coll: _Collective,
) -> StepResult:
    """`_norm()` with the 2-norm where nothing is read on the host (a fused step on a GPU; any step
    that is not fused) and inf/NaN skip the step.

    `_two_norm()` gives the per-tensor norms and ``T``, the global norm of the scaled gradients, in
    float64. One ``stack`` makes the float32 slots, after room for the per-tensor flags:

    ``[flags | norm, q | -c, c | 0, scale, max_norm | 1, inf | next counters]``

    one ``div`` writes ``norm = T / scale`` and ``q = T / max_norm`` into them (divided in float64,
    rounded once to float32: inf where either passes float32's range), one
    ``_foreach_addcdiv_`` makes ``q + norm / inf`` (``q``, or NaN where the norm is inf or NaN) and
    the update's counters, one ``nan_to_num`` its code ``c`` (``q`` when every value is finite,
    else negative), one ``sub`` ``-c`` (+0.0, never -0.0), and one ``clamp`` of ``(-c, c)`` between
    ``(0, scale)`` and ``(1, inf)`` gives ``found_inf`` (exactly 0.0 or 1.0) and ``grad_scale =
    max(q, scale)`` (``scale`` on an overflow). The per-tensor flags: `_saturated_flags()` into
    their room (two ops).
    """
    assert plan.max_norm is not None
    zero, one, scale = state.zero, state.one, state.scale
    a, b, c = state.counter_terms()
    buffer, num_grads, total = _two_norm(
        grads, state.device, coll, state.norm_buffer, recheck=plan.host_read_free
    )
    taking = plan.per_tensor_flags and num_grads > 0
    k = num_grads if taking else 0  # room for the flags
    buf = torch.stack([*[zero] * k, zero, zero, zero, zero, zero, scale, max_norm_t, one,
                       state.inf, *a])  # fmt: skip
    slots = buf[k:]
    # float64 / float32: one kernel, computed in float64 (T as a (1,) view: a 0-dim one would be
    # cast to float32 first), written as float32
    torch.div(total.unsqueeze(0), slots[5:7], out=slots[0:2])
    torch._foreach_addcdiv_([slots[1], *slots[9:]], [slots[0], *b], [state.inf, *c])
    torch.nan_to_num(slots[1], nan=NAN_CODE, posinf=INF_CODE, neginf=INF_CODE, out=slots[3])
    torch.sub(zero, slots[3], out=slots[2])
    # The clamp over one element per gradient (its operands repeated by views: no op more), so that
    # its first row, found_inf in every element, weighs the overflow flags
    # (`StepResult.flag_weights`); T is agreed before it at any world size.
    width = max(num_grads, 1)
    clamped = torch.clamp(_repeated(buf, k + 2, width), min=_repeated(buf, k + 4, width),
                          max=_repeated(buf, k + 7, width))  # fmt: skip
    weights, scales = clamped.unbind()  # (width,) each: found_inf, grad_scale
    found, grad_scale = weights[0], scales[0]
    if not plan.fused:
        _div_(grads, grad_scale)
    flags = _saturated_flags(buffer[:num_grads], out=buf[:k]) if taking else None
    return StepResult(
        found,
        grad_scale=grad_scale,
        total_norm=slots[0],
        per_tensor_flags=flags,
        params=params,
        flags_taken=True,
        flag_weights=weights if taking else None,
        next_counters=state.next_counters(list(slots[9:].unbind())),
        max_norm=plan.max_norm,
    )


def _repeated(buffer: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """``buffer[start]`` and ``buffer[start + 1]``, each repeated ``width`` times: a ``(2, width)``
    view of them (one ``as_strided``; a slice, a ``view`` and an ``expand`` would be three views,
    each some host time). ``buffer``: 1-d, contiguous, at the start of its storage (a fresh
    ``stack``'s: its storage offset is not read, which dynamo cannot trace)."""
    return buffer.as_strided((2, width), (1, 0), start)


def _norm_unscaled(
    plan: StepPlan,
    grads: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState | None,
    coll: _Collective,
    found_inf: torch.Tensor | None,
) -> StepResult:
    """Clip gradients that carry no loss scale (after ``unscale_``).

    The norm is always agreed: one collective of the weighted statistic over the group, also when
    every local gradient is replicated (a rank whose copy differs, silent data corruption after the
    reduce, must not get a norm of its own, nor skip or back off alone), and a non-finite norm
    skips the step too: ``found_inf`` is the earlier flag or'ed with it. (A disabled scaler runs no
    pass: its ``clip_grad_norm_`` is torch's.)
    """
    assert plan.max_norm is not None and state is not None
    max_norm, norm_type = plan.max_norm, plan.norm_type
    one = torch.ones((), dtype=torch.float32, device=state.device)
    local, per_tensor = local_stat(grads, one, norm_type)
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    coll.reduce_(local, op=op)
    norm = _p_norm(local, norm_type).to(torch.float32)  # inf where it passes float32's range
    if max_norm < math.inf:  # inf measures only: the coefficient would be 1
        _div_(grads, torch.fmax(norm / max_norm, one))
    found = None
    if found_inf is not None:
        nonfinite = torch.nan_to_num(norm * 0.0, nan=1.0)  # a non-finite norm skips too
        found = torch.fmax(found_inf, nonfinite)
        if not plan.skip_nonfinite:
            assert state is not None
            found = state.zero
    taking = plan.per_tensor_flags and per_tensor is not None
    return StepResult(
        found,
        total_norm=norm,
        per_tensor_flags=_saturated_flags(per_tensor) if taking else None,  # type: ignore[arg-type]
        params=params,
        flags_taken=True,
        max_norm=max_norm,
    )
