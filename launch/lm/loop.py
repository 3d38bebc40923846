"""The train step and the training loop: metrics, checkpoints, evaluation, the rank check."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from distscaler import GradScaler
from lm.checkpoint import CKPT_NAME, load_checkpoint, save_checkpoint
from lm.config import TrainConfig
from lm.data import get_batch, load_corpus
from lm.distributed import Dist, gather_objects, local_tensor
from lm.evaluate import evaluate
from lm.metrics import (
    METRICS_NAME,
    SUMMARY_NAME,
    PhaseTimer,
    read_metrics,
    step_record,
    summarize,
)
from lm.optim import lr_at, make_optimizer
from lm.parallel import Parallel, build_parallel
from lm.plot import PLOT_NAME, plot_metrics

__all__ = ["inject_inf_", "train", "train_step"]

logger = logging.getLogger(__name__)


def inject_inf_(model: nn.Module) -> None:
    """Writes an inf into the first gradient of ``model`` that this rank holds (this rank only).

    A DTensor gradient (FSDP2, HSDP, tensor parallel) gets it in its local shard; gradients with
    no element here (an empty shard) are passed over.
    """
    for p in model.parameters():
        grad = None if p.grad is None else local_tensor(p.grad)
        if grad is not None and grad.numel() > 0:
            grad.view(-1)[0] = math.inf
            return
    raise RuntimeError("inject_inf: this rank holds no gradient element to write an inf into")


def train_step(
    par: Parallel,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    *,
    inject: bool = False,
    timer: PhaseTimer | None = None,
    comm: CommDebugMode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the loss and the global unscaled gradient norm, on the device.

    No host read here: with a fused optimizer the scaler's skip decision and clipping stay on the
    device. ``inject``: write an inf into this rank's first gradient after backward. ``timer`` and
    ``comm`` (CommDebugMode) cover the scaler phase: clip_grad_norm_ + step + update.
    """
    loss = par.forward_backward(x, y, optimizer, scaler, cfg)
    if inject:
        # After backward the gradients are already reduced (DDP, FSDP): only this rank sees it.
        inject_inf_(par.state_module)
    if timer is not None:
        timer.start()
    with comm if comm is not None else nullcontext():
        # One collective gives every rank the same skip decision and the same global norm.
        grad_norm = scaler.clip_grad_norm_(optimizer, cfg.max_norm)
        scaler.step(optimizer)
        scaler.update()
    if timer is not None:
        timer.stop()
    return loss, grad_norm


def train(
    cfg: TrainConfig, d: Dist, *, config_path: str | Path | None, resume: bool, t_start: float
) -> dict[str, Any]:
    """Runs the job on an initialized ``d``; returns the summary (rank 0's records)."""
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

    # The same initial model on every rank, laid out as cfg.parallelism (lm.parallel).
    par = build_parallel(cfg, d)
    # The ranks of one data-parallel replica (a TP group, a pipeline) draw the same batches.
    random.seed(cfg.seed + par.dp_rank)
    sampler = torch.Generator().manual_seed(cfg.seed + par.dp_rank)
    logger.info("parallelism %s: %s", cfg.parallelism, par.describe)
    optimizer = make_optimizer(par.state_module, cfg, d.device)
    scaler = GradScaler(
        d.device.type,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
        enabled=cfg.amp,
    )
    # The gradients' layout (DDP's replication, FSDP1's sharding, a pipeline stage), for the
    # global norm of clip_grad_norm_; DTensor gradients carry theirs.
    par.setup_scaler(scaler)
    num_params = par.num_params
    logger.info("model: %.2fM parameters", num_params / 1e6)

    start_step = 0
    if resume:
        start_step = load_checkpoint(
            ckpt_path,
            model=par.state_module,
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
    tokens_per_step = cfg.batch_size * cfg.block_size * par.dp_size
    # CommDebugMode counts the collectives of the scaler phase on one step after warm-up (the
    # second of this run, or the only one); that step is left out of the timing median.
    measure_step = start_step + min(2, cfg.steps - start_step)
    comm_counts: dict[str, int] = {}
    scaler_times: list[float] = []
    timer = PhaseTimer(d.device)
    skipped_steps: list[int] = []  # this rank's view, checked against the others at the end
    train_time = 0.0
    eval_loss = None
    step = start_step

    def checkpoint(at_step: int) -> None:
        save_checkpoint(
            ckpt_path,
            step=at_step,
            model=par.state_module,
            optimizer=optimizer,
            scaler=scaler,
            sampler=sampler,
            cfg=cfg,
            d=d,
            sharded=par.sharded_checkpoint,
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
                comm = CommDebugMode() if step == measure_step else None
                loss, grad_norm = train_step(
                    par,
                    optimizer,
                    scaler,
                    x,
                    y,
                    cfg,
                    inject=inject_here and step in inject_steps,
                    timer=timer,
                    comm=comm,
                )
                # The step's host reads, all after it: metrics, the agreed skip flag, next scale.
                loss_value, norm_value = torch.stack([loss.float(), grad_norm]).tolist()
                if comm is not None:
                    comm_counts = {str(op): n for op, n in comm.get_comm_counts().items()}
                else:
                    scaler_times.append(timer.seconds())
                skipped = scaler.step_was_skipped
                next_scale = scaler.get_scale()
                dt = time.perf_counter() - t0
                train_time += dt
                if skipped:
                    skipped_steps.append(step)

                record = step_record(
                    step,
                    loss=loss_value,
                    scale=scale,
                    skipped=skipped,
                    grad_norm=norm_value,
                    lr=lr,
                    tokens_per_s=tokens_per_step / dt,
                )
                if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.steps:
                    eval_loss = evaluate(par, held_out, cfg, d)
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
    eval_loss = evaluate(par, held_out, cfg, d)
    final_scale = scaler.get_scale()

    # Every rank must have skipped the same steps and hold the same scale and parameters.
    # Parameters are compared in full (DTensors gathered, FSDP1 unsharded) between the ranks that
    # hold the same ones: all of them, or the replicas of each pipeline stage.
    digest = par.params_digest()
    views = gather_objects((skipped_steps, final_scale, par.replica_key, digest), d)
    first_of_replica = {}  # replica key -> digest of the first rank holding those parameters
    for _, _, key, dig in views:
        first_of_replica.setdefault(key, dig)
    consistent = all(v[:2] == views[0][:2] and v[3] == first_of_replica[v[2]] for v in views)
    if not consistent:
        for r, v in enumerate(views):
            logger.error("rank %d: skipped steps %s, scale %g, replica %d, params %s", r, *v)
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
        parallelism=cfg.parallelism,
        layout=par.describe,
        scaler_collectives_per_step=sum(comm_counts.values()) if comm_counts else None,
        scaler_collectives=comm_counts,
        scaler_phase_ms_median=1e3 * statistics.median(scaler_times) if scaler_times else None,
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
            "loss %.4f -> %.4f, eval loss %.4f, %.0f tok/s, wall %.1f s; ranks consistent: %s; "
            "scaler phase (clip_grad_norm_ + step + update): %s collective(s) %s, median %.3f ms",
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
            summary["scaler_collectives_per_step"],
            comm_counts,
            summary["scaler_phase_ms_median"] or math.nan,
        )
    return summary
