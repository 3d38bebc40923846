"""How a model is wrapped for data parallelism: DDP's device ids, FSDP2 block by block."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["ddp_device_ids", "fully_shard_blocks"]


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """``DistributedDataParallel``'s ``device_ids``: the GPU's index, None on the CPU."""
    return [device.index] if device.type == "cuda" else None


def fully_shard_blocks(
    blocks: Iterable[nn.Module], root: nn.Module, mesh: Any, **kwargs: Any
) -> None:
    """FSDP2 as torch recommends it: ``fully_shard`` each block (one all-gather per block in the
    forward), then the root (the parameters outside every block). ``kwargs`` go to every call
    (``mp_policy``...). A 2-D mesh makes it HSDP."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(root, mesh=mesh, **kwargs)
