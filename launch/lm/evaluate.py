"""Held-out evaluation: the mean per-byte loss over fixed windows, split across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lm.config import TrainConfig
from lm.data import get_batch
from lm.distributed import Dist

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: nn.Module, held_out: torch.Tensor, cfg: TrainConfig, d: Dist) -> float:
    """Mean per-byte loss over ``eval_windows`` fixed windows of the held-out split.

    The windows do not depend on the world size; ranks split them and sum with one all_reduce.
    """
    was_training = model.training
    model.eval()
    last = len(held_out) - cfg.block_size - 1
    starts = torch.linspace(0, last, cfg.eval_windows).long()[d.rank :: d.world_size]
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)  # (sum of losses, tokens)
    for chunk in starts.split(cfg.batch_size):
        x, y = get_batch(held_out, chunk, cfg.block_size, d.device)
        with torch.autocast(d.device.type, dtype=torch.float16, enabled=cfg.amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        totals += torch.stack([loss.double(), torch.tensor(y.numel(), device=d.device)])
    if d.enabled:
        dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1]).item()
