"""The step's collectives as the code issues them, for docs/facts.yml (tests/test_docs_facts.py).

Each rank wraps ``torch.distributed.all_reduce`` (what the scaler calls) to record every call's
payload (bytes of its tensor) and reduce op, and counts every c10d collective dispatched with
``CollectiveLog``, both only around the scaler's phase of a step (``clip_grad_norm_`` when
clipping, ``step``, ``update``): the gradients' own reduce (DDP's, FSDP2's) is done by then. Per
setting, three steps with fused AdamW and three with foreach AdamW; every step's record is
returned, and the test compares them with each other and with the facts. Layouts: DDP on 2 ranks,
gradients declared sharded on the same 2 ranks (nothing replicated), HSDP on 2 x 2 ranks; on the 2
ranks also the overflow report's one all_gather (its bytes per rank), after a skipped step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.probes import CollectiveLog
from distscaler import GradScaler

#: Steps per (setting, optimizer); the facts hold for every one of them.
STEPS = 3

#: The settings measured: GradScaler's keyword arguments, and whether the step clips. Where the
#: replica check is on, every measured update is a checked one (``replica_check_interval=1``; by
#: default every 32nd with torch's kernels): "defaults" are the sizes of a checked update.
_CHECKED = {"replica_check_interval": 1}
SETTINGS: dict[str, tuple[dict[str, Any], bool]] = {
    "defaults": (_CHECKED, False),
    "defaults, clipping": (_CHECKED, True),
    "replica_check=False": ({"replica_check": False}, False),
    "replica_check=False, clipping": ({"replica_check": False}, True),
    "param_check_interval=1": ({**_CHECKED, "param_check_interval": 1}, False),
    "param_check_interval=1, clipping": ({**_CHECKED, "param_check_interval": 1}, True),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class _AllReduceSpy:
    """``torch.distributed.all_reduce``, wrapped while ``active``: (dtype, values, op) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.active = False
        self._original = dist.all_reduce

    def __enter__(self) -> _AllReduceSpy:
        original = self._original

        def all_reduce(
            tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any
        ):
            if self.active:
                name = str(getattr(op, "name", op)).rsplit(".", 1)[-1]
                self.calls.append((str(tensor.dtype).removeprefix("torch."), tensor.numel(), name))
            return original(tensor, op, *args, **kwargs)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _measure(
    build: Callable[[], tuple[nn.Module, nn.Module]],
    rank: int,
    scaler_kwargs: dict[str, Any],
    clip: bool,
    register: bool,
) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    for fused in (True, False):
        model, wrapped = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
        scaler = GradScaler("cpu", **scaler_kwargs)
        if register:
            scaler.register_model(wrapped)
        with _AllReduceSpy() as spy:
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(10 * step + rank)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = wrapped(torch.randn(4, 8)).float().square().mean()
                scaler.scale(loss).backward()
                spy.calls.clear()
                spy.active = True
                with CollectiveLog() as log:
                    if clip:
                        scaler.clip_grad_norm_(opt, 1.0)
                    scaler.step(opt)
                    scaler.update()
                spy.active = False
                steps.append(
                    {
                        "optimizer": "fused" if fused else "foreach",
                        "collectives": len(log.calls),
                        "all_reduce": [list(c) for c in spy.calls],
                        "skipped": bool(scaler.step_was_skipped),
                    }
                )
    return steps


def _report(wrapped: nn.Module, model: nn.Module, rank: int) -> dict[str, Any]:
    """The overflow report's collectives: rank 1's loss is inf at the second step, the report
    runs at every update (``skip_log_interval=1``); what ``update()`` issues then."""
    gathers: list[int] = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def spy(original: Callable[..., Any]) -> Callable[..., Any]:
        def gather(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            gathers.append(input.numel() * input.element_size())
            return original(output, input, *args, **kwargs)

        return gather

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cpu", skip_log_interval=1).register_model(wrapped)
    counts = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(torch.randn(4, 8)).square().mean()
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        for n in names:
            setattr(dist, n, spy(originals[n]))
        try:
            with CollectiveLog() as log:
                scaler.update()
        finally:
            for n in names:
                setattr(dist, n, originals[n])
        counts.append(len(log.calls))
    report = scaler.report_overflow()
    assert report is not None and {e.rank for e in report.entries} == {0, 1}, report
    # update() of the clean step: no collective; of the skipped one: the report's all_gather.
    assert counts[0] == 0 and len(gathers) == 1, (counts, gathers)
    return {"collectives": counts[1], "all_gather_bytes_per_rank": gathers[0]}


def ddp(rank: int, world_size: int) -> dict[str, Any]:
    """DDP over every rank, the model registered (what the docs tell DDP users to do); the same
    model unwrapped with ``grad_layout="sharded"``; the overflow report."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build() -> tuple[nn.Module, nn.Module]:
        model = _mlp()
        return model, DDP(model)

    def alone() -> tuple[nn.Module, nn.Module]:
        model = _mlp()
        return model, model

    results: dict[str, Any] = {
        "DDP (2 ranks)": {
            name: _measure(build, rank, kwargs, clip, register=True)
            for name, (kwargs, clip) in SETTINGS.items()
        },
        # Each rank's own gradients, declared sharded (a pipeline stage, Megatron's registered
        # parameters, FSDP's shards): no replica set, so no replica check.
        'nothing replicated (2 ranks, grad_layout="sharded")': {
            name: _measure(alone, rank, {**kwargs, "grad_layout": "sharded"}, clip, register=False)
            for name, (kwargs, clip) in SETTINGS.items()
        },
    }
    model, wrapped = build()
    results["overflow report"] = _report(wrapped, model, rank)
    return results


def hsdp(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 HSDP: replicate 2 x shard world/2; nothing registered (DTensor gradients)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))

    def build() -> tuple[nn.Module, nn.Module]:
        model = _mlp()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model

    return {
        "HSDP (2 x 2 ranks)": {
            name: _measure(build, rank, kwargs, clip, register=False)
            for name, (kwargs, clip) in SETTINGS.items()
        }
    }
