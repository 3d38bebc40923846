"""The training data: a byte corpus split into train and held-out parts, and batches of it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from lm.config import TrainConfig

__all__ = ["data_files", "get_batch", "load_corpus", "stdlib_files"]


def stdlib_files() -> list[Path]:
    """The ``*.py`` files of this interpreter's standard library, sorted, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages live under the stdlib folder in many installs; they are not stdlib.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        files.extend(Path(dirpath) / n for n in filenames if n.endswith(".py"))
    return sorted(files)


def data_files(path: str | None) -> list[Path]:
    if path is None:
        return stdlib_files()
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    raise FileNotFoundError(f"--data {path}: no such file or folder")


def load_corpus(cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Returns (train bytes, held-out bytes, number of files) as uint8 CPU tensors."""
    files = data_files(cfg.data)
    blob = b"".join(f.read_bytes() for f in files)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_eval = int(len(data) * cfg.eval_fraction)
    train, held_out = data[: len(data) - n_eval], data[len(data) - n_eval :]
    need = cfg.block_size + 1
    if len(train) <= need or len(held_out) <= need:
        raise ValueError(
            f"data too small: {len(data)} bytes in {len(files)} file(s) give {len(train)} train "
            f"and {len(held_out)} held-out bytes; each needs more than block_size + 1 = {need}"
        )
    return train, held_out, len(files)


def get_batch(
    data: torch.Tensor, starts: torch.Tensor, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    window = data[offsets].long()
    x, y = window[:, :-1], window[:, 1:]  # (B, T) each
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
