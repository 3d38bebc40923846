"""Fault injection: an inf written into one gradient of one rank, after the gradients are reduced."""

from __future__ import annotations

import math

import torch.nn as nn

from common.tensors import local_tensor

__all__ = ["inject_inf_"]


def inject_inf_(model: nn.Module) -> None:
    """Writes an inf into the first gradient of ``model`` that this rank holds (this rank only).

    A DTensor gradient (FSDP2, HSDP, tensor parallel) gets it in its local shard; gradients with
    no element here (an empty shard) are passed over.

    Raises:
        RuntimeError: this rank holds no gradient element.
    """
    for p in model.parameters():
        grad = None if p.grad is None else local_tensor(p.grad)
        if grad is not None and grad.numel() > 0:
            grad.view(-1)[0] = math.inf
            return
    raise RuntimeError("inject_inf: this rank holds no gradient element to write an inf into")
