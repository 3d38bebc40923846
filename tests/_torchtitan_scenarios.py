"""torchtitan scenarios run inside spawned gloo ranks (tests/test_torchtitan.py checks the results).
Nothing here asserts: every rank runs the same collectives whatever it sees.

Each run builds torchtitan 0.3.0's Trainer on its llama3 debug model shrunk to 2 layers (dim 64,
byte vocabulary, sequence 32, batch 2 per rank; ``launch/common/torchtitan_cpu.py``: the CPU shims,
each with its reason, the byte data, SDPA attention) and trains it for a few steps with
``train()``, either

* "stock": torchtitan's ``Trainer`` (fp16 parameters through the same FSDP2 policy, bf16 or fp32
  for the references), or
* "ours": :class:`distscaler.integrations.torchtitan.DistScalerTrainer` from ``fp16(config)``.

An inf is written into this rank's shard of ``norm.weight``'s gradient (the final norm: every token
goes through it, so a NaN weight there poisons the next loss) after the backward of step
``INJECT_STEP`` on the last rank only. A recording metrics logger keeps what torchtitan's metrics
logger gets each step.
"""

from __future__ import annotations

import math
import os
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torchtitan_job import cpu_config

from common.tensors import local_tensor, params_digest
from common.torchtitan_cpu import adapt_pipeline_schedule, apply_cpu_shims

STEPS = 4
INJECT_STEP = 2  # 1-based, torchtitan's step numbering
INJECT_PARAM = "norm.weight"
SEED = 0


def _quiet_train_end() -> None:
    # Rank 0 sleeps 2 s at the end of Trainer.train() so that other ranks finish logging; a spawn
    # that trains a dozen times would spend most of its time there. The trainer module's own
    # ``time`` only (the ``time`` module stays as it is).
    import torchtitan.trainer as trainer_module

    if isinstance(trainer_module.time, types.ModuleType):
        trainer_module.time = types.SimpleNamespace(  # type: ignore[assignment]
            perf_counter=time.perf_counter, sleep=lambda seconds: None
        )


def _classes() -> tuple[type, type, type]:
    from torchtitan.components.metrics import BaseLogger
    from torchtitan.trainer import Trainer

    from distscaler.integrations.torchtitan import DistScalerTrainer

    class Recorder(BaseLogger):
        """torchtitan's metrics logger interface: keeps every step's metrics."""

        def __init__(self) -> None:
            self.steps: dict[int, dict[str, Any]] = {}

        def log(self, metrics: dict[str, Any], step: int) -> None:
            self.steps[step] = {k: _plain(v) for k, v in metrics.items()}

    class Probe:
        """Writes the inf, and records per step what the parent compares."""

        inject_rank = -1
        inject_step = -1
        records: list[dict[str, Any]]
        injected: list[int]
        raw_grad_norms: list[float]
        compute_dtypes: set[str]
        first_state: dict[str, Any] | None = None

        def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
            t: Any = self
            loss = super().forward_backward_step(**kwargs)  # type: ignore[misc]
            params = [p for m in t.model_parts for p in m.parameters() if p.grad is not None]
            # The gradients as they leave the backward (scaled, for ours): one collective.
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            self.raw_grad_norms.append(float(_full(norm)))
            if t.step == self.inject_step and dist.get_rank() == self.inject_rank:
                for name, p in t.model_parts[0].named_parameters():
                    if name == INJECT_PARAM:
                        local_tensor(p.grad).view(-1)[0] = math.inf
                        self.injected.append(t.step)
            return loss

        def train_step(self, data_iterator: Any) -> None:
            t: Any = self
            scaler = getattr(t, "grad_scaler", None)
            if scaler is not None and self.first_state is None:  # after a resume's load
                self.first_state = scaler.state_dict()
            super().train_step(data_iterator)  # type: ignore[misc]
            self.records.append(
                {
                    "step": t.step,
                    "skipped": bool(scaler.step_was_skipped) if scaler is not None else False,
                    "scale": scaler.get_scale() if scaler is not None else None,
                    "params": params_digest(p for m in t.model_parts for p in m.parameters()),
                }
            )

    class StockProbe(Probe, Trainer):
        pass

    class OursProbe(Probe, DistScalerTrainer):
        pass

    return Recorder, StockProbe, OursProbe


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _config(
    kind: str,
    dump: str,
    *,
    dtype: str = "float16",
    tp: int = 1,
    pp: int = 1,
    steps: int = STEPS,
    implementation: str = "fused",
    chunked: bool = True,
    scaler: dict[str, Any] | None = None,
    checkpoint_interval: int = 0,
    load_step: int = -1,
) -> Any:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from distscaler import ScalerConfig
    from distscaler.integrations.torchtitan import fp16

    config = llama3_debugmodel()
    if not chunked:
        config.loss = CrossEntropyLoss.Config(global_vocab_size=256)
    config = cpu_config(config, max_bytes=1 << 18)
    training = config.training
    training.steps, training.local_batch_size = steps, 2
    training.mixed_precision_param = dtype
    config.parallelism.tensor_parallel_degree = tp
    config.parallelism.pipeline_parallel_degree = pp
    if pp > 1:
        config.parallelism.pipeline_parallel_schedule = "1F1B"
        config.parallelism.pipeline_parallel_microbatch_size = 1
    config.activation_checkpoint = None
    config.optimizer.implementation = implementation
    config.metrics.log_freq = 1
    config.debug.seed = SEED
    config.dump_folder = dump
    config.checkpoint.enable = checkpoint_interval > 0
    config.checkpoint.interval = max(checkpoint_interval, 1)
    config.checkpoint.load_step = load_step
    config.checkpoint.load_only = load_step > 0  # resume from that step, save nothing
    if kind == "ours":
        config = fp16(config, ScalerConfig(**(scaler or {})))
    return config


def _run(kind: str, tmp: str, name: str, *, inject: bool = True, **kwargs: Any) -> dict[str, Any]:
    """One training; returns what the parent compares (or the exception stock raised)."""
    Recorder, StockProbe, OursProbe = _classes()
    config = _config(kind, os.path.join(tmp, name), **kwargs)
    trainer = (OursProbe if kind == "ours" else StockProbe)(config)
    adapt_pipeline_schedule(trainer)
    trainer.records, trainer.injected, trainer.raw_grad_norms = [], [], []
    trainer.compute_dtypes = set()
    linears = [m for m in trainer.model_parts[0].modules() if isinstance(m, torch.nn.Linear)]
    linears[0].register_forward_hook(  # the dtype FSDP2's policy computes in
        lambda module, args, output: trainer.compute_dtypes.add(str(output.dtype))
    )
    if inject:
        trainer.inject_rank, trainer.inject_step = dist.get_world_size() - 1, INJECT_STEP
    recorder = Recorder()
    trainer.metrics_processor.logger = recorder
    out: dict[str, Any] = {"error": None}
    try:
        trainer.train()
    except RuntimeError as e:
        out["error"] = str(e)
    out.update(
        metrics=[recorder.steps[s] for s in sorted(recorder.steps)],
        records=trainer.records,
        injected=trainer.injected,
        raw_grad_norms=trainer.raw_grad_norms,
        grad_type=type(next(trainer.model_parts[0].parameters())).__name__,
        compute_dtypes=sorted(trainer.compute_dtypes),
        first_state=trainer.first_state,
    )
    if kind == "ours":
        scaler = trainer.grad_scaler
        report = scaler.last_overflow
        out.update(
            fused_step=trainer.fused_step,
            scaler_state=scaler.state_dict(),
            report=None
            if report is None
            else {
                "step": report.step,
                "entries": [[e.rank, e.param, e.kind] for e in report.entries],
                "text": report.describe(),
            },
        )
    trainer.close()
    return out


def everything(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    apply_cpu_shims(cpu=True)  # gloo CPU ranks, on GPU machines too
    _quiet_train_end()
    out: dict[str, Any] = {}
    # FSDP2 over both ranks: the references (same seed and data), stock fp16, ours.
    out["fp32"] = _run("stock", tmp, "fp32", dtype="float32", inject=False)
    out["bf16"] = _run("stock", tmp, "bf16", dtype="bfloat16", inject=False)
    out["stock"] = _run("stock", tmp, "stock")
    out["ours"] = _run("ours", tmp, "ours")
    out["ours-clean"] = _run("ours", tmp, "ours-clean", inject=False)
    out["ours-disabled"] = _run("ours", tmp, "ours-disabled", scaler={"enabled": False})
    out["ours-foreach"] = _run("ours", tmp, "ours-foreach", implementation="foreach")
    out["ours-ce"] = _run("ours", tmp, "ours-ce", chunked=False)
    # FSDP2 (a shard degree of 1) x TP over both ranks.
    out["stock-tp"] = _run("stock", tmp, "stock-tp", tp=2)
    out["ours-tp"] = _run("ours", tmp, "ours-tp", tp=2)
    # Pipeline parallel: two stages, one per rank (shim 6 of launch/common/torchtitan_cpu.py).
    out["ours-pp"] = _run("ours", tmp, "ours-pp", pp=2)
    # A checkpoint at step 2 (one skip and a grown scale in it), then a resume from it.
    scaler = {"init_scale": 1024.0, "growth_interval": 1}
    out["ours-full"] = _run("ours", tmp, "ckpt", scaler=scaler, checkpoint_interval=2)
    out["ours-resumed"] = _run(
        "ours", tmp, "ckpt", scaler=scaler, load_step=2, checkpoint_interval=2
    )
    return out
