"""Scenarios of tests/test_kernels.py on gloo ranks: the scaler with ``kernels="triton"`` (Triton's
interpreter on the CPU) beside ``kernels="torch"``, DDP on 2 ranks, a bit flipped on rank 1 after
the reduce at one step and an inf on rank 0 before the backward at another."""

from __future__ import annotations

import os
from typing import Any

import torch
from _common import gpu_path
from _replica_scenarios import flip_bit_
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

FLIP_STEP = 1
INF_STEP = 3
STEPS = 5


class _launches:
    """The names of the Triton kernels launched until `stop()` (the interpreter's)."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.names: list[str] = []
        self._cls, self._run = InterpretedFunction, InterpretedFunction.run
        names, run = self.names, self._run

        def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            names.append(fn.fn.__name__)
            return run(fn, *args, **kwargs)

        InterpretedFunction.run = counting  # type: ignore[method-assign]

    def stop(self) -> list[str]:
        self._cls.run = self._run  # type: ignore[method-assign]
        return self.names


def _run(rank: int, kernels: str, clip: float | None, fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scaler = gpu_path(GradScaler("cpu", init_scale=2.0**8, kernels=kernels,
                                 replica_check_interval=1).register_model(ddp))  # fmt: skip
    out: dict[str, Any] = {"scales": [], "skipped": [], "norms": [], "mismatch_steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + 10 * step + rank)
        x = torch.randn(4, 8)
        if step == INF_STEP and rank == 0:
            x[0, 0] = float("inf")  # before the reduce: every replica sees it (an overflow)
        scaler.scale(ddp(x).square().mean()).backward()
        if step == FLIP_STEP and rank == 1:
            flip_bit_(model[0].weight.grad, 5, 30)  # after the reduce: this replica only
        launched = _launches() if kernels == "triton" and step == STEPS - 1 else None
        try:
            norm = scaler.clip_grad_norm_(opt, clip) if clip is not None else None
            scaler.step(opt)
            scaler.update()
        finally:
            if launched is not None:
                out["launched"] = launched.stop()
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(scaler.step_was_skipped)
        out["norms"].append(None if norm is None else float(norm))
        mismatch = scaler.last_replica_mismatch
        if mismatch is not None and mismatch.step not in out["mismatch_steps"]:
            out["mismatch_steps"].append(mismatch.step)
    out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    out["repr"] = repr(scaler)
    return out


def triton_beside_torch(rank: int, world_size: int) -> dict[str, Any]:
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter on the CPU
    results = {}
    for clip, fused in ((None, True), (1.0, True), (1.0, False), (None, False)):
        key = f"{'clip' if clip else 'noclip'}-{'fused' if fused else 'foreach'}"
        results[key] = {k: _run(rank, k, clip, fused) for k in ("torch", "triton")}
    return results
