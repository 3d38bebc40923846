"""One process per GPU on NCCL, for the multi-GPU tests, and the scenarios only GPUs can run.

``spawn_per_gpu`` is ``_harness.spawn`` for GPUs: rank ``r`` drives ``cuda:r``, the process group is
NCCL, the rendezvous a FileStore in ``tmp_path``. With ``backend="gloo"`` it runs the very same
scenarios on CPU, which is how the GPU scenarios are dry-run on machines without GPUs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _scenarios as S
import torch
import torch.distributed as dist
from _common import make_optimizer, mlp, model_digest
from _harness import spawn
from torch.distributed.tensor.debug import CommDebugMode

from distscaler import GradScaler

Scenarios = Callable[[int, int, str], dict[str, Any]]

#: What torch.cuda.set_sync_debug_mode("warn") says for each synchronizing call.
SYNC_WARNING = "called a synchronizing CUDA operation"


def spawn_per_gpu(
    scenarios: Scenarios, world_size: int, tmp_path: Path, *, backend: str = "nccl"
) -> list[dict[str, Any]]:
    """Run ``scenarios(rank, world_size, device)`` in ``world_size`` processes; return their dicts.

    ``backend="nccl"``: rank ``r`` on ``cuda:r`` (needs ``world_size`` GPUs), ``device="cuda"``.
    ``backend="gloo"``: CPU, ``device="cpu"``. ``scenarios`` must be a module-level function.
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got: {backend!r}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size must be at most the {torch.cuda.device_count()} visible GPUs, "
            f"got: {world_size}"
        )
    return spawn(scenarios, world_size, tmp_path, backend=backend, with_device=True)


# ----------------------------------------------------------------- scenarios


def sync_free_fused_step(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """Host syncs inside (clip_grad_norm_ +) step + update of a fused AdamW, NCCL collective included.

    ``torch.cuda.set_sync_debug_mode("warn")`` rather than ``"error"``: an error raised on one rank
    in the middle of a step would leave the other ranks waiting in the collective, a warning is
    counted and the step goes on. The last rank writes an inf on step 2, so a skipped step is
    measured too. ``guard_syncs`` counts the warnings of one deliberate host read (``get_scale()``)
    to prove the mode really reports syncs here.
    """
    results: dict[str, Any] = {}
    for clip in (False, True):
        model = mlp().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = GradScaler(device, skip_log_interval=0, grad_layout="replicated")
        syncs, skipped = [], []
        for step in range(4):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(16, 8, device=device)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2 and rank == world_size - 1:
                model[0].weight.grad[0, 0] = math.inf
            with _sync_warnings() as caught:
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
            syncs.append(len(caught))
            skipped.append(scaler.step_was_skipped)
        with _sync_warnings() as guard:
            scaler.get_scale()
        results["clip" if clip else "noclip"] = {
            "syncs": syncs,
            "skipped": skipped,
            "guard_syncs": len(guard),
        }
    return results


@contextlib.contextmanager
def _sync_warnings() -> Iterator[list[str]]:
    """Collects the sync-debug warnings raised inside it (their messages, filled on exit)."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.synchronize()  # work queued before the block is not counted
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield messages
        finally:
            torch.cuda.set_sync_debug_mode(0)
    messages.extend(str(w.message) for w in records if SYNC_WARNING in str(w.message))


def fsdp2_agreement(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """FSDP2 ``fully_shard`` on a 1-D mesh with an fp16 ``MixedPrecisionPolicy``.

    Each rank holds a different shard of every gradient (DTensor, ``Shard(0)``) and different data.
    The last rank writes an inf into its shard on step 2. Records, per rank: whether the fault was
    seen locally, skips, scales, the clipped norm next to a reference taken on the full gathered
    unscaled gradients (fp64, CPU), whether a skipped step changed the local shards, and the
    collectives inside clip + step + update.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    results: dict[str, Any] = {}
    for opt_kind, clip in itertools.product(("fused", "foreach"), (False, True)):
        model = mlp().to(device)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = make_optimizer(opt_kind, model.parameters())
        scaler = GradScaler(device, init_scale=2.0**8, growth_interval=2)
        gen = torch.Generator().manual_seed(10 + rank)  # different data on every rank
        out: dict[str, list] = {
            "local_nonfinite": [],
            "skipped": [],
            "scales": [],
            "norms": [],
            "ref_norms": [],
            "unchanged": [],
            "all_reduces": [],
        }
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 8, generator=gen).to(device)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2 and rank == world_size - 1:
                shard = model[0].weight.grad.to_local()  # (16 / world_size, 8) rows of this rank
                if shard.numel():
                    shard.view(-1)[0] = math.inf
            grads = [p.grad for p in model.parameters()]
            out["local_nonfinite"].append(
                not all(bool(g.to_local().isfinite().all()) for g in grads)
            )
            if clip:  # reference: every full gradient, gathered (a collective on every rank)
                scale = scaler.get_scale()
                full = [g.full_tensor().to("cpu", torch.float64) / scale for g in grads]
                out["ref_norms"].append(
                    float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full])))
                )
            before = model_digest(model)
            with CommDebugMode() as comm:
                if clip:
                    out["norms"].append(float(scaler.clip_grad_norm_(opt, 1.0)))
                scaler.step(opt)
                scaler.update()
            out["all_reduces"].append(comm.get_total_counts())
            out["skipped"].append(scaler.step_was_skipped)
            out["scales"].append(scaler.get_scale())
            out["unchanged"].append(before == model_digest(model))
        results[f"{opt_kind}-{'clip' if clip else 'noclip'}"] = out
    return results


def fsdp1_cpu_offload(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """FSDP1 FULL_SHARD with ``CPUOffload(offload_params=True)``: sharded gradients on the CPU.

    torch 2.13 only offloads with an accelerator (it pins memory), so this runs on GPUs only. The
    last rank writes an inf into its flat gradient shard on step 2. Records skips, scales, norms
    (next to the gathered reference), the devices of the gradients, collectives, and host reads
    per step (``HostReadSpy``; the optimizer's own excluded): a constant, not one per gradient.
    """
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from common.probes import HostReadSpy

    results: dict[str, Any] = {}
    for opt_kind in ("fused", "foreach"):
        model = FSDP(
            mlp(),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            cpu_offload=CPUOffload(offload_params=True),
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            device_id=torch.device(device),
        )
        opt = make_optimizer(opt_kind, model.parameters())  # over the CPU flat shards
        scaler = GradScaler(device, init_scale=2.0**8, growth_interval=2).register_model(model)
        spy = HostReadSpy()
        spy.exclude_optimizer(opt)
        gen = torch.Generator().manual_seed(10 + rank)
        out: dict[str, list] = {
            "grad_devices": [],
            "skipped": [],
            "scales": [],
            "norms": [],
            "ref_norms": [],
            "all_reduces": [],
            "host_reads": [],
        }
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(8, 8, generator=gen).to(device)).float().pow(2).mean()
            scaler.scale(loss).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if step == 2 and rank == world_size - 1 and grads[0].numel():
                grads[0].view(-1)[0] = math.inf
            out["grad_devices"].append(sorted({g.device.type for g in grads}))
            scale = scaler.get_scale()
            local = torch.stack([g.double().pow(2).sum() for g in grads]).sum().to(device)
            dist.all_reduce(local)  # FULL_SHARD: every gradient value lives on exactly one rank
            out["ref_norms"].append(math.sqrt(float(local)) / scale)
            with CommDebugMode() as comm, spy:
                out["norms"].append(scaler.clip_grad_norm_(opt, 1.0))
                scaler.step(opt)
                scaler.update()
            out["norms"][-1] = float(out["norms"][-1])
            out["all_reduces"].append(comm.get_total_counts())
            out["host_reads"].append(len(spy.reads))
            spy.reads.clear()
            out["skipped"].append(scaler.step_was_skipped)
            out["scales"].append(scaler.get_scale())
        results[opt_kind] = out
    return results


def everything_on_gpus(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """The gloo matrix of tests/_scenarios.py on this device, plus FSDP2 and (CUDA) sync checks."""
    results = S.everything(rank, world_size, device)
    results["fsdp2"] = fsdp2_agreement(rank, world_size, device)
    if torch.device(device).type == "cuda":
        results["sync_free"] = sync_free_fused_step(rank, world_size, device)
        results["fsdp1_cpu_offload"] = fsdp1_cpu_offload(rank, world_size, device)
    return results
