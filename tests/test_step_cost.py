"""What one scaler step costs on the device, counted where it can be counted exactly: on the CPU.

A GPU step of the scaler phase is launch-bound (every launch costs microseconds of host time, the
bytes do not matter below ~1 GB), so the number of device ops it dispatches is what sets its time.
A TorchDispatchMode sees every aten op, on any machine: these tests pin distscaler's count for the
case of the GPU-first issue (144 small fp32 gradients, one dtype group, world size 1, fused AdamW,
after warm-up) and compare it with torch's recipe counted the same way, side by side.
"""

from __future__ import annotations

import math

import pytest
import torch
from benchkit.contenders import noop_step

import distscaler
from common.probes import DispatchCounter, HostReadSpy

NUM_TENSORS = 144

#: distscaler's scaler phase, op by op (clip_grad_norm_ + step + update).
OURS_WITH_CLIP = {
    "aten._foreach_norm.Scalar": 1,  # the one read of every gradient
    "aten.stack.default": 1,  # the per-tensor norms
    "aten.linalg_vector_norm.default": 1,  # the global norm (world size 1)
    "aten._foreach_addcdiv.Scalar": 1,  # norm, norm / max_norm, flag, the record's next counts
    "aten.nan_to_num.default": 2,  # the flag, exactly 0.0 or 1.0; the tensor codes (attribution)
    "aten.fmax.default": 1,  # grad_scale = scale / clip_coef
    "aten._foreach_lerp_.List": 1,  # the skip record
    "aten.lerp_.Tensor": 1,  # the overflow record: the codes of the last skipped step
    "aten._amp_update_scale_.default": 1,  # torch's policy
}
#: step + update without clipping.
OURS_WITHOUT_CLIP = {
    "aten._foreach_norm.Scalar": 1,  # the check: each gradient's largest magnitude (p = inf)
    "aten.stack.default": 1,
    "aten.nan_to_num.default": 1,  # the tensor codes: < 0 exactly for an inf/NaN gradient
    "aten.amin.default": 1,
    "aten._foreach_addcdiv.Scalar": 1,  # -min(codes) and the record's next counts
    "aten.clamp.default": 1,  # the flag, exactly 0.0 or 1.0
    "aten._foreach_lerp_.List": 1,  # the skip record
    "aten.lerp_.Tensor": 1,  # the overflow record
    "aten._amp_update_scale_.default": 1,
}
#: What keeping the overflow record costs per step (distscaler.attribution); none without a
#: periodic report (skip_log_interval=0).
RECORD = {"aten.lerp_.Tensor": 1}


def _setup(scaler_cls, **settings):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(NUM_TENSORS)]
    optimizer = noop_step(torch.optim.AdamW(params, lr=1e-3, fused=True))
    scaler = scaler_cls("cpu", init_scale=2.0**16, **settings)
    scaler.scale(torch.ones(()))
    return params, optimizer, scaler


def _phase(params, optimizer, scaler, clip: bool) -> None:
    if clip and isinstance(scaler, distscaler.GradScaler):
        scaler.clip_grad_norm_(optimizer, 1.0)
    elif clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(optimizer)
    scaler.update()


def _count(
    scaler_cls, clip: bool, *, fault: bool = False, **settings
) -> tuple[dict[str, int], bool]:
    params, optimizer, scaler = _setup(scaler_cls, **settings)
    for _ in range(2):  # warm-up: plans, constants, the device state
        for p in params:
            p.grad = torch.randn_like(p)
        _phase(params, optimizer, scaler, clip)
    for p in params:
        p.grad = torch.randn_like(p)
    if fault:
        params[7].grad[3] = math.inf
    with DispatchCounter() as counter:
        _phase(params, optimizer, scaler, clip)
    skipped = scaler.get_scale() < 2.0**16
    return counter.ops, skipped


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "overflow"])
def test_clipped_step_verdict_dispatches_at_most_half_of_torchs_ops(fault):
    ours, skipped = _count(distscaler.GradScaler, clip=True, fault=fault)
    theirs, torch_skipped = _count(torch.amp.GradScaler, clip=True, fault=fault)
    assert skipped is fault and torch_skipped is fault  # guard: the inf was seen by both
    assert ours == OURS_WITH_CLIP
    # The verdict itself takes at most half of torch's ops; attributing an overflow adds the
    # codes (one nan_to_num) and the record on top.
    attribution = 1 + sum(RECORD.values())
    assert sum(ours.values()) - attribution <= sum(theirs.values()) // 2, (ours, theirs)


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "overflow"])
def test_unclipped_step_verdict_dispatches_no_more_than_torchs_ops(fault):
    ours, skipped = _count(distscaler.GradScaler, clip=False, fault=fault)
    theirs, torch_skipped = _count(torch.amp.GradScaler, clip=False, fault=fault)
    assert skipped is fault and torch_skipped is fault
    assert ours == OURS_WITHOUT_CLIP
    # The verdict itself is no dearer than torch's; the overflow record is one op on top.
    assert sum(ours.values()) - sum(RECORD.values()) <= sum(theirs.values()), (ours, theirs)


def test_without_a_periodic_report_the_clip_path_neither_codes_nor_records():
    ours, skipped = _count(distscaler.GradScaler, clip=True, fault=True, skip_log_interval=0)
    assert skipped
    expected = dict(OURS_WITH_CLIP, **{"aten.nan_to_num.default": 1})  # the flag only
    del expected["aten.lerp_.Tensor"]
    assert ours == expected


def test_without_a_periodic_report_the_check_is_torchs_kernel_and_nothing_is_recorded():
    ours, skipped = _count(distscaler.GradScaler, clip=False, fault=True, skip_log_interval=0)
    assert skipped
    assert ours == {
        "aten.zeros.default": 1,  # the verdict buffer
        "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,  # a factor of 1.0
        "aten._foreach_add.Scalar": 1,  # the record's next counts
        "aten._foreach_lerp_.List": 1,
        "aten._amp_update_scale_.default": 1,
    }


def _clipped_step_ops(params: list[torch.nn.Parameter]) -> dict[str, int]:
    """distscaler's clipped fused step over ``params``, counted after two warm-up steps."""
    optimizer = noop_step(torch.optim.AdamW(params, lr=1e-3, fused=True))
    scaler = distscaler.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        with DispatchCounter() as counter:
            _phase(params, optimizer, scaler, clip=True)
    return counter.ops


def test_the_counts_do_not_grow_with_the_number_of_tensors_in_a_group():
    # One multi-tensor launch per (device, dtype) group: 1,000 tensors cost what 144 do.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(1000)]
    assert _clipped_step_ops(params) == OURS_WITH_CLIP


def test_a_second_dtype_group_adds_one_norm_launch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(4)]
    params += [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(4)]
    expected = dict(OURS_WITH_CLIP, **{"aten._foreach_norm.Scalar": 2})
    assert _clipped_step_ops(params) == expected


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_fused_step_reads_nothing_on_the_host(clip):
    params, optimizer, scaler = _setup(distscaler.GradScaler)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 1:
            params[0].grad[0] = math.nan
        with HostReadSpy() as spy:
            _phase(params, optimizer, scaler, clip)
        assert spy.reads == []
    assert scaler.skip_totals.num_skipped == 1  # guard: the NaN was seen
