"""``--parallelism pp``: ``ByteGPT`` cut into pipeline stages of torch.distributed.pipelining.

Ranks form a (dp, pp) mesh: rank = dp_rank * pp_stages + stage, so the stages of one pipeline are
neighbours (one node). Stage 0 holds the embeddings and the first blocks, the last stage the last
blocks, the final norm and the output head; blocks are split as evenly as possible, the earlier
stages taking the extra ones (a stage may hold no block). The head is **untied** from the
embedding (the two ends live on different ranks): it starts as a copy of the embedding, so the
initial function is the DDP model's, and the two then train apart.

The loss is scaled on the last stage (the schedule's ``loss_fn`` returns ``scaler.scale(loss)``);
the other stages create the scale with ``scaler.materialize`` since their gradients arrive scaled.
With more ranks than stages, each stage is wrapped in DDP over its replicas (the ``dp`` axis);
torch's pipelining then all-reduces once, after the last micro-batch.

Cost outside the scaler phase, per step: the schedule's send/recv of activations and gradients,
DDP's all-reduce when dp > 1, and one broadcast of the loss from the last stage to the other ranks
(for the metrics line).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.distributed import Dist
from common.torch_compat import pipeline_eval, pipeline_grad_kwargs
from common.wrapping import ddp_device_ids
from distscaler import GradScaler
from lm.config import TrainConfig
from lm.layout import Parallel
from lm.model import ByteGPT

__all__ = ["PipelineLoss", "PipelineParallel", "StageModule", "build_pipeline", "stage_blocks"]


def stage_blocks(n_layer: int, num_stages: int, stage: int) -> range:
    """The block indices of ``stage``: an even split, earlier stages taking the extra blocks."""
    bounds = [(i * n_layer + num_stages - 1) // num_stages for i in range(num_stages + 1)]
    return range(bounds[stage], bounds[stage + 1])


class StageModule(nn.Module):
    """One pipeline stage of a ``ByteGPT``; parameter names keep the full model's (``blocks.3``),
    so that the stages' checkpoints never collide."""

    def __init__(self, gpt: ByteGPT, stage: int, num_stages: int) -> None:
        super().__init__()
        first, last = stage == 0, stage == num_stages - 1
        self.tok_emb = gpt.tok_emb if first else None
        self.pos_emb = gpt.pos_emb if first else None
        self.drop = gpt.drop if first else None
        self.blocks = nn.ModuleDict(
            {str(i): gpt.blocks[i] for i in stage_blocks(len(gpt.blocks), num_stages, stage)}
        )
        self.ln_f = gpt.ln_f if last else None
        self.head: nn.Linear | None = None
        if last:
            self.head = nn.Linear(gpt.head.in_features, gpt.vocab_size, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(gpt.head.weight)  # untied copy of the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            assert self.pos_emb is not None and self.drop is not None
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T) -> (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            assert self.ln_f is not None
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


class PipelineLoss:
    """The schedule's ``loss_fn`` on the last stage: the scaled mean loss of a micro-batch while
    training (the unscaled value is kept in ``losses``), per-sequence summed losses in eval."""

    def __init__(self) -> None:
        self.scaler: GradScaler | None = None
        self.losses: list[torch.Tensor] = []
        self.eval = False

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.eval:
            loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
            return loss.view(target.shape).sum(1)  # (mb,)
        assert self.scaler is not None
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.losses.append(loss.detach())
        return self.scaler.scale(loss)


@dataclass(kw_only=True)
class PipelineParallel(Parallel):
    """A :class:`Parallel` whose step and evaluation run a pipeline schedule.

    Attributes:
        schedule: the torch.distributed.pipelining schedule (``ScheduleGPipe``, ``Schedule1F1B``)
            over this rank's stage.
        loss_fn: the schedule's loss function (the last stage scales the loss with it).
        stage, num_stages: this rank's stage and the number of stages.
        loss_src: global rank of the last stage of replica 0, which broadcasts the loss.
    """

    schedule: Any
    loss_fn: PipelineLoss
    stage: int
    num_stages: int
    loss_src: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def setup_scaler(self, scaler: GradScaler) -> GradScaler:
        super().setup_scaler(scaler)
        if not self.is_last:
            # These stages never scale a loss: their gradients arrive scaled from the last one.
            scaler.materialize(next(self.state_module.parameters()).device)
        self.loss_fn.scaler = scaler
        return scaler

    def _run(self, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, *, train: bool) -> list:
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else functools.partial(pipeline_eval, self.schedule)
        with torch.autocast(x.device.type, dtype=torch.float16, enabled=cfg.amp):
            if self.is_first:
                # Contiguous: x is a view of the (B, T + 1) batch, and torch 2.6 checks strides
                # against the stage's static input_args.
                run(x.contiguous())
            elif self.is_last:
                run(target=y, losses=losses)
            else:
                run()
        return losses

    def forward_backward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        scaler: GradScaler,
        cfg: TrainConfig,
    ) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        self.loss_fn.eval = False
        self.loss_fn.losses = []
        self._run(x, y, cfg, train=True)
        if self.is_last:
            # The first step also calls loss_fn for the schedule's shape inference (on values that
            # mean nothing): the micro-batches' losses are the last ones.
            losses = self.loss_fn.losses[-cfg.pp_microbatches :]
            loss = torch.stack(losses).mean().float()
        else:
            loss = torch.zeros((), device=x.device)
        dist.broadcast(loss, src=self.loss_src)  # the metrics line is written by rank 0
        return loss

    def loss_sums(self, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> torch.Tensor | None:
        self.loss_fn.eval = True
        try:
            losses = self._run(x, y, cfg, train=False)
        finally:
            self.loss_fn.eval = False
        return torch.cat(losses) if self.is_last else None


def build_pipeline(model: ByteGPT, cfg: TrainConfig, d: Dist) -> PipelineParallel:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    num_stages = cfg.pp_stages
    dp = d.world_size // num_stages
    mesh = init_device_mesh(d.device.type, (dp, num_stages), mesh_dim_names=("dp", "pp"))
    stage, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage_module = StageModule(model, stage, num_stages).to(d.device)
    wrapped: nn.Module = stage_module
    register: list[tuple[nn.Module, Any]] = [(stage_module, "sharded")]
    describe = f"pipeline of {num_stages} stages ({cfg.pp_schedule})"
    if dp > 1:
        wrapped = DDP(
            stage_module,
            process_group=mesh["dp"].get_group(),
            device_ids=ddp_device_ids(d.device),
        )
        register = [(wrapped, None)]  # DDP's replication over dp; the stages hold different layers
        describe += f" x DDP over {dp} replicas"
    # Static shapes: no metadata inference on the first step (whose backward pass would run
    # outside DDP's no_sync and break its first-iteration bucket rebuild).
    mb, T, C = cfg.batch_size // cfg.pp_microbatches, cfg.block_size, cfg.d_model
    hidden = torch.empty(mb, T, C, device=d.device)  # (mb, T, C) fp32: residual stream
    logits_dtype = torch.float16 if cfg.amp else torch.float32
    pipe_stage = PipelineStage(
        wrapped,
        stage,
        num_stages,
        d.device,
        # requires_grad: a later stage sends the gradient of its input back
        input_args=torch.zeros(mb, T, dtype=torch.long, device=d.device)
        if stage == 0
        else hidden.clone().requires_grad_(),
        output_args=torch.empty(mb, T, model.vocab_size, dtype=logits_dtype, device=d.device)
        if stage == num_stages - 1
        else hidden,
        group=mesh["pp"].get_group(),
        **pipeline_grad_kwargs(
            output_grads=None if stage == num_stages - 1 else hidden,
            input_grads=None if stage == 0 else hidden,
        ),
    )
    loss_fn = PipelineLoss()
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.pp_schedule]
    return PipelineParallel(
        name="pp",
        model=wrapped,
        state_module=stage_module,
        dp_rank=dp_rank,
        dp_size=dp,
        replica_key=stage,
        register=register,
        describe=describe + f", {cfg.pp_microbatches} micro-batches",
        schedule=schedule_cls(pipe_stage, n_microbatches=cfg.pp_microbatches, loss_fn=loss_fn),
        loss_fn=loss_fn,
        stage=stage,
        num_stages=num_stages,
        loss_src=int(mesh.mesh[0, num_stages - 1].item()),
    )
