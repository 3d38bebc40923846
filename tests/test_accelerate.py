"""HuggingFace Accelerate integration (``distscaler.integrations.accelerate``) against Accelerate.

Three kinds of runs:

* In this process, one rank (``DistributedType.NO``): install / uninstall, the skip flag with fused
  and foreach optimizers and with a hysteresis policy, clipping against torch, ``save_state`` /
  ``load_state``, a DeepSpeed ``fp16`` section, CPU autocast.
* One spawn of 2 gloo ranks (tests/_accelerate_scenarios.py): MULTI_CPU (DDP) with an inf on one
  rank, and FSDP2 ``load_state`` with its dummy optimizer step; each next to stock Accelerate
  (a ``torch.amp.GradScaler`` in ``accelerator.scaler``, as Accelerate builds it on GPUs), which
  shows the bug the integration fixes in the same scenario.
* One ``accelerate launch`` of ``launch/train_accelerate.py`` with configs/accelerate/multi_cpu.yaml
  (2 CPU processes, a free port).
"""

from __future__ import annotations

import functools
import json
import math
import pickle
import socket
import subprocess
import sys

import _accelerate_scenarios as S
import pytest
import torch
from _common import REPO, launch_env, mlp
from _harness import spawn
from _torch_gaps import guarded

accelerate = pytest.importorskip("accelerate")  # a test extra; CI installs it

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

from distscaler import GradScaler, ScalerConfig  # noqa: E402
from distscaler.integrations.accelerate import (  # noqa: E402
    ScaledAcceleratedOptimizer,
    install,
    installed_scaler,
    uninstall,
)


@pytest.fixture
def make_accelerator():
    """Fresh Accelerate singletons for each test (Accelerate keeps its state process-wide)."""

    def make(**kwargs) -> Accelerator:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True, **kwargs)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    fused = kind == "fused"
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)


def _run(accelerator, model, optimizer, steps: int, inject: set[int], clip: float | None = None):
    """Train ``steps`` steps; returns per step: skipped flag, scale after, params unchanged, norm."""
    out = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        before = [p.detach().clone() for p in model.parameters()]
        accelerator.backward(model(x).float().pow(2).mean())
        if step in inject:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        norm = accelerator.clip_grad_norm_(model.parameters(), clip) if clip else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        scale = accelerator.scaler.get_scale()
        out.append((accelerator.optimizer_step_was_skipped, scale, unchanged, norm))
    return out


def _stock(make_accelerator, kind: str, **scaler_kwargs):
    """Accelerate with torch's GradScaler, as it builds it for fp16 on GPUs (none on the CPU)."""
    accelerator = make_accelerator(mixed_precision="fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    accelerator.native_amp = True
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, kind))
    return accelerator, model, optimizer


# ----------------------------------------------------------------------- one process


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_skip_flag_is_right_for_fused_optimizers_where_accelerate_misses_it(make_accelerator, kind):
    inject = {2}
    stock = _run(*_stock(make_accelerator, kind), steps=4, inject=inject)
    # Guard: under stock Accelerate the overflow step really was skipped (scale backed off,
    # parameters untouched) ...
    assert [s[2] for s in stock] == [False, False, True, False]
    assert stock[2][1] == stock[1][1] / 2
    # ... yet Accelerate reports it only when the optimizer's step was not called (not fused).
    assert [s[0] for s in stock] == [False, False, kind == "foreach", False]

    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    optimizer = _optimizer(model, kind)
    install(accelerator)  # before prepare()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert type(optimizer) is ScaledAcceleratedOptimizer
    ours = _run(accelerator, model, optimizer, steps=4, inject=inject)
    assert [s[0] for s in ours] == [False, False, True, False]
    assert [s[2] for s in ours] == [False, False, True, False]
    assert [s[1] for s in ours] == [s[1] for s in stock]


def test_overflow_absorbed_by_hysteresis_is_still_a_skipped_step(make_accelerator):
    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    install(accelerator, GradScaler("cpu", init_scale=1024.0, policy="deepspeed", hysteresis=2))
    res = _run(accelerator, model, optimizer, steps=4, inject={1, 2})
    # Guard: the first overflow is absorbed (no backoff), the second one backs off.
    assert [s[1] for s in res] == [1024.0, 1024.0, 512.0, 512.0]
    assert [s[0] for s in res] == [False, True, True, False]
    assert [s[2] for s in res] == [False, True, True, False]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_clip_grad_norm_goes_through_the_scaler_and_matches_torch(make_accelerator, kind):
    max_norm = 0.05  # below every norm here, so clipping really scales
    stock_run = _stock(make_accelerator, kind)
    stock = _run(*stock_run, steps=3, inject=set(), clip=max_norm)

    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, kind))
    scaler = install(accelerator)
    calls = []
    clip = scaler.clip_grad_norm_
    scaler.clip_grad_norm_ = lambda *a, **k: calls.append(1) or clip(*a, **k)  # test-only spy
    ours = _run(accelerator, model, optimizer, steps=3, inject=set(), clip=max_norm)
    assert len(calls) == 3  # routed to GradScaler.clip_grad_norm_ (one inf check per step)
    for (_, _, _, ref), (_, _, _, norm) in zip(stock, ours):
        assert norm.dtype == torch.float32 and norm.shape == ()
        assert float(norm) > max_norm
        assert float(norm) == pytest.approx(float(ref), rel=1e-6)
    # Same clipped updates as torch's unscale_ + clip_grad_norm_ + step (fp32 rounding apart:
    # a fused kernel gets grad_scale = scale / clip_coef instead of clipped gradients).
    for ref, p in zip(stock_run[1].parameters(), model.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_of_a_parameter_subset_falls_back_with_a_warning(make_accelerator):
    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "foreach"))
    scaler = install(accelerator)
    accelerator.backward(model(torch.randn(4, 8)).float().pow(2).mean())
    first = [p for p in model[0].parameters()]
    expected = (
        torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in first]))
        / scaler.get_scale()
    )
    with pytest.warns(UserWarning, match="not exactly those of one prepared optimizer"):
        norm = accelerator.clip_grad_norm_(first, 1e9)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    optimizer.step()  # the fallback unscaled through the scaler: the step still works
    assert not accelerator.optimizer_step_was_skipped


def test_save_and_load_state_round_trip_the_scaler_exactly(make_accelerator, tmp_path):
    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    scaler = install(accelerator, GradScaler("cpu", init_scale=512.0, growth_interval=3))
    _run(accelerator, model, optimizer, steps=6, inject={1})
    saved = scaler.state_dict()
    assert saved["_growth_tracker"] == 1 and saved["num_skipped_steps"] == 1  # not a trivial state
    accelerator.save_state(str(tmp_path / "ckpt"))
    stored = torch.load(tmp_path / "ckpt" / "scaler.pt", weights_only=True)
    assert stored == saved
    assert torch.amp.GradScaler("cpu").load_state_dict(stored) is None  # torch reads it too

    # A resumed run: fresh accelerator, model, optimizer and scaler.
    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    resumed = install(accelerator, GradScaler("cpu", init_scale=512.0, growth_interval=3))
    assert resumed.state_dict() != saved
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert resumed.state_dict() == saved


def test_gradient_accumulation_steps_and_updates_once_per_sync(make_accelerator):
    accelerator = make_accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    scaler = install(accelerator, GradScaler("cpu", init_scale=1024.0, growth_interval=1))
    flags, scales = [], []
    for micro in range(6):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(4, 8)).float().pow(2).mean())
            if micro == 2:  # first micro-step of the second optimizer step
                next(model.parameters()).grad.view(-1)[0] = math.inf
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        flags.append(accelerator.optimizer_step_was_skipped)
        scales.append(scaler.get_scale())
    # The scaler runs on the syncing micro-steps only (1, 3, 5): grow, back off, grow.
    assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert flags == [False, False, False, True, True, False]


@pytest.mark.parametrize("given", ["config", "dict", "json_path"])
def test_deepspeed_fp16_section_in_one_call(make_accelerator, given, tmp_path):
    ds_config = {
        "train_batch_size": 8,
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 2, "min_loss_scale": 1},
    }
    accelerator = make_accelerator(mixed_precision="fp16")
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    if given == "config":
        scaler = install(accelerator, ScalerConfig.from_deepspeed(ds_config))
    elif given == "dict":
        scaler = install(accelerator, ds_config)
    else:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(ds_config))
        scaler = install(accelerator, str(path))
    assert accelerator.scaler is scaler and scaler.get_scale() == 1024.0
    res = _run(accelerator, model, optimizer, steps=3, inject={1})
    assert [s[0] for s in res] == [False, True, False]  # DeepSpeed's hysteresis: absorbed, skipped
    assert [s[1] for s in res] == [1024.0, 1024.0, 1024.0]


def test_cpu_gets_fp16_autocast_whether_installed_before_or_after_prepare(make_accelerator):
    dtypes = {}
    for when in ("before", "after"):
        accelerator = make_accelerator(mixed_precision="fp16")
        assert accelerator.scaler is None and not accelerator.native_amp  # Accelerate on CPU
        model = mlp(0)
        optimizer = _optimizer(model, "fused")
        if when == "before":
            install(accelerator)
        model, optimizer = accelerator.prepare(model, optimizer)
        if when == "after":
            install(accelerator)
        seen: list[torch.dtype] = []
        model[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        out = model(torch.randn(2, 8))
        dtypes[when] = (seen[0], out.dtype)
        results = _run(accelerator, model, optimizer, steps=3, inject={1})
        dtypes[when] += tuple(s[:3] for s in results)
    assert dtypes["before"][:2] == (torch.float16, torch.float32)  # fp16 inside, fp32 out
    assert dtypes["before"] == dtypes["after"]


def test_install_validates_and_uninstall_restores(make_accelerator, tmp_path):
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        install(object())
    accelerator = make_accelerator(mixed_precision="no")
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*got: mixed_precision='no'"):
        install(accelerator)
    accelerator = make_accelerator(mixed_precision="fp16")
    with pytest.raises(TypeError, match="scaler must be None, a distscaler.GradScaler"):
        install(accelerator, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="device type must be the accelerator's"):
        install(accelerator, GradScaler("cuda", enabled=False))
    # A DeepSpeed config path that is not a file: the documented ValueError, which is also the
    # FileNotFoundError that ScalerConfig.from_deepspeed raises for it.
    missing = str(tmp_path / "ds_config.json")
    with pytest.raises(ValueError, match=r"got: '.*ds_config.json' \(no such file\)") as err:
        install(accelerator, missing)
    assert isinstance(err.value, FileNotFoundError)
    assert accelerator.scaler is None and installed_scaler(accelerator) is None  # untouched

    model = mlp(0)
    model, optimizer = accelerator.prepare(model, _optimizer(model, "fused"))
    scaler = install(accelerator)
    assert installed_scaler(accelerator) is scaler and accelerator.scaler is scaler
    with pytest.raises(RuntimeError, match="already installed"):
        install(accelerator)
    assert uninstall(accelerator) is scaler
    assert type(optimizer) is AcceleratedOptimizer and optimizer.scaler is None
    assert accelerator.scaler is None and not accelerator.native_amp
    assert "clip_grad_norm_" not in vars(accelerator)
    assert "prepare_optimizer" not in vars(accelerator)
    assert not hasattr(model, "_original_forward")
    with pytest.raises(RuntimeError, match="not installed"):
        uninstall(accelerator)


def _prepared(accelerator, stock: bool, kind: str = "fused", scheduler: bool = False):
    """A model and optimizer (and a StepLR halving the LR each step) prepared on ``accelerator``;
    ``stock``: Accelerate with torch's GradScaler as it builds it for fp16 on GPUs."""
    if stock:
        accelerator.scaler = torch.amp.GradScaler("cpu")
        accelerator.native_amp = True
    model = mlp(0)
    optimizer = _optimizer(model, kind)
    if not scheduler:
        return accelerator.prepare(model, optimizer)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return accelerator.prepare(model, optimizer, sched)


@pytest.mark.parametrize("installed", ["stock", "before_prepare", "after_prepare"])
def test_accelerator_pickles_after_install_as_it_does_without(make_accelerator, installed):
    accelerator = make_accelerator(mixed_precision="fp16")
    if installed == "before_prepare":
        install(accelerator)
    model = mlp(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)))
    optimizer = _optimizer(model, "foreach")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    prepared = accelerator.prepare(model, optimizer, scheduler, loader)
    if installed == "after_prepare":
        install(accelerator)  # wraps the prepared model's forward in autocast itself
    # Accelerate's test_can_pickle_dataloader: dumps and loads the accelerator.
    loaded = pickle.loads(pickle.dumps(accelerator))
    assert len(loaded._dataloaders) == 1 and len(loaded._optimizers) == 1
    assert len(loaded._models) == 1 and len(loaded._schedulers) == 1
    pickle.dumps(prepared[0])  # the prepared model alone too
    if installed == "stock":
        assert installed_scaler(loaded) is None
        return
    assert accelerator.native_amp and "_original_forward" in vars(prepared[0])  # really wrapped
    scaler = installed_scaler(loaded)
    assert isinstance(scaler, GradScaler) and loaded.scaler is scaler
    assert type(loaded._optimizers[0]) is ScaledAcceleratedOptimizer
    assert loaded._optimizers[0].scaler is scaler
    # The installed methods are bound to the loaded accelerator, not the original one.
    for name in ("clip_grad_norm_", "prepare_optimizer", "prepare_scheduler"):
        assert vars(loaded)[name].args == (loaded,), name
    assert uninstall(loaded) is scaler and loaded.scaler is None


def test_write_to_is_overflow_marks_a_skipped_step_as_with_accelerate(make_accelerator):
    # Accelerate's test_scheduler.lambda_test: the test marks a skipped step by writing
    # optimizer._is_overflow, and the scheduler holds the LR.
    lrs = {}
    for kind in ("stock", "ours"):
        accelerator = make_accelerator()  # fp32, each with a scaler (so a step sets the flag)
        if kind == "ours":
            install(accelerator, GradScaler("cpu"))
        else:
            accelerator.scaler = torch.amp.GradScaler("cpu")
        model = torch.nn.Linear(2, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / 10)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        seen = []
        optimizer._is_overflow = False  # stepped
        scheduler.step()
        seen.append((scheduler.get_last_lr()[0], accelerator.optimizer_step_was_skipped))
        optimizer._is_overflow = True  # skipped
        scheduler.step()
        seen.append((scheduler.get_last_lr()[0], accelerator.optimizer_step_was_skipped))
        # A real step replaces the written value with the step's own found_inf.
        accelerator.backward(model(torch.randn(3, 2)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        seen.append((scheduler.get_last_lr()[0], accelerator.optimizer_step_was_skipped))
        lrs[kind] = seen
    assert lrs["stock"] == [(0.9, False), (0.9, True), (0.8, False)]
    assert lrs["ours"] == lrs["stock"]


def _closure_step(accelerator, enabled: bool, stock: bool) -> tuple:
    """``optimizer.step(closure)`` on a prepared SGD; returns the number of closure calls, whether
    the parameters moved, and the skip flag."""
    handler = accelerator.scaler_handler
    if stock:  # as Accelerate builds it on GPUs, from the same GradScalerKwargs
        accelerator.scaler = torch.amp.GradScaler("cpu", **handler.to_kwargs())
        accelerator.native_amp = True
    else:
        assert install(accelerator).is_enabled() is enabled
    model = mlp(0)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        accelerator.backward(loss)
        return loss

    optimizer.step(closure)
    changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return len(calls), changed, accelerator.optimizer_step_was_skipped


def test_step_with_closure_runs_it_when_the_scaler_is_disabled(make_accelerator):
    def disabled():
        return make_accelerator(
            mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(enabled=False)]
        )

    # Stock: the disabled scaler runs the optimizer's own step, closure included.
    stock = _closure_step(disabled(), enabled=False, stock=True)
    assert stock == (1, True, False)
    assert _closure_step(disabled(), enabled=False, stock=False) == stock
    # Enabled, the closure is refused with torch's words (it would run on scaled gradients).
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        _closure_step(make_accelerator(mixed_precision="fp16"), enabled=True, stock=False)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_lr_is_held_on_skipped_steps_unless_lr_on_skip_step(make_accelerator, kind, when):
    def lrs(accelerator, model, optimizer, scheduler):
        out = []
        for step in range(3):
            accelerator.backward(model(torch.randn(4, 8)).float().pow(2).mean())
            if step == 1:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            out.append((accelerator.optimizer_step_was_skipped, scheduler.get_last_lr()[0]))
        return out

    accelerator = make_accelerator(mixed_precision="fp16")
    stock = lrs(accelerator, *_prepared(accelerator, stock=True, kind=kind, scheduler=True))
    runs = {}
    for lr_on_skip in ("hold", "step"):
        accelerator = make_accelerator(mixed_precision="fp16")
        if when == "before":
            install(accelerator, lr_on_skip=lr_on_skip)
        prepared = _prepared(accelerator, stock=False, kind=kind, scheduler=True)
        if when == "after":
            install(accelerator, lr_on_skip=lr_on_skip)
        runs[lr_on_skip] = lrs(accelerator, *prepared)
        uninstall(accelerator)
        assert type(prepared[2]).__name__ == "AcceleratedScheduler"  # restored
    # Stock Accelerate holds the LR only where it sees the skip: not with a fused optimizer.
    assert [s for s, _ in stock] == [False, kind == "foreach", False]
    assert [lr for _, lr in stock] == (
        [5e-3, 2.5e-3, 1.25e-3] if kind == "fused" else [5e-3, 5e-3, 2.5e-3]
    )
    # distscaler: the skip is reported either way; "hold" holds the LR, "step" steps it.
    for run in runs.values():
        assert [s for s, _ in run] == [False, True, False]
    assert [lr for _, lr in runs["hold"]] == [5e-3, 5e-3, 2.5e-3]
    assert [lr for _, lr in runs["step"]] == [5e-3, 2.5e-3, 1.25e-3]
    with pytest.raises(
        ValueError, match=r"lr_on_skip must be one of \('hold', 'step'\), got: 'keep'"
    ):
        install(make_accelerator(mixed_precision="fp16"), lr_on_skip="keep")


# ----------------------------------------------------------------------- two gloo ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate2")
    return guarded(spawn(functools.partial(S.everything, tmp=str(tmp)), 2, tmp))


@pytest.mark.xdist_group("accelerate2")
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_inf_on_one_rank_is_a_skip_on_every_rank_under_multi_cpu(two_ranks, kind):
    stock = [r["ddp"][f"stock-{kind}"] for r in two_ranks]
    ours = [r["ddp"][f"ours-{kind}"] for r in two_ranks]
    step = S.INJECT_STEP
    for runs in (stock, ours):
        assert [r["distributed_type"] for r in runs] == ["DistributedType.MULTI_CPU"] * 2
        # Guard: only the last rank saw the inf (after DDP's all-reduce).
        assert [r["seen"][step] for r in runs] == [False, True]
    # Stock Accelerate: rank 1 skipped (its scale backed off), rank 0 stepped; and the flag misses
    # the skip of a fused optimizer altogether.
    assert [r["unchanged"][step] for r in stock] == [False, True]
    assert stock[0]["params"] != stock[1]["params"]
    assert [r["skipped"][step] for r in stock] == [False, kind == "foreach"]
    # distscaler: every rank skips and says so; same scale, norms and parameters everywhere.
    for r in ours:
        assert r["optimizer_class"] == "ScaledAcceleratedOptimizer"
        assert r["skipped"] == [s == step for s in range(S.NUM_STEPS)]
        assert r["unchanged"] == r["skipped"]
        for field in ("scales", "norms", "params"):
            assert r[field] == ours[0][field], field
    assert ours[0]["scales"][step] == ours[0]["scales"][step - 1] / 2
    # The clipped norm is the global norm of the unscaled gradients (DDP: counted once).
    for r in ours:
        for s in range(S.NUM_STEPS):
            if s == step:
                assert math.isinf(r["norms"][s])
            else:
                assert r["norms"][s] == pytest.approx(r["ref_norms"][s], rel=1e-5)


@pytest.mark.xdist_group("accelerate2")
def test_fsdp2_load_state_dummy_step_does_not_change_the_restored_scale(two_ranks):
    for r in two_ranks:
        stock, ours = r["fsdp2"]["stock"], r["fsdp2"]["ours"]
        for run in (stock, ours):
            assert run["is_fsdp2"] and run["grad_type"] == "DTensor"  # really FSDP2
            assert "scaler.pt" in run["files"] and "optimizer_0" in run["files"]
            assert run["fresh"] != run["saved"]  # the resumed scaler starts elsewhere
            # The clean steps before saving, norms against the gathered gradients.
            assert run["trained"]["skipped"] == [False] * (S.GROWTH_INTERVAL - 1)
            for norm, ref in zip(run["trained"]["norms"], run["trained"]["ref_norms"]):
                assert norm == pytest.approx(ref, rel=1e-5)
        # Guard: the dummy step ran and, with Accelerate's own handling, grew the scale.
        assert stock["saved"]["_growth_tracker"] == S.GROWTH_INTERVAL - 1
        assert stock["loaded"]["scale"] == 2 * stock["saved"]["scale"]
        assert stock["loaded"]["_growth_tracker"] == 0
        # distscaler: the same dummy step, and the restored state is the saved one exactly.
        assert ours["dummy_steps"] == 1
        assert ours["loaded"] == ours["saved"]
        assert not ours["skipped_after_load"]
    assert two_ranks[0]["fsdp2"]["ours"] == two_ranks[1]["fsdp2"]["ours"]


# ----------------------------------------------------------------------- accelerate launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    types = {}
    for name in ("multi_cpu", "multi_gpu", "fsdp"):
        config = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
        assert config.mixed_precision == "fp16" and config.num_processes == 2
        types[name] = str(config.distributed_type)
    assert types == {
        # The launcher choice; inside the job the processes find no GPU and are MULTI_CPU.
        "multi_cpu": "DistributedType.MULTI_GPU",
        "multi_gpu": "DistributedType.MULTI_GPU",
        "fsdp": "DistributedType.FSDP",
    }


@pytest.mark.slow
@pytest.mark.xdist_group("accelerate_launch")
def test_train_accelerate_runs_with_accelerate_launch_on_two_cpu_processes(tmp_path):
    env = launch_env()
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "configs" / "accelerate" / "multi_cpu.yaml"),
        "--main_process_port", str(_free_port()),
        str(REPO / "launch" / "train_accelerate.py"),
        "--config", str(REPO / "configs" / "smoke.yaml"),
        "--data", str(REPO / "launch" / "train.py"),
        "--steps", "8", "--inject-inf", "5", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["distributed_type"] == "DistributedType.MULTI_CPU"
    assert summary["ranks_consistent"] and summary["steps"] == 8
    assert [r["skipped_steps"] for r in summary["ranks"]] == [[5], [5]]
    assert len({r["params_digest"] for r in summary["ranks"]}) == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [r["step"] == 5 for r in records]
    assert records[5]["scale"] == records[4]["scale"] / 2  # backed off after the skip
    assert records[4]["grad_norm"] is None  # the inf reached the norm: the inf check saw it
    # Accelerate's scheduler does not step after a skipped step: step 6 keeps step 5's lr.
    assert records[5]["lr"] == records[4]["lr"] != records[3]["lr"]
    assert (out / "state" / "scaler.pt").is_file()
