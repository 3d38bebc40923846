"""Process group and device setup (torchrun or a single process), and object gathering."""

from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from common.rendezvous import elastic_store, uses_agent_store

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Dist",
    "destroy_process_group",
    "gather_objects",
    "launched",
    "setup_distributed",
]

#: Seconds a collective (or the start of the process group) may wait for a rank before it fails.
#: torch's own default is 30 minutes on gloo and 10 on NCCL: a lost rank then looks like a hang.
DEFAULT_TIMEOUT_S = 300.0


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
            _barrier()


def _barrier() -> None:
    # NCCL's barrier on this rank's GPU (setup_distributed made it the current device).
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after every rank is done, in the order that cannot hang.

    Every rank calls it after its last collective (a no-op without a process group). Before torch
    2.8 (pytorch/pytorch PR 154976), gloo's process group is destroyed holding the GIL while it
    joins gloo's worker threads, and a worker still freeing a finished collective's last tensor
    waits for that GIL: both wait forever. Seen on torch 2.6: both ranks of a compiled-phase test
    stuck in ``~ProcessGroupGloo``, now and then. So first collect the cycles that hold tensors (a
    DDP model), then a barrier, whose wait releases the GIL: the workers free what the earlier
    collectives held. The short sleep (also without the GIL) covers a worker descheduled then.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    _barrier()
    time.sleep(0.05)
    dist.destroy_process_group()


def launched() -> bool:
    """Whether a launcher (torchrun) set this process's rank and world size."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup_distributed(device_type: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Dist:
    """Picks the device and, when launched by torchrun (RANK / WORLD_SIZE set), initializes the
    process group: NCCL on CUDA, gloo on the CPU.

    ``timeout_s``: seconds a collective may wait for the other ranks before it raises, and the
    longest the process group's start may take. Under torchrun the group starts from a store of
    its own for each restart of the workers (:mod:`common.rendezvous`), so ``--max-restarts``
    restarts cleanly.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 (seconds), got: {timeout_s}")
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
    if not launched():
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        return Dist(device=device)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"timeout": timeout, "device_id": device if use_cuda else None}
    if uses_agent_store():
        kwargs.update(store=elastic_store(rank, world_size, timeout), rank=rank)
        kwargs["world_size"] = world_size
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", **kwargs)
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
