"""The cross-replica found_inf: each replica group's agreed found_inf, and which group went
non-finite, under one MAX across groups (``manager.allreduce``).

A group's part is float32 ``[v0, v1, hi, lo]``. ``v0, v1``: the found_inf agreed inside the group
(a flag, or [flag or statistic, statistic]; a flag alone is padded with 0), NaN as inf. ``hi,
lo``: ``r + 1`` and ``LO_BASE - (r + 1)`` for a group of replica rank ``r`` that went non-finite,
else 0; after the MAX ``hi`` names the highest such rank and ``LO_BASE - lo`` the lowest, so one
group alone went non-finite exactly where ``hi + lo == LO_BASE``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CROSS_NUMEL", "cross_part", "lone"]

#: Elements of the cross-replica found_inf: [flag or statistic, statistic, hi, lo].
CROSS_NUMEL = 4
#: Encodes the lowest non-finite replica rank under a MAX (``LO_BASE - (rank + 1)``).
LO_BASE = float(2**20)


def cross_part(flat: torch.Tensor, replica_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This group's part, float32 ``(CROSS_NUMEL,)`` on ``flat``'s device, and its own found_inf
    (0-dim float32, 1.0 where the flag is > 0 or a value is non-finite). ``flat``: the found_inf
    agreed inside the group, ``(1,)`` or ``(2,)``; ``replica_rank``: None for a healing group
    (torchft zeroes its part: no ``hi, lo``). No host read."""
    bad = torch.logical_or(flat[0] > 0, flat.isfinite().all().logical_not()).to(torch.float32)
    # NaN as inf: a MAX over NaN depends on the order of the operands.
    values = torch.nan_to_num(flat, nan=math.inf, posinf=math.inf, neginf=-math.inf)
    ident = 0.0 if replica_rank is None else float(replica_rank + 1)
    ends = bad * torch.tensor(
        [ident, LO_BASE - ident if ident else 0.0], dtype=torch.float32, device=flat.device
    )
    pad = [values.new_zeros(2 - flat.numel())] if flat.numel() < 2 else []
    return torch.cat([values, *pad, ends]), bad


def lone(cross: list[float], num_participants: int) -> int | None:
    """The replica rank of the only group that went non-finite, from the reduced
    ``[v0, v1, hi, lo]``; None where none did, or more than one."""
    hi, lo = cross[2], cross[3]
    if num_participants < 2 or hi <= 0 or hi + lo != LO_BASE:
        return None
    return int(hi) - 1
