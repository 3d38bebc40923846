"""``ckpt.pt``: model, optimizer, scaler, step and every rank's RNG / sampler state."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from distscaler import GradScaler
from lm.config import TrainConfig
from lm.distributed import Dist, gather_objects

__all__ = ["CKPT_NAME", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]

logger = logging.getLogger(__name__)

CKPT_NAME = "ckpt.pt"


def rng_state(sampler: torch.Generator) -> dict[str, Any]:
    """This rank's torch, CUDA, Python and batch-sampler RNG states."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "sampler": sampler.get_state(),
    }


def set_rng_state(state: dict[str, Any], sampler: torch.Generator) -> None:
    """Restores what ``rng_state`` returned (the CUDA state only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
    sampler.set_state(state["sampler"])


def save_checkpoint(
    path: Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
    sampler: torch.Generator,
    cfg: TrainConfig,
    d: Dist,
) -> None:
    """Rank 0 writes ``path`` atomically; every rank must call this (it gathers RNG states)."""
    rngs = gather_objects(rng_state(sampler), d)
    if d.is_main:
        state = {
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rngs,  # indexed by global rank
            "world_size": d.world_size,
            "config": dataclasses.asdict(cfg),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    d.barrier()


def load_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
    sampler: torch.Generator,
    cfg: TrainConfig,
    d: Dist,
) -> int:
    """Loads ``path`` into the given objects on every rank; returns the step it was saved at."""
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    if d.rank < len(state["rng"]):
        set_rng_state(state["rng"][d.rank], sampler)
    else:
        logger.warning(
            "checkpoint was saved by %d ranks; rank %d keeps fresh RNG and sampler states",
            len(state["rng"]),
            d.rank,
        )
    saved = state.get("config", {})
    changed = {
        k: (saved[k], v)
        for k, v in dataclasses.asdict(cfg).items()
        if k in saved and saved[k] != v and k not in ("steps", "out")
    }
    if changed and d.is_main:
        logger.warning("resuming with changed settings (saved -> now): %s", changed)
    return int(state["step"])
