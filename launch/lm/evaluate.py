"""Held-out evaluation: the mean per-byte loss over fixed windows, split across replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.distributed import Dist
from lm.config import TrainConfig
from lm.data import get_batch
from lm.layout import Parallel

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(par: Parallel, held_out: torch.Tensor, cfg: TrainConfig, d: Dist) -> float:
    """Mean per-byte loss over ``eval_windows`` fixed windows of the held-out split.

    The windows do not depend on the layout: data-parallel replicas split them, the ranks of one
    replica (a tensor-parallel group, a pipeline) evaluate the same ones. Every rank runs the same
    number of full batches (sharded layouts gather parameters in each forward, a pipeline needs
    fixed shapes): a replica's last batch is padded with its first window, masked out. One
    all_reduce sums (loss, tokens) over the ranks that hold a loss; replicas' duplicates scale
    both alike, so the mean is exact.
    """
    was_training = par.model.training
    par.model.eval()
    last = len(held_out) - cfg.block_size - 1
    all_starts = torch.linspace(0, last, cfg.eval_windows).long()
    starts = all_starts[par.dp_rank :: par.dp_size]
    per_replica = -(-cfg.eval_windows // par.dp_size)  # the most any replica gets
    num_batches = -(-per_replica // cfg.batch_size)
    padded = torch.full((num_batches * cfg.batch_size,), int(all_starts[0]))
    padded[: len(starts)] = starts
    valid = torch.zeros(len(padded), dtype=torch.float64, device=d.device)
    valid[: len(starts)] = 1.0
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)  # (sum of losses, tokens)
    for chunk, mask in zip(padded.split(cfg.batch_size), valid.split(cfg.batch_size), strict=True):
        x, y = get_batch(held_out, chunk, cfg.block_size, d.device)
        sums = par.loss_sums(x, y, cfg)  # (B,) or None
        if sums is not None:
            totals += torch.stack([(sums.double() * mask).sum(), mask.sum() * cfg.block_size])
    if d.enabled:
        dist.all_reduce(totals)
    par.model.train(was_training)
    return (totals[0] / totals[1]).item()
