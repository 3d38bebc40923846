"""Scenarios of tests/test_one_account.py on gloo ranks: one DDP run with every kind of skip the
CPU reaches, the skip account, the replica ledger and ``metrics()`` read after every update on every
rank. ``torch.Tensor.numpy`` raises in these ranks, as on a plain install without numpy (torch's
``RuntimeError: Numpy is not available``): naming the ranks at a mismatch must not need it."""

from __future__ import annotations

from typing import Any

import torch
from _replica_scenarios import flip_bit_
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

#: An inf in rank 1's batch, before DDP's reduce: every replica's average overflows (no mismatch).
OVERFLOW = 1
#: A bit flipped in rank 1's gradients after the reduce: a finite replica mismatch.
FLIP = 3
#: An inf written into rank 1's gradients after the reduce: a replica mismatch and an overflow.
INF_AFTER_REDUCE = 5
#: A bit flipped after the reduce, then ``update(new_scale)``: a mismatch no update counts.
FLIP_NEW_SCALE = 6
STEPS = 8


def _no_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Numpy is not available")


def every_skip(rank: int, world_size: int) -> dict[str, Any]:
    torch.Tensor.numpy = _no_numpy  # type: ignore[method-assign]  # as without numpy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**8, skip_log_interval=1,
                        replica_check_interval=1).register_model(ddp)  # every update checked
    out: dict[str, Any] = {"steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + step + 10 * rank)
        x = torch.randn(4, 8)
        if step == OVERFLOW and rank == 1:
            x[0, 0] = float("inf")
        scaler.scale(ddp(x).square().mean()).backward()
        if step in (FLIP, FLIP_NEW_SCALE) and rank == 1:
            flip_bit_(model[0].weight.grad, 3, 20)  # after the reduce: this replica only
        if step == INF_AFTER_REDUCE and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update(2.0**7 if step == FLIP_NEW_SCALE else None)
        skipped = scaler.step_was_skipped
        report = scaler.report_skip() if skipped else None
        totals = scaler.skip_totals
        mismatch = scaler.last_replica_mismatch
        out["steps"].append({
            "skipped": skipped,
            "scale": scaler.get_scale(),
            "cause": None if report is None else report.cause,
            "causes": totals.causes,
            "num_skipped": totals.num_skipped,
            "ledger": scaler.replica_ledger.as_dict(),
            "metrics": scaler.metrics(),
            "mismatch": None if mismatch is None else
                [mismatch.step, list(mismatch.ranks), list(mismatch.nonfinite)],
        })  # fmt: skip
    return out
