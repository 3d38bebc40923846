"""Scenarios of tests/test_stated_costs.py on gloo ranks: each entry point's collectives counted
(which, how many float32) under DDP, as a user's loop calls them, with the replica check on and off,
a fused and a foreach optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

#: The collectives a scaler may issue, patched to record (name, float32 elements).
NAMES = tuple(
    name
    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather",
                 "broadcast", "all_gather_object")
    if hasattr(dist, name)
)  # fmt: skip

#: Each sequence of calls between the backward and the update, by name.
SEQUENCES: dict[str, Callable[[GradScaler, Any], None]] = {
    "unscale_": lambda s, o: s.unscale_(o),
    "clip_grad_norm_": lambda s, o: s.clip_grad_norm_(o, 1.0),
    "clip_grad_norm_ inf": lambda s, o: s.clip_grad_norm_(o, 1.0, float("inf")),
    "unscale_ then clip_grad_norm_": lambda s, o: (s.unscale_(o), s.clip_grad_norm_(o, 1.0)),
    "step": lambda s, o: None,
}


def _counted(calls: list[tuple[str, int]]) -> dict[str, Any]:
    real = {name: getattr(dist, name) for name in NAMES}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            single = name in ("all_gather_into_tensor", "all_gather_single")
            tensor = args[1] if single else args[0]
            kind = "all_gather" if single else name
            calls.append((kind, tensor.numel() if isinstance(tensor, torch.Tensor) else -1))
            return real[name](*args, **kwargs)

        return call

    return {name: counting(name) for name in NAMES}, real  # type: ignore[return-value]


def costs(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fused in (True, False):
        for replica_check in (True, False):
            for name, calls_between in SEQUENCES.items():
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
                ddp = DDP(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused,
                                        foreach=None if fused else True)  # fmt: skip
                scaler = GradScaler("cpu", replica_check=replica_check,
                                    replica_check_interval=1).register_model(ddp)
                torch.manual_seed(1 + rank)
                scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
                calls: list[tuple[str, int]] = []
                patched, real = _counted(calls)
                for n, fn in patched.items():
                    setattr(dist, n, fn)
                try:
                    calls_between(scaler, opt)
                    scaler.step(opt)
                    scaler.update()
                finally:
                    for n, fn in real.items():
                        setattr(dist, n, fn)
                key = f"{'fused' if fused else 'foreach'}-{'check' if replica_check else 'nocheck'}"
                out[f"{key}-{name}"] = calls
    return out
