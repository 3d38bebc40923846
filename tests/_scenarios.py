"""Scenarios run inside spawned gloo ranks. Each returns plain data; the tests compare ranks.

Every scenario takes ``device`` ("cpu" on gloo, the default; "cuda" on NCCL with one GPU per rank,
see tests/_nccl.py), so the GPU runners repeat the same matrix. Nothing here asserts across ranks: every rank runs the same collectives in the same order whatever
its values, so one rank's surprise can never hang the others. The parent process asserts.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    FAULTS,
    OPTIMIZERS,
    TARGETS,
    gpu_path,
    make_optimizer,
    mlp,
    model_digest,
    optim_digest,
    target_ranks,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from common.probes import DispatchCounter, HostReadSpy
from distscaler import GradScaler

INJECT_STEPS = (2, 4)
NUM_STEPS = 7
MAX_NORM = 0.005  # below every norm in clip_norms, so clipping really scales


def train_steps(
    rank: int,
    world_size: int,
    scaler: Any,
    opt_kind: str,
    fault: str,
    target: str,
    clip: bool,
    device: str = "cpu",
) -> dict[str, Any]:
    """Identical data on every rank (replicated gradients, as after DDP); a fault on chosen ranks."""
    model = mlp().to(device)
    opt = make_optimizer(opt_kind, model.parameters())
    gen = torch.Generator().manual_seed(1)
    is_distscaler = isinstance(scaler, GradScaler)
    out: dict[str, list] = {"skipped": [], "scales": [], "norms": [], "local_nonfinite": []}
    out["unchanged"] = []
    for step in range(NUM_STEPS):
        x = torch.randn(16, 8, generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in INJECT_STEPS and rank in target_ranks(target, world_size):
            model[0].weight.grad[0, 1] = FAULTS[fault]
        grads = [p.grad for p in model.parameters()]
        out["local_nonfinite"].append(not all(bool(g.isfinite().all()) for g in grads))
        before = (model_digest(model), optim_digest(opt))
        scale_before = scaler.get_scale()
        if clip:
            if is_distscaler:
                norm = scaler.clip_grad_norm_(opt, max_norm=1.0)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            out["norms"].append(float(norm))
        scaler.step(opt)
        scaler.update()
        if is_distscaler:
            out["skipped"].append(scaler.step_was_skipped)
        else:
            out["skipped"].append(scaler.get_scale() < scale_before)
        out["scales"].append(scaler.get_scale())
        out["unchanged"].append(before == (model_digest(model), optim_digest(opt)))
    out["params"] = model_digest(model)
    out["optim"] = optim_digest(opt)
    return out


def agreement(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """The core property over optimizers x faults x faulty ranks x clipping, plus torch's contrast."""
    results = {}
    for opt_kind, fault, target, clip in itertools.product(
        OPTIMIZERS, FAULTS, TARGETS, (False, True)
    ):
        key = f"{opt_kind}-{fault}-{target}-{'clip' if clip else 'noclip'}"
        mk = dict(init_scale=2.0**8, growth_interval=2)
        results[key] = {
            "ours": train_steps(
                rank,
                world_size,
                GradScaler(device, **mk, grad_layout="replicated"),
                opt_kind,
                fault,
                target,
                clip,
                device,
            ),
            "torch": train_steps(
                rank,
                world_size,
                torch.amp.GradScaler(device, **mk),
                opt_kind,
                fault,
                target,
                clip,
                device,
            ),
        }
    return results


def _shard_params(
    rank: int, dtypes: tuple[torch.dtype, ...], device: str = "cpu"
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(100 + rank)
    params = []
    for i, dtype in enumerate(dtypes):
        # Zero parameters: after SGD(lr=1) a parameter is exactly minus its clipped gradient.
        p = torch.nn.Parameter(torch.zeros(5 + 3 * i + rank, dtype=dtype, device=device))
        p.grad = (torch.randn(p.shape, generator=gen) * (3.0 + rank)).to(device, dtype)
        params.append(p)
    return params


def clip_norms(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """Norms and clipped gradients against torch.nn.utils.clip_grad_norm_ on the gathered gradients."""
    results = {}
    for layout, opt_kind, norm_type in itertools.product(
        ("sharded", "replicated"), ("for-loop", "fused"), (2.0, 1.0, math.inf)
    ):
        dtypes = (torch.float32, torch.float32, torch.float64)
        shard_rank = rank if layout == "sharded" else 0
        params = _shard_params(shard_rank, dtypes, device)
        scaler = GradScaler(device, init_scale=1024.0, grad_layout=layout)
        scaler.scale(torch.ones((), device=device))  # materialise the scale
        # The reference runs on CPU in fp64, whatever the device under test.
        unscaled = [p.grad.double().cpu() / 1024.0 for p in params]
        # Reference: torch's clip over the full set of unscaled gradients (each shard once).
        gathered: list[list[torch.Tensor]] = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, unscaled)
        full = gathered if layout == "sharded" else gathered[:1]
        ref_grads = [g.clone() for shard in full for g in shard]
        ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref_grads]
        for p, g in zip(ref_params, ref_grads):
            p.grad = g
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM, norm_type=norm_type))
        # distscaler's coefficient is min(1, max_norm / norm) exactly: torch's adds 1e-6 to the
        # norm (a relative 1e-6 / norm, 2e-4 here), a guard the grad_scale form does not need.
        ref_mine = [g * min(1.0, MAX_NORM / ref_norm) for g in unscaled]

        fused = opt_kind == "fused"
        opt = torch.optim.SGD(params, lr=1.0, fused=fused, foreach=None if fused else False)
        before = [p.detach().to("cpu", torch.float64, copy=True) for p in params]
        with CommDebugMode() as comm:  # two dtype groups (fp32, fp64), still one collective
            norm = scaler.clip_grad_norm_(opt, MAX_NORM, norm_type=norm_type)
            scaler.step(opt)
            scaler.update()
        # SGD(lr=1) moves each parameter by exactly its clipped gradient.
        moved = [(b - p.detach().double().cpu()) for b, p in zip(before, params)]
        err = max(
            float((m - r).abs().max() / (r.abs().max() + 1e-12)) for m, r in zip(moved, ref_mine)
        )
        results[f"{layout}-{opt_kind}-p{norm_type}"] = {
            "norm": float(norm),
            "ref_norm": ref_norm,
            "norm_dtype": str(norm.dtype),
            "norm_shape": list(norm.shape),
            "rel_err_update": err,
            "skipped": scaler.step_was_skipped,
            "all_reduces": comm.get_total_counts(),
        }
    return results


def step_costs(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """Collectives (CommDebugMode) and host reads inside (clip_grad_norm_ +) step + update, with
    the path a GPU runs (``gpu_path``).

    Rank 0 writes a NaN on step 2, so clean and overflowing steps are both measured.
    """
    return _step_costs(rank, world_size, device)


def _step_costs(rank: int, world_size: int, device: str) -> dict[str, Any]:
    results = {}
    for opt_kind, clip, enabled in itertools.product(OPTIMIZERS, (False, True), (True, False)):
        model = mlp().to(device)
        opt = make_optimizer(opt_kind, model.parameters())
        scaler = gpu_path(
            GradScaler(
                device,
                init_scale=2.0**8,
                growth_interval=3,
                enabled=enabled,
                grad_layout="replicated",
            )
        )
        spy = HostReadSpy()
        spy.exclude_optimizer(opt)
        counts, reads = [], []
        for step in range(6):
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = model(torch.randn(4, 8, device=device)).float().sum()
            scaler.scale(loss).backward()
            if step == 2 and rank == 0:
                model[0].weight.grad[1, 1] = math.nan
            spy.reads.clear()
            with CommDebugMode() as comm, spy:
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
            counts.append(comm.get_total_counts())
            reads.append(len(spy.reads))
        key = f"{opt_kind}-{'clip' if clip else 'noclip'}-{'on' if enabled else 'off'}"
        results[key] = {
            "all_reduces": counts,
            "host_reads": reads,
            "skipped_total": float(scaler.state_dict().get("num_skipped_steps", 0)),
        }
    return results


def empty_rank(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """The last rank has no gradients at all (a frozen stage); rank 0 overflows on step 1."""
    results = {}
    for opt_kind, clip in itertools.product(OPTIMIZERS, (False, True)):
        model = mlp().to(device)
        opt = make_optimizer(opt_kind, model.parameters())
        scaler = GradScaler(device, init_scale=2.0**8, grad_layout="sharded")
        skipped, scales, norms = [], [], []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = model(torch.randn(4, 8, device=device)).float().sum()
            scaled = scaler.scale(loss)
            if rank != world_size - 1:
                scaled.backward()
                if step == 1 and rank == 0:
                    model[0].bias.grad[0] = math.inf
            if clip:
                norms.append(float(scaler.clip_grad_norm_(opt, 1.0)))
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.step_was_skipped)
            scales.append(scaler.get_scale())
        results[f"{opt_kind}-{'clip' if clip else 'noclip'}"] = {
            "skipped": skipped,
            "scales": scales,
            "norms": norms,
        }
    return results


def ddp_end_to_end(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """DDP, fp16 autocast, different data per rank, an inf injected after DDP's all-reduce."""
    results = {}
    for opt_kind in OPTIMIZERS:
        model = DDP(mlp().to(device))
        opt = make_optimizer(opt_kind, model.parameters())
        # DDP's gradients are replicated over its process group: learnt from the wrapper.
        scaler = GradScaler(device, init_scale=2.0**10, growth_interval=3).register_model(model)
        gen = torch.Generator().manual_seed(10 + rank)
        skipped, scales, norms, local = [], [], [], []
        for step in range(8):
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = model(torch.randn(8, 8, generator=gen).to(device)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 3 and rank == world_size - 1:
                model.module[2].weight.grad[0, 0] = math.inf
            local.append(not all(bool(p.grad.isfinite().all()) for p in model.parameters()))
            norms.append(float(scaler.clip_grad_norm_(opt, 1.0)))
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.step_was_skipped)
            scales.append(scaler.get_scale())
        results[opt_kind] = {
            "skipped": skipped,
            "scales": scales,
            "norms": norms,
            "local_nonfinite": local,
            "params": model_digest(model),
            "optim": optim_digest(opt),
        }
    return results


def fused_step_ops(rank: int = 0, world_size: int = 1, device: str = "cpu") -> dict[str, Any]:
    """Device ops (a dispatch counter) of a clean fused step + update, with and without clipping.

    Also run without a process group, in the test process: the difference is what more ranks add.
    """
    out = {}
    for clip in (False, True):
        model = mlp().to(device)
        opt = make_optimizer("fused", model.parameters())
        # The inf check alone: the replica check's own ops are pinned by tests/test_replica_check.py.
        scaler = GradScaler(
            device, init_scale=2.0**8, grad_layout="replicated", replica_check=False
        )
        for _ in range(3):  # the last one counted, after warm-up
            opt.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = model(torch.randn(4, 8, device=device)).float().sum()
            scaler.scale(loss).backward()
            with DispatchCounter() as counter:
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
        out["clip" if clip else "noclip"] = counter.ops
    return out


def everything(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """All scenarios in one spawn: starting processes is the expensive part."""
    return {
        "fused_ops": fused_step_ops(rank, world_size, device),
        "agreement": agreement(rank, world_size, device),
        "clip_norms": clip_norms(rank, world_size, device),
        "empty_rank": empty_rank(rank, world_size, device),
        "ddp": ddp_end_to_end(rank, world_size, device),
        "step_costs": step_costs(rank, world_size, device),
    }
