"""``GradScaler.metrics()``: the keys every integration logs, against the scaler's own readings."""

from __future__ import annotations

import math

import torch

from common.probes import HostReadSpy
from distscaler import GradScaler

BASE_KEYS = {
    "distscaler/scale",
    "distscaler/updates",
    "distscaler/skipped_total",
    "distscaler/skipped_overflow",
    "distscaler/skipped_replica_mismatch",
    "distscaler/skipped_not_committed",
}
OVERFLOW_KEYS = {"distscaler/overflow_step", "distscaler/overflow_tensors"}
REPLICA_KEYS = {
    "distscaler/replica_checks",
    "distscaler/replica_mismatches",
    "distscaler/replica_skipped",
    "distscaler/suspects",
}


def _step(scaler: GradScaler, params: list[torch.nn.Parameter], opt, infs: int) -> None:
    scaler.scale(sum(p.sum() for p in params)).backward()
    for p in params[:infs]:
        p.grad.view(-1)[0] = math.inf
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_metrics_are_the_scalers_readings_under_stable_keys():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2, skip_log_interval=1)
    assert scaler.metrics() == {
        "distscaler/scale": 1024.0,
        "distscaler/updates": 0,
        "distscaler/skipped_total": 0,
        "distscaler/skipped_overflow": 0,
        "distscaler/skipped_replica_mismatch": 0,
        "distscaler/skipped_not_committed": 0,
    }
    seen = []
    for infs in (0, 2, 0, 0):  # a clean step, two tensors with an inf, two clean steps
        _step(scaler, params, opt, infs)
        metrics = scaler.metrics()
        totals = scaler.skip_totals
        assert metrics["distscaler/scale"] == scaler.get_scale()
        assert metrics["distscaler/updates"] == totals.num_updates
        assert metrics["distscaler/skipped_total"] == totals.num_skipped
        seen.append(metrics)
    assert set(seen[0]) == BASE_KEYS  # no overflow yet, nothing replicated at one rank
    assert [m["distscaler/scale"] for m in seen] == [1024.0, 512.0, 512.0, 1024.0]
    assert [m["distscaler/skipped_total"] for m in seen] == [0, 1, 1, 1]
    assert [m["distscaler/skipped_overflow"] for m in seen] == [0, 1, 1, 1]  # the one cause
    for metrics in seen[1:]:  # the report of the skipped step stays until the next skip
        assert set(metrics) == BASE_KEYS | OVERFLOW_KEYS
        report = scaler.last_overflow
        assert report is not None and metrics["distscaler/overflow_step"] == report.step == 2
        assert metrics["distscaler/overflow_tensors"] == 2  # both tensors the inf was put in


def test_metrics_cost_one_host_read_and_carry_the_replica_ledger():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", skip_log_interval=0)
    _step(scaler, [p], opt, 0)
    with HostReadSpy() as spy:
        scaler.metrics()
    assert len(spy.reads) == 1, spy.reads
    ledger = scaler.replica_ledger
    ledger.checks, ledger.skipped, ledger.suspects = 5, 1, (3,)
    ledger.mismatches.update({1: 1, 3: 2})
    ledger.mismatch_events = 3
    metrics = scaler.metrics()
    assert {k: metrics[k] for k in REPLICA_KEYS} == {
        "distscaler/replica_checks": 5,
        "distscaler/replica_mismatches": 3,
        "distscaler/replica_skipped": 1,
        "distscaler/suspects": 1,
    }


def test_a_disabled_scaler_has_no_metrics():
    assert GradScaler("cpu", enabled=False).metrics() == {}
