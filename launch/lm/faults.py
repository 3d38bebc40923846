"""Fault injection after the gradients are reduced, on one rank: an inf written into one gradient
(an overflow), or one bit flipped (silent data corruption)."""

from __future__ import annotations

import math

import torch.nn as nn

from common.tensors import local_tensor

__all__ = ["flip_sign_bit_", "inject_inf_"]


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


def flip_sign_bit_(model: nn.Module) -> str:
    """Flips the sign bit of the first non-zero element of the first gradient ``model`` holds on
    this rank (this rank only), as a memory or compute fault would: the value stays finite and
    plausible, so no overflow check can see it. Returns where (``"<param>[i]"``).

    Raises:
        RuntimeError: this rank holds no non-zero gradient element.
    """
    for name, p in model.named_parameters():
        grad = None if p.grad is None else local_tensor(p.grad)
        if grad is None or grad.numel() == 0 or not grad.is_floating_point():
            continue
        flat = grad.view(-1)
        nonzero = flat.nonzero()
        if nonzero.numel():
            i = int(nonzero[0, 0])
            flat[i] = -flat[i]  # exactly the sign bit: IEEE negation flips it and nothing else
            return f"{name}[{i}]"
    raise RuntimeError("inject_bitflip: this rank holds no non-zero gradient element to corrupt")
