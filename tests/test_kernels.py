"""The ``kernels`` setting: the scaler's pass as one multi-tensor Triton read (distscaler's
``_triton`` package) beside torch's kernels.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): the same scaler, the
same steps, torch's path and the kernel's side by side (scales and skips equal, norms within
float32 rounding, parameters after the optimizer's step equal), the launches of the phase counted,
and on 2 gloo ranks the replica check folding the kernel's checksum. On a GPU (``cuda``): the
kernels the phase launches, counted by torch's profiler.
"""

from __future__ import annotations

import functools
import math

import _kernel_scenarios as S
import pytest
import torch
from _common import gpu_path, interpreted
from _harness import spawn

from distscaler import GradScaler, ScalerConfig

triton = pytest.importorskip("triton")


def test_kernels_is_validated_and_named():
    with pytest.raises(ValueError, match="kernels must be 'auto', 'triton' or 'torch', got: 'cuda'"):
        ScalerConfig(kernels="cuda")  # type: ignore[arg-type]


def test_triton_where_it_cannot_run_is_refused_before_anything(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"kernels='triton' needs a CUDA device"):
        GradScaler("cpu", kernels="triton")


@interpreted
def test_auto_is_torch_on_the_cpu_and_repr_shows_the_choice(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even where the interpreter could run it
    assert "kernels='torch'" in repr(GradScaler("cpu"))
    assert "kernels='triton'" in repr(GradScaler("cpu", kernels="triton"))


def _train(kernels, *, fused, clip, norm_type=2.0, inf_step=None, layers=2, flags=100):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scaler = gpu_path(GradScaler("cpu", init_scale=2.0**8, kernels=kernels,
                                 skip_log_interval=flags))  # fmt: skip
    out = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
        if step == inf_step:
            model[0].weight.grad[0, 0] = math.inf
        norm = scaler.clip_grad_norm_(opt, 0.5, norm_type) if clip else None
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler.step_was_skipped,
                    None if norm is None else float(norm)))  # fmt: skip
    return out, [p.detach().clone() for p in model.parameters()]


@interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [None, 2.0, math.inf, 1.0], ids=["noclip", "p2", "pinf", "p1"])
@pytest.mark.parametrize("inf_step", [None, 1], ids=["clean", "inf"])
def test_the_kernel_steps_as_torch_kernels_do(monkeypatch, fused, clip, inf_step):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(fused=fused, clip=clip is not None, norm_type=clip or 2.0, inf_step=inf_step)
    ours, ours_params = _train("triton", **kw)
    ref, ref_params = _train("torch", **kw)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]  # scales and skips: exactly
    for (_, _, a), (_, _, b) in zip(ours, ref):
        if b is None or not math.isfinite(b):
            assert a == b or (a is not None and not math.isfinite(a) and not math.isfinite(b))
        else:  # float32 sums in another order (the kernel's docstring bounds it)
            assert a == pytest.approx(b, rel=1e-5)
    for p, q in zip(ours_params, ref_params):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7)
    if inf_step is not None:
        assert ours[inf_step][1] and ours[inf_step][0] < ours[inf_step - 1][0]  # seen, backed off


def _overflow_report(kernels, *, fused, clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scaler = gpu_path(GradScaler("cpu", kernels=kernels, skip_log_interval=100))
    for step in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
        if step == 1:
            model[0].weight.grad[3, 1] = math.inf
            model[1].bias.grad[0] = -math.inf
            model[2].weight.grad[1, 7] = math.nan
        if clip is not None:
            scaler.clip_grad_norm_(opt, 0.5, clip)
        scaler.step(opt)
        scaler.update()
    return scaler.report_overflow()


@interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [None, 2.0, math.inf], ids=["noclip", "p2", "pinf"])
def test_the_overflow_report_names_what_torchs_kernels_name(monkeypatch, fused, clip):
    """The per-tensor flags of the kernels' path (with a fused optimizer on a GPU's step, written
    as the report keeps them by the reduction; else flagged after the host read) name the same
    tensors, with the same kinds, as torch's kernels: an inf, a -inf and a NaN in three tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours = _overflow_report("triton", fused=fused, clip=clip)
    ref = _overflow_report("torch", fused=fused, clip=clip)
    assert ours is not None and ref is not None and ours.step == ref.step == 2
    kinds = sorted(e.kind for e in ref.entries)
    assert kinds == ["inf", "inf", "nan"], ref  # the three seen, each kind
    assert ours.entries == ref.entries and ours.unlisted == ref.unlisted == 0


def _past_float32_once_unscaled(kernels, *, fused, norm_type):
    """One clipped step at a loss scale of 0.5 whose scaled gradient holds 3e38: finite, and past
    float32's largest value once unscaled (times 2). ``kernels="stock"``: torch's recipe
    (``GradScaler.unscale_``, ``clip_grad_norm_``, ``step``, ``update``)."""
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused, foreach=not fused)
    scaler = (torch.amp.GradScaler("cpu", init_scale=0.5) if kernels == "stock" else
              gpu_path(GradScaler("cpu", init_scale=0.5, kernels=kernels)))  # fmt: skip
    scaler.scale(torch.ones(()))
    params[0].grad = torch.tensor([3e38, 1.0, -1.0, 1.0])
    params[1].grad = torch.ones(3)
    if kernels == "stock":
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, 1e6, norm_type)
    else:
        norm = scaler.clip_grad_norm_(opt, 1e6, norm_type)
    scaler.step(opt)
    scaler.update()
    return float(norm), scaler.get_scale(), [p.detach().clone() for p in params]


@interpreted
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["p2", "p1", "pinf"])
def test_a_gradient_past_float32_once_unscaled_is_an_overflow_on_both_paths(
    monkeypatch, fused, norm_type
):
    """A finite scaled gradient that passes float32's range once unscaled (a loss scale below 1)
    is an overflow on both kernels' paths alike: skipped, the scale backed off, the parameters
    kept. The kernels' path stepped at p = 1 and p = inf (its finish looked at the scaled norm
    only) where torch's path of the scaler skipped. torch's own recipe steps: its unscale kernel
    checks the gradients before it multiplies, and its clip multiplies an inf by 0."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stock_norm, stock_scale, stock_params = _past_float32_once_unscaled(
        "stock", fused=fused, norm_type=norm_type)  # fmt: skip
    assert math.isinf(stock_norm) and stock_scale == 0.5  # the overflow, not seen as one
    assert not bool(stock_params[0].isfinite().all())
    for kernels in ("triton", "torch"):
        norm, scale, params = _past_float32_once_unscaled(kernels, fused=fused, norm_type=norm_type)
        assert math.isinf(norm) and scale == 0.25, kernels  # skipped, backed off
        assert all(bool((p == 0).all()) for p in params), kernels


def _count_launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    launched: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    return launched


@interpreted
@pytest.mark.parametrize("layers", [2, 60])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_the_phase_is_at_most_four_launches_at_any_tensor_count(monkeypatch, layers, fused, clip):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launched = _count_launches(monkeypatch)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scaler = gpu_path(GradScaler("cpu", kernels="triton"))
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        launched.clear()
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    # read + reduce (one rank: no collective, so the reduction also computes found_inf,
    # grad_scale and the norm; at world size > 1 `_finish_kernel` does, after the all_reduce:
    # test_two_ranks_... below), and where the optimizer is not fused, one write pass (unscale or
    # clip): whatever the number of tensors (2 * layers).
    expected = ["_read_kernel", "_reduce_kernel"]
    assert sorted(launched) == sorted(expected + ([] if fused else ["_scale_kernel"]))


def _compiled_run(compiled: bool, launched: list[str], kernels: str, report: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    scaler = gpu_path(GradScaler("cpu", kernels=kernels, skip_log_interval=report,
                                 init_scale=16.0, growth_interval=2))  # fmt: skip

    def phase():
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        return norm

    run = torch.compile(phase, fullgraph=True) if compiled else phase
    out, per_step = [], []
    for step in range(6):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(step)
        scaler.scale(model(torch.randn(4, 8, generator=gen)).square().mean()).backward()
        if step == 3:
            model[0].weight.grad[0, 0] = math.inf
            model[2].bias.grad[1] = math.nan
        launched.clear()
        norm = run()
        per_step.append(list(launched))
        out.append((scaler.get_scale(), float(norm)))
    params = [p.detach().clone() for p in model.parameters()]
    return out, params, per_step, scaler.report_overflow()


@interpreted
@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("report", [0, 100], ids=["report-off", "report-on"])
def test_the_phase_compiles_whole_with_fullgraph(monkeypatch, kernels, report):
    """``clip_grad_norm_`` + the fused step + ``update`` (the GPU's step) trace as one graph with
    ``fullgraph=True`` on either kernels' path, with the overflow report off or on (its per-tensor
    flags kept on the device in the graph, read by ``report_overflow()`` outside it): scales,
    norms (an inf and a NaN at step 3: skipped, backed off) and parameters equal eager's, bit for
    bit, and so does the report. The Triton kernels (in Triton's interpreter on the CPU) run
    inside the graph as one custom op at one rank: read and reduce (which finishes) at every
    step, as eager."""
    from distscaler._traced_step import TRACES_WHOLE_PHASE

    if not TRACES_WHOLE_PHASE:
        pytest.skip("fullgraph=True over the whole phase needs torch >= 2.12")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launched = _count_launches(monkeypatch)
    try:
        eager, eager_params, _, eager_report = _compiled_run(False, launched, kernels, report)
        compiled, compiled_params, per_step, report_ = _compiled_run(True, launched, kernels, report)
    finally:
        torch._dynamo.reset()
    assert repr(compiled) == repr(eager)  # (nan == nan is False; their reprs are equal)
    assert math.isnan(eager[3][1]) and eager[3][0] < eager[2][0]  # the NaN seen: backed off
    assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))
    assert report_ == eager_report
    if report:
        assert sorted(e.kind for e in eager_report.entries) == ["inf", "nan"]
    else:
        assert eager_report is None
    launches = ["_read_kernel", "_reduce_kernel"] if kernels == "triton" else []
    assert per_step == [launches] * 6, per_step


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(S.triton_beside_torch, 2, tmp_path_factory.mktemp("kernels2"))


@interpreted
@pytest.mark.parametrize("case", ["noclip-fused", "clip-fused", "clip-foreach", "noclip-foreach"])
def test_two_ranks_agree_and_the_kernels_checksum_catches_a_flip(two, case):
    runs = [r[case] for r in two]
    for run in runs:
        ours, ref = run["triton"], run["torch"]
        assert "kernels='triton'" in ours["repr"]
        # The flip after the reduce is caught at its step by the kernel's moments, as by torch's
        # path; the inf before the reduce is an overflow on every rank.
        assert ours["mismatch_steps"] == ref["mismatch_steps"] == [S.FLIP_STEP + 1]
        assert ours["skipped"] == ref["skipped"]
        assert ours["skipped"][S.FLIP_STEP] and ours["skipped"][S.INF_STEP]
        assert ours["scales"] == ref["scales"]
        assert ours["scales"][S.FLIP_STEP] == ours["scales"][S.FLIP_STEP - 1]  # a mismatch: kept
        assert ours["scales"][S.INF_STEP] < ours["scales"][S.INF_STEP - 1]  # an overflow: backoff
        # two ranks: read + reduce, the all_reduce, then finish (and the non-fused write pass)
        expected = ["_read_kernel", "_reduce_kernel", "_finish_kernel"]
        write = [] if case.endswith("fused") and "foreach" not in case else ["_scale_kernel"]
        assert sorted(ours["launched"]) == sorted(expected + write), ours["launched"]
    assert runs[0]["triton"]["scales"] == runs[1]["triton"]["scales"]
    assert runs[0]["triton"]["norms"] == runs[1]["triton"]["norms"]
    assert runs[0]["triton"]["params"] == runs[1]["triton"]["params"]


@pytest.fixture(scope="module")
def deferred(tmp_path_factory):
    return spawn(S.deferred_beside_immediate, 2, tmp_path_factory.mktemp("deferred2"))


@interpreted
@pytest.mark.parametrize("case", list(S.DEFER_CASES))
def test_a_deferred_replica_check_skips_and_holds_as_the_check_read_at_the_step(deferred, case):
    """The GPU's path with the Triton kernels and a fused optimizer checks every update by default
    and reads the mismatch flag later; every step, scale, growth tracker, policy counter, skip
    count and ledger entry is the one of the check read at the step (and of torch's kernels on the
    CPU's path), through a finite mismatch, an overflow, and a mismatch that is an overflow."""
    for r in deferred:
        runs = r[case]
        ours, at_step, cpu, off = (runs[m] for m in ("deferred", "immediate", "cpu", "off"))
        assert ours["ledger"]["replica_checks"] == S.DEFER_STEPS  # every update, by default
        for ref in (at_step, cpu):
            assert ours["scales"] == ref["scales"]
            assert ours["params"] == ref["params"]  # every step's parameters, bit for bit
            assert ours["state"] == ref["state"]  # scale, growth tracker, the policy's counters
            assert ours["causes"] == ref["causes"] and ours["skipped"] == ref["skipped"]
            assert ours["ledger"] == ref["ledger"]
            assert ours["report"] == ref["report"]
        assert ours["causes"]["replica_mismatch"] == 1 and ours["causes"]["overflow"] == 2
        # one account: the mismatch that is an overflow too is not in the ledger's skipped
        assert ours["ledger"]["replica_skipped"] == ours["causes"]["replica_mismatch"]
        flip, mixed = S.DEFER_FLIP, S.DEFER_MIXED
        assert ours["params"][flip] == ours["params"][flip - 1]  # the flipped step was skipped
        assert off["params"][flip] != ours["params"][flip]  # which the flip alone would not be
        assert ours["params"][mixed] == ours["params"][mixed - 1]
        # a mismatch with an inf on one replica is an overflow too: the scale backs off (the
        # finite one's held scale and counters are the state compared above)
        assert ours["scales"][mixed] < ours["scales"][mixed - 1]
    assert deferred[0][case]["deferred"]["params"] == deferred[1][case]["deferred"]["params"]


@interpreted
def test_a_deferred_check_reads_nothing_at_the_step_and_names_at_the_periodic_read(deferred):
    for r in deferred:
        ours, at_step, off = (r["noclip-torch"][m] for m in ("deferred", "immediate", "off"))
        periodic = {u - 1 for u in range(S.DEFER_LOG, S.DEFER_STEPS + 1, S.DEFER_LOG)}
        # the run's first check reads its key once (the broadcast's value), then never again
        assert ours["reads"][0] == ["item", *off["reads"][0]]
        for i in range(1, S.DEFER_STEPS):
            if i not in periodic:  # the step and the update read what they read without it
                assert ours["reads"][i] == off["reads"][i], i
        assert len(at_step["reads"][0]) > len(off["reads"][0])  # the check read at the step
        # named at the first periodic read after it, on every rank; the check read at the step
        # names it at once
        flip_update, mixed_update = S.DEFER_FLIP + 1, S.DEFER_MIXED + 1
        assert ours["named"][: S.DEFER_LOG - 1] == [None] * (S.DEFER_LOG - 1)
        assert ours["named"][S.DEFER_LOG - 1] == [flip_update, [0, 1], []]
        assert at_step["named"][S.DEFER_FLIP] == [flip_update, [0, 1], []]
        assert ours["named"][-1] == at_step["named"][-1] == [mixed_update, [0, 1], [1]]
        # What the check adds to a clean step with the kernels (the checksum is in their read;
        # at this update without the keyed sums, which come every INTERVAL updates): the slot
        # sums the reduction adds into (zeros), their residues (remainder), as float32 limbs
        # (arange, mul, rshift, bitwise_and, _to_copy), the collective's cat, copy_ back and
        # clamp_: 10 ops. The interpreter also copies the reduction's two more arguments (the
        # terms, the sums) in and out (set_, empty, copy_), which a GPU does not.
        check = {k: at_step["ops"].get(k, 0) - off["ops"].get(k, 0)
                 for k in set(at_step["ops"]) | set(off["ops"])}  # fmt: skip
        assert {k: v for k, v in check.items() if v} == {
            "aten.zeros.default": 1, "aten.remainder.Tensor": 1,
            "aten.cat.default": 1, "aten.arange.default": 1, "aten.mul.Tensor": 1,
            "aten.__rshift__.Tensor": 1, "aten.bitwise_and.Scalar": 1,
            "aten._to_copy.default": 1, "aten.copy_.default": 1 + 2, "aten.clamp_.default": 1,
            "aten.set_.source_Storage": 4, "aten.empty.memory_format": 4,
        }  # fmt: skip
        # What deferring adds to a clean step: the mismatch flag (the limbs put together: arange,
        # mul, to, lshift, sum, remainder; then amax, clamp_, to), this rank's
        # flag kept (clone), the step's found_inf (fmax), and the held update: the skip weight
        # (fmax), the scale and growth tracker kept (2 clones), the hold (gt, to), put back (lerp_;
        # a where into the tracker)
        extra = {k: ours["ops"].get(k, 0) - at_step["ops"].get(k, 0)
                 for k in set(ours["ops"]) | set(at_step["ops"])}  # fmt: skip
        assert {k: v for k, v in extra.items() if v} == {
            "aten.arange.default": 1, "aten.mul.Tensor": 1, "aten.__lshift__.Tensor": 1,
            "aten.sum.dim_IntList": 1, "aten.remainder.Tensor": 1, "aten.amax.default": 1,
            "aten.clamp_.default": 1, "aten.clone.default": 3, "aten.fmax.default": 2,
            "aten.gt.Tensor": 1, "aten._to_copy.default": 1 + 2, "aten._foreach_lerp_.List": 1,
            "aten.where.self_out": 1,
        }  # fmt: skip


@interpreted
def test_raise_comes_at_the_periodic_read_once_the_update_is_complete(deferred):
    for r in deferred:
        got, skip = r["raise"], r["noclip-torch"]["immediate"]
        flip_update, mixed_update = S.DEFER_FLIP + 1, S.DEFER_MIXED + 1
        assert got["raised"] == [
            [S.DEFER_LOG - 1, "ReplicaMismatchError", [0, 1], flip_update],
            [2 * S.DEFER_LOG - 1, "ReplicaMismatchError", [0, 1], mixed_update],
        ]
        # the step skipped and the update held before it raised: training goes on unchanged
        assert got["params"] == skip["params"] and got["scales"] == skip["scales"]


@interpreted
def test_a_deferred_parameter_check_reads_as_the_check_read_at_the_step(deferred):
    for r in deferred:
        ours, at_step = r["params"]["deferred"], r["params"]["immediate"]
        assert ours["ledger"]["replica_param_checks"] == S.DEFER_STEPS // 2
        for name in ("scales", "params", "state", "causes", "ledger"):
            assert ours[name] == at_step[name], name
        # seen at update 4 and 6 (the replicas stay apart), named at the periodic read of 6
        assert ours["named"][-1] == at_step["named"][-1] == [6, [0, 1], []]
        # the gradient flip at 2, the parameters at 6 (at 4 an inf too: an overflow)
        assert ours["causes"]["replica_mismatch"] == 2
        assert ours["ledger"]["replica_mismatches"] == 4  # updates 2, 4, 5 and 6


@interpreted
def test_a_new_scale_at_a_deferred_mismatch_keeps_it_in_the_ledger(deferred):
    for r in deferred:
        ours, at_step = r["new_scale"]["deferred"], r["new_scale"]["immediate"]
        assert ours["scales"][S.DEFER_FLIP] == 2.0**6  # the scale given
        for name in ("scales", "params", "state", "causes", "ledger"):
            assert ours[name] == at_step[name], name
        # One account: the flip whose update set the scale (update 2) is in no count of skips and
        # the mismatch with an inf (update 5) is an overflow, so no skip has the cause
        # replica_mismatch, nor the ledger's skipped; the ledger found both mismatches.
        assert ours["ledger"]["replica_skipped"] == ours["causes"]["replica_mismatch"] == 0
        assert ours["ledger"]["replica_mismatches"] == 2


@interpreted
def test_a_non_fused_step_with_the_kernels_checks_every_update_at_its_own_host_read(deferred):
    for r in deferred:
        ours, cpu = r["foreach"]["deferred"], r["foreach"]["cpu"]  # the GPU's path; the CPU's
        assert ours["ledger"]["replica_checks"] == S.DEFER_STEPS  # every update, by default
        assert ours["named"][S.DEFER_FLIP] == [S.DEFER_FLIP + 1, [0, 1], []]  # read at the step
        for name in ("scales", "params", "state", "causes", "ledger"):
            assert ours[name] == cpu[name], name


@pytest.mark.cuda
def test_a_deferred_replica_check_on_a_gpu(tmp_path):
    """The same checks with the kernels compiled for the GPU: two gloo ranks on it, the deferred
    check beside the check read at the step (the same kernels: the same bits)."""
    results = spawn(S.deferred_on_a_gpu, 2, tmp_path)
    for r in results:
        for key, runs in r.items():
            ours, at_step, off = (runs[m] for m in ("deferred", "immediate", "off"))
            assert ours["ledger"]["replica_checks"] == S.DEFER_STEPS, key
            for name in ("scales", "params", "state", "causes", "ledger", "report"):
                assert ours[name] == at_step[name], (key, name)
            assert ours["causes"]["replica_mismatch"] == 1, key
            assert ours["params"][S.DEFER_FLIP] == ours["params"][S.DEFER_FLIP - 1], key
            periodic = {u - 1 for u in range(S.DEFER_LOG, S.DEFER_STEPS + 1, S.DEFER_LOG)}
            for i in set(range(S.DEFER_STEPS)) - periodic:
                assert ours["reads"][i] == off["reads"][i], (key, i)
            assert ours["named"][S.DEFER_LOG - 1] == [S.DEFER_FLIP + 1, [0, 1], []], key
    for key in results[0]:  # the replicas bit-identical after
        assert results[0][key]["deferred"]["params"] == results[1][key]["deferred"]["params"]


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_the_phase_kernels_on_a_gpu(fused):
    """The kernels ``clip_grad_norm_`` launches on a GPU, counted by torch's profiler: read +
    reduce (one rank: the reduction finishes too), and the clip's write pass where the optimizer
    is not fused; at 4 and at 400 tensors alike (torch's path launches per dtype group and per
    op)."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for layers in (2, 200):
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)]).cuda()
        opt = torch.optim.AdamW(model.parameters(), fused=fused, foreach=not fused)
        scaler = GradScaler("cuda", kernels="triton", skip_log_interval=0)
        for step in range(3):
            opt.zero_grad(set_to_none=False)  # the same addresses: the tables are cached
            scaler.scale(model(torch.randn(8, 64, device="cuda")).sum()).backward()
            torch.cuda.synchronize()
            if step < 2:
                scaler.clip_grad_norm_(opt, 1.0)
            else:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    scaler.clip_grad_norm_(opt, 1.0)
                    torch.cuda.synchronize()
            scaler.step(opt)
            scaler.update()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[layers] = [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]
    assert len(counts[2]) == len(counts[200]) == (2 if fused else 3), counts


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()]


@pytest.mark.cuda
def test_the_whole_phase_in_cuda_kernels_against_torchs_recipe():
    """CUDA kernels of the scaler's whole phase (clip_grad_norm_ if clipping, step, update; the
    optimizer's own kernels left out: its step does nothing) at 144 fp32 gradients, fused AdamW,
    one rank, counted by torch's profiler: distscaler's Triton path launches each kernel once
    (nothing per tensor or per chunk of tensors: the skip counters' lerp is one kernel), with
    clipping at most half of torch's recipe (GradScaler + unscale_ + clip_grad_norm_), without
    no more than it (7 and 7 on an H100 with torch 2.11, 2026-11-27, with clipping 7 and 21, when
    a `nan_to_num` still made the overflow report's flags; the reduction writes them now)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, device="cuda")) for _ in range(144)]
    counts = {}
    for name in ("triton", "recipe"):
        for clip in (True, False):
            opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
            opt.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
            scaler = torch.amp.GradScaler("cuda") if name == "recipe" else GradScaler(
                "cuda", kernels="triton")  # fmt: skip
            scaler.scale(torch.ones((), device="cuda"))
            for step in range(4):
                for p in params:
                    p.grad = torch.randn_like(p)
                torch.cuda.synchronize()
                run = functools.partial(_phase_of, scaler, opt, clip, name == "recipe")
                if step < 3:
                    run()
                else:
                    counts[name, clip] = _cuda_kernels(run)
    print({f"{k[0]} clip={k[1]}": len(v) for k, v in counts.items()}, counts[("triton", False)])
    for clip in (True, False):
        ours = counts["triton", clip]
        assert len(ours) == len(set(ours)), ours  # each kernel once, at 144 tensors
    assert len(counts["triton", True]) <= len(counts["recipe", True]) // 2, counts
    assert len(counts["triton", False]) <= len(counts["recipe", False]), counts


def _phase_of(scaler, opt, clip: bool, recipe: bool) -> None:
    if clip and recipe:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    elif clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    return spawn(S.keyed_every_interval, 2, tmp_path_factory.mktemp("keyed2"))


@interpreted
def test_the_kernels_keyed_sums_catch_a_second_difference_at_every_interval_th_update(keyed):
    """A change the fixed weights cannot see (+1, -2, +1 on neighbouring words, rank 1 only):
    at update 31 the kernel's check has no keyed sums and misses it (the replicas drift apart,
    as with ``replica_check=False``); at update 32 (`INTERVAL`) its keyed sums catch it, on
    both ranks, and the step is skipped with the replicas kept equal."""
    from distscaler.replica_check import INTERVAL

    assert S.KEYED_UPDATE == INTERVAL
    missed, caught = (r[str(u)] for r in keyed[1:] for u in (S.KEYED_UPDATE - 1, S.KEYED_UPDATE))
    assert missed["changed"] == S.KEYED_UPDATE - 1 and caught["changed"] == S.KEYED_UPDATE
    for r in keyed:
        run = r[str(S.KEYED_UPDATE)]
        assert run["skipped"] == [False] * (S.KEYED_UPDATE - 1) + [True]
        assert run["mismatch"][-1] == S.KEYED_UPDATE and run["mismatch"][-2] is None
        early = r[str(S.KEYED_UPDATE - 1)]
        assert not any(early["skipped"][: S.KEYED_UPDATE - 1]) and early["mismatch"][-2] is None
    assert keyed[0][str(S.KEYED_UPDATE)]["params"] == keyed[1][str(S.KEYED_UPDATE)]["params"]
    assert keyed[0][str(S.KEYED_UPDATE - 1)]["params"] != keyed[1][str(S.KEYED_UPDATE - 1)]["params"]
