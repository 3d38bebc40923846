"""The optimizer (fused AdamW where available) and the learning-rate schedule."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn

from lm.config import TrainConfig

__all__ = ["lr_at", "make_optimizer"]

logger = logging.getLogger(__name__)


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    try:
        # Fused: the scaler hands the scale and the skip flag to the kernel, with no host sync.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)
    except (RuntimeError, ValueError) as e:
        logger.warning("fused AdamW unavailable on %s (%s); using the foreach one", device, e)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    decay_steps = cfg.decay_steps or cfg.steps
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
