"""The clip verdict: the agreed global norm of the unscaled gradients, the overflow flag and the
``grad_scale`` a fused optimizer divides by, from one read of this rank's gradients.

:func:`clip_verdict` takes the gradients :class:`~distscaler.verdict.VerdictGroup` gathered and
its group; with the 2-norm it sums squares across ranks (one ``all_reduce``) and ends in a few
device ops, which differ by where the flag may be read (:mod:`~distscaler.host_read`): on the
CPU a fused step reads it and codes the gradients only on a skip (:func:`_on_host`); elsewhere
nothing is read and the flag, ``grad_scale`` and the codes come from one ``nan_to_num`` and one
``clamp`` over the stacked norms (:func:`_on_device`). Other p-norms take the p-norm verdict of
:mod:`distscaler.grad_kernels`. :func:`clip_unscaled` clips gradients that carry no loss scale.

The 2-norm takes no 1e-6 guard: torch's ``clip_grad_norm_`` computes ``max_norm / (norm + 1e-6)``
to avoid dividing by zero; here the coefficient ``min(1, max_norm / norm)`` is applied as
``grad_scale = max(scale, scaled_norm / max_norm)``, which never divides by the norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import host_read
from .attribution import TensorCodes, tensor_codes
from .grad_kernels import (
    _div_groups_,
    _inv_scale,
    _local_verdict,
    _p_norm,
    _scaled_two_norm,
    _stacked_two_norm,
    all_reduce_verdict,
)
from .layouts import GradGroups
from .state import DeviceState, Epilogue

__all__ = ["ClipVerdict", "clip_unscaled", "clip_verdict"]


@dataclass(frozen=True, slots=True)
class ClipVerdict:
    """What :meth:`~distscaler.verdict.VerdictGroup.clip` agreed on, all 0-dim float32 on the scale's device.

    Attributes:
        norm: global norm of the unscaled gradients, identical on every rank (returned to the user).
        found_inf: exactly 1.0 if any rank saw inf/NaN (the norm is then non-finite), else 0.0.
        grad_scale: what a fused optimizer divides the gradients by: ``scale / clip_coef``.
        ends: the skip record's next counts, made in the epilogue (see ``DeviceState.record_``).
        codes: this rank's tensor codes (:mod:`distscaler.attribution`), None without gradients.
    """

    norm: torch.Tensor
    found_inf: torch.Tensor
    grad_scale: torch.Tensor
    ends: Epilogue | None
    codes: TensorCodes | None
    #: The flag was read on the host and the gradients coded only on a skip.
    after_read: bool = False


def clip_verdict(
    groups: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    max_norm: float,
    norm_type: float,
    *,
    world_size: int,
    group: dist.ProcessGroup | None,
    fused: bool,
    skip_nonfinite: bool,
    codes: bool,
) -> ClipVerdict:
    """Global norm of the unscaled gradients, overflow flag and ``grad_scale``, agreed.

    One read of every gradient byte, at most one ``all_reduce`` of 2 float32, and (fused) the
    gradients are not rewritten: the optimizer divides them by ``grad_scale``. Non-fused
    optimizers get their gradients divided by ``grad_scale`` in place (one multi-tensor op).
    With ``codes``, one ``nan_to_num`` codes the per-tensor norms for the overflow report. A
    fused step on the CPU reads the flag instead (no sync there, :mod:`~distscaler.host_read`)
    and codes the norms only on a skip.
    """
    device = state.device
    scale = state.scale
    on_host = fused and skip_nonfinite and host_read.host_read_is_free(device)
    if norm_type == 2.0 and skip_nonfinite and not on_host:  # the flag stays on the device
        return _on_device(
            groups, params, state, max_norm, world_size, group, fused=fused, codes=codes
        )
    if norm_type == 2.0:
        total, per_tensor = _scaled_two_norm(groups, device, world_size, group, state.verdict)
        a, b, c = state.epilogue()
        zero = state.zero
        # norm = T / scale, Q = T / max_norm, F = T / inf (0, or NaN when T is inf/NaN), and
        # the update's lanes (the record's next counts...), in one multi-tensor op.
        norm, q, flag, *lanes = torch._foreach_addcdiv(
            [zero, zero, zero, *a],
            [total, total, total, *b],
            [scale, state.max_norm(max_norm), state.inf, *c],
        )
        ends: Epilogue | None = state.name_ends(lanes)
        if on_host:  # others read it anyway
            return _on_host(groups, params, per_tensor, state, (norm, q, flag), ends, fused, codes)
        found = state.zero  # a static scale told to step through inf/NaN
    else:
        local, per_tensor = _local_verdict(groups, _inv_scale(scale), norm_type)
        if world_size > 1:
            all_reduce_verdict(local, group, norm_type=norm_type)
        norm = _p_norm(local, norm_type)
        nonfinite = torch.logical_or(local[0] > 0, norm.isfinite().logical_not())
        found = nonfinite.to(torch.float32) if skip_nonfinite else state.zero
        q = norm * scale / max_norm
        ends = None
    grad_scale = torch.fmax(q, scale)  # scale / min(1, max_norm / norm)
    if not fused:
        _div_groups_(groups, grad_scale)
    return ClipVerdict(norm, found, grad_scale, ends, _coded(params, per_tensor, codes))


def _on_device(
    groups: GradGroups,
    params: tuple[torch.Tensor, ...],
    state: DeviceState,
    max_norm: float,
    world_size: int,
    group: dist.ProcessGroup | None,
    *,
    fused: bool,
    codes: bool,
) -> ClipVerdict:
    """:meth:`clip` with the 2-norm where the verdict does not read the flag on the host (a
    fused step on a GPU; any step that is not fused), and inf/NaN skip the step: everything
    after the global norm in three device ops.

    The per-tensor norms are stacked into one buffer with the global norm's slot and the lanes
    the epilogue writes in place (:func:`~distscaler.grad_kernels._stacked_two_norm`):

    ``[per-tensor norms (num_grads) | T | -c, q | 0, scale | 1, inf | norm | epilogue]``

    where ``T`` is the global norm of the scaled gradients. Then one ``nan_to_num`` codes the
    per-tensor norms and ``T`` together (``c``: ``T`` when finite, else negative), one
    ``_foreach_addcdiv_`` writes ``-c``, ``q = c / max_norm``, ``norm = T / scale`` and the
    update's lanes into their slots, and one ``clamp`` of ``(-c, q)`` between ``(0, scale)``
    and ``(1, inf)`` gives the flag (exactly 0.0 when ``T`` is finite, 1.0 when it is not) and
    ``grad_scale = max(q, scale)``: the values ``fmax(T / max_norm, scale)`` gives, bit for bit
    (both ``scale`` on an overflow).
    """
    zero, one, scale = state.zero, state.one, state.scale
    a, b, c = state.epilogue()
    tail = [zero, zero, zero, scale, one, state.inf, zero, *a]
    total, per_tensor, buffer = _stacked_two_norm(
        groups, state.device, world_size, group, state.verdict, tail
    )
    assert buffer is not None
    num_grads = 0 if per_tensor is None else per_tensor.numel()
    coded = tensor_codes(buffer[: num_grads + 1])  # the codes, then T's
    lanes = buffer[num_grads + 1 :]  # the tail's slots: (-c, q | 0, scale | 1, inf | norm | a)
    coded_total = coded[num_grads]
    # -c = 0 - c / 1 (+0.0, never -0.0, when T is 0), q, norm and the update's lanes, in place.
    torch._foreach_addcdiv_(
        [lanes[0], lanes[1], *lanes[6:]],
        [coded_total, coded_total, total, *b],
        [state.minus_one, state.max_norm(max_norm), scale, *c],
    )
    found, grad_scale = torch.clamp(lanes[0:2], min=lanes[2:4], max=lanes[4:6]).unbind()
    if not fused:
        _div_groups_(groups, grad_scale)
    ends = state.name_ends(list(lanes[7:].unbind()))
    taken = None
    if codes and per_tensor is not None:
        taken = TensorCodes(params, coded[:num_grads])
    return ClipVerdict(lanes[6], found, grad_scale, ends, taken)


def clip_unscaled(
    groups: GradGroups,
    params: tuple[torch.Tensor, ...],
    max_norm: float,
    norm_type: float,
    device: torch.device | None,
    *,
    world_size: int,
    group: dist.ProcessGroup | None,
    codes: bool,
) -> tuple[torch.Tensor, TensorCodes | None]:
    """Clip gradients that carry no loss scale (after ``unscale_``, or with a disabled scaler).

    Adds a collective unless every local gradient is replicated over the whole group (then the
    local norm is already the global one). Returns the global norm (0-dim float32) and, with
    ``codes``, this rank's tensor codes (None without gradients).
    """
    replicated = bool(groups) and all(key.weight == 1.0 / world_size for key in groups)
    if device is None:
        device = next(iter(groups)).device if groups else torch.device("cpu")
    one = torch.ones((), dtype=torch.float32, device=device)
    local, per_tensor = _local_verdict(
        {key._replace(weight=1.0): grads for key, grads in groups.items()}
        if replicated
        else groups,
        one,
        norm_type,
    )
    if world_size > 1 and not replicated:
        all_reduce_verdict(local, group, norm_type=norm_type)
    norm = _p_norm(local, norm_type)
    if max_norm < math.inf:  # inf measures only: the coefficient would be 1
        _div_groups_(groups, torch.fmax(norm / max_norm, one))
    return norm, _coded(params, per_tensor, codes)


def _on_host(
    groups: GradGroups,
    params: tuple[torch.Tensor, ...],
    per_tensor: torch.Tensor | None,
    state: DeviceState,
    epilogue: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ends: Epilogue | None,
    fused: bool,
    codes: bool,
) -> ClipVerdict:
    """The end of :func:`clip_verdict` where a host read is free (:mod:`~distscaler.host_read`):
    ``flag`` (0.0, or NaN for a non-finite norm) is read, the agreed flag is the constant 1.0 or
    0.0, and the per-tensor norms are coded only on a skip; a clean step takes ``fmax`` for
    ``grad_scale``, a skipped one nothing (its ``grad_scale`` is the scale)."""
    norm, q, flag = epilogue
    skipped = not math.isfinite(flag.item())
    found = state.one if skipped else state.zero
    grad_scale = state.scale if skipped else torch.fmax(q, state.scale)
    if not fused:
        _div_groups_(groups, grad_scale)
    coded = _coded(params, per_tensor, codes and skipped)
    if codes and coded is None:
        coded = TensorCodes(params, None)  # clean: nothing to record
    return ClipVerdict(norm, found, grad_scale, ends, coded, after_read=codes)


def _coded(
    params: tuple[torch.Tensor, ...], per_tensor: torch.Tensor | None, wanted: bool
) -> TensorCodes | None:
    # The codes of a verdict's per-tensor norms, when an overflow report will read them.
    if not wanted or per_tensor is None:
        return None
    return TensorCodes(params, tensor_codes(per_tensor))
