"""Overflow attribution scenarios, run inside spawned gloo ranks (tests/test_attribution.py checks).

Each scenario trains a layout of tests/_layout_scenarios.py for :data:`UPDATES` updates with
``skip_log_interval=2`` and writes inf, -inf or NaN into the local gradient of *named* parameters
(the names torch itself gives: the unwrapped module's ``named_parameters()``, FSDP1's own
``named_parameters()``, which strips its wrapper prefixes) on chosen ranks at chosen updates. Every
rank records, per update: the collectives and host reads of ``clip_grad_norm_`` (when clipping) +
``step`` + ``update`` (CommDebugMode, HostReadSpy), the loss scale the update used, and
``scaler.last_overflow``; and what it really injected (rank, name, kind), gathered from every rank
so that the test can build the exact expected report. Nothing here asserts.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from _common import gpu_path
from _layout_scenarios import DEVICE, INIT_SCALE, LAYOUTS, MAX_NORM
from _torch_gaps import run_case as guarded
from _torch_gaps import torch_gaps
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from common.probes import HostReadSpy
from common.tensors import local_tensor
from distscaler import GradScaler

INTERVAL = 2
UPDATES = 8
_VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

#: (layout, optimizer, clip) per world size. DDP runs every inf check path: clip (fused), the fused
#: check, and the non-fused step that codes its gradients after reading the flag. Every case runs
#: the path a GPU runs (no host read of the flag: ``gpu_path``) except the
#: ``-cpuread`` ones, which run the CPU's (the flag read on the host, gradients coded on a skip).
CASES: dict[int, list[tuple[str, str, bool]]] = {
    2: [
        ("ddp-no_sync", "fused", True),
        ("ddp-no_sync", "fused", False),
        ("ddp-no_sync-cpuread", "fused", True),
        ("ddp-no_sync-cpuread", "fused", False),
        ("ddp-no_sync", "foreach", False),
        ("fsdp2-fp16", "fused", True),
        ("pp", "fused", True),
        ("pp", "foreach", False),
        ("fsdp1-full_shard", "fused", True),
        ("fsdp1-full_shard-orig", "foreach", True),
    ],
    4: [
        ("hsdp", "fused", True),
        ("fsdp2-tp", "fused", False),
        ("pp-dp", "foreach", False),
    ],
}


def user_names(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters by the names torch gives them (wrapper prefixes stripped), sorted."""
    if isinstance(model, DDP):
        model = model.module
    return sorted(model.named_parameters(), key=lambda kv: kv[0])


def faults_at(update: int, rank: int, world_size: int) -> list[tuple[int, str]]:
    """(index into this rank's sorted names, fault) this rank writes at ``update`` (1-based)."""
    last = world_size - 1
    plan = {
        2: [(0, 0, "inf"), (last, -1, "-inf")],
        3: [(last, 1, "nan")],
        6: [(0, 1, "nan"), (0, 2, "inf")],
    }
    return [(index, fault) for r, index, fault in plan.get(update, []) if r == rank]


def _inject(
    names: list[tuple[str, torch.Tensor]], index: int, fault: str
) -> tuple[str, str] | None:
    """Write ``fault`` into the first element of the named gradient (the next one with a local
    element if that one holds none here). Returns (name, expected kind)."""
    for name, param in names[index:] + names[:index]:
        grad = param.grad
        if grad is not None and local_tensor(grad).numel() > 0:
            local_tensor(grad).view(-1)[0] = _VALUES[fault]
            return name, "nan" if fault == "nan" else "inf"
    return None


def run_case(layout: str, opt_kind: str, clip: bool, rank: int, world_size: int) -> dict:
    if layout.endswith("-cpuread"):
        return _run_case(layout.removesuffix("-cpuread"), opt_kind, clip, rank, world_size, False)
    return _run_case(layout, opt_kind, clip, rank, world_size, True)


def _run_case(
    layout: str, opt_kind: str, clip: bool, rank: int, world_size: int, gpu: bool
) -> dict:
    built = LAYOUTS[layout][1](rank, world_size, opt_kind)
    assert built.model is not None
    # The replica check off: these infs are written on one rank after the reduce, which it would
    # also (rightly) report as a replica mismatch, with a gather of its own; the overflow report's
    # costs are what is counted here (tests/test_replica_check.py counts the check's).
    scaler = GradScaler(DEVICE, init_scale=INIT_SCALE, skip_log_interval=INTERVAL,
                        replica_check=False)  # fmt: skip
    if gpu:
        gpu_path(scaler)
    for module, grad_layout in built.register:
        scaler.register_model(module, grad_layout=grad_layout)
    scaler.register_model(built.model)  # names (FSDP2's layout needs nothing)
    scaler.materialize(DEVICE)  # first pipeline stages never call scale()
    names = user_names(built.model)
    spy = HostReadSpy()
    spy.exclude_optimizer(built.opt)
    out: dict[str, list] = {k: [] for k in ("injected", "scales", "comms", "reads", "reports")}
    for update in range(1, UPDATES + 1):
        built.opt.zero_grad(set_to_none=True)
        built.backward(scaler.scale, update)
        injected = [_inject(names, i, f) for i, f in faults_at(update, rank, world_size)]
        out["injected"].append([[rank, *hit] for hit in injected if hit is not None])
        out["scales"].append(scaler.get_scale())
        spy.reads.clear()
        with CommDebugMode() as comm, spy:
            if clip:
                scaler.clip_grad_norm_(built.opt, MAX_NORM)
            scaler.step(built.opt)
            scaler.update()
        out["comms"].append({str(k): v for k, v in comm.get_comm_counts().items()})
        out["reads"].append(len(spy.reads))
        report = scaler.last_overflow
        out["reports"].append(
            None
            if report is None
            else {
                "step": report.step,
                "scale": report.scale,
                "entries": [[e.rank, e.param, e.kind] for e in report.entries],
                "unlisted": report.unlisted,
            }
        )
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, out["injected"])
    out["all_injected"] = [
        sorted(hit for per_rank in everyone for hit in per_rank[u]) for u in range(UPDATES)
    ]
    out["names"] = [name for name, _ in names]
    return out


def attribution_cases(rank: int, world_size: int) -> dict[str, Any]:
    # A crash (torch's own, on an old torch) fails its case only (tests/_torch_gaps.py).
    out: dict[str, Any] = {"torch_gaps": torch_gaps(world_size)}
    for layout, opt_kind, clip in CASES[world_size]:
        out[f"{layout}-{opt_kind}-{'clip' if clip else 'noclip'}"] = guarded(
            functools.partial(run_case, layout, opt_kind, clip, rank, world_size)
        )
    return out
