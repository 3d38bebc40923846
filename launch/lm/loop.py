"""The train step and the training loop: metrics, checkpoints, evaluation, the rank check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from distscaler import GradScaler
from lm.checkpoint import CKPT_NAME, load_checkpoint, save_checkpoint
from lm.config import TrainConfig
from lm.data import get_batch, load_corpus
from lm.distributed import Dist, gather_objects
from lm.evaluate import evaluate
from lm.metrics import METRICS_NAME, SUMMARY_NAME, finite_or_none, read_metrics, summarize
from lm.model import ByteGPT
from lm.optim import lr_at, make_optimizer
from lm.plot import PLOT_NAME, plot_metrics

__all__ = ["inject_inf_", "params_digest", "train", "train_step"]

logger = logging.getLogger(__name__)


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


def params_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests across ranks mean identical models."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
    ).register_model(model)  # DDP's replication, for the global norm of clip_grad_norm_
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

    def checkpoint(at_step: int) -> None:
        save_checkpoint(
            ckpt_path,
            step=at_step,
            model=raw_model,
            optimizer=optimizer,
            scaler=scaler,
            sampler=sampler,
            cfg=cfg,
            d=d,
        )

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
                    checkpoint(step)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()

    checkpoint(step)
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
        if records:
            plot_metrics(
                records, out / PLOT_NAME, title=f"{len(records)} steps, {d.world_size} rank(s)"
            )
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
