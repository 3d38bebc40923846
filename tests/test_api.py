"""Single process: call order, argument checks, state dicts, a disabled scaler, skip logging."""

from __future__ import annotations

import io
import logging
import math
import pickle
import warnings

import pytest
import torch
from _common import gpu_path, make_optimizer, optimizer_tensors
from _models import make_model, train

import distscaler
from common.probes import HostReadSpy


def backward(scaler, model, *, fault=False):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if fault:
        next(model.parameters()).grad.view(-1)[0] = math.inf


# ----------------------------------------------------------------- call order, as torch words it


def _unscale_twice(s, m, o):
    backward(s, m)
    s.unscale_(o)
    s.unscale_(o)


def _unscale_after_step(s, m, o):
    backward(s, m)
    s.step(o)
    s.unscale_(o)


def _step_twice(s, m, o):
    backward(s, m)
    s.step(o)
    s.step(o)


def _update_without_step(s, m, o):
    backward(s, m)
    s.update()


def _step_before_scale(s, m, o):
    s.step(o)


def _closure(s, m, o):
    backward(s, m)
    s.step(o, closure=lambda: 0.0)


def _fp16_grads(s, m, o):
    m.half()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(4, 8, dtype=torch.float16)).float().sum()
    s.scale(loss).backward()
    s.step(o)


CALL_ORDER = [
    _unscale_twice,
    _unscale_after_step,
    _step_twice,
    _update_without_step,
    _step_before_scale,
    _closure,
]


@pytest.mark.parametrize(
    "misuse, opt_kind",
    [(m, k) for m in CALL_ORDER for k in ("fused", "for-loop")]
    # Fused optimizers take fp16 gradients (there is no unscale pass to refuse them).
    + [(_fp16_grads, "for-loop")],
    ids=lambda x: x if isinstance(x, str) else x.__name__.strip("_"),
)
def test_misuse_raises_what_torch_raises(misuse, opt_kind):
    errors = []
    for cls in (torch.amp.GradScaler, distscaler.GradScaler):
        model = make_model()
        with pytest.raises(Exception) as info:
            misuse(cls("cpu"), model, make_optimizer(opt_kind, model.parameters()))
        errors.append(info.value)
    theirs, ours = errors
    assert isinstance(ours, type(theirs)), (type(theirs), type(ours))
    assert str(ours) == str(theirs)


@pytest.mark.parametrize(
    "misuse, match",
    [
        (
            lambda s, o: (s.step(o), s.clip_grad_norm_(o, 1.0)),
            r"clip_grad_norm_\(\) is being called after step",
        ),
        (
            lambda s, o: (s.clip_grad_norm_(o, 1.0), s.clip_grad_norm_(o, 1.0)),
            "has already been called",
        ),
    ],
    ids=["clip_after_step", "clip_twice"],
)
def test_clip_grad_norm_call_order(misuse, match):
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    scaler = distscaler.GradScaler("cpu")
    backward(scaler, model)
    with pytest.raises(RuntimeError, match=match):
        misuse(scaler, opt)


def test_no_inf_check_error_is_both_runtime_and_assertion_error():
    scaler = distscaler.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


def test_clip_after_explicit_unscale_clips_the_unscaled_gradients():
    model = make_model()
    opt = make_optimizer("for-loop", model.parameters())
    scaler = distscaler.GradScaler("cpu", init_scale=256.0)
    backward(scaler, model)
    scaler.unscale_(opt)
    unscaled = [p.grad.clone() for p in model.parameters()]
    ref = [p.clone() for p in unscaled]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(ref_params, ref):
        p.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.01)
    norm = scaler.clip_grad_norm_(opt, 0.01)
    torch.testing.assert_close(norm, ref_norm)
    for p, q in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.grad, q.grad)
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_was_skipped


# ----------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(growth_factor=1.0),
            ValueError,
            r"growth_factor must be a finite number > 1.0, got: 1.0",
        ),
        (dict(growth_factor=math.inf), ValueError, r"growth_factor must be a finite number > 1.0"),
        (
            dict(backoff_factor=1.0),
            ValueError,
            r"backoff_factor must be in \[1.17549\d*e-38, 1.0\), got: 1.0",
        ),
        (
            dict(backoff_factor=0.0),
            ValueError,
            r"backoff_factor must be in \[1.17549\d*e-38, 1.0\), got: 0.0",
        ),
        (dict(backoff_factor=math.nan), ValueError, r"backoff_factor must be in \[1.17549"),
        # a denormal factor takes a small scale to exactly 0 in one backoff
        (
            dict(backoff_factor=1e-45),
            ValueError,
            r"backoff_factor must be in \[1.17549\d*e-38, 1.0\), got: 1e-45",
        ),
        (
            dict(init_scale=0.0),
            ValueError,
            r"init_scale must be a finite number in \[1.1754943508222875e-38, 3.4028234663852886e\+38\] \(float32's normal range\), got: 0.0",
        ),
        (dict(init_scale=-2.0), ValueError, r"init_scale must be a finite number in .*, got: -2.0"),
        (
            dict(init_scale=math.inf),
            ValueError,
            r"init_scale must be a finite number in .*, got: inf",
        ),
        (
            dict(init_scale=math.nan),
            ValueError,
            r"init_scale must be a finite number in .*, got: nan",
        ),
        (
            dict(growth_interval=0),
            ValueError,
            r"growth_interval must be an integer in \[1, 2147483647\], got: 0",
        ),
        (
            dict(growth_interval=2.5),
            ValueError,
            r"growth_interval must be an integer in \[1, 2147483647\], got: 2.5",
        ),
        (
            dict(growth_interval=True),
            ValueError,
            r"growth_interval must be an integer in \[1, 2147483647\], got: True",
        ),
        (
            dict(min_scale=8.0, max_scale=4.0, init_scale=4.0),
            ValueError,
            r"min_scale must be <= max_scale",
        ),
        (dict(min_scale=0.0), ValueError, r"min_scale must be a finite number in .*, got: 0.0"),
        (
            dict(max_scale=1024.0),
            ValueError,
            r"init_scale must be in \[min_scale, max_scale\] = \[None, 1024.0\], got: 65536.0",
        ),
        (
            dict(grad_layout="diagonal"),
            ValueError,
            r"grad_layout must be one of \('replicated', 'sharded'\) or None, got: 'diagonal'",
        ),
        (dict(policy="apex"), ValueError, r"policy must be one of \(.*'torch'.*\), got: 'apex'"),
        (
            dict(skip_log_interval=-1),
            ValueError,
            r"skip_log_interval must be an integer in \[0, 9223372036854775807\], got: -1",
        ),
        (
            dict(process_group="world"),
            TypeError,
            r"process_group must be a ProcessGroup or None, got: 'world'",
        ),
        (dict(enabled="yes"), TypeError, r"enabled must be a bool, got: 'yes'"),
    ],
)
def test_bad_constructor_argument_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        distscaler.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_norm=0.0), r"max_norm must be a number > 0 or math.inf, got: 0.0"),
        (dict(max_norm=math.nan), r"max_norm must be a number > 0 or math.inf, got: nan"),
        (
            dict(max_norm=1.0, norm_type=0.0),
            r"norm_type must be a number > 0 or math.inf, got: 0.0",
        ),
        (
            dict(max_norm=1.0, norm_type="fro"),
            r"norm_type must be a number > 0 or math.inf, got: 'fro'",
        ),
    ],
)
def test_bad_clip_argument_is_named_and_changes_nothing(kwargs, match):
    model = make_model()
    opt = make_optimizer("for-loop", model.parameters())
    scaler = distscaler.GradScaler("cpu")
    backward(scaler, model)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        scaler.clip_grad_norm_(opt, **kwargs)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    scaler.step(opt)  # the scaler is still usable: nothing was recorded
    scaler.update()


def test_setters_validate():
    scaler = distscaler.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"growth_factor must be a finite number > 1.0, got: 0.5"):
        scaler.set_growth_factor(0.5)
    with pytest.raises(
        ValueError, match=r"backoff_factor must be in \[1.17549\d*e-38, 1.0\), got: 2.0"
    ):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(
        ValueError, match=r"growth_interval must be an integer in \[1, 2147483647\]"
    ):
        scaler.set_growth_interval(0)
    with pytest.raises(ValueError, match=r"growth_interval .* got: 1180591620717411303424"):
        scaler.set_growth_interval(2**70)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7


def test_update_with_new_scale():
    scaler = distscaler.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(new_scale=torch.tensor(64.0))
    assert scaler.get_scale() == 64.0
    with pytest.raises(ValueError, match=r"new_scale must be a finite number in .*, got: -1.0"):
        scaler.update(new_scale=-1.0)
    with pytest.raises(ValueError, match=r"new_scale must be a float or a 1-element tensor"):
        scaler.update(new_scale=torch.ones(2))
    assert scaler.get_scale() == 64.0


# ----------------------------------------------------------------- state dicts


def test_state_dict_loads_into_torch_and_back():
    ours = distscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    train(ours, "fused", steps=4, faults={1: ("inf", 0)})
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == ours.get_scale()
    assert theirs._get_growth_tracker() == ours._get_growth_tracker() == 2
    assert theirs.get_growth_interval() == 3

    again = distscaler.GradScaler("cpu")
    again.load_state_dict(theirs.state_dict())
    ours_state = ours.state_dict()
    assert (ours_state["num_updates"], ours_state["num_skipped_steps"]) == (4, 1)
    torch_keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    assert {k: again.state_dict()[k] for k in torch_keys} == {k: ours_state[k] for k in torch_keys}


def test_resume_continues_the_same_trajectory(tmp_path):
    faults = {2: ("nan", 3), 7: ("inf", 0)}
    kw = dict(init_scale=2.0**12, growth_interval=2, min_scale=2.0**10)
    model, opt, full = train(distscaler.GradScaler("cpu", **kw), "fused", steps=12, faults=faults)

    scaler = distscaler.GradScaler("cpu", **kw)
    model2, opt2, first = train(scaler, "fused", steps=6, faults=faults)
    path = tmp_path / "ckpt.pt"
    torch.save(
        {"scaler": scaler.state_dict(), "opt": opt2.state_dict(), "model": model2.state_dict()},
        path,
    )
    ckpt = torch.load(path, weights_only=True)
    resumed = distscaler.GradScaler("cpu")
    with pytest.warns(UserWarning, match="min_scale=None given to the constructor is replaced"):
        resumed.load_state_dict(ckpt["scaler"])
    assert resumed.get_min_scale() == 2.0**10
    model3 = make_model(seed=99)
    model3.load_state_dict(ckpt["model"])
    opt3 = make_optimizer("fused", model3.parameters())
    opt3.load_state_dict(ckpt["opt"])
    model3, opt3, rest = train(
        resumed, "fused", steps=6, faults=faults, model=model3, optimizer=opt3, start=6
    )
    assert first + rest == full
    for p, q in zip(model3.parameters(), model.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(optimizer_tensors(opt3), optimizer_tensors(opt)):
        assert torch.equal(s, t)


GOOD_STATE = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 100,
    "_growth_tracker": 3,
}


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(scale=None), r"missing key 'scale'"),
        (dict(scale="big"), r"state_dict\['scale'\] must be a finite number in .*, got: 'big'"),
        (dict(scale=math.nan), r"state_dict\['scale'\] must be a finite number in .*, got: nan"),
        (dict(scale=-4.0), r"state_dict\['scale'\] must be a finite number in .*, got: -4.0"),
        (dict(scale=0.0), r"state_dict\['scale'\] must be a finite number in .*, got: 0.0"),
        (dict(scale=1e40), r"state_dict\['scale'\] must be a finite number in .*, got: 1e\+40"),
        (dict(growth_interval=0), r"state_dict\['growth_interval'\] must be an integer in \[1, "),
        (
            dict(growth_interval=2**70),
            r"state_dict\['growth_interval'\] must be an integer in \[1, 2147483647\], got: 1180",
        ),
        (dict(_growth_tracker=-1), r"state_dict\['_growth_tracker'\] must be an integer in \[0, "),
        (
            dict(_growth_tracker=2**70),
            r"state_dict\['_growth_tracker'\] must be an integer in \[0, 2147483647\], got: 1180",
        ),
        (
            dict(min_scale=1e40),
            r"state_dict\['min_scale'\] must be a finite number in .*, got: 1e\+40",
        ),
        (dict(growth_factor=0.9), r"state_dict\['growth_factor'\] must be a finite number > 1.0"),
        (dict(backoff_factor=None), r"missing key 'backoff_factor'"),
    ],
)
def test_bad_state_dict_raises_and_leaves_scaler_unchanged(change, match):
    scaler = distscaler.GradScaler("cpu", init_scale=4096.0, growth_interval=5)
    train(scaler, "fused", steps=3)
    before = scaler.state_dict()
    state = {k: v for k, v in (GOOD_STATE | change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_bad_state_dict_reports_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        distscaler.GradScaler("cpu").load_state_dict({"scale": -1.0, "growth_interval": 0})
    message = str(info.value)
    for part in (
        "'scale'",
        "'growth_interval'",
        "missing key 'growth_factor'",
        "'_growth_tracker'",
    ):
        assert part in message


def test_empty_state_dict_uses_torch_wording():
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        distscaler.GradScaler("cpu").load_state_dict({})


def test_pickle_round_trip():
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, min_scale=4.0)
    train(scaler, "fused", steps=4, faults={0: ("inf", 1)})
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == scaler.state_dict()
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == scaler.state_dict()


@pytest.mark.parametrize("lazy_init_scale", [True, False], ids=["scaled", "fresh"])
def test_torchs_pickle_test_passes(lazy_init_scale):
    # torch's own test_pickle_gradscaler (test/test_torch.py), on the CPU, with distscaler's class:
    # its settings survive pickling, and the per-optimizer state's default entry is torch's fresh
    # one (it reads a dummy key to test the defaultdict's default_factory).
    a = distscaler.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, growth_interval=2)
    assert a.is_enabled()
    if lazy_init_scale:
        a.scale(torch.tensor([4.0], dtype=torch.float32))
        assert a._scale.device.type == "cpu"
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled()
    assert b.get_scale() == 3.0
    assert b.get_growth_factor() == 4.0
    assert b.get_backoff_factor() == 0.5
    assert b.get_growth_interval() == 2
    assert b._init_growth_tracker == 0
    assert b._per_optimizer_states["fdsa"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
    if lazy_init_scale:
        assert b.scale(torch.tensor([4.0], dtype=torch.float32)) == 12.0


@pytest.mark.parametrize("opt_kind", ["fused", "for-loop"])
def test_per_optimizer_states_read_as_torchs_through_an_iteration(opt_kind):
    # Code written against torch reads _per_optimizer_states: torch's two keys, the same stages
    # and flags as torch's scaler at each point of an iteration, nothing else.
    fresh = torch.amp.grad_scaler._refresh_per_optimizer_state()
    assert distscaler.GradScaler("cpu")._per_optimizer_states[0] == fresh
    seen = {}
    for cls in (distscaler.GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = make_optimizer(opt_kind, model.parameters())
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()

        def read(state):  # as it is now (torch's dicts change in place)
            flags = {d: float(f) for d, f in state["found_inf_per_device"].items()}
            return {"stage": state["stage"], "found_inf_per_device": flags}

        states = []
        scaler.unscale_(opt)
        states.append(read(scaler._per_optimizer_states[id(opt)]))
        scaler.step(opt)
        states.append(read(scaler._per_optimizer_states[id(opt)]))
        scaler.update()
        states.append(dict(scaler._per_optimizer_states))
        seen[cls] = states
    ours, theirs = seen.values()
    assert ours == theirs
    assert ours[0]["stage"] is distscaler.OptState.UNSCALED  # guard: an inf check was recorded


def test_init_growth_tracker_follows_torchs_through_load_and_pickle():
    # torch's private field, read by code (and torch's own tests) that inspect torch's scaler.
    ours, theirs = distscaler.GradScaler("cpu", growth_interval=5), torch.amp.GradScaler("cpu")
    assert ours._init_growth_tracker == theirs._init_growth_tracker == 0
    train(ours, "fused", steps=3)
    assert ours._get_growth_tracker() == 3, "the tracker never moved: nothing to check"
    assert ours._init_growth_tracker == 0  # as torch's: it does not follow the device tracker
    saved = ours.state_dict()
    for scaler in (distscaler.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        scaler.load_state_dict(saved)
        assert scaler._init_growth_tracker == 3
    theirs.load_state_dict(saved)
    theirs.scale(torch.ones(()))  # theirs too holds its tracker on the device now
    for scaler in (ours, theirs):
        scaler._growth_tracker.fill_(4)
        copy = pickle.loads(pickle.dumps(scaler))
        assert copy._init_growth_tracker == 4
        assert copy._get_growth_tracker() == 4
    fresh = distscaler.GradScaler("cpu")
    fresh._init_growth_tracker = 2  # before the first scale(): where the device state starts
    fresh.scale(torch.ones(()))
    assert fresh._get_growth_tracker() == 2


# ----------------------------------------------------------------- enabled=False, device="cuda"


def test_disabled_scaler_is_a_true_no_op():
    model = make_model()
    opt = make_optimizer("for-loop", model.parameters())
    scaler = distscaler.GradScaler("cpu", enabled=False)
    spy = HostReadSpy()
    spy.exclude_optimizer(opt)
    loss = model(torch.randn(4, 8)).sum()
    with spy:
        assert scaler.scale(loss) is loss
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert spy.reads == []
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "no step ran"
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert not scaler.step_was_skipped and not scaler.is_enabled()
    scaler.load_state_dict(GOOD_STATE)  # a no-op, as torch's


def test_cuda_device_without_cuda_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = distscaler.GradScaler()
    assert not scaler.is_enabled()
    assert any("CUDA is not available" in str(w.message) for w in caught)


def test_is_a_torch_gradscaler():
    assert isinstance(distscaler.GradScaler("cpu"), torch.amp.GradScaler)


# ----------------------------------------------------------------- bounds, skip flag, logging


def test_min_and_max_scale_bound_the_scale():
    scaler = distscaler.GradScaler("cpu", init_scale=1024.0, min_scale=256.0, growth_interval=100)
    faults = {s: ("inf", 0) for s in range(6)}
    _, _, scales = train(scaler, "fused", steps=6, faults=faults)
    assert scales == [512.0, 256.0, 256.0, 256.0, 256.0, 256.0]

    scaler = distscaler.GradScaler("cpu", init_scale=1024.0, max_scale=4096.0, growth_interval=1)
    _, _, scales = train(scaler, "fused", steps=4)
    assert scales == [2048.0, 4096.0, 4096.0, 4096.0]


def test_step_was_skipped_follows_the_agreed_found_inf():
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    scaler = distscaler.GradScaler("cpu")
    assert scaler.step_was_skipped is False
    for fault in (False, True, False):
        opt.zero_grad()
        backward(scaler, model, fault=fault)
        scaler.step(opt)
        scaler.update()
        assert scaler.step_was_skipped is fault


def test_skips_are_logged_when_the_host_reads(caplog):
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**16, skip_log_interval=0)
    caplog.set_level(logging.INFO, logger="distscaler")
    for step in range(4):
        opt.zero_grad()
        backward(scaler, model, fault=step in (1, 2))
        scaler.step(opt)
        scaler.update()
    assert not caplog.records, "logged without a host read"
    assert scaler.get_scale() == 2.0**14
    (record,) = caplog.records
    message = record.getMessage()
    assert "2 optimizer step(s) skipped" in message
    assert "the last at step 3, at loss scale 32768 (now 16384)" in message
    scaler.get_scale()
    assert len(caplog.records) == 1, "a skip was reported twice"


def test_skips_are_logged_every_interval(caplog):
    # The path a GPU runs (the CPU's reads its flag each step, see test_step_cost).
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    scaler = gpu_path(distscaler.GradScaler("cpu", skip_log_interval=3))
    caplog.set_level(logging.INFO, logger="distscaler")
    spy = HostReadSpy()
    spy.exclude_optimizer(opt)
    reads = []
    for step in range(6):
        opt.zero_grad()
        backward(scaler, model, fault=step == 0)
        spy.reads.clear()
        with spy:
            scaler.step(opt)
            scaler.update()
        reads.append(len(spy.reads))
    # The report of step 3 reads the state, then (a step was skipped) the overflow flags.
    assert reads == [0, 0, 2, 0, 0, 1]
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2
    assert messages[0][0] == "INFO" and "1 optimizer step(s) skipped" in messages[0][1]
    # Not registered: the parameter is named after its place in the optimizer.
    assert messages[1][0] == "WARNING"
    assert "step 1 (loss scale 65536): inf in `param_groups[0][0]` on rank 0" in messages[1][1]


# ----------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [False, True])
def test_fused_step_and_update_never_sync_on_cuda(clip):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = distscaler.GradScaler("cuda", skip_log_interval=0)
    for step in range(4):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(16, 8, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = math.inf
        torch.cuda.set_sync_debug_mode("error")
        try:
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert scaler.step_was_skipped is (step == 2)


def test_fp16_gradients_in_clip_raise_and_leave_the_optimizer_ready():
    model = make_model().half()
    opt = make_optimizer("for-loop", model.parameters())
    scaler = distscaler.GradScaler("cpu", init_scale=4.0)
    loss = model(torch.randn(4, 8, dtype=torch.float16)).float().pow(2).mean()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler.clip_grad_norm_(opt, 1.0)
    model.float()  # fix the cause; the same iteration can go on
    for p in model.parameters():
        p.grad = p.grad.float()
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_was_skipped


def test_skip_log_keeps_counting_across_a_resume(caplog):
    faults = {2: ("inf", 0), 8: ("nan", 1)}
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**10, skip_log_interval=0)
    model, opt, _ = train(scaler, "fused", steps=6, faults=faults)
    state = scaler.state_dict()
    assert (state["num_updates"], state["num_skipped_steps"]) == (6, 1)

    resumed = distscaler.GradScaler("cpu", skip_log_interval=0)
    resumed.load_state_dict(state)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="distscaler")
    train(resumed, "fused", steps=4, faults=faults, model=model, optimizer=opt, start=6)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "1 optimizer step(s) skipped" in messages[0]
    assert "(2 skipped in 9 steps so far); the last at step 9, at loss scale" in messages[0]


def test_loading_other_scale_bounds_warns():
    source = distscaler.GradScaler("cpu", min_scale=1.0)
    source.scale(torch.ones(()))
    target = distscaler.GradScaler("cpu", min_scale=4.0)
    with pytest.warns(
        UserWarning,
        match=r"min_scale=4.0 given to the constructor is replaced by the checkpoint's min_scale=1.0",
    ):
        target.load_state_dict(source.state_dict())
    assert target.get_min_scale() == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(source.state_dict())  # same bounds: silent


def test_state_dict_reads_the_device_once():
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**10)
    train(scaler, "fused", steps=3, faults={1: ("inf", 0)})
    with HostReadSpy() as spy:
        state = scaler.state_dict()
    assert spy.reads == ["tolist"]
    assert (state["scale"], state["num_updates"], state["num_skipped_steps"]) == (512.0, 3, 1)


def test_found_inf_is_the_agreed_flag_on_the_device_without_a_host_read():
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**10)
    assert scaler.found_inf is None  # before the first update
    model, opt, _ = train(scaler, "fused", steps=1, faults={0: ("nan", 1)})
    flags = [scaler.found_inf]
    train(scaler, "fused", steps=1, model=model, optimizer=opt, start=1)
    with HostReadSpy() as spy:
        flags.append(scaler.found_inf)
    assert spy.reads == []
    assert [float(f) for f in flags] == [1.0, 0.0]  # kept tensors are not overwritten later
    assert scaler.step_was_skipped is False
    assert distscaler.GradScaler("cpu", enabled=False).found_inf is None


def test_lazy_init_is_idempotent_on_a_scaler_in_use():
    # Accelerate's FSDP2 load_state calls it on a scaler that has already run.
    scaler = distscaler.GradScaler("cpu", init_scale=2.0**10)
    train(scaler, "foreach", steps=2, faults={0: ("inf", 0)})
    scale = scaler._scale
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert scaler._scale is scale and scaler.get_scale() == 2.0**9


def test_fused_step_leaves_the_optimizers_attributes_as_they_were():
    # torch's scaler leaves optimizer.grad_scale = None behind when a fused step raises after
    # unscale_() (it deletes the attributes only on success); ours must read None as "no user
    # factor", step, and put back what was there.
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    leftover = torch.zeros(())
    opt.grad_scale, opt.found_inf = None, leftover
    ours = distscaler.GradScaler("cpu", init_scale=4.0)
    ours.scale(model(torch.randn(4, 8)).sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    ours.step(opt)
    ours.update()
    assert not ours.step_was_skipped
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.grad_scale is None and opt.found_inf is leftover  # as they were
    del opt.grad_scale, opt.found_inf
    opt.zero_grad()
    ours.scale(model(torch.randn(4, 8)).sum()).backward()
    ours.step(opt)
    ours.update()
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)


def test_every_attribute_torchs_init_sets_exists_with_torchs_meaning():
    # Other libraries read torch's private fields (Accelerate's test_grad_scaler_kwargs reads
    # _init_scale): each one torch's __init__ sets exists here with torch's value, before and
    # after load_state_dict, and the setters torch's set_* write through validate.
    kwargs = dict(init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    ours = distscaler.GradScaler("cpu", **kwargs)
    names = sorted(vars(theirs))
    assert {"_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval"} <= set(names)
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name
    saved = {"scale": 64.0, "growth_factor": 4.0, "backoff_factor": 0.125, "growth_interval": 9,
             "_growth_tracker": 3}  # fmt: skip
    theirs.load_state_dict(saved)
    ours.load_state_dict(saved)
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name
    ours._growth_factor = 5.0  # torch's set_growth_factor writes the field
    assert ours.get_growth_factor() == 5.0
    with pytest.raises(ValueError, match="growth_factor"):
        ours._growth_factor = 0.5
    assert ours.get_growth_factor() == 5.0
