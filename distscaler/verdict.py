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

__all__ = [
    "VERDICT_NUMEL",
    "Verdict",
    "all_reduce_verdict",
    "check_and_unscale_",
    "local_overflow_flag",
    "local_verdict",
]

#: Elements in a verdict tensor: [non-finite flag, weighted sum of |g|**p (or max |g| for p = inf)].
VERDICT_NUMEL = 2


def _new_verdict(device: torch.device) -> torch.Tensor:
    return torch.zeros(VERDICT_NUMEL, dtype=torch.float32, device=device)


def local_verdict(
    groups: GradGroups,
    *,
    inv_scale: torch.Tensor,
    norm_type: float,
) -> torch.Tensor:
    """This rank's contribution with a norm, read-only over the gradients (one read per byte).

    Args:
        groups: local gradients grouped by (device, dtype, weight), still multiplied by the loss
            scale. ``weight`` multiplies the group's ``sum |g|**p`` (``1 / replicas``, see
            :mod:`distscaler.layouts`); it is not needed for p = inf (a max ignores repeats).
        inv_scale: 0-dim float32 tensor ``1 / scale`` on the verdict device.
        norm_type: ``p`` of the norm to fold in (``math.inf`` allowed).

    Returns:
        float32 tensor of shape ``(2,)`` on ``inv_scale.device``: [1.0 if a per-tensor norm is
        non-finite else 0.0, weighted ``sum |g / scale|**p`` (max for p = inf)]. A norm is
        non-finite when an element is inf/NaN, or (fp32/bf16 gradients only) when the scaled
        values' sum of ``|g|**p`` exceeds the fp32 range: torch's clip_grad_norm_ would return a
        non-finite norm there too, on values ``scale`` times smaller.
    """
    device = inv_scale.device
    ord_ = float(norm_type)
    parts = []
    weights = []
    for key, grads in groups.items():
        norms = _per_tensor_norms(grads, key.device, key.dtype, ord_)
        parts.append(norms.to(device, torch.float32, non_blocking=True))
        weights.append(key.weight)
    if not parts:
        # A rank with no gradients still joins the collective, with zeros.
        return _new_verdict(device)
    per_tensor = parts[0] if len(parts) == 1 else torch.cat(parts)  # (num_grads,)
    flag = per_tensor.isfinite().all().logical_not().to(torch.float32)
    unscaled = per_tensor * inv_scale  # (num_grads,) norms of the unscaled gradients
    if ord_ == math.inf:
        stat = unscaled.max()
    elif all(w == weights[0] for w in weights):
        stat = unscaled.pow(ord_).sum() * weights[0]
    else:  # groups of different replication: weight each group's sum
        sums = [(part * inv_scale).pow(ord_).sum() * w for part, w in zip(parts, weights)]
        stat = torch.stack(sums).sum()
    return torch.stack([flag, stat])


#: Dtypes whose 2-norm has a BLAS dot product on CPU (``sdot``/``ddot``).
_BLAS_DOT_DTYPES = (torch.float32, torch.float64)
#: Elements from which a CPU gradient's 2-norm comes from a dot product. Below it the few
#: microseconds of a Python call and a view per tensor cost more than the bandwidth saved, and
#: ``_foreach_norm`` takes all the small ones in one call.
_DOT_MIN_NUMEL = 1 << 15


def _per_tensor_norms(
    grads: list[torch.Tensor], device: torch.device, dtype: torch.dtype, ord_: float
) -> torch.Tensor:
    """The ``ord_``-norm of each tensor of one (device, dtype) group, in no particular order.

    Shape ``(len(grads),)``, dtype fp32 at least (fp64 stays fp64): fp16 values never overflow it.
    One read of each gradient byte. On CPU the 2-norm of large contiguous fp32/fp64 tensors comes
    from BLAS dot products (``x . x``, then a square root of the per-tensor results): torch's CPU
    ``_foreach_norm`` loops over ``linalg_vector_norm``, which runs at about half the memory
    bandwidth the dot product reaches (``launch/bench.py`` measures both). Both give inf/NaN for a
    tensor holding inf/NaN, and inf when the sum of squares leaves the accumulation dtype's range,
    so the verdict is the same.
    """
    acc_dtype = torch.promote_types(dtype, torch.float32)
    if not (device.type == "cpu" and ord_ == 2.0 and dtype in _BLAS_DOT_DTYPES):
        return torch.stack(torch._foreach_norm(grads, ord_, dtype=acc_dtype))
    large: list[torch.Tensor] = []
    small: list[torch.Tensor] = []
    for g in grads:
        (large if g.numel() >= _DOT_MIN_NUMEL and g.is_contiguous() else small).append(g)
    parts = []
    if large:
        flat = [g if g.dim() == 1 else g.view(-1) for g in large]
        parts.append(torch.stack([torch.dot(g, g) for g in flat]).sqrt())
    if small:
        parts.append(torch.stack(torch._foreach_norm(small, ord_, dtype=acc_dtype)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def local_overflow_flag(
    groups: GradGroups, *, device: torch.device, read_only: bool | None = None
) -> torch.Tensor:
    """This rank's overflow flag alone, leaving every gradient value as it is.

    Exact (an element is inf or NaN), never fooled by large finite values. On CUDA and other
    accelerators: a read-only max-abs pass (``_foreach_norm(ord=inf)``). On CPU, where that kernel
    is several times slower than the rest, torch's own check ``_amp_foreach_non_finite_check_and_
    unscale_`` with a factor of exactly 1.0 (what ``torch.amp.GradScaler`` runs for fused
    optimizers; the values written back are unchanged).

    Args:
        read_only: force the max-abs pass (True) or the check kernel (False) on every device;
            None picks per device as above.

    Returns:
        float32 tensor of shape ``(2,)`` on ``device``: [flag, 0.0].
    """

    def use_max_abs(grad_device: torch.device) -> bool:
        return grad_device.type != "cpu" if read_only is None else read_only

    checked = {key: grads for key, grads in groups.items() if not use_max_abs(key[0])}
    if checked:
        one = torch.ones((), dtype=torch.float32, device=device)
        verdict = check_and_unscale_(checked, inv_scale=one)
    else:
        verdict = _new_verdict(device)
    max_abs = [
        torch.stack(torch._foreach_norm(grads, math.inf)).to(device, torch.float32)
        for key, grads in groups.items()
        if use_max_abs(key[0])
    ]
    if max_abs:
        per_tensor = max_abs[0] if len(max_abs) == 1 else torch.cat(max_abs)
        verdict[0] += per_tensor.isfinite().all().logical_not().to(torch.float32)
    return verdict


def check_and_unscale_(groups: GradGroups, *, inv_scale: torch.Tensor) -> torch.Tensor:
    """Unscale gradients in place and flag non-finite values in the same pass (read + write).

    Uses ``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
    uses, so unscaled values are bit-identical to torch's. Returns a local verdict tensor (shape
    ``(2,)``, float32, on ``inv_scale.device``) whose element 1 is 0.
    """
    device = inv_scale.device
    verdict = _new_verdict(device)
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, grads in groups.items():
        grad_device = key.device
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
