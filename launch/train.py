"""Reference training job for distscaler: a byte-level GPT trained with fp16 autocast and
``distscaler.GradScaler``, laid out over the ranks by ``--parallelism`` (DDP by default).

By default it trains on the Python standard library sources of the running interpreter (every
``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, ``site-packages``
excluded, read as bytes; the last ``eval_fraction`` of the bytes is held out for evaluation), so it
needs no download. ``--data PATH`` takes any file or folder instead (all files, sorted, as bytes).

The backend and device are picked automatically: NCCL and ``cuda:$LOCAL_RANK`` where CUDA is
available, gloo and the CPU otherwise. fp16 autocast is used on both.

Single node, two processes (two CPU processes here, or two GPUs); the default config
(``configs/default.yaml``) is sized for a 2-core CPU, fp16 units or not::

    torchrun --standalone --nproc-per-node=2 launch/train.py

GPUs, one process per GPU, a ~85M-parameter model with a context of 512 bytes::

    torchrun --standalone --nproc-per-node=gpu launch/train.py --config configs/gpu.yaml

Surviving a lost worker: torchrun restarts every worker (up to N times) and ``--resume auto``
continues from the last checkpoint in ``--out`` (or starts at step 0 if there is none yet), with
the same step, scale, optimizer and RNG state, so the run ends as an undisturbed one would::

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 launch/train.py --resume auto

Two nodes, one process each, c10d rendezvous (run on each node; HOST is the first node)::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=job1 launch/train.py

Other layouts (``lm/parallel.py``; each also runs on GPUs, one process per GPU)::

    torchrun --standalone --nproc-per-node=2 launch/train.py --parallelism fsdp1  # FULL_SHARD
    torchrun --standalone --nproc-per-node=2 launch/train.py --parallelism fsdp2  # fully_shard
    torchrun --standalone --nproc-per-node=4 launch/train.py --parallelism hsdp   # 2 x 2 mesh
    torchrun --standalone --nproc-per-node=2 launch/train.py --parallelism tp     # tensor par.
    torchrun --standalone --nproc-per-node=4 launch/train.py --parallelism tp     # FSDP2 x TP
    torchrun --standalone --nproc-per-node=2 launch/train.py --parallelism pp     # 2 stages
    torchrun --standalone --nproc-per-node=4 launch/train.py --parallelism pp     # 2 x DDP 2

A layout that does not fit the world size (hsdp on 2 ranks with hsdp_shard_size 2, tp or pp on
a world size that is not a multiple of tp_size / pp_stages) exits with code 2 and says why,
before any process group is created. So does a missing package of the ``train`` extra (tqdm,
PyYAML, pydantic, numpy, matplotlib): ``pip install -e ".[train]"``.

Single process, no torch.distributed::

    python launch/train.py

A seconds-long smoke run (tiny model; any text file)::

    torchrun --standalone --nproc-per-node=2 launch/train.py --config configs/smoke.yaml \\
        --data launch/train.py --out runs/smoke

Options (config values come from the ``TrainConfig`` defaults, then the YAML file, then the
command line)::

    --config FILE   YAML config (default: configs/default.yaml next to this script)
    --steps N       total number of optimizer steps (the cosine decay ends there unless
                    decay_steps is set)
    --out DIR       output folder (default: runs/default)
    --data PATH     text file or folder to train on instead of the stdlib sources
    --parallelism L ddp | fsdp1 | fsdp2 | hsdp | tp | pp (config key ``parallelism``)
    --inject-bitflip STEP:RANK
                    flip the sign bit of one gradient element on RANK after the reduce at STEP
                    (silent data corruption): the replica check skips that step on every rank
                    and the summary names the rank (distscaler.replica_check)
    --resume [auto] continue from DIR/ckpt.pt with its step, model, optimizer, scale and RNG
                    states; metrics.jsonl keeps the lines up to that step and grows from there.
                    ``--resume auto``: the same if DIR holds a checkpoint, a fresh start if not.
                    Every rank reads its own node's copy (ddp: every node's first rank writes
                    one; the sharded layouts' ckpt_dcp/ needs DIR on a shared filesystem across
                    nodes); a checkpoint on some nodes only stops the run, naming them. On
                    another world size the state carries over (DCP reshards sharded layouts)
                    but the data order changes (a warning says so).

With the default config the scaler is visibly at work: it starts at 2**20, backs off on the first
steps' overflows (skipped on every rank), then grows every ``scaler.growth_interval`` clean steps
until fp16 overflows again. ``inject_inf: {steps: [...], rank: R}`` writes an inf into one
gradient on rank R only (its local shard under FSDP/TP, its stage under pp), after the gradients
are reduced, to show that every rank still skips that step.

Outputs, written by rank 0 into ``--out``:

* ``metrics.jsonl``: one JSON object per optimizer step, each step exactly once (also across
  resumes): ``step``, ``loss`` (rank 0's micro-batch), ``scale`` (the loss scale used for that
  step), ``skipped``, ``grad_norm`` (global norm of the unscaled gradients before clipping;
  ``null`` when non-finite), ``lr``, ``tokens_per_s`` (all ranks), and ``eval_loss`` on
  evaluation steps.
* ``ckpt.pt``: model, optimizer, scaler, step and every rank's RNG / sampler state; under ddp
  the first rank of every node writes it (each node keeps a copy); for every other layout rank 0
  writes it and the model and optimizer are in ``ckpt_dcp/step-N/`` (torch.distributed.checkpoint,
  every rank writes its shards).
* ``summary.json``: the figures of the final summary, among them what the scaler phase
  (``clip_grad_norm_`` + ``step`` + ``update``) costs: ``scaler_collectives_per_step`` and
  ``scaler_collectives`` (counted with CommDebugMode on the second step of the run) and
  ``scaler_phase_ms_median`` (median wall time over the other steps; CUDA events on GPUs), and
  ``resumed_from`` (step and scaler state of the checkpoint a resumed run started from), and
  ``skipped_per_rank`` (each rank's own count of the steps it skipped in this run), and
  ``hosts`` (the hostname each rank ran on), and
  ``params_digests`` (SHA-256 of the final parameters, one per replica group: the whole model for
  every data-parallel layout, one per stage under pp; two runs of the same job compare by it).
* ``metrics.png``: loss and scale per step (``python launch/plot_metrics.py DIR`` redraws it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from common.requirements import require

logger = logging.getLogger("train")


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _step_rank(text: str) -> tuple[int, int]:
    """``"STEP:RANK"`` -> (STEP, RANK); an argparse type (its error names the argument)."""
    try:
        step, rank = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP:RANK (two integers), got: {text!r}") from None
    if step < 1 or rank < 0:
        raise argparse.ArgumentTypeError(f"STEP must be >= 1 and RANK >= 0, got: {text!r}")
    return step, rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Byte-level GPT trained with fp16 autocast and distscaler.GradScaler, "
        "laid out by --parallelism (DDP, FSDP1, FSDP2, HSDP, tensor or pipeline parallel).",
    )
    parser.add_argument("--config", help="YAML config file (default: configs/default.yaml)")
    parser.add_argument("--steps", type=int, help="total number of optimizer steps")
    parser.add_argument("--out", help="output folder (default: runs/default)")
    parser.add_argument("--data", help="text file or folder (default: the stdlib *.py sources)")
    parser.add_argument(
        "--parallelism",
        choices=["ddp", "fsdp1", "fsdp2", "hsdp", "tp", "pp"],
        help="how the model is laid out over the ranks (default: the config's, ddp)",
    )
    parser.add_argument(
        "--inject-bitflip",
        metavar="STEP:RANK",
        type=_step_rank,
        help="flip the sign bit of one gradient element on RANK after the reduce at optimizer "
        "step STEP (silent data corruption): the replica check skips that step on every rank "
        "and names the rank in the summary",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const="always",
        choices=["always", "auto"],
        help="continue from OUT/ckpt.pt and its metrics; 'auto': only if it exists",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    # Before anything is started or written: a missing package is named now, not at the plot.
    require("train", "launch/train.py")
    from common.distributed import destroy_process_group, launched, setup_distributed
    from lm.config import DEFAULT_CONFIG, ConfigError, load_config
    from lm.parallel import check_parallelism
    from lm.trainer import Trainer

    setup_logging(int(os.environ.get("RANK", 0)))
    config_path = args.config
    if config_path is None and DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
    elif config_path is None:
        logger.warning("%s not found; using the built-in defaults", DEFAULT_CONFIG)
    try:
        cfg = load_config(
            config_path,
            steps=args.steps,
            out=args.out,
            data=args.data,
            parallelism=args.parallelism,
        )
        # From the launcher's environment, before any process group exists: a layout that does
        # not fit the world size exits here rather than hang in a collective.
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if launched() else 1
        problems = check_parallelism(cfg, world_size, launched=launched())
        if args.inject_bitflip is not None and args.inject_bitflip[1] >= world_size:
            problems.append(
                f"--inject-bitflip rank must be below the world size {world_size}, "
                f"got: {args.inject_bitflip[1]}"
            )
        if problems:
            raise ConfigError(problems)
    except ConfigError as e:
        logger.error("%s: %s", config_path or "(built-in defaults)", e)
        raise SystemExit(2) from None
    d = setup_distributed(cfg.device, timeout_s=cfg.dist_timeout_s)
    if d.device.type == "cuda" and args.config is None:
        logger.info("configs/default.yaml is sized for CPUs; on GPUs try --config configs/gpu.yaml")
    # No teardown after an error: destroy_process_group is collective-like and would hang the
    # ranks that are still running (torchrun stops them instead).
    summary = Trainer(
        cfg,
        d,
        config_path=config_path,
        resume=args.resume,
        t_start=t_start,
        inject_bitflip=args.inject_bitflip,
    ).run()
    # The trainer is gone: its cycles (a DDP model) are collected while the process group lives.
    destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
