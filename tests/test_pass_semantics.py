"""One semantics of the pass (docs/pass-semantics.md): torch's kernels (fused and foreach, the
host's read and the GPU's path), the Triton kernels (in Triton's interpreter on the CPU) and the
float64 path, each held to one oracle computed in float64 from the same gradients.

The gradients are generated from a seed with the hazards of float32's edges: inf/NaN, denormals,
-0.0, values near float32's largest, empty and odd-sized tensors, float32 beside bfloat16; scales
from 2**-3 to 2**24; p = 1, 2, inf; and the four cases of issue 54 by name. One clipped step from
zero parameters with SGD (lr = 1), then ``update()``: the skip, the returned norm, ``.grad`` after
the clip, the parameters, the scale and the overflow report's named tensors are asserted. A
hypothesis test draws more (float32, from a list of edge values) on four of the paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from _common import gpu_path, interpreted_mark
from hypothesis import given, settings
from hypothesis import strategies as st

from distscaler import GradScaler

FLOAT32_MAX = torch.finfo(torch.float32).max
SCALES = (2.0**-3, 1.0, 2.0**10, 2.0**24)
MAX_NORMS = (1e-3, 1.0, 1e30, math.inf)
NORM_TYPES = {"p1": 1.0, "p2": 2.0, "pinf": math.inf}


@dataclass(frozen=True)
class Case:
    grads: tuple[torch.Tensor, ...]  # as the backward left them: still multiplied by the scale
    scale: float
    max_norm: float


def _named() -> dict[str, Case]:
    t = torch.tensor
    return {
        # (a): finite, the scaled sum of |g| past float32, the unscaled norm 3.6e31
        "a-two": Case((t([3e38]), t([3e38])), 2.0**24, 1e30),
        "a-one": Case((t([3e38, 3e38]),), 2.0**24, 1e30),
        # (b): a finite tensor whose own statistic overflows beside an inf one
        "b-big": Case((t([3e38]), t([1.0, math.inf])), 2.0**24, 1.0),
        "b-pair": Case((t([3e38, 3e38]), t([math.inf])), 2.0**24, 1.0),
        # (c): .grad after a skipped clipped step
        "c-inf": Case((t([1.0, math.inf]), t([2.0])), 2.0**24, 1.0),
        "c-nan": Case((t([1.0, math.nan, -0.0]), t([-math.inf])), 2.0**3, 1.0),
        # (d): a max_norm past float32 clips nothing, as torch's clip_grad_norm_
        "d-1e40": Case((t([1.0, 2.0]), t([-3.0])), 2.0**4, 1e40),
        # a finite scaled gradient past float32 once unscaled: an overflow
        "unscaled-past": Case((t([3e38, 1.0]), t([1.0])), 2.0**-3, 1.0),
        # scale / clip_coef past float32: an overflow, never a clean step divided by inf
        "grad-scale-past": Case((t([1e30]), t([1.0])), 2.0**24, 1e-20),
        "empty-and-zero": Case((t([]), t([0.0, -0.0]), t([])), 1.0, 1.0),
    }


def _random_tensor(g: torch.Generator, dtype: torch.dtype, hazard: bool, big: bool) -> torch.Tensor:
    n = [0, 1, 3, 7, 33][int(torch.randint(5, (), generator=g))]
    if dtype == torch.bfloat16:  # torch 2.13's CPU fused SGD drops bfloat16 updates from 16 on
        n = min(n, 13)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** torch.randint(-6, 7, (n,), generator=g).double()
    kinds = torch.randint(24 if big else 48, (n,), generator=g)
    finfo = torch.finfo(dtype)
    for i in range(n):
        k = int(kinds[i])
        if k == 0:
            x[i] = -0.0
        elif k == 1:
            x[i] = finfo.tiny * 2.0**-3  # a denormal
        elif k == 2 and big:
            x[i] = finfo.max * (0.5 + 0.4 * float(torch.rand((), generator=g)))
        elif k in (3, 4) and hazard:
            x[i] = [math.inf, -math.inf, math.nan][int(torch.randint(3, (), generator=g))]
    return x.to(dtype)


def _random(seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    num = int(torch.randint(1, 4, (), generator=g))
    hazard = bool(torch.rand((), generator=g) < 0.4)
    big = bool(torch.rand((), generator=g) < 0.4)
    dtypes = [torch.float32, torch.bfloat16]
    grads = tuple(
        _random_tensor(g, dtypes[int(torch.randint(2, (), generator=g))], hazard, big)
        for _ in range(num)
    )
    scale = SCALES[int(torch.randint(len(SCALES), (), generator=g))]
    max_norm = MAX_NORMS[int(torch.randint(len(MAX_NORMS), (), generator=g))]
    return Case(grads, scale, max_norm)


CASES = {**_named(), **{f"seed{s}": _random(s) for s in range(16)}}


# ---------------------------------------------------------------------- the oracle


@dataclass(frozen=True)
class Expected:
    skipped: bool
    norm: float  # inf/NaN where any gradient held inf/NaN (either is accepted then)
    grads: tuple[torch.Tensor, ...]  # .grad after the clip, float64 (not fused)
    params: tuple[torch.Tensor, ...]  # float64
    named: tuple[tuple[int, str], ...]  # (tensor's position, "inf" or "nan")
    scale: float


def oracle(case: Case, norm_type: float, *, fused: bool) -> Expected:
    """docs/pass-semantics.md in float64: the unscaled gradients as torch's unscale kernel makes
    them (a float32 product by the float32 inverse scale), their norm exact, the coefficient
    ``min(1, max_norm / norm)`` and ``grad_scale = scale / coef``."""
    inv = torch.tensor(case.scale, dtype=torch.float64).reciprocal().float()
    unscaled = [g.float() * inv for g in case.grads]  # float32: past its range is inf
    held_bad = [not bool(g.isfinite().all()) for g in case.grads]
    named = tuple(
        (i, "nan" if bool(g.isnan().any()) else "inf")
        for i, (g, bad) in enumerate(zip(case.grads, held_bad))
        if bad
    )  # fmt: skip
    nonfinite = any(not bool(u.isfinite().all()) for u in unscaled)
    flat = torch.cat([u.double().reshape(-1) for u in unscaled])
    if nonfinite:
        norm = math.inf
    elif flat.numel() == 0:
        norm = 0.0
    else:
        norm = float(torch.linalg.vector_norm(flat, norm_type))
    norm_overflows = float(torch.tensor(norm).float()) == math.inf
    norm = math.inf if norm_overflows else norm
    coef = 1.0 if norm == 0.0 or math.isinf(case.max_norm) else min(1.0, case.max_norm / norm)
    grad_scale = case.scale / coef if not nonfinite and not norm_overflows else math.inf
    skipped = nonfinite or norm_overflows or float(torch.tensor(grad_scale).float()) == math.inf
    if skipped:
        after = tuple(g.double() if fused else u.to(g.dtype).double()
                      for g, u in zip(case.grads, unscaled))  # fmt: skip
        params = tuple(torch.zeros(g.shape, dtype=torch.float64) for g in case.grads)
        return Expected(True, norm, after, params, named, case.scale / 2)
    clipped = tuple(g.double() / grad_scale for g in case.grads)
    after = tuple(g.double() for g in case.grads) if fused else clipped
    return Expected(False, norm, after, tuple(-c for c in clipped), (), case.scale * 2)


# ---------------------------------------------------------------------- the paths


@dataclass(frozen=True)
class Got:
    skipped: bool
    norm: float
    grads: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]
    named: tuple[tuple[int, str], ...]
    scale: float


def _step(case: Case, norm_type: float, *, kernels: str, fused: bool, host_reads: bool) -> Got:
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in case.grads]
    opt = torch.optim.SGD(params, lr=1.0, **({"fused": True} if fused else {"foreach": True}))
    scaler = GradScaler("cpu", init_scale=case.scale, growth_interval=1, kernels=kernels,
                        skip_log_interval=1000)  # fmt: skip
    if not host_reads:
        gpu_path(scaler)
    scaler.scale(torch.ones(()))
    for p, g in zip(params, case.grads):
        p.grad = g.clone()
    norm = float(scaler.clip_grad_norm_(opt, case.max_norm, norm_type))
    grads = tuple(p.grad.double() for p in params)  # type: ignore[union-attr]
    scaler.step(opt)
    scaler.update()
    report = scaler.report_overflow()
    named: tuple[tuple[int, str], ...] = ()
    if report is not None and scaler.step_was_skipped:
        where = {f"param_groups[0][{i}]": i for i in range(len(params))}
        named = tuple(sorted((where[e.param], e.kind) for e in report.entries))
    return Got(bool(scaler.step_was_skipped), norm, grads,
               tuple(p.detach().double() for p in params), named, scaler.get_scale())  # fmt: skip


def _float64_path(case: Case, norm_type: float, *, fused: bool) -> Got:
    """The pass for float64 gradients (`distscaler._triton.reference.torch_pass()`, through
    `distscaler._triton.phase()`): the same values as float64."""
    from distscaler import _triton

    grads = [g.double() for g in case.grads]
    scale = torch.tensor(case.scale, dtype=torch.float32)
    max_norm = torch.tensor(case.max_norm, dtype=torch.float64).float()
    taken, done = _triton.phase(grads, scale, None, norm_type=norm_type, max_norm=max_norm,
                                clip=not fused)  # fmt: skip
    skipped = bool(done.found_inf)
    flags = taken.per_tensor
    assert flags is not None
    named = tuple(
        (i, "nan" if math.isnan(f) else "inf")
        for i, f in enumerate(flags.tolist())
        if not math.isfinite(f)
    )  # fmt: skip
    params = tuple(torch.zeros_like(g) if skipped else -(g / float(done.grad_scale))
                   for g in case.grads)  # fmt: skip
    return Got(skipped, float(done.total_norm), tuple(grads), tuple(p.double() for p in params),
               named if skipped else (), case.scale / 2 if skipped else case.scale * 2)  # fmt: skip


PATHS = {
    "torch-fused-gpu": dict(kernels="torch", fused=True, host_reads=False),
    "torch-foreach-gpu": dict(kernels="torch", fused=False, host_reads=False),
    "torch-fused-host": dict(kernels="torch", fused=True, host_reads=True),
    "torch-foreach-host": dict(kernels="torch", fused=False, host_reads=True),
    "triton-fused": dict(kernels="triton", fused=True, host_reads=False),
    "triton-foreach": dict(kernels="triton", fused=False, host_reads=False),
    "float64": dict(kernels="float64", fused=False, host_reads=False),
}

def _tol(case: Case) -> dict[str, float]:
    if any(g.dtype == torch.bfloat16 for g in case.grads):
        return {"rtol": 2e-2, "atol": 1e-38}
    return {"rtol": 2e-5, "atol": 1e-38}


def _params():
    out = []
    for name in CASES:
        for pn in NORM_TYPES:
            for path in PATHS:
                marks = [interpreted_mark()] if path.startswith("triton") else []
                out.append(pytest.param(name, pn, path, marks=marks, id=f"{name}-{pn}-{path}"))
    return out


@pytest.mark.parametrize(("name", "pn", "path"), _params())
def test_every_path_steps_as_the_spec_says(monkeypatch, name, pn, path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check(CASES[name], pn, path)


def _check(case: Case, pn: str, path: str) -> None:
    norm_type, how = NORM_TYPES[pn], PATHS[path]
    if how["kernels"] == "float64":
        got = _float64_path(case, norm_type, fused=False)
        want = oracle(case, norm_type, fused=False)
        want_grads = want.grads if not want.skipped else None
    else:
        got = _step(case, norm_type, **how)
        want = oracle(case, norm_type, fused=how["fused"])
        want_grads = want.grads
    assert got.skipped == want.skipped, (got, want)
    if math.isfinite(want.norm):
        assert got.norm == pytest.approx(want.norm, rel=_tol(case)["rtol"], abs=1e-38)
    else:
        assert not math.isfinite(got.norm)
    assert got.named == want.named
    assert got.scale == want.scale
    for a, b in zip(got.params, want.params):
        torch.testing.assert_close(a, b, **_tol(case))
    if want_grads is not None:
        for a, b in zip(got.grads, want_grads):
            torch.testing.assert_close(a, b, equal_nan=True, **_tol(case))


# ---------------------------------------------------------------------- hypothesis

_VALUES = [0.0, -0.0, 1.0, -2.5, 1e-3, 3e-39, -1e-45, 7.0e4, 1e20, -1e20, 3e38, -3.4e38,
           math.inf, -math.inf, math.nan]  # fmt: skip


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    values=st.lists(st.lists(st.sampled_from(_VALUES), max_size=5), min_size=1, max_size=3),
    scale=st.sampled_from(SCALES),
    max_norm=st.sampled_from(MAX_NORMS),
    pn=st.sampled_from(list(NORM_TYPES)),
)
def _hypothesis_case(path, values, scale, max_norm, pn):
    case = Case(tuple(torch.tensor(v, dtype=torch.float32) for v in values), scale, max_norm)
    _check(case, pn, path)


@pytest.mark.parametrize(
    "path",
    ["torch-fused-gpu", "torch-foreach-host",
     pytest.param("triton-foreach", marks=interpreted_mark()), "float64"],
)  # fmt: skip
def test_hypothesis_gradients_follow_the_spec_on_every_path(monkeypatch, path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _hypothesis_case(path)


# ---------------------------------------------------------------------- max_norm


@pytest.mark.parametrize("max_norm", [1e-30, 1.0, 3.4e38, 1e40, 1e300, math.inf])
def test_every_max_norm_torch_accepts_is_accepted_and_clips_as_torch(max_norm):
    grads = [torch.tensor([3.0, -4.0])]
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = grads[0].clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([p], max_norm)
    ref_grad = p.grad.clone()
    q = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([q], lr=1.0)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    q.grad = grads[0] * 4.0
    norm = scaler.clip_grad_norm_(opt, max_norm)
    assert float(norm) == float(ref_norm)
    torch.testing.assert_close(q.grad, ref_grad, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan, -math.inf])
def test_a_max_norm_that_clips_to_nothing_or_flips_is_refused(max_norm):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match="max_norm must be a number > 0 or math.inf"):
        GradScaler("cpu").clip_grad_norm_(opt, max_norm)
