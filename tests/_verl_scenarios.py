"""verl scenarios run inside spawned gloo ranks (tests/test_verl.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The engine is verl's own (launch/verl_job.py: ``EngineRegistry.new(model_type="language_model"...)``) on a
tiny Qwen2 (2 layers, hidden 64, vocab 256, saved locally, sdpa attention, padded batches), fp16
(``mixed_precision.param_dtype: fp16``), verl's PPO loss on a synthetic batch with GRPO-style
advantages, 2 CPU ranks. "stock" is what verl's registry builds without distscaler, its
``ShardedGradScaler(growth_interval=400)`` rebuilt for the device ``"cpu"``: verl builds it for
torch's default ``"cuda"``, which torch disables on a CPU (fp16 with no scale and no inf check);
built for the CPU it runs what a GPU runs. "ours" is what the registry builds after importing
``distscaler.integrations.verl``. The CPU stand-ins are in launch/common/verl_cpu.py, each with
its reason.

An inf is written into one element of rank 1's gradient shard, after the backward, at chosen steps.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from verl_job import (
    build_engine,
    poison_local_grad,
    ppo_loss,
    shared_model_dir,
    synthetic_batch,
)

from common.probes import CollectiveLog, HostReadSpy
from common.verl_cpu import rebuild_stock_scaler_for_cpu, use_cpu_platform

BATCH = 4
LR = 1e-3
#: A warmup long enough that the LR changes at every scheduler step of a scenario.
WARMUP = 8
INF_RANK = 1


def build(model: str, strategy: str, *, ours: bool, fused: bool = False) -> Any:
    """verl's actor engine, fp16; stock: its scaler rebuilt for the CPU (module doc)."""
    engine = build_engine(model, strategy, ours=ours, fused=fused, lr=LR, warmup=WARMUP)
    if not ours:
        rebuild_stock_scaler_for_cpu(engine)
    return engine


def batch(step: int, rank: int) -> Any:
    return synthetic_batch(step, rank, BATCH)


def local_shards(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out.append(t.detach().clone())
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def scale_of(engine: Any) -> float:
    return float(engine.scaler.get_scale())


def train(engine: Any, steps: range, *, inf_steps: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """verl's worker step (``train_batch``, then ``lr_scheduler_step``), per step: what it
    reported, the scale after, whether the shards changed, the scaler phase's counts."""
    rank = dist.get_rank()
    loss = ppo_loss(BATCH)
    original = engine.optimizer_step
    counts: dict[str, int] = {}

    def optimizer_step() -> float:
        if step in inf_steps and rank == INF_RANK:
            poison_local_grad(engine.module.parameters())
        optimizer = engine.optimizer
        own_step = optimizer.__dict__.get("step")  # the LR scheduler's wrapper, if any
        spy = HostReadSpy()
        spy.exclude_optimizer(optimizer)  # not the optimizer's own reads (foreach AdamW's steps)
        try:
            with spy, CollectiveLog() as log:
                norm = original()
        finally:
            if own_step is None:
                del optimizer.step
            else:
                optimizer.step = own_step
        counts.update(collectives=len(log.calls), host_reads=len(spy.reads))
        counts["kinds"] = sorted({name for name, _ in log.calls})  # type: ignore[assignment]
        return norm

    engine.optimizer_step = optimizer_step
    records = []
    try:
        with engine.train_mode():
            for step in steps:
                before = digest(local_shards(engine))
                output = engine.train_batch(batch(step, rank), loss_function=loss)
                lr = engine.lr_scheduler_step()
                metrics = output["metrics"]
                records.append(
                    {
                        "step": step,
                        "grad_norm": float(metrics["grad_norm"]),
                        "scale": scale_of(engine),
                        "changed": digest(local_shards(engine)) != before,
                        "lr": float(lr),
                        "metrics": {k: float(v) for k, v in metrics.items() if "distscaler" in k},
                        **counts,
                    }
                )
    finally:
        engine.optimizer_step = original
    return records


#: How long the last rank waits before it writes distscaler's file: a rank that returns from
#: ``save_checkpoint`` without waiting for the others lists the directory before it exists.
SLOW_WRITE_S = 1.0


def save_and_list(engine: Any, path: str) -> list[str]:
    """``save_checkpoint`` with the last rank slow to write distscaler's file; what rank 0 (every
    rank, in fact) sees in the directory right after ``save_checkpoint`` returns."""
    slow = dist.get_rank() == dist.get_world_size() - 1
    real_save = torch.save

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if slow and "distscaler_world_size" in str(f):
            time.sleep(SLOW_WRITE_S)
        return real_save(obj, f, *args, **kwargs)

    torch.save = slow_save  # type: ignore[assignment]
    try:
        engine.save_checkpoint(path, global_step=3)
        listing = sorted(os.listdir(path))  # right after it returns
    finally:
        torch.save = real_save  # type: ignore[assignment]
    dist.barrier()  # the next scenario starts together
    return listing


def _release(engine: Any) -> None:
    del engine
    dist.barrier()


def everything(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    """Every scenario for one FSDP version (``"fsdp"``: FSDP1, ``"fsdp2"``), on every rank."""
    use_cpu_platform()
    import distscaler.integrations.verl as ds_verl

    model = shared_model_dir()
    ckpt_root = [tempfile.mkdtemp(prefix="verl-ckpt-") if rank == 0 else ""]
    dist.broadcast_object_list(ckpt_root, src=0)
    out: dict[str, Any] = {}

    # (a) an inf on rank 1 at step 1; (d) a checkpoint after step 2, then 2 more steps.
    for name, ours in (("stock", False), ("ours", True)):
        engine = build(model, strategy, ours=ours)
        out[f"{name}_engine"] = type(engine).__module__
        path = os.path.join(ckpt_root[0], name)
        first = train(engine, range(3), inf_steps=(1,))
        if ours:
            report = engine.scaler.last_overflow
            out["ours_overflow"] = [(e.rank, e.param) for e in report.entries]
            out["ours_overflow_text"] = report.describe()
            out["param_names"] = [n for n, _ in engine.module.named_parameters()]
        out[f"{name}_listing"] = save_and_list(engine, path)
        rest = train(engine, range(3, 5))
        out[name] = first + rest
        out[f"{name}_final"] = digest(local_shards(engine))
        _release(engine)
        resumed = build(model, strategy, ours=ours)
        resumed.load_checkpoint(path)
        out[f"{name}_resumed_scale"] = scale_of(resumed)
        out[f"{name}_resumed"] = train(resumed, range(3, 5))
        out[f"{name}_resumed_final"] = digest(local_shards(resumed))
        _release(resumed)

    # (b) fused AdamW: stock crashes at the first step (torch issue 140514), ours runs.
    engine = build(model, strategy, ours=False, fused=True)
    try:
        train(engine, range(1))
        out["stock_fused_error"] = None
    except Exception as e:  # noqa: BLE001 - what the stock path raises is the result
        out["stock_fused_error"] = f"{type(e).__name__}: {e}"
    _release(engine)
    engine = build(model, strategy, ours=True, fused=True)
    out["ours_fused_is_fused"] = bool(engine.optimizer.defaults.get("fused"))
    out["ours_fused"] = train(engine, range(3), inf_steps=(1,))
    _release(engine)

    # lr_on_skip="step": verl's stock schedule, kept on request.
    ds_verl.configure(lr_on_skip="step")
    try:
        engine = build(model, strategy, ours=True)
        out["ours_lr_step"] = train(engine, range(3), inf_steps=(1,))
        _release(engine)
    finally:
        ds_verl._options = None
    return out


def fsdp1(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "fsdp")


def fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    return everything(rank, world_size, "fsdp2")
