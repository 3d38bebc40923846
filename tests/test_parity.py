"""Single process: distscaler.GradScaler is bit-for-bit torch.amp.GradScaler."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from _common import FAULTS, gpu_path_of, make_optimizer, optimizer_tensors
from _models import make_model, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distscaler

OPTIMIZERS = ["fused", "foreach", "for-loop", "sgd-fused", "sgd-for-loop"]

faults_strategy = st.dictionaries(
    keys=st.integers(0, 23),
    values=st.tuples(st.sampled_from(list(FAULTS)), st.integers(0, 5)),
    max_size=8,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=faults_strategy,
    init_exp=st.integers(2, 30),
    growth_interval=st.integers(1, 5),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    torch_clip=st.booleans(),
)
@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
def test_matches_torch_gradscaler_bit_for_bit(
    opt_kind, faults, init_exp, growth_interval, growth_factor, backoff_factor, torch_clip
):
    kwargs = dict(
        init_scale=2.0**init_exp,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    clip = "torch" if torch_clip else None
    ref_model, ref_opt, ref_scales = train(
        torch.amp.GradScaler("cpu", **kwargs), opt_kind, steps=24, faults=faults, clip=clip
    )
    model, opt, scales = train(
        distscaler.GradScaler("cpu", **kwargs), opt_kind, steps=24, faults=faults, clip=clip
    )
    assert scales == ref_scales
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(optimizer_tensors(opt), optimizer_tensors(ref_opt)):
        assert torch.equal(s, t)
    # Guard: every injected fault was seen (the scale backed off right there).
    previous = [kwargs["init_scale"], *scales]
    for step in faults:
        assert scales[step] < previous[step], f"fault at step {step} was not seen"


@pytest.mark.parametrize("opt_kind", ["fused", "for-loop", "sgd-for-loop"])
def test_clip_grad_norm_matches_unscale_then_torch_clip(opt_kind):
    faults = {3: ("inf", 1), 9: ("nan", 4)}
    kwargs = dict(init_scale=2.0**12, growth_interval=4)
    ref_model, _, ref_scales = train(
        torch.amp.GradScaler("cpu", **kwargs), opt_kind, steps=16, faults=faults, clip="torch"
    )
    model, _, scales = train(
        distscaler.GradScaler("cpu", **kwargs), opt_kind, steps=16, faults=faults, clip="ours"
    )
    assert scales == ref_scales
    assert ref_scales[3] < ref_scales[2] and ref_scales[9] < ref_scales[8]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_kind", ["fused", "sgd-fused"])
def test_the_gpu_clip_path_matches_the_cpus_bit_for_bit(opt_kind):
    """The clipped inf check a GPU runs (the flag and grad_scale from one clamp, nothing read on the
    host; float64 per-tensor norms) against the CPU's (float32 per-tensor norms, torch's, summed in
    float64, the flag read on the host, grad_scale by fmax): the same skips and scales, and norms,
    parameters and optimizer state within the float32 rounding of the per-tensor norms, through
    clipped and unclipped clean steps and inf, -inf and NaN gradients."""
    faults = {2: ("inf", 1), 5: ("nan", 3), 6: ("-inf", 0), 9: ("nan", 2)}
    runs = []
    for gpu in (False, True):
        model = make_model()
        opt = make_optimizer(opt_kind, model.parameters())
        scaler = distscaler.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)
        params = list(model.parameters())
        gen = torch.Generator().manual_seed(7)
        norms, scales = [], []
        with gpu_path_of(scaler) if gpu else contextlib.nullcontext():
            for step in range(12):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(16, 8, generator=gen)).float().pow(2).mean()
                scaler.scale(loss).backward()
                if step in faults:
                    kind, index = faults[step]
                    params[index].grad.view(-1)[0] = FAULTS[kind]
                norm = scaler.clip_grad_norm_(opt, max_norm=1e-3 if step % 2 else 1e3)
                norms.append(norm.clone())
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
        runs.append((norms, scales, model, opt, scaler.skip_totals.num_skipped))
    (cpu_norms, cpu_scales, cpu_model, cpu_opt, cpu_skips) = runs[0]
    (norms, scales, model, opt, skips) = runs[1]
    assert cpu_skips == skips == len(faults)  # guard: every fault was seen by both
    assert scales == cpu_scales
    for a, b in zip(norms, cpu_norms):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0.0, equal_nan=True)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    for s, t in zip(optimizer_tensors(opt), optimizer_tensors(cpu_opt)):
        torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_returns_norm_of_unscaled_gradients():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = distscaler.GradScaler("cpu", init_scale=512.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    reference = [p.grad.double() / 512.0 for p in model.parameters()]
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference]))
    norm = scaler.clip_grad_norm_(opt, max_norm=1e-3)
    assert norm.dtype == torch.float32 and norm.shape == ()
    torch.testing.assert_close(norm.double(), ref_norm, rtol=1e-6, atol=0)
    # Non-fused optimizer: the gradients are now unscaled and clipped, as torch's clip leaves them.
    coef = 1e-3 / (ref_norm + 1e-6)
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad.double(), g * coef, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("opt_kind", ["fused", "for-loop", "sgd-fused"])
def test_infinite_max_norm_measures_only_like_torch_clip(opt_kind):
    # torch.nn.utils.clip_grad_norm_(..., inf): the norm, and a coefficient clamped to 1.
    model = make_model()
    opt = make_optimizer(opt_kind, model.parameters())
    scaler = distscaler.GradScaler("cpu", init_scale=512.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).sum()
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in scaled]
    for p, g in zip(ref_params, scaled):
        p.grad = g / 512.0  # exact: a power of two
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, math.inf)
    norm = scaler.clip_grad_norm_(opt, max_norm=math.inf)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert float(norm) > 1.0  # guard: a finite max_norm of 1.0 would have clipped
    record = scaler._records[id(opt)]
    if opt_kind == "for-loop":
        # Only unscaled: exactly the gradients torch's clip leaves.
        for p, q in zip(model.parameters(), ref_params):
            assert torch.equal(p.grad, q.grad)
    else:
        # Fused: the gradients are not touched and the kernel gets the scale itself.
        for p, g in zip(model.parameters(), scaled):
            assert torch.equal(p.grad, g)
        assert float(record.grad_scale) == 512.0
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_was_skipped and scaler.get_scale() == 512.0


def test_infinite_max_norm_after_unscale_leaves_the_gradients_as_they_are():
    model = make_model()
    opt = make_optimizer("for-loop", model.parameters())
    scaler = distscaler.GradScaler("cpu", init_scale=256.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    unscaled = [p.grad.clone() for p in model.parameters()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in unscaled]
    for p, g in zip(ref_params, unscaled):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, math.inf)
    norm = scaler.clip_grad_norm_(opt, math.inf)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert float(norm) > 1.0  # guard: a finite max_norm of 1.0 would have clipped
    for p, g, q in zip(model.parameters(), unscaled, ref_params):
        assert torch.equal(p.grad, g) and torch.equal(q.grad, g)  # torch multiplies by 1.0
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_was_skipped


@pytest.mark.parametrize("opt_kind", ["fused", "foreach", "sgd-for-loop"])
def test_infinite_max_norm_trains_like_torch_scaler_and_clip(opt_kind):
    faults = {3: ("inf", 1), 7: ("nan", 4)}
    kwargs = dict(init_scale=2.0**12, growth_interval=3)
    ref_model, _, ref_scales = train(
        torch.amp.GradScaler("cpu", **kwargs),
        opt_kind,
        steps=10,
        faults=faults,
        clip="torch",
        max_norm=math.inf,
    )
    model, _, scales = train(
        distscaler.GradScaler("cpu", **kwargs),
        opt_kind,
        steps=10,
        faults=faults,
        clip="ours",
        max_norm=math.inf,
    )
    assert scales == ref_scales
    assert ref_scales[3] < ref_scales[2] and ref_scales[7] < ref_scales[6]  # faults were seen
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_sparse_gradients_match_torch():
    def run(scaler_cls):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 6, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
        scales = []
        for step in range(6):
            opt.zero_grad()
            idx = torch.tensor([1, 3, 3, 7, 1, step])  # repeated indices: an uncoalesced grad
            scaler.scale(emb(idx).pow(2).sum()).backward()
            assert emb.weight.grad.is_sparse
            if step == 2:
                emb.weight.grad._values()[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return emb.weight.detach(), scales

    ref_w, ref_scales = run(torch.amp.GradScaler)
    w, scales = run(distscaler.GradScaler)
    assert scales == ref_scales and ref_scales[2] < ref_scales[1]
    assert torch.equal(w, ref_w)


def test_clip_grad_norm_coalesces_sparse_gradients():
    emb = torch.nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.0)
    scaler = distscaler.GradScaler("cpu", init_scale=8.0)
    idx = torch.tensor([2, 2, 2, 5])
    scaler.scale(emb(idx).sum()).backward()
    assert not emb.weight.grad.is_coalesced()
    dense = emb.weight.grad.to_dense() / 8.0
    norm = scaler.clip_grad_norm_(opt, max_norm=100.0)
    torch.testing.assert_close(norm, dense.norm())


def test_parameters_without_grad_are_skipped():
    model = make_model()
    model[0].weight.requires_grad_(False)
    _, _, ours = train(distscaler.GradScaler("cpu"), "fused", steps=3, model=model)
    model = make_model()
    model[0].weight.requires_grad_(False)
    _, _, ref = train(torch.amp.GradScaler("cpu"), "fused", steps=3, model=model)
    assert ours == ref
