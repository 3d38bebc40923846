"""How gradients are laid out across the ranks of the verdict group, and how they are gathered.

The verdict sums per-rank contributions over the process group. A gradient held identically by ``r``
ranks (DDP replicates every gradient over the data-parallel group) must contribute ``1 / r`` of its
squared norm on each of them so that one SUM counts it exactly once.

Supported here:

* ``"replicated"`` (default): every rank of the group holds the same gradients (DDP, or a single
  process). Weight ``1 / world_size``.
* ``"sharded"``: every rank holds different gradients (a manual shard, a pipeline stage, a tensor-
  parallel slice with no replication inside the group). Weight ``1``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, get_args

import torch

__all__ = ["GradGroups", "GradLayout", "collect_grads", "replication_weight"]

GradLayout = Literal["replicated", "sharded"]
GRAD_LAYOUTS: tuple[str, ...] = get_args(GradLayout)

#: Gradients of one optimizer grouped by (device, dtype), so that each group is one multi-tensor launch.
GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]


def collect_grads(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool, coalesce_sparse: bool
) -> GradGroups:
    """Group the optimizer's non-None gradients by device and dtype, in parameter order.

    Sparse gradients are handled as ``torch.amp.GradScaler`` does: fp16 ones are coalesced (``.grad`` is
    replaced) and their ``_values()`` are checked. With ``coalesce_sparse`` every sparse gradient is
    coalesced, which a norm needs (duplicate indices would otherwise be counted apart).

    Raises:
        ValueError: ``allow_fp16`` is False and a gradient is fp16 (torch's "Attempting to unscale FP16
            gradients.").
    """
    groups: GradGroups = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse:
                if grad.dtype is torch.float16 or coalesce_sparse:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            groups[(grad.device, grad.dtype)].append(grad)
    return dict(groups)


def replication_weight(layout: str, world_size: int) -> float:
    """Weight of one rank's squared norm in the group SUM: ``1 / world_size`` if replicated, else 1."""
    if layout == "replicated":
        return 1.0 / world_size
    return 1.0
