"""Multi-rank policy scenarios, run inside spawned gloo ranks; the parent process compares ranks.

Every rank trains the same model on the same data; an inf is written into a gradient on ONE rank at
the steps of ``INJECT`` (step -> rank). Nothing here asserts across ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from _common import digest, mlp

from distscaler import GradScaler

NUM_STEPS = 14
INJECT = {1: 0, 2: 1, 3: 0, 8: 1}  # step -> the one rank that sees an inf
POLICY_KWARGS: dict[str, dict[str, Any]] = {
    "torch": dict(init_scale=2.0**10, growth_interval=3),
    "deepspeed": dict(
        init_scale=2.0**10, growth_interval=3, policy="deepspeed", hysteresis=2, min_scale=1.0
    ),
    "deepspeed-consecutive": dict(
        init_scale=2.0**10,
        growth_interval=2,
        policy="deepspeed",
        hysteresis=3,
        consecutive_hysteresis=True,
    ),
    "megatron": dict(init_scale=2.0**10, growth_interval=3, policy="megatron", hysteresis=2),
    "static": dict(init_scale=2.0**10, policy="static"),
}


def snapshot(scaler: GradScaler) -> list:
    """The scale and every counter of the scaler's state, as plain numbers."""
    state = scaler.state_dict()
    keys = ("scale", "_growth_tracker", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return [state.get(k) for k in (*keys, "hysteresis_tracker")]


def policies_on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kwargs in POLICY_KWARGS.items():
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", **kwargs)
        data = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
        run: dict[str, list] = {"trajectory": [], "skipped": [], "local_nonfinite": []}
        for step in range(NUM_STEPS):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(data).float().pow(2).mean()
            scaler.scale(loss).backward()
            if INJECT.get(step) == rank:
                next(iter(model.parameters())).grad.view(-1)[0] = math.inf
            grads = [p.grad for p in model.parameters()]
            run["local_nonfinite"].append(not all(bool(g.isfinite().all()) for g in grads))
            scaler.step(opt)
            scaler.update()
            run["skipped"].append(scaler.step_was_skipped)
            run["trajectory"].append(snapshot(scaler))
        run["params"] = digest(model.parameters())
        out[name] = run
    dist.barrier()
    return out
