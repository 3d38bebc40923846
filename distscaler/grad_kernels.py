"""The per-rank multi-tensor kernels a verdict is made of, over one rank's local gradients.

Each function takes gradients grouped by (device, dtype, replication weight)
(:data:`distscaler.layouts.GradGroups`) and launches torch's multi-tensor kernels once per group:
the read-only norms (``_foreach_norm``, accumulated in float32 at least so that a large finite fp16
gradient never looks like an overflow), torch's check-and-unscale kernel (the one
``torch.amp.GradScaler`` uses), the in-place division, and the p-norm verdict and its one
``all_reduce``. :mod:`distscaler.verdict` combines them into the verdicts every rank agrees on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._torch_compat import amp_check_and_unscale_
from .attribution import tensor_codes
from .layouts import GradGroups

__all__ = [
    "VERDICT_NUMEL",
    "all_reduce_verdict",
    "check_and_unscale_",
    "local_verdict",
]

#: Elements in a verdict tensor: [non-finite flag, weighted sum of |g|**p (or max |g| for p = inf)].
VERDICT_NUMEL = 2


def _codes(groups: GradGroups, device: torch.device) -> torch.Tensor | None:
    """Tensor codes of the gradients as they are (float32 ``(num_grads,)`` on ``device``): the
    largest magnitude of each (``_foreach_norm`` with p = inf, one launch per group: inf or NaN
    exactly when the gradient holds one, never for finite values), coded. None without any."""
    parts: list[torch.Tensor] = []
    wide: list[tuple[int, torch.Tensor]] = []  # float64 groups: coded before the cast to float32
    for key, grads in groups.items():
        part = list(torch._foreach_norm(grads, math.inf, dtype=_accumulation_dtype(key.dtype)))
        if key.dtype == torch.float64:
            # A finite float64 magnitude past float32's range must not turn into an inf code.
            coded = tensor_codes(torch.stack(part)).clamp_(max=torch.finfo(torch.float32).max)
            wide.append((len(parts), coded.to(device, torch.float32, non_blocking=True)))
            part = [torch.zeros((), dtype=torch.float32, device=device)] * len(part)
        elif key.device != device:
            part = [n.to(device, torch.float32, non_blocking=True) for n in part]
        parts += part
    if not parts:
        return None
    codes = tensor_codes(torch.stack(parts))
    for start, coded in wide:
        codes[start : start + coded.numel()] = coded
    return codes


def _inv_scale(scale: torch.Tensor) -> torch.Tensor:
    # As torch: the reciprocal in float64, so unscaled values match torch's bit for bit.
    return scale.double().reciprocal().float()


def _p_norm(verdict: torch.Tensor, norm_type: float) -> torch.Tensor:
    # The norm from an agreed verdict's statistic: sum |g|**p, or max |g| for p = inf.
    return verdict[1] if norm_type == math.inf else verdict[1].pow(1.0 / norm_type)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 at least: a large finite fp16 gradient's square never overflows it. (Not
    # torch.promote_types, which is a dispatched op.)
    return torch.float64 if dtype == torch.float64 else torch.float32


def _div_groups_(groups: GradGroups, divisor: torch.Tensor) -> None:
    """Divide every gradient in place by a 0-dim tensor (one launch per (device, dtype) group)."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for key, grads in groups.items():
        if key.device not in per_device:
            per_device[key.device] = divisor.to(key.device, non_blocking=True)
        torch._foreach_div_(grads, per_device[key.device])


def _scaled_two_norm(
    groups: GradGroups,
    device: torch.device,
    world_size: int,
    group: dist.ProcessGroup | None,
    verdict: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global 2-norm of the (still scaled) gradients: 0-dim float32 on ``device``, and the
    per-tensor norms (float32 ``(num_grads,)``, None without gradients).

    One ``_foreach_norm`` per (device, dtype) group (float32 accumulation at least: a large finite
    fp16 gradient never looks like an overflow) and one ``stack``; then at world size 1 one
    ``linalg_vector_norm``, and otherwise the weighted sum of squares written into ``verdict[1]``
    (one ``addmv_``), one ``all_reduce`` of ``verdict``, and one ``sqrt``. A rank without gradients
    joins with zeros.
    """
    total, per_tensor, _ = _stacked_two_norm(groups, device, world_size, group, verdict, ())
    return total, per_tensor


def _stacked_two_norm(
    groups: GradGroups,
    device: torch.device,
    world_size: int,
    group: dist.ProcessGroup | None,
    verdict: torch.Tensor,
    tail: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`_scaled_two_norm`, with the same ops, and with ``tail`` (0-dim float32 tensors on
    ``device``) the buffer the per-tensor norms were stacked into (else None).

    The one ``stack`` also copies a slot for the global norm and ``tail`` after the per-tensor
    norms, and the norm is written into its slot (the ``out=`` of ``linalg_vector_norm`` or
    ``sqrt``): the buffer is float32 ``(num_grads + 1 + len(tail),)``, ``[per-tensor norms |
    global norm | tail]``, so that later ops treat the norms and the global norm, or lanes of the
    tail, as one tensor.
    """
    norms: list[torch.Tensor] = []  # per-tensor 2-norms
    weights: list[tuple[int, int, float]] = []  # (first norm, end, weight) per group
    for key, grads in groups.items():
        acc = _accumulation_dtype(key.dtype)
        part = list(torch._foreach_norm(grads, 2.0, dtype=acc))
        if key.device != device or acc != torch.float32:
            part = [n.to(device, torch.float32, non_blocking=True) for n in part]
        weights.append((len(norms), len(norms) + len(part), key.weight))
        norms += part
    num_grads = len(norms)
    buffer = None
    total = None
    if tail:
        buffer = torch.stack([*norms, tail[0], *tail])  # the norm's slot: a copy of tail[0]
        per_tensor = buffer[:num_grads] if norms else None
        total = buffer[num_grads]
    else:
        per_tensor = torch.stack(norms) if norms else None  # (num_grads,)
    if world_size == 1:
        if per_tensor is None:
            zero = torch.zeros((), dtype=torch.float32, device=device)
            return (zero if total is None else total.zero_()), None, buffer
        if total is None:
            return torch.linalg.vector_norm(per_tensor), per_tensor, None
        torch.linalg.vector_norm(per_tensor, out=total)
        return total, per_tensor, buffer
    out = verdict[1:2]
    if per_tensor is not None:
        stacked, weight = per_tensor, weights[0][2]
        if any(w != weight for _, _, w in weights):  # groups of different replication
            stacked = torch.cat([stacked[s:e] * math.sqrt(w) for s, e, w in weights])
            weight = 1.0
        out.addmv_(stacked.unsqueeze(0), stacked, beta=0, alpha=weight)
    else:
        out.zero_()
    dist.all_reduce(verdict, op=dist.ReduceOp.SUM, group=group)
    if total is None:
        return verdict[1].sqrt(), per_tensor, None
    torch.sqrt(verdict[1], out=total)
    return total, per_tensor, buffer


def local_verdict(groups: GradGroups, *, inv_scale: torch.Tensor, norm_type: float) -> torch.Tensor:
    """This rank's contribution to a p-norm verdict (see :func:`_local_verdict`)."""
    return _local_verdict(groups, inv_scale, norm_type)[0]


def _local_verdict(
    groups: GradGroups, inv_scale: torch.Tensor, norm_type: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's contribution to a p-norm verdict, read-only over the gradients (any p).

    Args:
        groups: local gradients grouped by (device, dtype, weight), still multiplied by the loss
            scale. ``weight`` multiplies the group's ``sum |g|**p`` (``1 / replicas``, see
            :mod:`distscaler.layouts`); it is not needed for p = inf (a max ignores repeats).
        inv_scale: 0-dim float32 tensor ``1 / scale`` on the verdict device.
        norm_type: ``p`` of the norm (``math.inf`` allowed).

    Returns:
        float32 tensor of shape ``(2,)`` on ``inv_scale.device``: [1.0 if a per-tensor norm is
        non-finite else 0.0, weighted ``sum |g / scale|**p`` (max for p = inf)], and the per-tensor
        norms (float32 ``(num_grads,)``, still scaled; None without gradients).
    """
    device = inv_scale.device
    ord_ = float(norm_type)
    parts = []
    weights = []
    for key, grads in groups.items():
        acc = _accumulation_dtype(key.dtype)
        norms = torch.stack(torch._foreach_norm(grads, ord_, dtype=acc))
        parts.append(norms.to(device, torch.float32, non_blocking=True))
        weights.append(key.weight)
    if not parts:
        # A rank with no gradients still joins the collective, with zeros.
        return torch.zeros(VERDICT_NUMEL, dtype=torch.float32, device=device), None
    per_tensor = parts[0] if len(parts) == 1 else torch.cat(parts)  # (num_grads,)
    flag = per_tensor.isfinite().all().logical_not().to(torch.float32)
    if ord_ == math.inf:
        stat = (per_tensor * inv_scale).max()
    else:
        sums = [(part * inv_scale).pow(ord_).sum() * w for part, w in zip(parts, weights)]
        stat = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return torch.stack([flag, stat]), per_tensor


def all_reduce_verdict(
    verdict: torch.Tensor, group: dist.ProcessGroup | None, *, norm_type: float | None
) -> None:
    """Combine local p-norm verdicts in place: SUM (or MAX for an inf-norm) over ``group``.

    One ``all_reduce`` of ``VERDICT_NUMEL`` float32 elements; every rank of ``group`` must call it.
    A flag summed or maxed over ranks is > 0 on every rank as soon as one rank saw a non-finite value.
    """
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(verdict, op=op, group=group)


def check_and_unscale_(groups: GradGroups, *, inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply gradients in place by ``inv_scale`` and flag non-finite values in the same pass.

    Uses ``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
    uses, so unscaled values are bit-identical to torch's; with ``inv_scale`` exactly 1.0 the values
    are unchanged. Returns a fresh verdict tensor (shape ``(2,)``, float32, on ``inv_scale.device``):
    [exactly 1.0 if an element is inf/NaN else 0.0, 0.0].
    """
    device = inv_scale.device
    verdict = torch.zeros(VERDICT_NUMEL, dtype=torch.float32, device=device)
    others: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, grads in groups.items():
        if key.device == device:
            found, factor = verdict[0], inv_scale  # the kernel writes into the verdict buffer
        else:
            if key.device not in others:
                others[key.device] = (
                    torch.zeros((), dtype=torch.float32, device=key.device),
                    inv_scale.to(key.device, non_blocking=True),
                )
            found, factor = others[key.device]
        amp_check_and_unscale_(grads, found, factor)
    for found, _ in others.values():
        verdict[0:1].copy_(torch.maximum(verdict[0], found.to(device, non_blocking=True)))
    return verdict
