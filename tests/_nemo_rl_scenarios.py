"""NeMo-RL scenarios run inside spawned gloo ranks (tests/test_nemo_rl.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The worker is NeMo-RL's own ``DTensorPolicyWorkerV2Impl``, built by its ``__init__`` from a policy
config (launch/common/nemo_rl_cpu.py: ``grpo_math_1B.yaml``'s policy section shrunk, a tiny Qwen2
saved locally, ``precision: "float16"``, AdamW, NeMo-RL's warmup schedule), trained by its own
``train()`` with NeMo-RL's GRPO loss (``ClippedPGLossFn``) on a synthetic GRPO batch, 2 CPU ranks.
"stock" is NeMo-RL's class; "ours" is ``distscaler.integrations.nemo_rl.DTensorPolicyWorkerV2Impl``
(what ``worker_extension_cls_fqn=WORKER`` builds). The CPU stand-ins are in
launch/common/nemo_rl_cpu.py, each with its reason.

An inf is written into one element of rank 1's gradient shard right after FSDP2's reduce-scatter,
at chosen steps (``nemo_rl_job.poison_on``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

import torch.distributed as dist
from nemo_rl_job import (
    build_worker,
    digest,
    finite,
    grpo_batch,
    local_shards,
    pg_loss,
    poison_on,
    policy_config,
    shared_model_dir,
    train,
)

from common.probes import CollectiveLog

INF_RANK = 1
#: Advantages this small make gradients that fp16 cannot hold without a loss scale.
TINY = 1e-7
#: Advantages this large overflow fp16 in the backward (a genuine overflow, not an injected inf).
HUGE = 1e9


def checkpointing(model: str) -> dict[str, Any]:
    """NeMo-RL's ``checkpointing`` settings the worker's save reads (DCP, synchronous)."""
    return {
        "model_save_format": "torch_save",
        "save_consolidated": False,
        "is_peft": False,
        "model_cache_dir": None,
        "model_repo_id": model,
        "is_async": False,
        "dequantize_base_checkpoint": False,
    }


def count_clip(worker: Any, *, ours: bool, log: list[int]) -> None:
    """Count the collectives of the gradient clip (stock: Automodel's
    ``scale_grads_and_clip_grad_norm``, ours: distscaler's, which replaces it in ``train``)."""
    if ours:
        real = worker._distscaler_clip

        def clip(*args: Any, **kwargs: Any) -> Any:
            with CollectiveLog() as calls:
                out = real(*args, **kwargs)
            log.append(len(calls.calls))
            return out

        worker._distscaler_clip = clip
        return
    from nemo_rl.models.policy.workers import dtensor_policy_worker_v2 as stock

    real_stock = stock.scale_grads_and_clip_grad_norm
    if getattr(real_stock, "_counting", False):
        real_stock = real_stock.__wrapped__

    def stock_clip(*args: Any, **kwargs: Any) -> Any:
        with CollectiveLog() as calls:
            out = real_stock(*args, **kwargs)
        log.append(len(calls.calls))
        return out

    stock_clip._counting = True  # type: ignore[attr-defined]
    stock_clip.__wrapped__ = real_stock  # type: ignore[attr-defined]
    stock.scale_grads_and_clip_grad_norm = stock_clip


def run(
    worker: Any,
    steps: range,
    *,
    ours: bool,
    inf_steps: tuple[int, ...] = (),
    huge_steps: tuple[int, ...] = (),
    advantage_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """NeMo-RL's ``train()`` once per step (one global batch, one optimizer step, one scheduler
    step); per step what it reported, whether the shards changed and stayed finite, the LR after,
    the clip's collectives."""
    rank = dist.get_rank()
    state = {"step": -1}
    handle = poison_on(worker, lambda: state["step"] in inf_steps and rank == INF_RANK)
    clip_log: list[int] = []
    count_clip(worker, ours=ours, log=clip_log)
    loss = pg_loss()
    records = []
    try:
        for step in steps:
            state["step"] = step
            scale = HUGE if step in huge_steps and rank == INF_RANK else advantage_scale
            before = digest(local_shards(worker))
            start = time.perf_counter()
            metrics = train(worker, grpo_batch(step, rank, advantage_scale=scale), loss)
            seconds = time.perf_counter() - start
            records.append(
                {
                    "step": step,
                    "grad_norm": float(metrics["grad_norm"]),
                    "loss": float(metrics["global_loss"]),
                    "changed": digest(local_shards(worker)) != before,
                    "finite": finite(worker),
                    "lr": metrics["lr_after"],
                    "clip_collectives": clip_log[-1] if clip_log else None,
                    "seconds": seconds,
                    "metrics": {k: float(v) for k, v in metrics.items() if "distscaler" in k},
                }
            )
    finally:
        handle.remove()
    return records


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _release(worker: Any) -> None:
    del worker
    dist.barrier()


def _refused(worker: Any, wrap: str) -> str:
    """Run one more ``train()`` with the clip doing something a stock fp16 path might: a second
    ``unscale_`` or an ``optimizer.step()`` of its own; the error distscaler raises."""
    scaler = worker._distscaler_scaler
    real = worker._distscaler_clip

    def clip(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if wrap == "unscale":
            scaler.unscale_(worker._distscaler_step._optimizer)
        else:
            worker.optimizer.step()  # the worker's own step follows: a second one
        return out

    worker._distscaler_clip = clip
    try:
        train(worker, grpo_batch(9, dist.get_rank()), pg_loss())
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    finally:
        worker._distscaler_clip = real
    return "no error"


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """Every scenario, on every rank."""
    model = shared_model_dir()
    root = [tempfile.mkdtemp(prefix="nemo-rl-ckpt-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    out: dict[str, Any] = {}
    records = _Records()
    logging.getLogger("distscaler").addHandler(records)

    # (a) tiny gradients: fp32 (the reference), stock fp16 (no scale), ours fp16; one step each.
    for name, precision, ours in (
        ("fp32", "float32", False),
        ("stock", "float16", False),
        ("ours", "float16", True),
    ):
        worker = build_worker(policy_config(model, precision=precision), ours=ours)
        out[f"tiny_{name}"] = run(worker, range(1), ours=ours, advantage_scale=TINY)
        _release(worker)

    # (b) an inf on rank 1 at step 1, 5 steps; ours saves a checkpoint after step 2, and a run
    # resumed from it (NeMo-RL's resume: a worker built with weights_path and optimizer_path).
    for name, ours in (("stock", False), ("ours", True)):
        worker = build_worker(policy_config(model), ours=ours)
        out[f"{name}_class"] = f"{type(worker).__module__}.{type(worker).__qualname__}"
        first = run(worker, range(3), ours=ours, inf_steps=(1,))
        weights, optim = (os.path.join(root[0], name, part) for part in ("weights", "optimizer"))
        worker.save_checkpoint(
            weights, optimizer_path=optim, checkpointing_cfg=checkpointing(model)
        )
        out[f"{name}_listing"] = sorted(os.listdir(optim))
        if ours:
            report = worker._distscaler_scaler.last_overflow
            out["ours_overflow"] = [(e.rank, e.param) for e in report.entries]
            out["ours_overflow_text"] = report.describe()
        out[name] = first + run(worker, range(3, 5), ours=ours)
        out[f"{name}_final"] = digest(local_shards(worker))
        _release(worker)
    weights, optim = (os.path.join(root[0], "ours", part) for part in ("weights", "optimizer"))
    worker = build_worker(
        policy_config(model), ours=True, weights_path=weights, optimizer_path=optim
    )
    out["ours_resumed_scale"] = worker._distscaler_scaler.get_scale()
    out["ours_resumed"] = run(worker, range(3, 5), ours=True)
    out["ours_resumed_final"] = digest(local_shards(worker))
    # load_checkpoint (the method) reads the scale back: set another one first.
    worker._distscaler_scaler.update(new_scale=1024.0)
    worker.load_checkpoint(weights, optimizer_path=optim)
    out["ours_loaded_scale"] = worker._distscaler_scaler.get_scale()
    # A second unscale_ in the same step is refused.
    out["refused_unscale"] = _refused(worker, "unscale")
    _release(worker)
    # A checkpoint saved without distscaler (stock's, after its step 0... 2): NeMo-RL's resume
    # loads it, with a warning, and the scale starts from its initial value.
    del records.messages[:]
    stock_weights, stock_optim = (
        os.path.join(root[0], "stock", part) for part in ("weights", "optimizer")
    )
    worker = build_worker(
        policy_config(model), ours=True, weights_path=stock_weights, optimizer_path=stock_optim
    )
    out["ours_from_stock_scale"] = worker._distscaler_scaler.get_scale()
    out["ours_from_stock_warnings"] = list(records.messages)
    _release(worker)

    # (c) lr_on_skip="step" (policy.distscaler in the config): NeMo-RL's schedule.
    worker = build_worker(policy_config(model, distscaler={"lr_on_skip": "step"}), ours=True)
    out["ours_lr_step"] = run(worker, range(3), ours=True, inf_steps=(1,))
    out["refused_step"] = _refused(worker, "step")  # a second optimizer.step() is refused
    _release(worker)

    # (d) a genuine fp16 overflow: rank 1's advantages are huge at step 1.
    for name, ours in (("stock", False), ("ours", True)):
        worker = build_worker(policy_config(model), ours=ours)
        out[f"{name}_huge"] = run(worker, range(3), ours=ours, huge_steps=(1,))
        _release(worker)
    logging.getLogger("distscaler").removeHandler(records)
    return out
