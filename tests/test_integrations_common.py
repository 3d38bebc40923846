"""``distscaler.integrations._common`` (what the integrations share) and torchft's constructor,
without a framework's run: the rules themselves, checked on small cases."""

from __future__ import annotations

import math

import pytest
import torch

from distscaler import GradScaler
from distscaler.integrations import _common as C


def test_requires_says_what_to_install_and_keeps_the_cause():
    with pytest.raises(
        ImportError, match=r"^distscaler.integrations.x needs X 1.0: pip install 'distscaler\[x\]'$"
    ) as e:
        with C.requires("x", "X 1.0", "x"):
            import distscaler_no_such_module  # noqa: F401
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ImportError, match=r"^distscaler.integrations.x: install it first$"):
        with C.requires("x", "X", "x", hints={"distscaler_no_such_module": "install it first"}):
            import distscaler_no_such_module  # noqa: F401


def test_lr_on_skip_values_and_message():
    assert C.check_lr_on_skip("hold") == "hold"
    with pytest.raises(
        ValueError, match=r"^MY_ENV must be one of \('hold', 'step'\), got: 'keep'$"
    ):
        C.check_lr_on_skip("keep", "MY_ENV")


def test_lr_hold_holds_only_when_every_step_since_the_last_skipped():
    hold = C.LRHold()
    assert not hold.hold() and not hold.last_skipped  # no step since: the scheduler steps
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    cases = [([True], True), ([True, False], False), ([one], True), ([one, one], True),
             ([one, zero], False), ([True, one], True), ([zero], False)]  # fmt: skip
    for steps, held in cases:
        for skipped in steps:
            hold.record(skipped)
        assert hold.last_skipped == bool(steps[-1])
        assert hold.hold() is held, steps
        assert hold.last_skipped == bool(steps[-1])  # kept past the scheduler's step


def test_log_metrics_counts_the_skips_since_the_previous_log():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler("cpu", skip_log_interval=1000)  # no periodic report in 3 steps
    log = C.LogMetrics()

    def step(inf: bool) -> None:
        scaler.scale(p.sum()).backward()
        if inf:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    step(True)
    first = log.metrics(scaler)  # report=False: the skip counts, no report
    assert first[C.SKIPPED] == 1 and "distscaler/overflow_step" not in first
    step(True)
    step(False)
    second = log.metrics(scaler, report=True)
    assert second[C.SKIPPED] == 1 and second["distscaler/skipped_total"] == 2
    assert second["distscaler/overflow_step"] == 2  # reported at this log
    assert log.metrics(scaler)[C.SKIPPED] == 0
    resumed = GradScaler("cpu")
    resumed.load_state_dict(scaler.state_dict())
    log = C.LogMetrics()
    log.resume(resumed)
    assert log.metrics(resumed)[C.SKIPPED] == 0  # the checkpoint's skips were logged before


def test_installed_scaler_reads_what_install_attached():
    class Holder:
        pass

    target, holder = Holder(), Holder()
    assert C.installed_scaler(target) is None
    holder.scaler = GradScaler("cpu")  # type: ignore[attr-defined]
    setattr(target, C.INSTALLED, holder)
    assert C.installed_scaler(target) is holder.scaler  # type: ignore[attr-defined]


def test_torchft_from_scaler_takes_the_scaler_over_and_refuses_before_building():
    pytest.importorskip("torchft", reason="torchft (the torchft extra)")
    import torch.distributed as dist

    from distscaler.integrations.torchft import FaultTolerantGradScaler

    scaler = GradScaler("cpu", init_scale=64.0, growth_interval=7, policy="megatron", hysteresis=2)
    manager = object()  # the constructor only keeps it
    ft = FaultTolerantGradScaler.from_scaler(scaler, manager, report_lone_replica=True)  # type: ignore[arg-type]
    assert type(ft) is FaultTolerantGradScaler and type(scaler) is GradScaler
    assert ft.config == scaler.config and ft.get_scale() == 64.0
    assert ft.manager is manager and ft.last_step_committed is None and ft.replica_overflow is None
    # the user's scaler itself agrees across groups: the torchft check added to it, no stand-in
    # process group, nothing copied
    assert ft.scaler is scaler and ft.check.scaler is scaler
    with pytest.raises(ValueError, match="already installed on a torchft Manager"):
        FaultTolerantGradScaler.from_scaler(ft, manager)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler must be a distscaler.GradScaler"):
        FaultTolerantGradScaler.from_scaler(torch.amp.GradScaler("cpu"), manager)  # type: ignore[arg-type]

    class Managed(dist.ProcessGroup):
        dynamic_membership = True

    torchft_group = GradScaler("cpu", process_group=Managed(0, 1))
    with pytest.raises(ValueError, match="torchft group whose membership changes"):
        FaultTolerantGradScaler.from_scaler(torchft_group, manager)  # type: ignore[arg-type]
