"""distscaler._traced_step: the fused Adam/AdamW step a compiled phase traces, checked eagerly.

``traced_step`` acts only while dynamo traces; here ``torch.compiler.is_compiling`` is made to say
so, and the mirrored step runs eagerly, on real tensors, against torch's own fused step
(``optimizer.step()`` with ``grad_scale``/``found_inf`` set, as torch's GradScaler hands them
over): parameters, gradients and every state tensor bit for bit. tests/test_compile.py traces it.
"""

from __future__ import annotations

import math
import warnings
from unittest import mock

import pytest
import torch

from distscaler import _traced_step as T


def _traced(*args):
    # traced_step as dynamo's trace would call it; torch's own steps outside stay eager (torch's
    # optimizers read is_compiling too). The mirror is checked on every torch, also where dynamo
    # cannot trace the whole phase (TRACES_WHOLE_PHASE false: the compiled phase leaves it out).
    with (
        mock.patch.object(torch.compiler, "is_compiling", return_value=True),
        mock.patch.object(T, "TRACES_WHOLE_PHASE", True),
    ):
        return T.traced_step(*args)


def _params(seed: int = 0, dtypes: tuple[torch.dtype, ...] = (torch.float32,) * 3) -> list:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.randn(4, 3 + i, generator=gen).to(dtype))
        p.grad = (torch.randn(4, 3 + i, generator=gen) * 64).to(dtype)
        params.append(p)
    return params


def _torch_step(optimizer, grad_scale, found_inf) -> None:
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _everything(optimizer) -> list[torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [t for p in params for t in optimizer.state.get(p, {}).values()]
    return [t.detach().clone() for t in (*params, *(p.grad for p in params), *state)]


CASES = {
    "adamw": dict(cls=torch.optim.AdamW, kw={}),
    "adam-coupled-wd-amsgrad-maximize": dict(
        cls=torch.optim.Adam, kw=dict(weight_decay=0.1, amsgrad=True, maximize=True)
    ),
    "adamw-tensor-lr": dict(cls=torch.optim.AdamW, kw=dict(lr=torch.tensor(0.02))),
    "adamw-two-groups-two-dtypes": dict(cls=torch.optim.AdamW, kw={}, groups=True),
}


@pytest.mark.parametrize("grad_scale", [None, 64.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("case", list(CASES))
def test_mirrored_fused_step_equals_torchs_bit_for_bit(case, grad_scale):
    spec = CASES[case]
    runs = []
    for mirrored in (False, True):
        dtypes = (torch.float32, torch.float32, torch.bfloat16) if spec.get("groups") else None
        params = _params(dtypes=dtypes) if dtypes else _params()
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}]
        optimizer = spec["cls"](groups if spec.get("groups") else params, fused=True, **spec["kw"])
        for step, found in enumerate([0.0, 1.0, 0.0]):  # a clean step, a skip, a clean step
            scale = None if grad_scale is None else torch.tensor(grad_scale)
            found_inf = torch.tensor(found)
            if mirrored:
                assert _traced(optimizer, scale, found_inf, (), {}) is None
            else:
                _torch_step(optimizer, scale, found_inf)
            for p in params:  # fresh gradients for the next step, the same in both runs
                p.grad = torch.full_like(p, 0.5 * (step + 1))
        runs.append(_everything(optimizer))
        steps = [float(optimizer.state[p]["step"]) for p in params]
        assert steps == [2.0] * len(params)  # the skipped step was not counted
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eager_calls_take_torchs_path():
    params = _params()
    optimizer = torch.optim.AdamW(params, fused=True)
    before = _everything(optimizer)
    assert T.traced_step(optimizer, torch.tensor(2.0), torch.tensor(0.0), (), {}) is T.NOT_TRACED
    assert all(torch.equal(a, b) for a, b in zip(before, _everything(optimizer)))
    assert not optimizer.state


class _OwnStep(torch.optim.AdamW):
    def step(self, closure=None):  # an override: its effect cannot be known
        return super().step(closure)


def _patched(optimizer):
    optimizer.step = lambda *a, **k: None  # something other than an LR scheduler's wrapper
    return optimizer


NOT_MIRRORED = {
    "fused-sgd": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "foreach-adamw": lambda p: torch.optim.AdamW(p, foreach=True),
    "tensor-betas": lambda p: torch.optim.AdamW(
        p, betas=(torch.tensor(0.9), torch.tensor(0.999)), fused=True
    ),
    "overridden-step": lambda p: _OwnStep(p, fused=True),
    "patched-instance-step": lambda p: _patched(torch.optim.AdamW(p, fused=True)),
}


@pytest.mark.parametrize("case", list(NOT_MIRRORED))
def test_steps_it_does_not_mirror_are_left_to_torch_untouched(case):
    params = _params()
    optimizer = NOT_MIRRORED[case](params)
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    before = _everything(optimizer)
    assert _traced(optimizer, torch.tensor(2.0), torch.tensor(0.0), (), {}) is T.NOT_TRACED
    assert calls == [] and not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, _everything(optimizer)))


def test_step_arguments_are_left_to_torch():
    optimizer = torch.optim.AdamW(_params(), fused=True)
    out = _traced(optimizer, None, torch.tensor(0.0), (), {"closure": lambda: 1.0})
    assert out is T.NOT_TRACED and not optimizer.state


def test_hooks_and_the_lr_schedulers_mark():
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=torch.tensor(0.1), fused=True)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert "step" in vars(optimizer) and not getattr(optimizer, "_opt_called", False)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", args, kwargs)))
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: calls.append(("post", args, kwargs))
    )
    assert _traced(optimizer, None, torch.tensor(0.0), (), {}) is None
    assert calls == [("pre", (), {}), ("post", (), {})]
    assert optimizer._opt_called  # the LR scheduler sees that its optimizer stepped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
        schedule.step()
    assert math.isclose(float(optimizer.param_groups[0]["lr"]), 0.05, rel_tol=1e-6)


def test_a_pre_hook_that_returns_new_arguments_is_refused():
    optimizer = torch.optim.AdamW(_params(), fused=True)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: ((1,), {}))
    with pytest.raises(RuntimeError, match="pre-hook returned new step arguments"):
        _traced(optimizer, None, torch.tensor(0.0), (), {})


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_more_tensors_than_one_call_takes_equal_torchs_fused_step(device, compiled):
    # 40 tensors: two calls of the step op (CHUNK and the rest); compiled with fullgraph=True, the
    # graph holds one op node per call and inductor runs them in place.
    from torch._inductor.utils import run_and_get_code

    num = T.CHUNK + 8
    runs = []
    for mirrored in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(5 + i % 3, generator=gen).to(device)) for i in range(num)
        ]
        optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)
        scale = torch.tensor(64.0, device=device)
        step_fn = torch.compile(lambda o, s, f: T.traced_step(o, s, f, (), {}), fullgraph=True)
        codes: list[str] = []
        for step, found in enumerate([0.0, 1.0, 0.0]):  # a clean step, a skip, a clean step
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 64.0 * (step + 1) * (i + 1) / num)
            found_inf = torch.tensor(found, device=device)
            if not mirrored:
                _torch_step(optimizer, scale, found_inf)
            elif compiled:
                with mock.patch.object(T, "TRACES_WHOLE_PHASE", True):
                    if step == 0:  # inductor's code of the first compile
                        _, codes = run_and_get_code(step_fn, optimizer, scale, found_inf)
                    else:
                        step_fn(optimizer, scale, found_inf)
            else:
                assert _traced(optimizer, scale, found_inf, (), {}) is None
        runs.append(_everything(optimizer))
        assert [float(optimizer.state[p]["step"]) for p in params] == [2.0] * num
    if compiled:  # one graph, two calls of the op in it, run in place
        assert len(codes) == 1 and codes[0].count("torch.ops.distscaler.fused_adam_step_") == 2
    assert len(runs[0]) == len(runs[1]) == 5 * num  # parameter, gradient, step, two moments
    for a, b in zip(*runs):
        assert torch.equal(a, b)
