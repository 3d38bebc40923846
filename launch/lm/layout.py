"""``Parallel``: the model laid out over the ranks, as the train step, the evaluation and the
checkpoint see it, whatever the layout (``lm.parallel`` builds one per ``--parallelism``;
``lm.pipeline`` subclasses it for pipeline stages)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.tensors import params_digest
from distscaler import GradScaler
from lm.config import TrainConfig

__all__ = ["Parallel"]


@dataclass(kw_only=True)
class Parallel:
    """The model laid out over the ranks.

    Attributes:
        model: the module the train step and the evaluation call (wrapped where a wrapper must
            run the forward: DDP, FSDP1; ``fully_shard`` and tensor parallelism work in place).
        state_module: whose ``parameters()`` the optimizer gets and whose state is checkpointed
            (DDP: the unwrapped module, as before; otherwise ``model``).
        dp_rank, dp_size: this rank's data-parallel replica and their number: the ranks of one
            replica (a TP group, one pipeline) draw the same batches.
        replica_key: ranks with equal keys hold the same full parameters (pp: the stage index).
        register: modules to ``scaler.register_model(module, grad_layout=...)``.
        sharded_checkpoint: model and optimizer go to torch.distributed.checkpoint (DCP).
    """

    name: str
    model: nn.Module
    state_module: nn.Module
    dp_rank: int = 0
    dp_size: int = 1
    replica_key: int = 0
    register: list[tuple[nn.Module, Any]] = field(default_factory=list)
    sharded_checkpoint: bool = True
    describe: str = ""
    num_params: int = 0
    full_params: Callable[[], Any] = nullcontext

    def setup_scaler(self, scaler: GradScaler) -> GradScaler:
        for module, grad_layout in self.register:
            scaler.register_model(module, grad_layout=grad_layout)
        return scaler

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        scaler: GradScaler,
        cfg: TrainConfig,
    ) -> torch.Tensor:
        """Forward, ``scaler.scale(loss).backward()``; returns the mean loss (detached)."""
        with torch.autocast(x.device.type, dtype=torch.float16, enabled=cfg.amp):
            logits = self.model(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        return loss.detach()

    def loss_sums(self, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> torch.Tensor | None:
        """Per-sequence summed loss ``(B,)`` in fp32 (None on ranks without the loss)."""
        with torch.autocast(x.device.type, dtype=torch.float16, enabled=cfg.amp):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        return loss.view(y.shape).sum(1)

    def params_digest(self) -> str:
        """SHA-256 of the full parameters (DTensors gathered, FSDP1 unsharded): collective."""
        with self.full_params():
            return params_digest(self.state_module.parameters())
