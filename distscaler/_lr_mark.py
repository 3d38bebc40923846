"""The mark an LR scheduler reads, set from a step dynamo traces (`distscaler._traced_step`).

A module of its own so that ``import distscaler`` does not import dynamo: marking a function with
``torch.compiler.assume_constant_result`` does, and this module is imported only while dynamo
traces a step.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["mark_stepped"]


@torch.compiler.assume_constant_result
def mark_stepped(optimizer: Optimizer) -> bool:
    """Set ``optimizer._opt_called``: the mark an LR scheduler's step wrapper sets
    (torch/optim/lr_scheduler.py), read once, at the scheduler's first step, to warn about a
    scheduler stepped before its optimizer.

    dynamo drops (torch 2.13) or refuses (2.6) attribute writes on an optimizer; a constant-result
    function runs for real, once, while the step is traced, which is enough for a flag that is
    only ever set.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]
    return True
