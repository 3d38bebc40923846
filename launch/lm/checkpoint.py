"""``ckpt.pt``: model, optimizer, scaler, step and every rank's RNG / sampler state.

For ``ddp`` (and a single process) ``ckpt.pt`` holds everything, and the first rank of every node
(``LOCAL_RANK`` 0) writes it: every rank holds the whole state, so each node keeps the copy its
own ranks read at a resume, with or without a filesystem the nodes share (on a shared one the
copies are the same checkpoint; each is written to a file of its own, then renamed). For the
sharded and model-parallel layouts the model and optimizer state go to
torch.distributed.checkpoint (DCP) in ``ckpt_dcp/step-N/`` (every rank writes its shards; DCP's
``get_state_dict`` / ``set_state_dict`` handle FSDP1, FSDP2, HSDP, DTensor and pipeline-stage
modules alike, a stage's parameter names being unique), and ``ckpt.pt`` (rank 0) holds the rest
and the folder's name: across nodes they need a shared filesystem.

Resuming needs the same layout. On another world size the model, optimizer and scaler state carry
over (DCP reshards), but the batches drawn from there on differ from those of a run on the saved
world size (each data-parallel replica has a sampler of its own): a warning says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from common.distributed import Dist, gather_objects
from distscaler import GradScaler
from lm.config import TrainConfig

__all__ = [
    "CKPT_NAME",
    "DCP_DIR",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

logger = logging.getLogger(__name__)

CKPT_NAME = "ckpt.pt"
DCP_DIR = "ckpt_dcp"


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
    sharded: bool = False,
) -> None:
    """Writes ``path`` atomically: the first rank of every node without ``sharded`` (each node
    keeps a copy), rank 0 with it. Every rank must call this (it gathers RNG states).

    ``sharded``: model and optimizer go to DCP first (every rank writes), then ``path`` names
    the new folder, then older folders are removed: a crash leaves the last complete checkpoint.
    """
    rngs = gather_objects(rng_state(sampler), d)
    dcp_dir = None
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        dcp_dir = f"{DCP_DIR}/step-{step:08d}"
        if d.is_main:  # left half-written by a run killed while saving this step
            shutil.rmtree(path.parent / dcp_dir, ignore_errors=True)
        d.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=path.parent / dcp_dir
        )
    writes = d.is_main if sharded else d.local_rank == 0
    if writes:
        state = {
            "step": step,
            "model": None if sharded else model.state_dict(),
            "optimizer": None if sharded else optimizer.state_dict(),
            "dcp": dcp_dir,
            "parallelism": cfg.parallelism,
            "scaler": scaler.state_dict(),
            "rng": rngs,  # indexed by global rank
            "world_size": d.world_size,
            "config": dataclasses.asdict(cfg),
        }
        tmp = path.with_suffix(f".{d.rank}.tmp")  # nodes sharing a filesystem write apart
        torch.save(state, tmp)
        os.replace(tmp, path)
        if dcp_dir is not None and d.is_main:
            for old in (path.parent / DCP_DIR).iterdir():
                if old.name != Path(dcp_dir).name:
                    shutil.rmtree(old, ignore_errors=True)
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
    """Loads ``path`` into the given objects on every rank; returns the step it was saved at.

    Raises:
        FileNotFoundError: there is no ``path``.
        ValueError: it was saved with another ``parallelism``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved_as = state.get("parallelism", "ddp")
    if saved_as != cfg.parallelism:
        raise ValueError(
            f"--resume: {path} was saved with parallelism {saved_as!r}; resume with the same "
            f"layout (now: {cfg.parallelism!r})"
        )
    saved_world = int(state.get("world_size", len(state["rng"])))
    if saved_world != d.world_size and d.is_main:
        logger.warning(
            "resuming %s, saved by %d rank(s), on %d: the model, optimizer and scaler state "
            "(scale, growth tracker, skip counts) carry over, but the data order changes: the "
            "batches drawn from here on differ from those of a run on %d rank(s)",
            path,
            saved_world,
            d.world_size,
            saved_world,
        )
    if state.get("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        # DCP brings back the tensors; the hyperparameters are this run's (built from the config,
        # lr set every step): param-group values such as `betas` do not come back for every
        # layout (FSDP1's flat-parameter groups lose them).
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        loaded = {"model": model_state, "optimizer": optim_state}
        dcp.load(loaded, checkpoint_id=path.parent / state["dcp"])
        set_state_dict(
            model,
            optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optimizer"],
        )
        if len(hyper) != len(optimizer.param_groups):
            raise ValueError(
                f"--resume: {path} has {len(optimizer.param_groups)} optimizer param groups, "
                f"this run has {len(hyper)}"
            )
        for group, values in zip(optimizer.param_groups, hyper, strict=True):
            group.update(values)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    if d.rank < len(state["rng"]):
        set_rng_state(state["rng"][d.rank], sampler)  # a rank beyond the saved ones keeps its own
    saved = state.get("config", {})
    changed = {
        k: (saved[k], v)
        for k, v in dataclasses.asdict(cfg).items()
        if k in saved and saved[k] != v and k not in ("steps", "out")
    }
    if changed and d.is_main:
        logger.warning("resuming with changed settings (saved -> now): %s", changed)
    return int(state["step"])
