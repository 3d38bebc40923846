"""The per-rank overflow check and the one collective that turns it into a verdict every rank shares.

Per step each rank builds ``local = [non_finite_flag, sum_j w * |g_j / scale| ** p]`` (float32, shape
``(2,)``) with torch's multi-tensor kernels: one ``_foreach_norm`` launch per (device, dtype) group of
gradients, no per-tensor Python loop over values, no host read. One ``all_reduce`` over the verdict
group then gives every rank the same ``found_inf`` and, when clipping, the same global norm.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .layouts import GradGroups

__all__ = ["VERDICT_NUMEL", "Verdict", "all_reduce_verdict", "check_and_unscale_", "local_verdict"]

#: Elements in a verdict tensor: [non-finite flag, weighted sum of |g|**p (or max |g| for p = inf)].
VERDICT_NUMEL = 2


def _new_verdict(device: torch.device) -> torch.Tensor:
    return torch.zeros(VERDICT_NUMEL, dtype=torch.float32, device=device)


def local_verdict(
    groups: GradGroups,
    *,
    inv_scale: torch.Tensor,
    norm_type: float | None,
    weight: float,
) -> torch.Tensor:
    """This rank's contribution, read-only over the gradients (each gradient byte is read once).

    Args:
        groups: gradients grouped by (device, dtype), still multiplied by the loss scale.
        inv_scale: 0-dim float32 tensor ``1 / scale`` on the verdict device.
        norm_type: ``p`` of the norm to fold in (``math.inf`` allowed), or None for the overflow flag
            only (then the max-abs pass is used, which can never overflow in fp32).
        weight: multiplier of this rank's ``sum |g|**p`` (``1 / replicas``); ignored for p = inf.

    Returns:
        float32 tensor of shape ``(2,)`` on ``inv_scale.device``. Element 0 is 1.0 if any gradient
        element is inf or NaN (or a per-tensor norm overflowed fp32) else 0.0.
    """
    device = inv_scale.device
    ord_ = math.inf if norm_type is None else float(norm_type)
    parts = []
    for (_, dtype), grads in groups.items():
        # Accumulate in fp32 at least (fp64 stays fp64), so a large finite fp16 value never overflows.
        acc_dtype = torch.promote_types(dtype, torch.float32)
        norms = torch._foreach_norm(grads, ord_, dtype=acc_dtype)
        parts.append(torch.stack(norms).to(device, torch.float32, non_blocking=True))
    if not parts:
        # A rank with no gradients still joins the collective, with zeros.
        return _new_verdict(device)
    per_tensor = parts[0] if len(parts) == 1 else torch.cat(parts)  # (num_grads,)
    flag = per_tensor.isfinite().all().logical_not().to(torch.float32)
    if norm_type is None:
        stat = torch.zeros((), dtype=torch.float32, device=device)
    else:
        unscaled = per_tensor * inv_scale  # (num_grads,) norms of the unscaled gradients
        if ord_ == math.inf:
            stat = unscaled.max()
        else:
            stat = unscaled.pow(ord_).sum() * weight
    return torch.stack([flag, stat])


def check_and_unscale_(groups: GradGroups, *, inv_scale: torch.Tensor) -> torch.Tensor:
    """Unscale gradients in place and flag non-finite values in the same pass (read + write).

    Uses ``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
    uses, so unscaled values are bit-identical to torch's. Returns a local verdict tensor (shape
    ``(2,)``, float32, on ``inv_scale.device``) whose element 1 is 0.
    """
    device = inv_scale.device
    verdict = _new_verdict(device)
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for (grad_device, _), grads in groups.items():
        if grad_device not in per_device:
            if grad_device == device:
                found = verdict[0]  # the kernel writes straight into the verdict buffer
            else:
                found = torch.zeros((), dtype=torch.float32, device=grad_device)
            per_device[grad_device] = (found, inv_scale.to(grad_device, non_blocking=True))
        found, dev_inv_scale = per_device[grad_device]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, dev_inv_scale)
    for grad_device, (found, _) in per_device.items():
        if grad_device != device:
            verdict[0] += found.to(device, non_blocking=True)
    return verdict


def all_reduce_verdict(
    verdict: torch.Tensor, group: dist.ProcessGroup | None, *, norm_type: float | None
) -> None:
    """Combine the local verdicts in place: SUM (or MAX for an inf-norm) over ``group``.

    One ``all_reduce`` of ``VERDICT_NUMEL`` float32 elements; every rank of ``group`` must call it.
    A flag summed or maxed over ranks is > 0 on every rank as soon as one rank saw a non-finite value.
    """
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(verdict, op=op, group=group)


class Verdict:
    """The agreed outcome of one verdict collective, all on the verdict device, all read lazily.

    Attributes:
        found_inf: 0-dim float32, 1.0 if any rank saw a non-finite gradient (or the global norm is
            non-finite) else 0.0. Identical on every rank.
        total_norm: 0-dim float32, global norm of the unscaled gradients (None when not asked for).
    """

    __slots__ = ("found_inf", "total_norm")

    def __init__(self, reduced: torch.Tensor, norm_type: float | None) -> None:
        if norm_type is None:
            self.total_norm = None
            self.found_inf = (reduced[0] > 0).to(torch.float32)
        else:
            if norm_type == math.inf:
                total = reduced[1]
            else:
                total = reduced[1].pow(1.0 / norm_type)
            self.total_norm = total
            self.found_inf = torch.logical_or(reduced[0] > 0, total.isfinite().logical_not()).to(
                torch.float32
            )
