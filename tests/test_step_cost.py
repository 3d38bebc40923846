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
from _common import gpu_path
from benchkit.contenders import noop_step
from torch.utils._python_dispatch import TorchDispatchMode

import distscaler
from common.probes import DispatchCounter, HostReadSpy

NUM_TENSORS = 144

#: distscaler's scaler phase on the CPU, op by op (clip_grad_norm_ + step + update), a clean step.
#: A host read costs no sync there (distscaler._plan.host_read_is_free): the flag is read and the
#: gradients are coded only on a skip.
OURS_WITH_CLIP = {
    "aten._foreach_norm.Scalar": 1,  # the one read of every gradient (per-tensor norms)
    "aten.stack.default": 1,  # ... with scale and max_norm
    "aten.linalg_vector_norm.default": 1,  # the global norm T (world size 1, float64)
    "aten.div.Tensor": 1,  # norm = T / scale and q = T / max_norm, in float64
    # the stack cast to float64; norm and q rounded once to float32 (inf where past its range)
    "aten._to_copy.default": 2,
    "aten._foreach_addcdiv.Scalar": 1,  # q + norm / inf (the flag's value), the next counts
    # T, then the flag, read on the host (no sync on a CPU): the float32 norms are taken again in
    # float64 only where T is not finite
    "aten._local_scalar_dense.default": 2,
    "aten.fmax.default": 1,  # grad_scale = scale / clip_coef
    "aten._foreach_lerp_.List": 1,  # the skip counters (and the overflow flags, on a skip)
    "aten._amp_update_scale_.default": 1,  # torch's policy
}
#: The overflow flags' lerp_ where the flags were taken after the host read (the CPU's path, on a
#: skip): their weight is the 0-dim found_inf, and a vector with a 0-dim weight among the skip
#: counters' 0-dim tensors would send torch's CUDA foreach kernel down its per-tensor path (5
#: kernels in place of 1, on an H100), so it runs apart. On the GPU's path the inf check gives
#: found_inf in the flags' shape and they ride in the skip counters' _foreach_lerp_ (see
#: test_the_overflow_flags_ride_in_the_skip_counters_lerp_on_foreachs_multi_tensor_path).
FLAGS = {"aten.lerp_.Tensor": 1}
#: The same step when it overflows: the codes instead of grad_scale, and the overflow flags.
#: T is NaN: the norms are taken again in float64 (_foreach_norm, stack, copy_ into the buffer, T
#: again), and the per-tensor flags of them: nan_to_num, saturated at float32's largest (clamp_),
#: cast to float32.
OURS_WITH_CLIP_SKIPPED = dict(
    OURS_WITH_CLIP,
    **{"aten._foreach_norm.Scalar": 2, "aten.stack.default": 2, "aten.copy_.default": 1},
    **{"aten.linalg_vector_norm.default": 2},
    **{"aten.nan_to_num.default": 1, "aten.clamp_.default": 1, "aten._to_copy.default": 3},
    **FLAGS,
)
del OURS_WITH_CLIP_SKIPPED["aten.fmax.default"]
#: step + update without clipping (torch's check kernel, with a factor of 1.0).
OURS_WITHOUT_CLIP = {
    "aten._foreach_addcdiv.Scalar": 1,  # the flag's zero and the record's next counts
    "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,
    "aten._local_scalar_dense.default": 1,  # the flag, read on the host
    "aten._foreach_lerp_.List": 1,
    "aten._amp_update_scale_.default": 1,
}
#: On a skip, the gradients are coded for the overflow report (one more read pass).
OURS_WITHOUT_CLIP_SKIPPED = dict(
    OURS_WITHOUT_CLIP,
    **{"aten._foreach_norm.Scalar": 1, "aten.stack.default": 1, "aten.nan_to_num.default": 1},
    **FLAGS,
)
#: The inf check a GPU runs (no host read: the fused step's promise), counted on the CPU with
#: the scaler on the path a GPU runs (``gpu_path``). With clipping: the per-tensor norms and the
#: global norm T in float64 (`_two_norm`); one float32 stack makes the slots (room for the flags,
#: norm, q, the codes, the clamp's bounds, the next counters); norm and q are divided in float64
#: into them (rounded once: inf where past float32's range); one nan_to_num codes q + norm / inf and
#: one clamp makes both the flag and grad_scale, the flag in one element per gradient: the overflow
#: flags' weight in the skip counters' _foreach_lerp_ (no lerp_ of their own).
GPU_WITH_CLIP = {
    "aten._foreach_norm.Scalar": 1,  # the one read of every gradient (float64 norms)
    "aten.stack.default": 2,  # float64: the norms; float32: the slots (scale, max_norm, ...)
    "aten.linalg_vector_norm.default": 1,  # the global norm T (float64)
    "aten.div.out": 1,  # norm = T / scale, q = T / max_norm, in float64, written as float32
    "aten._foreach_addcdiv_.Scalar": 1,  # q + norm / inf, the record's next counts
    "aten.nan_to_num.out": 1,  # its code c: q, or negative on an overflow
    "aten.sub.out": 1,  # -c
    "aten.clamp.Tensor": 1,  # the flag (exactly 0.0 or 1.0, in every element) and grad_scale
    "aten.nan_to_num.default": 1,  # the per-tensor flags (float64)
    "aten.fmin.out": 1,  # ... saturated at float32's largest, written as float32
    "aten._foreach_lerp_.List": 1,  # the skip counters and the overflow flags
    "aten._amp_update_scale_.default": 1,
}
#: Without clipping: each gradient's largest magnitude (p = inf), coded, its minimum the flag
#: (clamped in one element per gradient, as with clipping): torch's recipe's count.
GPU_WITHOUT_CLIP = {
    "aten._foreach_norm.Scalar": 1,
    "aten.stack.default": 1,
    "aten.nan_to_num.default": 1,  # the tensor codes: < 0 exactly for an inf/NaN gradient
    "aten.amin.default": 1,
    "aten._foreach_addcdiv.Scalar": 1,  # -min(codes) and the record's next counts
    "aten.clamp.default": 1,  # the flag, exactly 0.0 or 1.0, in every element
    "aten._foreach_lerp_.List": 1,  # the skip counters and the overflow flags
    "aten._amp_update_scale_.default": 1,
}
#: What the DeepSpeed and Megatron rules add to the torch policy's update, with the same settings
#: (hysteresis, bounds, raise_error_at_min_scale): one clamp_min (grow / exhausted flags) and one
#: lerp (the elements after a clean step, the kernel's flags); their overflow values ride in the skip
#: record's lerp, and torch's scale kernel moves the scale.
PACKED_POLICY = {"aten._foreach_clamp_min.Scalar": 1, "aten._foreach_lerp_.List": 1}


@pytest.fixture
def on_gpu_path():
    """The path a GPU runs: found_inf never read on the host (pass it as ``gpu=`` to the
    helpers below, which build the scaler so)."""
    return True


def _setup(scaler_cls, gpu: bool = False, **settings):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(NUM_TENSORS)]
    optimizer = noop_step(torch.optim.AdamW(params, lr=1e-3, fused=True))
    scaler = scaler_cls("cpu", init_scale=2.0**16, **settings)
    if gpu and isinstance(scaler, distscaler.GradScaler):
        gpu_path(scaler)
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
    scaler_cls, clip: bool, *, fault: bool = False, gpu: bool = False, **settings
) -> tuple[dict[str, int], bool]:
    params, optimizer, scaler = _setup(scaler_cls, gpu, **settings)
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
def test_a_clean_clipped_step_dispatches_fewer_ops_than_torchs_with_the_report_on(fault):
    ours, skipped = _count(distscaler.GradScaler, clip=True, fault=fault)
    theirs, torch_skipped = _count(torch.amp.GradScaler, clip=True, fault=fault)
    assert skipped is fault and torch_skipped is fault  # guard: the inf was seen by both
    assert ours == (OURS_WITH_CLIP_SKIPPED if fault else OURS_WITH_CLIP)
    # 12 against torch's 17 (19 on a skip: the float64 norms, the flags, their lerp_)
    if not fault:
        assert sum(ours.values()) < sum(theirs.values()), (ours, theirs)


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "overflow"])
def test_unclipped_step_dispatches_no_more_than_torchs_ops_with_the_report_on(fault):
    ours, skipped = _count(distscaler.GradScaler, clip=False, fault=fault)
    theirs, torch_skipped = _count(torch.amp.GradScaler, clip=False, fault=fault)
    assert skipped is fault and torch_skipped is fault
    assert ours == (OURS_WITHOUT_CLIP_SKIPPED if fault else OURS_WITHOUT_CLIP)
    assert sum(ours.values()) <= sum(theirs.values()) + fault, (ours, theirs)  # + FLAGS


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "overflow"])
def test_the_gpu_path_costs_the_same_on_clean_and_skipped_steps(on_gpu_path, fault):
    for clip, expected in ((True, GPU_WITH_CLIP), (False, GPU_WITHOUT_CLIP)):
        ours, skipped = _count(distscaler.GradScaler, clip=clip, fault=fault, gpu=on_gpu_path)
        theirs, _ = _count(torch.amp.GradScaler, clip=clip, fault=fault)
        assert skipped is fault and ours == expected
        # With clipping fewer than torch's, without no more than torch's (the overflow flags in
        # the skip counters' _foreach_lerp_: 13 and 8, torch's 17 and 8).
        bound = sum(theirs.values()) - 1 if clip else sum(theirs.values())
        assert sum(ours.values()) <= bound, (ours, theirs)


class _LerpOperands(TorchDispatchMode):
    """The operand lists of every ``_foreach_lerp_`` dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[torch.Tensor], ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._foreach_lerp_.List:
            self.calls.append(tuple(list(tensors) for tensors in args[:3]))
        return func(*args, **(kwargs or {}))


def _multi_tensor_path(lists: tuple[list[torch.Tensor], ...]) -> bool:
    """Whether torch's CUDA foreach kernels take their multi-tensor path (one launch) over
    ``lists``: ATen's ``check_fast_path_restrictions`` (ForeachUtils.h, torch 2.13): one dtype and
    device, every tensor strided and non-overlapping and dense (here: contiguous, which implies
    it), and the tensors at each index of the lists of the same sizes and strides (dims of size 1
    aside). Otherwise they launch one kernel per tensor. Read from torch's source, not counted
    on a GPU here."""
    first = lists[0][0]
    for t in (t for tensors in lists for t in tensors):
        if (t.dtype, t.device, t.layout) != (first.dtype, first.device, torch.strided):
            return False
        if not t.is_contiguous():
            return False
    for tensors in lists[1:]:
        for a, b in zip(lists[0], tensors):
            if a.shape != b.shape or any(
                n != 1 and x != y for n, x, y in zip(a.shape, a.stride(), b.stride())
            ):
                return False
    return True


def test_a_vector_with_a_0_dim_weight_leaves_the_multi_tensor_path():
    # The guard of the helper above: the overflow flags as they were weighed before (the 0-dim
    # found_inf) would send the whole list down the per-tensor path.
    flags, counts = torch.zeros(NUM_TENSORS), list(torch.zeros(4).unbind())
    found = torch.zeros(())
    lists = ([*counts, flags], [*counts, torch.ones(NUM_TENSORS)], [found] * 5)
    assert not _multi_tensor_path(lists)
    elements = found.expand(NUM_TENSORS).clamp(0.0, 1.0)  # as the inf check makes them
    assert _multi_tensor_path(([*counts, flags], lists[1], [found] * 4 + [elements]))


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "overflow"])
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_the_overflow_flags_ride_in_the_skip_counters_lerp_on_foreachs_multi_tensor_path(
    on_gpu_path, clip, fault
):
    """On the GPU's path the inf check's clamp gives found_inf in one element per gradient (its
    operands repeated by views), which weighs the overflow flags in the skip counters' one
    ``_foreach_lerp_``: every tensor of it beside a weight of its own sizes, so that torch's CUDA
    foreach keeps its one-launch path (by the rule of torch's source; `_multi_tensor_path`)."""
    params, optimizer, scaler = _setup(distscaler.GradScaler, on_gpu_path)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if fault and step == 2:
            params[7].grad[3] = math.inf
        with _LerpOperands() as seen:
            _phase(params, optimizer, scaler, clip)
    (lists,) = seen.calls
    targets, ends, weights = lists
    assert [tuple(t.shape) for t in targets] == [()] * 4 + [(NUM_TENSORS,)]  # counters, flags
    assert _multi_tensor_path(lists), [(tuple(w.shape), w.stride()) for w in weights]
    elements = {float(v) for w in weights[1:] for v in w.reshape(-1)}
    assert elements == {float(fault)}  # found_inf in every element
    report = scaler.report_overflow()  # the flags kept: this step's on a skip, none before
    assert scaler.skip_totals.num_skipped == fault
    if fault:
        assert report.step == 3 and [(e.param, e.kind) for e in report.entries] == [
            ("param_groups[0][7]", "inf")
        ]
    else:
        assert report is None


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_the_skip_counters_and_the_overflow_flags_take_one_lerp_kernel_on_a_gpu(clip):
    """The kernels of the phase on CUDA with torch's kernels (the Triton kernels' path keeps the
    flags' lerp_ apart), counted by torch's profiler: one lerp kernel, the skip counters' and the
    overflow flags' _foreach_lerp_ on torch's multi-tensor path (its per-tensor path launches one
    per tensor: 5; the flags' lerp_ apart, 2)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, device="cuda")) for _ in range(NUM_TENSORS)]
    optimizer = noop_step(torch.optim.AdamW(params, lr=1e-3, fused=True))
    scaler = distscaler.GradScaler("cuda", kernels="torch")
    scaler.scale(torch.ones((), device="cuda"))
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        if step < 2:  # warm-up: plans, constants, the device state
            _phase(params, optimizer, scaler, clip)
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _phase(params, optimizer, scaler, clip)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len([n for n in names if "lerp" in n.lower()]) == 1, names
    assert scaler.report_overflow() is None  # guard: the phase ran clean, the report on


def test_without_a_periodic_report_nothing_is_coded_or_recorded(on_gpu_path):
    ours, skipped = _count(
        distscaler.GradScaler, clip=True, fault=True, gpu=on_gpu_path, skip_log_interval=0
    )
    assert skipped
    # The same ops but the per-tensor flags' two: the flag still takes its code's nan_to_num, and
    # the skip counters their _foreach_lerp_ (with no overflow flags in it).
    unflagged = {k: v for k, v in GPU_WITH_CLIP.items()
                 if k not in ("aten.nan_to_num.default", "aten.fmin.out")}  # fmt: skip
    assert ours == unflagged
    ours, skipped = _count(
        distscaler.GradScaler, clip=False, fault=True, gpu=on_gpu_path, skip_log_interval=0
    )
    assert skipped
    assert ours == {  # torch's check kernel on any device, and no host read
        "aten._foreach_addcdiv.Scalar": 1,
        "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,
        "aten._foreach_lerp_.List": 1,
        "aten._amp_update_scale_.default": 1,
    }


_SETTINGS = {
    "default": {},
    "bounded": {"min_scale": 1.0, "max_scale": 2.0**24},
    "raise": {"min_scale": 1.0, "raise_error_at_min_scale": True},
}


@pytest.mark.parametrize("settings", list(_SETTINGS), ids=list(_SETTINGS))
@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("policy", ["deepspeed", "megatron"])
def test_hysteresis_policies_cost_the_torch_policy_plus_two_ops(policy, path, settings):
    gpu = path == "gpu"
    for clip in (True, False):
        for fault in (False, True):
            base, _ = _count(
                distscaler.GradScaler, clip=clip, fault=fault, gpu=gpu, **_SETTINGS[settings]
            )
            ours, skipped = _count(
                distscaler.GradScaler,
                clip=clip,
                fault=fault,
                gpu=gpu,
                policy=policy,
                hysteresis=1 if fault else 2,  # the overflow backs off: the guard below
                **_SETTINGS[settings],
            )
            assert skipped is fault
            expected = {
                k: base.get(k, 0) + PACKED_POLICY.get(k, 0) for k in {*base, *PACKED_POLICY}
            }
            assert ours == expected, (clip, fault)
            assert sum(ours.values()) == sum(base.values()) + 2


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
def test_fused_step_reads_nothing_on_the_host_on_the_gpu_path(on_gpu_path, clip):
    params, optimizer, scaler = _setup(distscaler.GradScaler, gpu=on_gpu_path)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 1:
            params[0].grad[0] = math.nan
        with HostReadSpy() as spy:
            _phase(params, optimizer, scaler, clip)
        assert spy.reads == []
    assert scaler.skip_totals.num_skipped == 1  # guard: the NaN was seen
    assert scaler.last_overflow is None and scaler.report_overflow().entries[0].kind == "nan"


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_on_the_cpu_a_fused_step_reads_its_flag_once_and_codes_only_a_skip(clip):
    params, optimizer, scaler = _setup(distscaler.GradScaler)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 1:
            params[0].grad[0] = math.nan
        with HostReadSpy() as spy:
            _phase(params, optimizer, scaler, clip)
        # the flag (with clipping T first: its float32 norms are taken again in float64 where it
        # is not finite): no sync on a CPU
        assert spy.reads == (["item", "item"] if clip else ["item"])
    assert scaler.skip_totals.num_skipped == 1
    report = scaler.report_overflow()
    assert report.step == 2 and [(e.param, e.kind) for e in report.entries] == [
        ("param_groups[0][0]", "nan")
    ]
