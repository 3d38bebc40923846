"""Scenarios of tests/test_skip_account.py on gloo ranks: one DDP run with an overflow (an inf in
rank 1's batch, before the reduce) and a bit flipped on rank 1's gradients after the reduce, the
skip account and the last skip's report read after every update on every rank, as a user's loop
would (the Recipes page's pattern)."""

from __future__ import annotations

from typing import Any

import torch
from _replica_scenarios import flip_bit_
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

OVERFLOW_STEP = 1
FLIP_STEP = 3
STEPS = 5


def overflow_and_flip(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, replica_check_interval=1).register_model(ddp)
    out: dict[str, Any] = {"steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + step + 10 * rank)
        x = torch.randn(4, 8)
        if step == OVERFLOW_STEP and rank == 1:
            x[0, 0] = float("inf")  # this rank's data: every replica's average overflows
        scaler.scale(ddp(x).square().mean()).backward()
        if step == FLIP_STEP and rank == 1:
            flip_bit_(model[0].weight.grad, 3, 30)  # after the reduce: this replica only
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.step_was_skipped
        report = scaler.report_skip() if skipped else None  # the recipe's pattern
        totals = scaler.skip_totals
        out["steps"].append({
            "skipped": skipped,
            "scale": scaler.get_scale(),
            "cause": None if report is None else report.cause,
            "update": None if report is None else report.update,
            "describe": None if report is None else report.describe(),
            "causes": totals.causes,
            "num_skipped": totals.num_skipped,
            "num_updates": totals.num_updates,
            "totals": totals.describe(),
        })  # fmt: skip
    out["ledger"] = scaler.replica_ledger.as_dict()
    out["metrics_keys"] = sorted(scaler.skip_totals.causes)
    return out
