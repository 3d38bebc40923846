"""A small Lightning job with ``DistScalerPrecision``: fp16, fused AdamW, clipping, an injected inf.

Runs as is on CPU processes (gloo) and on GPUs::

    python launch/train_lightning.py --devices 2 --strategy ddp --inject-inf 5
    python launch/train_lightning.py --devices 2 --strategy fsdp2 --accelerator cuda

Lightning launches the processes itself (or joins torchrun's). Each rank prints, per step, whether
the step was skipped, the scale, the clipped norm and the learning rate; the last line is the
parameters' digest, the same on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distscaler import GradScaler
from distscaler.integrations.lightning import DistScalerPrecision


class Regression(pl.LightningModule):
    def __init__(self, inject_inf: int, fsdp2: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.inject_inf, self.fsdp2, self.batch = inject_inf, fsdp2, -1

    def configure_model(self) -> None:
        if self.fsdp2 and not hasattr(self.net, "reshard"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batch = batch_idx
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.batch == self.inject_inf and self.global_rank == self.trainer.world_size - 1:
            grad = self.net[0].weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        optimizer = self.trainer.optimizers[0]
        norm = plugin.grad_norm(optimizer)
        print(
            f"rank {self.global_rank} step {batch_idx}: skipped={plugin.step_was_skipped(optimizer)}"
            f" scale={plugin.scaler.get_scale()} norm={float(norm):.4g}"
            f" lr={optimizer.param_groups[0]['lr']:.4g}",
            flush=True,
        )

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)  # CPU too
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp2"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--inject-inf", type=int, default=5, help="batch with an inf on the last rank"
    )
    args = parser.parse_args()

    plugin = DistScalerPrecision(
        "16-mixed", device=args.accelerator, scaler=GradScaler(args.accelerator, init_scale=1024.0)
    )
    backend = "gloo" if args.accelerator == "cpu" else "nccl"
    strategy = (
        DDPStrategy(process_group_backend=backend)
        if args.strategy == "ddp"
        else ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, plugins=[plugin],
        max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Regression(args.inject_inf, fsdp2=args.strategy == "fsdp2")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer.fit(model, DataLoader(data, batch_size=8))
    digest = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(full.detach().cpu().numpy().tobytes())
    totals = plugin.scaler.skip_totals
    print(
        f"rank {trainer.global_rank}: {totals.num_skipped} of {totals.num_updates} steps skipped,"
        f" params {digest.hexdigest()[:16]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
