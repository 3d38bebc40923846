"""What the tests and the jobs compare: a tensor's local part, and a digest of a model's values."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

__all__ = ["local_tensor", "params_digest"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (the same storage: no copy, no
    communication), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def params_digest(params: Iterable[torch.Tensor]) -> str:
    """SHA-256 of every parameter's full value: equal digests across ranks mean identical models.

    DTensor parameters (FSDP2, TP) are gathered first: a collective every rank of their mesh must
    join. FSDP1 callers summon the full parameters around this.
    """
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for p in params:
        t = p.full_tensor() if isinstance(p, DTensor) else p
        # A copy: numpy() pins its storage, which FSDP1 must free after summoning.
        h.update(t.detach().cpu().clone().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
