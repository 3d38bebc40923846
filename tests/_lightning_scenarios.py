"""Lightning scenarios run inside spawned gloo ranks (tests/test_lightning.py checks the results).

Each scenario runs ``lightning.pytorch.Trainer.fit`` on the 2 CPU ranks of the spawn (the process
group already exists; Lightning sees ``LOCAL_RANK`` and does not launch processes itself) with a
tiny MLP, fp16, ``AdamW``, ``gradient_clip_val=1.0``, a step-interval ``StepLR`` and an inf written
into one gradient of the last rank only, after DDP's all-reduce, at batch ``INJECT_STEP``:

* ``ddp``: stock (Lightning's ``MixedPrecision("16-mixed", "cpu")``, torch's scaler; foreach AdamW,
  since stock refuses clipping with a fused one) next to ours (``DistScalerPrecision``, fused AdamW),
  then ours resumed from a ``trainer.save_checkpoint`` file.
* ``fsdp2``: ``ModelParallelStrategy(data_parallel_size=2)`` with ``fully_shard`` in
  ``configure_model`` (stock Lightning refuses "16-mixed" there), then resumed from its distributed
  checkpoint.
* ``tp``: ``ModelParallelStrategy(tensor_parallel_size=2)`` with a colwise/rowwise plan: sharded
  and replicated DTensor gradients in one norm.

Nothing here asserts: every rank runs the same collectives whatever it sees, and the parent process
compares the ranks.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from _common import mlp
from _torch_gaps import GAPS, run_case, torch_gaps
from torch.utils.data import DataLoader, TensorDataset

from common.tensors import params_digest

NUM_STEPS = 5
INJECT_STEP = 2  # batch index of the inf, on the last rank only
RESUME_STEPS = 2  # steps run after a resume
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 3
MAX_NORM = 1.0
LOSS_FACTOR = 50.0  # gradients of norm > MAX_NORM, so that clipping really scales


def _module_class() -> type:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        """A 2-layer MLP that records, per step, what the parent process compares across ranks."""

        def __init__(self, fused: bool, parallel: str | None = None) -> None:
            super().__init__()
            self.net = mlp(0)
            self.fused = fused
            self.parallel = parallel
            self.batch = -1
            self.rec: dict[str, list] = {
                k: [] for k in ("seen", "ref_norm", "norm", "skipped", "scale", "digest", "last_epoch")
            }  # fmt: skip
            self.start_state: dict[str, Any] | None = None

        def configure_model(self) -> None:
            if self.parallel is None or getattr(self, "_configured", False):
                return
            self._configured = True
            mesh = self.device_mesh
            if self.parallel == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                dp = mesh["data_parallel"]
                fully_shard(self.net[0], mesh=dp)
                fully_shard(self.net, mesh=dp)
            else:  # tensor parallel: weights sharded, the rowwise bias replicated
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
                parallelize_module(self.net, mesh["tensor_parallel"], plan)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.batch = batch_idx
            return self.net(batch[0]).float().pow(2).mean() * LOSS_FACTOR

        def on_after_backward(self) -> None:
            # After DDP's all-reduce (FSDP2's reduce-scatter): the inf reaches one rank only.
            rank, world = dist.get_rank(), dist.get_world_size()
            if self.batch == INJECT_STEP and rank == world - 1:
                grad = self.net[0].weight.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.view(-1)[0] = math.inf
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            self.rec["seen"].append(any(not bool(g.isfinite().all()) for g in local))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # Reference: torch's 2-norm of the full (gathered), unscaled gradients, in float64.
            full = [p.grad for p in self.parameters() if p.grad is not None]
            full = [(g.full_tensor() if hasattr(g, "full_tensor") else g).double() for g in full]
            scale = self.trainer.precision_plugin.scaler.get_scale()
            norm = torch.linalg.vector_norm(torch.stack([f.norm() for f in full])) / scale
            self.rec["ref_norm"].append(float(norm))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            plugin = self.trainer.precision_plugin
            optimizer = self.trainer.optimizers[0]
            scheduler = self.trainer.lr_scheduler_configs[0].scheduler
            scaler = plugin.scaler
            if hasattr(plugin, "step_was_skipped"):  # ours
                self.rec["skipped"].append(plugin.step_was_skipped(optimizer))
                norm = plugin.grad_norm(optimizer)
                self.rec["norm"].append(None if norm is None else float(norm))
            self.rec["scale"].append(scaler.get_scale())
            self.rec["digest"].append(params_digest(self.parameters()))
            self.rec["last_epoch"].append(scheduler.last_epoch)

        def on_train_start(self) -> None:
            self.start_state = self.trainer.precision_plugin.scaler.state_dict()

        def configure_optimizers(self) -> Any:
            fused = self.fused
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused, foreach=not fused)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Tiny


def _logger() -> Any:
    from lightning.pytorch.loggers import Logger

    class ListLogger(Logger):
        """Keeps what Lightning's logging hands to a logger (``log_every_n_steps=1``)."""

        name, version = "list", 0

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    return ListLogger()


def _data() -> DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    return DataLoader(TensorDataset(x), batch_size=4)


def _fit(kind: str, strategy: Any, steps: int, ckpt_path: str | None = None, **module_kw: Any):
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision

    from distscaler import GradScaler
    from distscaler.integrations.lightning import DistScalerPrecision

    if kind == "stock":
        plugin = MixedPrecision(
            "16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        )
    else:
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        plugin = DistScalerPrecision("16-mixed", device="cpu", scaler=scaler)
    logger = _logger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), num_nodes=1, strategy=strategy,
        plugins=[plugin], max_steps=steps, gradient_clip_val=MAX_NORM, logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model = _module_class()(**module_kw)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    out = dict(model.rec)
    out["metrics"] = [
        {k: v for k, v in row.items() if k.startswith("distscaler/")} for _, row in logger.rows
    ]
    out["start_state"] = model.start_state
    out["final_state"] = plugin.scaler.state_dict()
    if kind == "ours":
        totals = plugin.scaler.skip_totals
        out["skip_totals"] = [totals.num_updates, totals.num_skipped, totals.last_skipped]
    out["precision_flag"] = trainer.precision
    out["strategy"] = type(trainer.strategy).__name__
    out["grad_type"] = type(next(model.parameters())).__name__
    return trainer, out


def ddp(tmp: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    def strategy() -> Any:
        return DDPStrategy(process_group_backend="gloo")

    _, stock = _fit("stock", strategy(), NUM_STEPS, fused=False)
    trainer, ours = _fit("ours", strategy(), NUM_STEPS, fused=True)
    path = os.path.join(tmp, "ddp.ckpt")
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ours["checkpoint_state"] = ckpt.get("DistScalerPrecision")
    _, resumed = _fit("ours", strategy(), NUM_STEPS + RESUME_STEPS, ckpt_path=path, fused=True)
    return {"stock": stock, "ours": ours, "resumed": resumed}


def model_parallel(tmp: str, parallel: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = dist.get_world_size()

    def strategy() -> Any:
        sizes = (world, 1) if parallel == "fsdp2" else (1, world)
        return ModelParallelStrategy(data_parallel_size=sizes[0], tensor_parallel_size=sizes[1])

    trainer, ours = _fit("ours", strategy(), NUM_STEPS, fused=True, parallel=parallel)
    result = {"ours": ours}
    if parallel == "fsdp2":
        path = os.path.join(tmp, "fsdp2-ckpt")
        trainer.save_checkpoint(path)
        _, resumed = _fit(
            "ours", strategy(), NUM_STEPS + RESUME_STEPS, ckpt_path=path, fused=True,
            parallel=parallel,
        )  # fmt: skip
        result["resumed"] = resumed
    return result


def everything(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    # Lightning reads the process layout from the environment; the group already exists.
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
    )  # fmt: skip
    # A crash (torch's own, on an old torch) fails its scenario only (tests/_torch_gaps.py).
    return {
        GAPS: torch_gaps(world_size),
        "ddp": run_case(lambda: ddp(tmp)),
        "fsdp2": run_case(lambda: model_parallel(tmp, "fsdp2")),
        "tp": run_case(lambda: model_parallel(tmp, "tp")),
    }
