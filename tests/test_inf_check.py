"""The per-rank kernels behind the agreed found_inf, checked against elementwise torch.isfinite."""

from __future__ import annotations

import math

import pytest
import torch
from _common import gpu_path, interpreted_mark
from hypothesis import given, settings
from hypothesis import strategies as st

from distscaler import GradScaler
from distscaler import _inf_check as inf_check
from distscaler._inf_check import check_and_unscale_, local_stat
from distscaler._plan import GradPass, StepPlan
from distscaler.layouts import collect_grads

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIALS = [math.inf, -math.inf, math.nan, 6.0e4, -6.0e4, 1e30, 0.0]


def _groups(tensors):
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    # A parameter without a gradient is skipped (and keeps an empty rank's optimizer valid).
    opt = torch.optim.SGD([*params, torch.nn.Parameter(torch.zeros(3))], lr=0.0)
    return collect_grads(opt, allow_fp16=True, coalesce_sparse=False), params


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=0, max_size=4),
    special=st.sampled_from(SPECIALS),
    where=st.integers(0, 10_000),
)
def test_overflow_flag_is_exactly_elementwise_isfinite(dtypes, special, where):
    gen = torch.Generator().manual_seed(where)
    tensors = [(torch.randn(17 + i, generator=gen) * 100).to(d) for i, d in enumerate(dtypes)]
    if tensors:
        target = tensors[where % len(tensors)]
        # 1e30 is finite in fp32/bf16/fp64 and inf in fp16: the expectation follows the dtype.
        # Cast first: torch 2.6 refuses a Python number out of fp16's range in an indexed write.
        value = torch.tensor(special, dtype=torch.float64).to(target.dtype)
        target.view(-1)[where % target.numel()] = value
    expected = not all(bool(t.isfinite().all()) for t in tensors)
    groups, params = _groups(tensors)
    before = [p.grad.clone() for p in params]
    result = check_and_unscale_(groups, inv_scale=torch.ones(()))  # a fused step's check
    assert result.dtype == torch.float32 and result.shape == (2,)
    assert result.tolist() == [float(expected), 0.0]
    for p, b in zip(params, before):  # the gradients' values are unchanged
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_statistic_accumulates_wide_enough(dtype):
    # 60000 is near fp16's max; its square overflows fp16 but not the fp32 accumulator.
    grads = [torch.full((1000,), 6.0e4, dtype=dtype)]
    groups, _ = _groups(grads)
    inv_scale = torch.tensor(0.5)
    result = local_stat(groups, inv_scale, 2.0)[0]
    flag, sum_sq = result.tolist()
    assert flag == 0.0
    expected = (grads[0].double() * 0.5).norm().item() ** 2
    assert sum_sq == pytest.approx(expected, rel=1e-4)


def test_check_and_unscale_matches_torch_kernel_and_flags():
    grads = [torch.randn(33) * 1024, torch.randn(5, 7).half() * 64]
    grads[1][2, 3] = math.nan
    groups, params = _groups(grads)
    result = check_and_unscale_(groups, inv_scale=torch.tensor(1 / 64))
    assert result.tolist() == [1.0, 0.0]
    ref = [g.clone() for g in grads]
    found = torch.zeros(())
    for group in (ref[:1], ref[1:]):
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.tensor(1 / 64))
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=25, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    special=st.sampled_from([math.inf, -math.inf, math.nan, 6.0e4, 0.0, None]),
    where=st.integers(0, 10_000),
)
def test_two_norm_is_non_finite_exactly_when_an_element_is(dtypes, special, where):
    """The clip path's norm (one _foreach_norm per dtype group in float64, stack, linalg_vector_norm):
    non-finite exactly when an element is, and otherwise torch's clip_grad_norm_ norm of the same
    tensors."""
    gen = torch.Generator().manual_seed(where)
    tensors = [(torch.randn(17 + 5 * i, generator=gen) * 4).to(d) for i, d in enumerate(dtypes)]
    if special is not None:
        target = tensors[where % len(tensors)]
        target[where % target.numel()] = special
    groups, _ = _groups(tensors)
    alone = inf_check._Collective(StepPlan(GradPass.NORM), groups, ())  # one rank: no collective
    buffer, num_grads, norm = inf_check._two_norm(
        groups, torch.device("cpu"), alone, torch.zeros(2, dtype=torch.float64)
    )
    assert num_grads == len(tensors) and buffer.shape == (len(tensors),)
    assert buffer.dtype == norm.dtype == torch.float64 and norm.shape == ()
    finite = all(bool(t.isfinite().all()) for t in tensors)
    assert bool(norm.isfinite()) is finite
    if finite:
        reference = torch.nn.utils.get_total_norm([t.double() for t in tensors])
        assert float(norm) == pytest.approx(float(reference), rel=1e-5)


#: Parameters of which three are empty (first, between, last): what a rank holds of a layer with
#: fewer rows than ranks under FSDP2 or TP.
EMPTY_AMONG = ((0, 4), (3, 4), (0,), (3,), (2, 0))


def _steps_with_empty_gradients(kernels: str, norm_type: float | None, fused: bool) -> dict:
    """Three steps over `EMPTY_AMONG`, the overflow report read every update, an inf at step 1;
    at each clip, torch's norm of the unscaled gradients: the non-empty ones (``"stock"``,
    ``get_total_norm``), and all of them through ``clip_grad_norm_`` (``"stock_all"``: its norm,
    or its error)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in EMPTY_AMONG]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused, foreach=not fused)
    scaler = GradScaler("cpu", init_scale=2.0**8, kernels=kernels, skip_log_interval=1)
    if fused:
        gpu_path(scaler)  # the flags taken at every step, as on a GPU
    out: dict = {"norms": [], "stock": [], "stock_all": [], "scales": [], "skipped": []}
    for step in range(3):
        opt.zero_grad()
        scaler.scale(sum((p * torch.randn(p.shape)).sum() for p in params)).backward()
        if step == 1:
            params[1].grad[2, 3] = math.inf
        if norm_type is not None:
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for c, p in zip(copies, params):
                c.grad = p.grad / scaler.get_scale()  # a power of 2: exact
            kept = [c.grad for c in copies if c.numel()]
            out["stock"].append(float(torch.nn.utils.get_total_norm(kept, norm_type)))
            try:  # (max_norm inf: a coefficient of 1, or NaN at an inf norm, in the copies only)
                out["stock_all"].append(float(torch.nn.utils.clip_grad_norm_(copies, math.inf,
                                                                             norm_type)))
            except RuntimeError as e:
                out["stock_all"].append(str(e))
            out["norms"].append(float(scaler.clip_grad_norm_(opt, 0.5, norm_type)))
        scaler.step(opt)
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(scaler.step_was_skipped)
    report = scaler.report_overflow()
    out["report"] = None if report is None else [(e.param, e.kind) for e in report.entries]
    out["params"] = [p.detach().clone() for p in params]
    return out


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=interpreted_mark())])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("norm_type", [math.inf, 2.0, 1.0, None], ids=["pinf", "p2", "p1", "noclip"])
def test_an_empty_gradient_holds_nothing_where_torchs_clip_raises(
    monkeypatch, kernels, fused, norm_type
):
    """Empty gradients among others: the norm is torch's ``clip_grad_norm_`` of the others, the
    inf is skipped and named, and nothing raises. torch's ``_foreach_norm`` raises on an empty
    tensor at p = inf ("the operation does not have an identity"), and so does its
    ``clip_grad_norm_`` (``stock_all``, torch 2.13), and so did the scaler's path on torch's
    kernels, in the clip and in the overflow report's flags (its p = inf and no-clip cases here)."""
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours = _steps_with_empty_gradients(kernels, norm_type, fused)
    assert ours["skipped"] == [False, True, False]  # the inf seen
    assert ours["scales"][1] < ours["scales"][0]
    assert ours["report"] == [("param_groups[0][1]", "inf")]
    for norm, stock in zip(ours["norms"], ours["stock"]):
        assert norm == stock if math.isinf(stock) or norm_type == math.inf else (
            norm == pytest.approx(stock, rel=1e-6)
        )
    assert math.isinf(ours["norms"][1]) if norm_type is not None else ours["norms"] == []
    for stock_all, stock in zip(ours["stock_all"], ours["stock"]):
        if isinstance(stock_all, str):  # torch's clip raises where ours does not
            assert norm_type == math.inf and "does not have an identity" in stock_all
        else:
            assert stock_all == stock
    assert all(p.numel() == 0 or bool(p.isfinite().all()) for p in ours["params"])
