"""Reference training job for distscaler: a byte-level GPT trained with DDP, fp16 autocast and
``distscaler.GradScaler``.

By default it trains on the Python standard library sources of the running interpreter (every
``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, ``site-packages``
excluded, read as bytes; the last ``eval_fraction`` of the bytes is held out for evaluation), so it
needs no download. ``--data PATH`` takes any file or folder instead (all files, sorted, as bytes).

The backend and device are picked automatically: NCCL and ``cuda:$LOCAL_RANK`` where CUDA is
available, gloo and the CPU otherwise. fp16 autocast is used on both.

Single node, two processes (two CPU processes here, or two GPUs)::

    torchrun --standalone --nproc-per-node=2 launch/train.py

Two nodes, one process each, c10d rendezvous (run on each node; HOST is the first node)::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 --rdzv-id=job1 launch/train.py

Single process, no torch.distributed::

    python launch/train.py

A seconds-long smoke run (tiny model; any text file)::

    torchrun --standalone --nproc-per-node=2 launch/train.py --config configs/smoke.yaml \
        --data launch/train.py --out runs/smoke

Options (config values come from the ``TrainConfig`` defaults, then the YAML file, then the
command line)::

    --config FILE   YAML config (default: configs/default.yaml next to this script)
    --steps N       total number of optimizer steps (the cosine decay ends there unless
                    decay_steps is set)
    --out DIR       output folder (default: runs/default)
    --data PATH     text file or folder to train on instead of the stdlib sources
    --resume        continue from DIR/ckpt.pt with its step, model, optimizer, scale and RNG
                    states; metrics.jsonl keeps the lines up to that step and grows from there.
                    Every rank reads the checkpoint: across nodes DIR must be on a shared
                    filesystem.

With the default config the scaler is visibly at work: it starts at 2**20, backs off on the first
steps' overflows (skipped on every rank), then grows every ``growth_interval`` clean steps until
fp16 overflows again. ``inject_inf: {steps: [...], rank: R}`` writes an inf into one gradient on
rank R only, after DDP's all-reduce, to show that every rank still skips that step.

Outputs, written by rank 0 into ``--out``:

* ``metrics.jsonl``: one JSON object per optimizer step: ``step``, ``loss`` (rank 0's
  micro-batch), ``scale`` (the loss scale used for that step), ``skipped``, ``grad_norm`` (global
  norm of the unscaled gradients before clipping; ``null`` when non-finite), ``lr``,
  ``tokens_per_s`` (all ranks), and ``eval_loss`` on evaluation steps.
* ``ckpt.pt``: model, optimizer, scaler, step and every rank's RNG / sampler state.
* ``summary.json``: the figures of the final summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import sys
import sysconfig
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from distscaler import GradScaler

logger = logging.getLogger("train")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
CKPT_NAME = "ckpt.pt"
METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """Every problem found in a config, reported together so that one pass fixes them all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"- {p}" for p in problems))


@dataclass(kw_only=True, slots=True)
class InjectInf:
    """Fault injection: write an inf into one gradient on one rank, after backward.

    With DDP the gradients are already all-reduced at that point, so only ``rank`` sees the inf;
    the scaler must still make every rank skip the step and back off.
    """

    steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based) at which to inject."""
    rank: int = 1
    """Global rank that injects; must be in [0, world_size)."""

    def __post_init__(self) -> None:
        problems = []
        bad = [s for s in self.steps if s < 1]
        if bad:
            problems.append(f"inject_inf.steps must be >= 1, got: {bad}")
        if self.rank < 0:
            problems.append(f"inject_inf.rank must be >= 0, got: {self.rank}")
        if problems:
            raise ConfigError(problems)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Every setting of the job. YAML keys and ``--flags`` use these names."""

    # -- run --
    steps: int = 500
    """Total number of optimizer steps (a resumed run continues up to this number)."""
    out: str = "runs/default"
    """Output folder for metrics.jsonl, ckpt.pt and summary.json."""
    seed: int = 1337
    """Seed for model init; rank r samples batches with seed + r."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: ``cuda:$LOCAL_RANK`` with NCCL where CUDA is available, else the CPU with gloo."""
    num_threads: int = 0
    """CPU threads per process; 0 = usable cores // processes on this node (at least 1)."""
    ckpt_interval: int = 200
    """Checkpoint interval, in steps (a checkpoint is also written at the end); 0 = only at end."""
    log_interval: int = 50
    """Interval, in steps, of the log lines (the progress bar updates every step)."""
    eval_interval: int = 100
    """Interval, in steps, of held-out evaluation (always done at the end); 0 = only at end."""
    eval_windows: int = 128
    """Number of fixed, evenly spaced held-out windows (of block_size bytes) per evaluation."""

    # -- data --
    data: str | None = None
    """Text file or folder to train on; None = the stdlib sources of this interpreter."""
    eval_fraction: float = 0.05
    """Fraction of the bytes, taken from the end, held out for evaluation, in (0, 0.5]."""
    block_size: int = 128
    """Context length, in bytes (tokens)."""
    batch_size: int = 16
    """Sequences per rank per step."""

    # -- model --
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0

    # -- optimizer --
    lr: float = 2e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Linear warmup length, in steps."""
    decay_steps: int = 0
    """Step at which the cosine decay reaches min_lr; 0 = ``steps``. Fix it to resume a run
    with a larger ``--steps`` on the same schedule."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices and embeddings, not to biases and norms."""
    beta1: float = 0.9
    beta2: float = 0.95
    max_norm: float = 1.0
    """Gradient clipping threshold on the global norm of the unscaled gradients."""

    # -- mixed precision / scaler --
    amp: bool = True
    """fp16 autocast and loss scaling; False = fp32 with a disabled scaler."""
    init_scale: float = 2.0**20
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 25
    """Consecutive clean steps before the scale grows."""
    inject_inf: InjectInf | None = None
    """Fault injection, e.g. ``{steps: [40], rank: 1}``; None = off."""

    def __post_init__(self) -> None:
        problems = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(self.steps >= 1, f"steps must be >= 1, got: {self.steps}")
        need(self.num_threads >= 0, f"num_threads must be >= 0, got: {self.num_threads}")
        for name in ("ckpt_interval", "log_interval", "eval_interval"):
            value = getattr(self, name)
            need(value >= 0, f"{name} must be >= 0, got: {value}")
        need(self.eval_windows >= 1, f"eval_windows must be >= 1, got: {self.eval_windows}")
        need(
            0.0 < self.eval_fraction <= 0.5,
            f"eval_fraction must be in (0, 0.5], got: {self.eval_fraction}",
        )
        for name in ("block_size", "batch_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            need(value >= 1, f"{name} must be >= 1, got: {value}")
        need(
            self.d_model % self.n_head == 0,
            f"d_model must be a multiple of n_head, got: d_model={self.d_model}, "
            f"n_head={self.n_head}",
        )
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got: {self.dropout}")
        need(self.lr > 0, f"lr must be > 0, got: {self.lr}")
        need(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr], got: {self.min_lr}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got: {self.warmup_steps}")
        need(self.decay_steps >= 0, f"decay_steps must be >= 0, got: {self.decay_steps}")
        need(self.max_norm > 0, f"max_norm must be > 0, got: {self.max_norm}")
        need(self.init_scale > 0, f"init_scale must be > 0, got: {self.init_scale}")
        need(self.growth_factor > 1, f"growth_factor must be > 1, got: {self.growth_factor}")
        need(
            0 < self.backoff_factor < 1,
            f"backoff_factor must be in (0, 1), got: {self.backoff_factor}",
        )
        need(
            self.growth_interval >= 1, f"growth_interval must be >= 1, got: {self.growth_interval}"
        )
        if problems:
            raise ConfigError(problems)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks ``value`` from YAML against the type hint ``hint``; returns the converted value."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _coerce(key, value, non_none[0])
        errors = []
        for arg in non_none:
            try:
                return _coerce(key, value, arg)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError("; ".join(errors))
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{key} must be one of {typing.get_args(hint)}, got: {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{key} must be a list, got: {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise TypeError(f"{key} must be a mapping, got: {value!r}")
        return _from_dict(hint, value, prefix=f"{key}.")
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{key} must be true or false, got: {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key} must be an integer, got: {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool):
            raise TypeError(f"{key} must be a number, got: {value!r}")
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise TypeError(f"{key} must be a number, got: {value!r}") from None
        if not isinstance(value, (int, float)):
            raise TypeError(f"{key} must be a number, got: {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got: {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {hint!r}")  # internal: a new field type


def _from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Builds dataclass ``cls`` from ``raw``, reporting every unknown key and bad value at once."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    problems = []
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            problems.append(f"unknown config key '{prefix}{key}'; valid keys: {', '.join(names)}")
            continue
        try:
            kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
        except ConfigError as e:  # a nested dataclass: keep its list flat
            problems.extend(e.problems)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    return cls(**kwargs)


def load_config(path: str | os.PathLike | None, **overrides: Any) -> TrainConfig:
    """Returns the dataclass defaults, overridden by the YAML file ``path``, then by ``overrides``.

    Overrides whose value is None are ignored (an absent command-line flag).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(
                f"config file {path} must hold a mapping, got: {type(loaded).__name__}"
            )
        raw = dict(loaded or {})
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return _from_dict(TrainConfig, raw)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Model: a compact nanoGPT-style decoder
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(  # (B, nh, T, hs)
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes (vocabulary 256) with tied input/output embeddings."""

    vocab_size = 256

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(self.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


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


# --------------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def setup_distributed(device_type: str) -> Dist:
    """Picks the device and, when launched by torchrun (RANK / WORLD_SIZE set), initializes the
    process group: NCCL on CUDA, gloo on the CPU."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available; use 'auto' or 'cpu'")
    use_cuda = device_type == "cuda" or (device_type == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK must be in [0, {torch.cuda.device_count()}) (the visible GPUs) with "
            f"device {device_type!r}, got: {local_rank}; start fewer processes per node or set "
            "device: cpu"
        )
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        return Dist(device=device)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    return Dist(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device=device,
    )


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def gather_objects(obj: Any, d: Dist) -> list[Any]:
    if not d.enabled:
        return [obj]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------
# Checkpoints, evaluation, metrics
# --------------------------------------------------------------------------------------------


def rng_state(sampler: torch.Generator) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "sampler": sampler.get_state(),
    }


def set_rng_state(state: dict[str, Any], sampler: torch.Generator) -> None:
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


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def read_metrics(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """The records of ``path`` with step <= upto_step (later ones were not checkpointed).

    A line that does not parse (a job killed while writing it) is dropped with a warning.
    """
    if not path.is_file():
        logger.warning("%s not found; the summary covers this run's steps only", path)
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON; dropped: %r", path, num, line[:80])
    return [r for r in records if r["step"] <= upto_step]


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def summarize(records: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    scales = [r["scale"] for r in records]
    return {
        "steps": records[-1]["step"] if records else 0,
        "skipped_steps": sum(r["skipped"] for r in records),
        "num_growths": sum(b > a for a, b in zip(scales, scales[1:], strict=False)),
        "num_backoffs": sum(b < a for a, b in zip(scales, scales[1:], strict=False)),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        **extra,
    }


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def inject_inf_(model: nn.Module) -> None:
    """Writes an inf into the first gradient of ``model`` (this rank only)."""
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    grad.view(-1)[0] = math.inf


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    *,
    inject: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the loss and the global unscaled gradient norm, on the device.

    No host read here: with a fused optimizer the scaler's skip decision and clipping stay on the
    device. ``inject``: the unwrapped model whose gradient gets an inf after backward.
    """
    with torch.autocast(x.device.type, dtype=torch.float16, enabled=cfg.amp):
        logits = model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if inject is not None:
        # After backward DDP has already all-reduced the gradients: only this rank sees the inf.
        inject_inf_(inject)
    # One collective gives every rank the same skip decision and the same global norm.
    grad_norm = scaler.clip_grad_norm_(optimizer, cfg.max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach(), grad_norm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Byte-level GPT trained with DDP, fp16 autocast and distscaler.GradScaler.",
    )
    parser.add_argument(
        "--config", help=f"YAML config file (default: {DEFAULT_CONFIG}, if it exists)"
    )
    parser.add_argument("--steps", type=int, help="total number of optimizer steps")
    parser.add_argument("--out", help="output folder (default: runs/default)")
    parser.add_argument("--data", help="text file or folder (default: the stdlib *.py sources)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from OUT/ckpt.pt and append to metrics"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    setup_logging(int(os.environ.get("RANK", 0)))
    config_path = args.config
    if config_path is None and DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
    elif config_path is None:
        logger.warning("%s not found; using the built-in defaults", DEFAULT_CONFIG)
    try:
        cfg = load_config(config_path, steps=args.steps, out=args.out, data=args.data)
    except ConfigError as e:
        logger.error("%s: %s", config_path or "(built-in defaults)", e)
        raise SystemExit(2) from None
    d = setup_distributed(cfg.device)
    # No teardown after an error: destroy_process_group is collective-like and would hang the
    # ranks that are still running (torchrun stops them instead).
    summary = train(cfg, d, config_path=config_path, resume=args.resume, t_start=t_start)
    if d.enabled:
        d.barrier()  # every rank is done communicating before any rank tears its connections down
        dist.destroy_process_group()
    return summary


def train(
    cfg: TrainConfig, d: Dist, *, config_path: str | Path | None, resume: bool, t_start: float
) -> dict[str, Any]:
    """Runs the job on an initialized ``d``; returns the summary (rank 0's records)."""
    if cfg.inject_inf is not None and cfg.inject_inf.rank >= d.world_size:
        raise ValueError(
            f"inject_inf.rank must be in [0, {d.world_size}) for this world size, "
            f"got: {cfg.inject_inf.rank}"
        )

    if d.device.type == "cpu":
        threads = cfg.num_threads or max(1, len(os.sched_getaffinity(0)) // d.local_world_size)
        torch.set_num_threads(threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, metrics_path = out / CKPT_NAME, out / METRICS_NAME

    train_data, held_out, num_files = load_corpus(cfg)
    logger.info("config %s: %s", config_path or "(built-in defaults)", dataclasses.asdict(cfg))
    logger.info(
        "world_size=%d device=%s backend=%s threads/rank=%d data: %d files, %.2f MB train, "
        "%.2f MB held out",
        d.world_size,
        d.device,
        dist.get_backend() if d.enabled else "none",
        torch.get_num_threads(),
        num_files,
        len(train_data) / 1e6,
        len(held_out) / 1e6,
    )

    torch.manual_seed(cfg.seed)  # identical init on every rank (DDP broadcasts rank 0's anyway)
    random.seed(cfg.seed + d.rank)
    sampler = torch.Generator().manual_seed(cfg.seed + d.rank)
    raw_model = ByteGPT(cfg).to(d.device)
    model: nn.Module = raw_model
    if d.enabled:
        model = DDP(raw_model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = make_optimizer(raw_model, cfg, d.device)
    scaler = GradScaler(
        d.device.type,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
        enabled=cfg.amp,
    )
    num_params = sum(p.numel() for p in raw_model.parameters())
    logger.info("model: %.2fM parameters", num_params / 1e6)

    start_step = 0
    if resume:
        start_step = load_checkpoint(
            ckpt_path,
            model=raw_model,
            optimizer=optimizer,
            scaler=scaler,
            sampler=sampler,
            cfg=cfg,
            d=d,
        )
        logger.info(
            "resumed from %s at step %d, scale %g", ckpt_path, start_step, scaler.get_scale()
        )
    records = read_metrics(metrics_path, start_step) if d.is_main and resume else []
    metrics_file = None
    if d.is_main:
        # Rewrite rather than append: steps logged after the checkpoint will be run again.
        with open(metrics_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        metrics_file = open(metrics_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    inject_steps = set(cfg.inject_inf.steps) if cfg.inject_inf else set()
    inject_here = cfg.inject_inf is not None and cfg.inject_inf.rank == d.rank
    tokens_per_step = cfg.batch_size * cfg.block_size * d.world_size
    skipped_steps: list[int] = []  # this rank's view, checked against the others at the end
    train_time = 0.0
    eval_loss = None
    step = start_step

    scale = scaler.get_scale()  # the scale the next step's gradients carry
    bar = tqdm(
        total=cfg.steps,
        initial=start_step,
        disable=not d.is_main,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
    )
    try:
        with logging_redirect_tqdm():
            for step in range(start_step + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                starts = torch.randint(
                    len(train_data) - cfg.block_size - 1, (cfg.batch_size,), generator=sampler
                )
                x, y = get_batch(train_data, starts, cfg.block_size, d.device)
                inject = raw_model if inject_here and step in inject_steps else None
                loss, grad_norm = train_step(model, optimizer, scaler, x, y, cfg, inject=inject)
                # The step's host reads, all after it: metrics, the agreed skip flag, next scale.
                loss_value, norm_value = torch.stack([loss.float(), grad_norm]).tolist()
                skipped = scaler.step_was_skipped
                next_scale = scaler.get_scale()
                dt = time.perf_counter() - t0
                train_time += dt
                if skipped:
                    skipped_steps.append(step)

                record = {
                    "step": step,
                    "loss": finite_or_none(loss_value),
                    "scale": scale,
                    "skipped": skipped,
                    "grad_norm": finite_or_none(norm_value),
                    "lr": lr,
                    "tokens_per_s": tokens_per_step / dt,
                }
                if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.steps:
                    eval_loss = evaluate(raw_model, held_out, cfg, d)
                    record["eval_loss"] = eval_loss
                    logger.info("step %d: eval loss %.4f", step, eval_loss)
                if metrics_file is not None:  # rank 0
                    records.append(record)
                    metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
                    bar.set_postfix(loss=f"{loss_value:.3f}", scale=f"{scale:g}", refresh=False)
                    bar.update()
                    if cfg.log_interval and step % cfg.log_interval == 0:
                        logger.info(
                            "step %d/%d: loss %.4f scale %g grad_norm %.3f lr %.2e %.0f tok/s",
                            step,
                            cfg.steps,
                            loss_value,
                            scale,
                            norm_value,
                            lr,
                            tokens_per_step / dt,
                        )
                scale = next_scale
                if cfg.ckpt_interval and step % cfg.ckpt_interval == 0 and step < cfg.steps:
                    save_checkpoint(
                        ckpt_path,
                        step=step,
                        model=raw_model,
                        optimizer=optimizer,
                        scaler=scaler,
                        sampler=sampler,
                        cfg=cfg,
                        d=d,
                    )
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()

    save_checkpoint(
        ckpt_path,
        step=step,
        model=raw_model,
        optimizer=optimizer,
        scaler=scaler,
        sampler=sampler,
        cfg=cfg,
        d=d,
    )
    eval_loss = evaluate(raw_model, held_out, cfg, d)
    final_scale = scaler.get_scale()

    # Every rank must have skipped the same steps and hold the same scale and parameters.
    views = gather_objects((skipped_steps, final_scale, params_digest(raw_model)), d)
    consistent = all(v == views[0] for v in views)
    if not consistent:
        for r, v in enumerate(views):
            logger.error("rank %d: skipped steps %s, scale %g, params %s", r, *v)
        raise RuntimeError("ranks disagree on skipped steps, scale or parameters (see above)")

    steps_run = step - start_step
    summary = summarize(
        records,
        steps_this_run=steps_run,
        final_scale=final_scale,
        eval_loss=eval_loss,
        tokens_per_s=steps_run * tokens_per_step / train_time if train_time else None,
        wall_s=time.perf_counter() - t_start,
        world_size=d.world_size,
        device=str(d.device),
        num_params=num_params,
        ranks_consistent=consistent,
    )
    if d.is_main:
        with open(out / SUMMARY_NAME, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        logger.info(
            "done: %d steps (%d this run, %d skipped; %d growths, %d backoffs), final scale %g, "
            "loss %.4f -> %.4f, eval loss %.4f, %.0f tok/s, wall %.1f s; ranks consistent: %s",
            summary["steps"],
            steps_run,
            summary["skipped_steps"],
            summary["num_growths"],
            summary["num_backoffs"],
            final_scale,
            math.nan if summary["first_loss"] is None else summary["first_loss"],
            math.nan if summary["last_loss"] is None else summary["last_loss"],
            eval_loss,
            summary["tokens_per_s"] or 0.0,
            summary["wall_s"],
            consistent,
        )
    return summary


if __name__ == "__main__":
    main()
