"""A stand-in for ROLL's ``FSDP2TrainStrategy``, for where ROLL's source is not importable (CI).

ROLL is not on PyPI (``roll`` there is an unrelated HTTP framework) and CI installs from PyPI
only; tests/_roll_scenarios.py drives ROLL's own class where its source imports (the ``.venv-roll``
of docs/integrations/roll.md) and this one elsewhere. What it mirrors, from ROLL 0.3.0
(``roll/distributed/strategy/fsdp2_strategy.py``, sha256
``distscaler.integrations.roll.TESTED_SOURCE_SHA256``), minus Ray, Ulysses CP, expert parallelism,
CPU offload, multi-modal inputs and the HF save:

* ``initialize`` (lines 1362-1414): FSDP2 (``fully_shard`` per decoder layer and at the root) with
  ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32, cast_forward_inputs=True)``, fp32 master
  weights, then::

      if self.param_dtype == torch.float16:
          from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
          self.scaler = ShardedGradScaler(growth_interval=400)
      else:
          self.scaler = None

  and ``optim.AdamW`` with the training args, ``transformers.get_scheduler``;
* ``_clip_grad_norm`` (lines 1435-1452), its dense path: ``clip_grad_norm_(self.model.parameters(),
  max_norm=max_norm)``, a DTensor norm made a full tensor;
* ``train_step`` (lines 1565-1682), per mini-batch ``loss_func(data, logits)``, ``loss /
  gradient_accumulation_steps``, ``self.scaler.scale(loss).backward()``; at the sync boundary::

      if self.scaler is not None:
          self.scaler.unscale_(self.optimizer)
      grad_norm = self._clip_grad_norm(
          max_norm=self.worker.pipeline_config.max_grad_norm,
      )
      metrics[f"{self.worker_config.name}/grad_norm"] = grad_norm.item()

      if self.scaler is not None:
          self.scaler.step(self.optimizer)
          self.scaler.update()
      else:
          if not torch.isfinite(grad_norm):
              logger.warning(f"WARN: rank {dist.get_rank()} grad_norm is not finite: {grad_norm}")
          else:
              self.optimizer.step()
          self.scheduler.step()
          self.optimizer.zero_grad(set_to_none=True)

* ``save_checkpoint`` / ``load_checkpoint`` (lines 371-442, 503-655): DCP of the model's state
  dict, ``"optimizer"``, ``"scheduler"``: no scaler state.

The batch is `Batch` (ROLL's ``DataProto``: ``.batch``, ``.meta_info``, ``make_iterator``).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import optim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_


class Batch:
    """ROLL's ``DataProto``, the part ``train_step`` reads."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta_info: dict[str, Any]) -> None:
        self.batch = tensors
        self.meta_info = meta_info

    def __len__(self) -> int:
        return int(self.batch["input_ids"].shape[0])

    def make_iterator(self, mini_batch_size: int, epochs: int) -> Iterator[Batch]:
        for _ in range(epochs):
            for i in range(0, len(self), mini_batch_size):
                part = {k: v[i : i + mini_batch_size] for k, v in self.batch.items()}
                yield Batch(part, dict(self.meta_info))


class FSDP2TrainStrategy(ABC):  # noqa: B024 - ROLL's strategies derive from ABC (InferenceStrategy)
    """ROLL's ``FSDP2TrainStrategy``, the parts listed in the module docstring."""

    strategy_name = "fsdp2_train"

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_config = worker.worker_config
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.scaler: Any = None
        self.cpu_offload_enabled = False
        self.ep_enabled = False

    def initialize(self, model_provider: Callable[..., torch.nn.Module]) -> None:
        from transformers import get_scheduler

        config = self.worker_config.strategy_args.strategy_config
        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        self.param_dtype = dtypes[config.get("param_dtype", "bf16")]
        self.save_only_model = config.get("save_only_model", False)
        world = dist.get_world_size()
        self.worker.rank_info.dp_rank = dist.get_rank()
        self.worker.rank_info.dp_size = world
        self.worker.rank_info.cp_size, self.worker.rank_info.cp_rank = 1, 0
        self.device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        model = model_provider(
            tokenizer=None, model_args=self.worker_config.model_args, is_trainable=True
        )
        self.worker_config.training_args.max_steps //= world
        policy = MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.device_mesh, mp_policy=policy)
        fully_shard(model, mesh=self.device_mesh, mp_policy=policy)
        self.model = model
        if self.param_dtype == torch.float16:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(growth_interval=400)
        else:
            self.scaler = None
        args = self.worker_config.training_args
        trainable = (p for p in self.model.parameters() if p.requires_grad)
        self.optimizer = optim.AdamW(
            trainable,
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.weight_decay,
        )
        self.scheduler = get_scheduler(
            args.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=args.get_warmup_steps(args.max_steps),
            num_training_steps=args.max_steps,
        )
        dist.barrier()

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm=max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def train_step(self, batch: Batch, loss_func: Callable[..., Any], no_sync: bool = False) -> Any:
        self.model.train()
        args = self.worker_config.training_args
        mini_batch_size = args.per_device_train_batch_size
        data_iter = batch.make_iterator(mini_batch_size=mini_batch_size, epochs=1)
        mini_steps = len(batch) // mini_batch_size
        gradient_accumulation_steps = args.gradient_accumulation_steps
        metrics: dict[str, Any] = {}
        for step in range(mini_steps):
            data = next(data_iter)
            sync_boundary = (
                (step + 1) % gradient_accumulation_steps == 0 or (step + 1 == mini_steps)
            ) and not no_sync
            with (
                contextlib.nullcontext(),
                torch.autocast(device_type="cpu", dtype=self.param_dtype),
            ):
                logits = self.model(
                    input_ids=data.batch["input_ids"],
                    attention_mask=data.batch["attention_mask"],
                    position_ids=data.batch["position_ids"],
                    use_cache=False,
                ).logits
                loss, loss_reduced = loss_func(data, logits)
                for k, v in loss_reduced.items():
                    metrics.setdefault(k, []).append(v)
                loss = loss / gradient_accumulation_steps
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            if sync_boundary:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                grad_norm = self._clip_grad_norm(max_norm=self.worker.pipeline_config.max_grad_norm)
                metrics[f"{self.worker_config.name}/grad_norm"] = grad_norm.item()
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    if torch.isfinite(grad_norm):
                        self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _state(self) -> dict[str, Any]:
        return {
            **self.model.state_dict(),
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
        }

    def save_checkpoint(self, save_dir: str, global_step: int, ckpt_id: str, **kwargs: Any) -> Any:
        os.makedirs(save_dir, exist_ok=True)
        if not self.save_only_model:
            dcp.save(state_dict=self._state(), checkpoint_id=os.path.join(save_dir, "dcp"))
        return {}

    def load_checkpoint(self, load_dir: str, tag: str = "checkpoint", **kwargs: Any) -> None:
        path = os.path.join(load_dir, "dcp")
        if os.path.isdir(path):
            state = self._state()
            dcp.load(state_dict=state, checkpoint_id=path)
            self.model.load_state_dict(
                {k: v for k, v in state.items() if k not in ("optimizer", "scheduler")}
            )
