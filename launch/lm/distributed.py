"""Process group and device setup (torchrun or a single process), and object gathering."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Dist", "gather_objects", "local_tensor", "params_digest", "setup_distributed"]


@dataclass(kw_only=True, slots=True)
class Dist:
    """Where this process stands: its ranks, the world sizes and its device.

    A single process (no torchrun) is rank 0 of a world of 1, with ``enabled`` False.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        """Whether a process group is initialized (launched by torchrun)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """``dist.barrier`` on every rank when ``enabled``; a no-op otherwise."""
        if self.enabled:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def setup_distributed(device_type: str) -> Dist:
    """Picks the device and, when launched by torchrun (RANK / WORLD_SIZE set), initializes the
    process group: NCCL on CUDA, gloo on the CPU."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available; use 'auto' or 'cpu'")
    use_cuda = device_type == "cuda" or (device_type == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK must be in [0, {torch.cuda.device_count()}) (the visible GPUs) with "
            f"device {device_type!r}, got: {local_rank}; start fewer processes per node or set "
            "device: cpu"
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        return Dist(device=device)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    return Dist(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device=device,
    )


def gather_objects(obj: Any, d: Dist) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by global rank; ``[obj]`` in a single process.

    Issues one ``all_gather_object``: must be called on every rank.
    """
    if not d.enabled:
        return [obj]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


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
