"""AReaL scenarios run inside spawned gloo ranks (tests/test_areal.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The engine is AReaL's own ``FSDPPPOActor`` (launch/areal_job.py: built, its process group created
and initialized as AReaL's ``PPOTrainer`` does in SPMD mode) on a tiny Qwen2 (2 layers, hidden 64,
vocab 256, saved locally with a word-level tokenizer), ``dtype: float16`` (FSDP2 mixed precision,
fp32 master weights, fused AdamW: AReaL's defaults), a linear LR warmup over 8 of 10 steps, 2 CPU
ranks on AReaL's own CPU platform (gloo; launch/common/areal_cpu.py: what differs from a GPU run,
and why). Each RL step is AReaL's: ``compute_logp``,
``compute_advantages`` (GRPO: rewards normalized within each group of 2 responses), ``ppo_update``
(one ``train_batch``: AReaL's PPO loss, one optimizer step), ``step_lr_scheduler``. "stock" is that
engine as AReaL builds it; "ours" after ``distscaler.integrations.areal.install(engine)``; "fp32"
the stock engine with ``dtype: float32``, the reference for the gradients of step 0.

Step 0 has tiny advantages (times ``TINY``: tiny gradients); at step 2 an inf is written into one
element of rank 1's gradient shard after the backward; a checkpoint (AReaL's recover format: DCP
with the optimizer) is saved after step 3.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from areal_job import actor_config as _actor_config
from areal_job import build_engine as _build_engine
from areal_job import (
    local_grads,
    poison_local_grad,
    rl_step,
    shared_model_dir,
    synthetic_batch,
)

from common.areal_cpu import prepare
from common.probes import CollectiveLog, HostReadSpy

#: The advantages of step 0 are multiplied by this: gradients about 2**-20 of the usual ones.
TINY = 2.0**-20
TINY_STEP = 0
INF_STEP = 2
INF_RANK = 1
#: The checkpoint is saved after this step; the run goes on for 2 more.
SAVE_AFTER = 3
STEPS = 6
#: LR schedule: linear warmup over 80 % of 10 steps (the LR grows at every step of the run).
TOTAL_STEPS, WARMUP = 10, 0.8


def build(model: str, *, ours: bool, dtype: str = "float16", before_init: bool = False) -> Any:
    """The actor engine; ours: ``install`` after ``initialize`` (as on ``PPOTrainer``'s actor,
    which the trainer initializes), or before it with ``before_init``."""
    from distscaler.integrations import areal as ds_areal

    config = _actor_config(model, dtype=dtype, lr_scheduler="linear", warmup=WARMUP)
    early = ds_areal.install if ours and before_init else None
    engine = _build_engine(config, total_steps=TOTAL_STEPS, install=early)
    if ours and not before_init:
        ds_areal.install(engine)
    return engine


def local_shards(engine: Any) -> list[torch.Tensor]:
    out = []
    for p in engine.model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out.append(t.detach().clone())
    return out


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def adam_steps(engine: Any) -> int:
    """AdamW's step count of the first parameter: the optimizer steps that happened."""
    first = next(iter(engine.optimizer.state.values()), None)
    return 0 if first is None else int(first["step"])


def scale_of(engine: Any) -> float | None:
    from distscaler.integrations.areal import scaler_of

    scaler = scaler_of(engine)
    return None if scaler is None else scaler.get_scale()


def grad_stats(grads: list[torch.Tensor], ref: list[torch.Tensor] | None, divide: float) -> dict:
    """Global stats of the gradients (``divide``: the loss scale they carry), against the fp32
    reference ``ref`` when given: one all_reduce, on every rank."""
    g = [t.detach().double() / divide for t in grads]
    sums = [
        sum(float(t.pow(2).sum()) for t in g),
        sum(int((t == 0).sum()) for t in g),
        sum(t.numel() for t in g),
        sum(float((a - b.double()).pow(2).sum()) for a, b in zip(g, ref)) if ref else 0.0,
        sum(float(b.double().pow(2).sum()) for b in ref) if ref else 0.0,
    ]
    total = torch.tensor(sums, dtype=torch.float64)
    dist.all_reduce(total)
    sumsq, zeros, numel, diff, refsq = total.tolist()
    return {
        "norm": sumsq**0.5,
        "zero_fraction": zeros / numel,
        "rel_error": (diff / refsq) ** 0.5 if ref else None,
    }


def train(
    engine: Any,
    steps: range,
    *,
    ref_grads: list[torch.Tensor] | None = None,
    keep_grads: list[list[torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """AReaL's RL step (``rl_step``) per step: what ``optimizer_step`` returned, the LR after the
    scheduler step, the scale after, whether the shards changed, AdamW's step count, the
    optimizer step's collectives and host reads; at ``TINY_STEP`` the gradients against
    ``ref_grads`` (and a copy into ``keep_grads``)."""
    rank = dist.get_rank()
    original = engine.optimizer_step
    extra: dict[str, Any] = {}

    def optimizer_step() -> dict[str, float]:
        if step == INF_STEP and rank == INF_RANK:
            poison_local_grad(engine.model.parameters())
        if step == TINY_STEP:
            grads = local_grads(engine.model.parameters())
            if keep_grads is not None:
                keep_grads.append([g.detach().clone() for g in grads])
            extra["grads"] = grad_stats(grads, ref_grads, scale_of(engine) or 1.0)
        optimizer = engine.optimizer
        own_step = optimizer.__dict__.get("step")  # the LR scheduler's wrapper, if any
        spy = HostReadSpy()
        spy.exclude_optimizer(optimizer)  # not the optimizer's own reads
        try:
            with spy, CollectiveLog() as log:
                stats = original()
        finally:
            if own_step is None:
                del optimizer.step
            else:
                optimizer.step = own_step
        extra.update(collectives=len(log.calls), host_reads=len(spy.reads))
        extra["kinds"] = sorted({name for name, _ in log.calls})
        extra["all_reduce_bytes"] = [n for name, n in log.calls if name == "c10d.allreduce_"]
        extra["stats"] = {k: float(v) for k, v in stats.items()}
        return stats

    engine.optimizer_step = optimizer_step
    records = []
    try:
        for step in steps:
            extra.clear()
            before = digest(local_shards(engine))
            rl_step(engine, synthetic_batch(step, rank), TINY if step == TINY_STEP else 1.0)
            records.append(
                {
                    "step": step,
                    "lr_after": float(engine.lr_scheduler.get_last_lr()[0]),
                    "scale": scale_of(engine),
                    "changed": digest(local_shards(engine)) != before,
                    "adam_steps": adam_steps(engine),
                    **extra,
                }
            )
    finally:
        engine.optimizer_step = original
    return records


def save(engine: Any, path: str) -> list[str]:
    """AReaL's recover checkpoint (DCP with the optimizer); what is in the directory right after
    ``save`` returns."""
    from areal.api import SaveLoadMeta

    engine.save(SaveLoadMeta(path=path, weight_format="dcp", with_optim=True))
    listing = sorted(os.listdir(path))
    dist.barrier()
    return listing


def load(engine: Any, path: str) -> None:
    from areal.api import SaveLoadMeta

    engine.load(SaveLoadMeta(path=path, weight_format="dcp", with_optim=True))


def scale_report(engine: Any) -> Any:
    """The scaler's report of the last skipped step, or None."""
    from distscaler.integrations.areal import scaler_of

    scaler = scaler_of(engine)
    return None if scaler is None else scaler.last_overflow


def second_optimizer_step(engine: Any) -> dict[str, Any]:
    """``optimizer_step()`` again after the iteration's own (no backward in between)."""
    from distscaler import CallOrderError

    before = digest(local_shards(engine))
    steps = adam_steps(engine)
    try:
        stats = engine.optimizer_step()
        error = None
    except CallOrderError as e:
        stats, error = None, f"{type(e).__name__}: {e}"
    return {
        "stats": None if stats is None else {k: float(v) for k, v in stats.items()},
        "error": error,
        "changed": digest(local_shards(engine)) != before,
        "adam_steps_added": adam_steps(engine) - steps,
    }


def explicit_unscale_twice(engine: Any, step: int) -> dict[str, Any]:
    """One more RL step whose optimizer step first calls ``unscale_`` (to read unscaled
    gradients: allowed), then ``unscale_`` again (refused), then AReaL's optimizer step."""
    from distscaler import CallOrderError
    from distscaler.integrations.areal import scaler_of

    scaler = scaler_of(engine)
    assert scaler is not None
    original = engine.optimizer_step
    out: dict[str, Any] = {}

    def optimizer_step() -> dict[str, float]:
        scaler.unscale_(engine.optimizer)
        once = digest(local_grads(engine.model.parameters()))
        try:
            scaler.unscale_(engine.optimizer)
            out["error"] = None
        except CallOrderError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["grads_unchanged_by_the_refused_call"] = (
            digest(local_grads(engine.model.parameters())) == once
        )
        stats = original()
        out["stats"] = {k: float(v) for k, v in stats.items()}
        return stats

    engine.optimizer_step = optimizer_step
    try:
        rl_step(engine, synthetic_batch(step, dist.get_rank()))
    finally:
        engine.optimizer_step = original
    return out


def _release(engine: Any) -> None:
    del engine
    dist.barrier()


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """Every scenario, on every rank."""
    prepare()
    from areal.utils import logging as areal_logging

    areal_logging.getLogger("FSDPEngine").setLevel("WARNING")
    model = shared_model_dir()
    root = [tempfile.mkdtemp(prefix="areal-ckpt-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    out: dict[str, Any] = {"world_size": world_size}

    # The fp32 reference of step 0's gradients.
    engine = build(model, ours=False, dtype="float32")
    kept: list[list[torch.Tensor]] = []
    out["fp32"] = train(engine, range(1), keep_grads=kept)
    ref = kept[0]
    _release(engine)

    paths: dict[str, str] = {}
    schedulers: dict[str, Any] = {}
    for name, ours in (("stock", False), ("ours", True)):
        engine = build(model, ours=ours)
        out[f"{name}_engine"] = f"{type(engine).__module__}.{type(engine).__name__}"
        first = train(engine, range(SAVE_AFTER + 1), ref_grads=ref)
        paths[name] = os.path.join(root[0], name)
        out[f"{name}_listing"] = save(engine, paths[name])
        out[f"{name}_lr_scheduler"] = engine.lr_scheduler.state_dict()["last_epoch"]
        schedulers[name] = engine.lr_scheduler.state_dict()
        rest = train(engine, range(SAVE_AFTER + 1, STEPS))
        out[name] = first + rest
        out[f"{name}_final"] = digest(local_shards(engine))
        out[f"{name}_second_step"] = second_optimizer_step(engine)
        if ours:
            report = scale_report(engine)
            out["ours_overflow"] = (
                [] if report is None else [(e.rank, e.param) for e in report.entries]
            )
            out["ours_overflow_text"] = None if report is None else report.describe()
            out["param_names"] = [n for n, _ in engine.model.named_parameters()]
            out["ours_unscale_twice"] = explicit_unscale_twice(engine, STEPS)
        _release(engine)

    # Resume ours from its checkpoint. AReaL's checkpoint holds no LR scheduler state (stock and
    # ours alike): it is restored by hand, so that the comparison is of the rest.
    resumed = build(model, ours=True, before_init=True)
    out["resumed_engine"] = f"{type(resumed).__module__}.{type(resumed).__name__}"
    load(resumed, paths["ours"])
    resumed.lr_scheduler.load_state_dict(schedulers["ours"])
    out["ours_resumed_scale"] = scale_of(resumed)
    out["ours_resumed"] = train(resumed, range(SAVE_AFTER + 1, STEPS))
    out["ours_resumed_final"] = digest(local_shards(resumed))
    _release(resumed)

    # Ours loading stock's checkpoint: a warning, the initial scale. (The handler goes on the
    # module's logger object itself: AReaL replaces logging's root and manager each time it makes a
    # logger, areal/utils/logging.py, so logging.getLogger("distscaler") is another object now.)
    import logging

    from distscaler.integrations.areal import logger

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        from_stock = build(model, ours=True)
        load(from_stock, paths["stock"])
        out["ours_from_stock_scale"] = scale_of(from_stock)
        out["ours_from_stock_warnings"] = records
        _release(from_stock)
    finally:
        logger.removeHandler(handler)
    return out
