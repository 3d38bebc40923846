"""torchtitan's Trainer in fp16 with distscaler: its llama3 debug model, runnable without GPUs.

``distscaler.integrations.torchtitan`` is a torchtitan config module; on GPUs, in a torchtitan
checkout (its debug config reads ``./tests/assets/tokenizer`` and the ``c4_test`` data)::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module distscaler.integrations.torchtitan --config llama3.llama3_debugmodel

This script runs the same Trainer anywhere, CPU processes included: it applies the CPU shims where
needed (``launch/common/torchtitan_cpu.py``: torchtitan 0.3.0 wants triton, a GPU and a torch
nightly; each shim says why) and by default trains the debug model shrunk to 2 layers on bytes of
the Python standard library sources (``--module torchtitan_job --config llama3_debugmodel_fp16_bytes``).
Two CPU processes (gloo; FSDP2 over both)::

    torchrun --nproc-per-node 2 launch/train_torchtitan.py --inject-inf 5 --training.steps 20

Options of this script::

    --inject-inf S   write an inf into the last rank's shard of ``norm.weight``'s gradient at step
                     S (1-based, repeatable): every rank skips it and backs off
    --out DIR        torchtitan's dump folder (default runs/torchtitan); rank 0 writes
                     summary.json there

Every other flag is torchtitan's, with ``--grad_scaler.*`` for the scaler (``--training.steps 20``,
``--grad_scaler.init_scale 1024``, ``--parallelism.tensor_parallel_degree 2``,
``--dataloader.dataset_path FILE``, ``--module``/``--config`` for another config). At the end every
rank reports its skipped steps, final scale and parameter digest; the job exits non-zero if the
ranks disagree (``lm.agreement.ranks_agree``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.requirements import require


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--inject-inf", type=int, action="append", default=[])
    p.add_argument("--out", default="runs/torchtitan")
    args, rest = p.parse_known_args(argv)
    if any(s < 1 for s in args.inject_inf):
        p.error(f"--inject-inf takes steps >= 1, got: {args.inject_inf}")
    if "--module" not in rest and not any(a.startswith("--module=") for a in rest):
        rest = [
            "--module",
            "torchtitan_job",
            "--config",
            "llama3_debugmodel_fp16_bytes",
            *rest,
        ]
    return args, [*rest, "--dump_folder", args.out]


def _trainer_class(inject_steps: list[int]) -> type:
    import math

    import torch.distributed as dist

    from common.tensors import local_tensor
    from distscaler.integrations.torchtitan import DistScalerTrainer

    class Trainer(DistScalerTrainer):
        """Records each step's skip flag (one host read per step: a job's report, not the
        integration's cost) and writes the requested infs."""

        skipped_steps: list[int]

        def forward_backward_step(self, **kwargs: Any) -> Any:
            loss = super().forward_backward_step(**kwargs)
            if self.step in inject_steps and dist.get_rank() == dist.get_world_size() - 1:
                for part in self.model_parts:
                    for name, p in part.named_parameters():
                        if name == "norm.weight" and p.grad is not None:
                            local_tensor(p.grad).view(-1)[0] = math.inf
            return loss

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            if self.grad_scaler.step_was_skipped:
                self.skipped_steps.append(self.step)

    return Trainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, titan_args = parse_args(sys.argv[1:] if argv is None else argv)
    require("torchtitan", "launch/train_torchtitan.py")
    from common.torchtitan_cpu import adapt_pipeline_schedule, apply_cpu_shims

    apply_cpu_shims()  # before anything imports torchtitan's trainer; each shim only where needed
    import torch
    import torch.distributed as dist
    from torchtitan.components.metrics import BaseLogger
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from common.distributed import destroy_process_group
    from common.tensors import params_digest
    from lm.agreement import RankView, ranks_agree

    init_logger()
    config = ConfigManager().parse_args(titan_args)
    trainer = _trainer_class(args.inject_inf)(config)
    trainer.skipped_steps = []
    adapt_pipeline_schedule(trainer)
    losses: dict[int, float] = {}

    class Recorder(BaseLogger):
        def __init__(self, inner: BaseLogger) -> None:
            self.inner = inner

        def log(self, metrics: dict[str, Any], step: int) -> None:
            losses[step] = float(metrics["loss_metrics/global_avg_loss"])
            self.inner.log(metrics, step)

        def close(self) -> None:
            self.inner.close()

    trainer.metrics_processor.logger = Recorder(trainer.metrics_processor.logger)
    start = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
    seconds = time.perf_counter() - start
    pp_rank = (
        trainer.parallel_dims.get_mesh("pp").get_local_rank()
        if trainer.parallel_dims.pp_enabled
        else 0
    )
    view = RankView(
        rank=dist.get_rank(),
        skipped_steps=tuple(trainer.skipped_steps),
        scale=trainer.grad_scaler.get_scale(),
        params_digest=params_digest(p for m in trainer.model_parts for p in m.parameters()),
        replica=pp_rank,
    )
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, view)
    problems = ranks_agree(views)
    summary = {
        "steps": trainer.step,
        "losses": [losses[s] for s in sorted(losses)],
        "skipped_steps": list(trainer.skipped_steps),
        "scale": view.scale,
        "ranks_consistent": not problems,
        "problems": problems,
        "seconds": round(seconds, 2),
        "world_size": dist.get_world_size(),
        "torch": torch.__version__,
        "fused_step": trainer.fused_step,
    }
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
        first, last = summary["losses"][0], summary["losses"][-1]
        print(
            f"train_torchtitan: {trainer.step} steps in {seconds:.1f} s on {dist.get_world_size()} "
            f"ranks, loss {first:.3f} -> {last:.3f}, skipped steps {summary['skipped_steps']}, "
            f"final scale {view.scale:g}, ranks {'agree' if not problems else 'DISAGREE'}",
            flush=True,
        )
        for problem in problems:
            print(f"train_torchtitan: {problem}", file=sys.stderr, flush=True)
    destroy_process_group()  # after a barrier: gloo's teardown can hang on torch < 2.8
    if problems:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
