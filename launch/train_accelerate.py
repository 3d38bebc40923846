"""The reference job (``launch/train.py``'s byte-level GPT) under HuggingFace Accelerate.

Same model, data, optimizer and config files as ``launch/train.py`` (the ``lm`` modules); the
training loop is Accelerate's (``accelerator.prepare``, ``accelerator.backward``,
``accelerator.clip_grad_norm_``, ``optimizer.step()``, an ``AcceleratedScheduler``), with
distscaler put into the accelerator by one call, ``distscaler.integrations.accelerate.install``.

Two CPU processes (gloo), fp16 autocast, DDP::

    accelerate launch --config_file configs/accelerate/multi_cpu.yaml launch/train_accelerate.py

A seconds-long smoke run with an inf injected on rank 1 at step 5 (every rank skips it)::

    accelerate launch --config_file configs/accelerate/multi_cpu.yaml \
        launch/train_accelerate.py --config configs/smoke.yaml --data launch/train.py \
        --inject-inf 5 --out runs/acc_smoke

GPUs: ``configs/accelerate/multi_gpu.yaml`` (DDP) or ``configs/accelerate/fsdp.yaml`` (FSDP2);
set ``num_processes`` there to the number of GPUs. A single process: ``python
launch/train_accelerate.py``.

Options (as ``launch/train.py``; config values come from ``TrainConfig``'s defaults, the YAML file,
then the command line)::

    --config FILE     YAML config of launch/train.py (default: configs/default.yaml)
    --steps N         total number of optimizer steps
    --out DIR         output folder (default: runs/accelerate)
    --data PATH       text file or folder to train on instead of the stdlib sources
    --inject-inf S    write an inf into one gradient on the last rank only at step S (repeatable;
                      adds to the config's inject_inf steps)
    --ds-config FILE  take the loss-scale settings from a DeepSpeed config's fp16 section
                      (distscaler.ScalerConfig.from_deepspeed) instead of the YAML's
    --resume          continue from DIR/state (accelerator.load_state)

Outputs in ``--out`` (rank 0): ``metrics.jsonl`` (per step: ``step``, ``loss``, ``scale``,
``skipped`` from ``accelerator.optimizer_step_was_skipped``, ``grad_norm`` from
``accelerator.clip_grad_norm_``, ``lr``), ``summary.json`` (every rank's skipped steps, final
scale and parameter digest, and whether they agree) and ``state/`` (``accelerator.save_state``).
The job fails if the ranks disagree (``lm.agreement.ranks_agree``, the check of ``train.py``).
Every package it needs (the ``accelerate`` extra) is checked before it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from common.requirements import require

logger = logging.getLogger("train_accelerate")


class Progress:
    """The step and this rank's batch sampler, checkpointed with ``register_for_checkpointing``."""

    def __init__(self, seed: int) -> None:
        import torch

        self.step = 0
        self.sampler = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.set_state(state["sampler"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--steps", type=int, help="total number of optimizer steps")
    parser.add_argument("--out", help="output folder (default: runs/accelerate)")
    parser.add_argument("--data", help="text file or folder (default: the stdlib *.py sources)")
    parser.add_argument("--inject-inf", type=int, action="append", default=[], metavar="STEP")
    parser.add_argument("--ds-config", help="DeepSpeed config whose fp16 section sets the scaler")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/state")
    return parser.parse_args(argv)


def scaler_config(cfg: Any, args: argparse.Namespace) -> Any:
    """What ``install`` gets: the ScalerConfig of ``--ds-config``'s fp16 section, else the job
    config's ``scaler`` section (disabled without ``amp``)."""
    from distscaler import ScalerConfig

    if args.ds_config and cfg.amp:
        return ScalerConfig.from_deepspeed(args.ds_config)
    return cfg.scaler if cfg.amp else dataclasses.replace(cfg.scaler, enabled=False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    require("accelerate", "launch/train_accelerate.py")
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from common.tensors import params_digest
    from distscaler.integrations.accelerate import install
    from lm.agreement import RankView, ranks_agree
    from lm.config import DEFAULT_CONFIG, ConfigError, load_config
    from lm.data import get_batch, load_corpus
    from lm.faults import inject_inf_
    from lm.metrics import METRICS_NAME, SUMMARY_NAME, step_record, write_summary
    from lm.model import ByteGPT
    from lm.optim import lr_at, make_optimizer

    config_path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    out = args.out or "runs/accelerate"
    try:
        cfg = load_config(config_path, steps=args.steps, out=out, data=args.data)
    except ConfigError as e:
        print(f"{config_path or '(built-in defaults)'}: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    accelerator = Accelerator(
        mixed_precision="fp16" if cfg.amp else "no",
        # Without a GPU, processes started by torch's launcher join a gloo group (MULTI_CPU).
        cpu=cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()),
    )
    rank, world_size = accelerator.process_index, accelerator.num_processes
    logging.basicConfig(
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if accelerator.device.type == "cpu":
        torch.set_num_threads(cfg.num_threads or 1)
    inject_steps = set(args.inject_inf) | set(cfg.inject_inf.steps if cfg.inject_inf else [])
    inject_rank = cfg.inject_inf.rank if cfg.inject_inf else world_size - 1
    if inject_steps and not 0 <= inject_rank < world_size:
        raise ValueError(f"inject_inf.rank must be in [0, {world_size}), got: {inject_rank}")

    # One call: distscaler scales, skips, clips and checkpoints for this accelerator
    # (GradScaler.from_config of the config's scaler section or of --ds-config's fp16 section).
    scaler = install(accelerator, scaler_config(cfg, args))

    train_data, held_out, num_files = load_corpus(cfg)
    torch.manual_seed(cfg.seed)
    raw_model = ByteGPT(cfg)
    optimizer = make_optimizer(raw_model, cfg, accelerator.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s + 1, cfg) / cfg.lr)
    model, optimizer, scheduler = accelerator.prepare(raw_model, optimizer, scheduler)
    progress = Progress(cfg.seed + rank)
    accelerator.register_for_checkpointing(progress)
    state_dir = Path(cfg.out) / "state"
    if args.resume:
        accelerator.load_state(str(state_dir))
        logger.info("resumed at step %d, scale %g", progress.step, scaler.get_scale())
    logger.info(
        "%s, %d process(es), device %s, %d files, scaler %r",
        accelerator.distributed_type,
        world_size,
        accelerator.device,
        num_files,
        scaler,
    )

    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    metrics = open(Path(cfg.out) / METRICS_NAME, "a" if args.resume else "w", encoding="utf-8")  # noqa: SIM115
    skipped_steps: list[int] = []
    try:
        while progress.step < cfg.steps:
            step = progress.step + 1
            lr = scheduler.get_last_lr()[0]
            starts = torch.randint(
                len(train_data) - cfg.block_size - 1, (cfg.batch_size,), generator=progress.sampler
            )
            x, y = get_batch(train_data, starts, cfg.block_size, accelerator.device)
            scale = scaler.get_scale()
            logits = model(x)  # (B, T, vocab); fp16 autocast inside, installed by Accelerate
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            accelerator.backward(loss)
            if step in inject_steps and rank == inject_rank:
                # After DDP's all-reduce: only this rank sees the inf.
                inject_inf_(accelerator.unwrap_model(model))
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_norm)
            optimizer.step()
            scheduler.step()  # Accelerate skips it when the optimizer step was skipped
            optimizer.zero_grad(set_to_none=True)
            skipped = accelerator.optimizer_step_was_skipped
            if skipped:
                skipped_steps.append(step)
            progress.step = step
            loss_value, norm_value = torch.stack([loss.detach().float(), grad_norm]).tolist()
            if accelerator.is_main_process:
                record = step_record(
                    step,
                    loss=loss_value,
                    scale=scale,
                    skipped=skipped,
                    grad_norm=norm_value,
                    lr=lr,
                )
                metrics.write(json.dumps(record) + "\n")
            if cfg.log_interval and step % cfg.log_interval == 0:
                logger.info(
                    "step %d/%d: loss %.4f scale %g grad_norm %.3f skipped %s",
                    step,
                    cfg.steps,
                    loss_value,
                    scale,
                    norm_value,
                    skipped,
                )
    finally:
        metrics.close()
    accelerator.save_state(str(state_dir))

    final_scale = scaler.get_scale()
    view = RankView(
        rank=rank,
        skipped_steps=tuple(skipped_steps),
        scale=final_scale,
        params_digest=params_digest(accelerator.unwrap_model(model).parameters()),
    )
    views = gather_object([view])
    problems = ranks_agree(views)
    for problem in problems:
        logger.error("ranks disagree: %s", problem)
    consistent = not problems
    summary = {
        "steps": progress.step,
        "world_size": world_size,
        "distributed_type": str(accelerator.distributed_type),
        "inject_steps": sorted(inject_steps),
        "ranks": [dataclasses.asdict(v) for v in views],
        "ranks_consistent": consistent,
        "final_scale": final_scale,
        "wall_s": time.perf_counter() - t_start,
        "learning_rate": scheduler.get_last_lr()[0],
    }
    if accelerator.is_main_process:
        write_summary(Path(cfg.out) / SUMMARY_NAME, summary)
        logger.info(
            "done: %d steps, skipped %s, final scale %g; ranks consistent: %s",
            progress.step,
            skipped_steps,
            final_scale,
            consistent,
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # Release the DDP model (it holds the gloo process group) and collect reference cycles now,
    # while the interpreter is alive: left to interpreter finalization, gloo's worker threads
    # aborted a finished run once on a loaded CI runner ("terminate called without an active
    # exception", SIGABRT after "done").
    model, optimizer, scheduler = accelerator.free_memory(model, optimizer, scheduler)
    del raw_model
    gc.collect()
    if not consistent:
        raise SystemExit(
            "ranks disagree on skipped steps, scale or parameters: " + "; ".join(problems)
        )
    return summary


if __name__ == "__main__":
    main()
