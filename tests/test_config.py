"""ScalerConfig and ScalerConfig.from_deepspeed, checked against DeepSpeed's own config classes."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from distscaler import GradScaler, ScalerConfig
from distscaler.interop import DEEPSPEED_FP16_DEFAULTS

# The reference: DeepSpeed's own config classes (the compat extra; CI installs it). Without it,
# skip this module rather than fail the whole collection (seen on a GPU image without DeepSpeed).
pytest.importorskip("deepspeed", reason="the reference DeepSpeed config classes (compat extra)")
from deepspeed.runtime.precision_config import (  # noqa: E402
    DeepSpeedFP16Config,
    get_float16_config,
)

CONFIGS = sorted((Path(__file__).parents[1] / "configs" / "deepspeed").glob("*.json"))


@pytest.fixture(autouse=True)
def quiet_deepspeed_comm(monkeypatch):
    import deepspeed.runtime.fp16.loss_scaler as ls

    monkeypatch.setattr(ls, "dist", type("Comm", (), {"get_rank": staticmethod(lambda g=None: 0)}))


def test_defaults_are_deepspeeds():
    reference = DeepSpeedFP16Config().model_dump()
    assert DEEPSPEED_FP16_DEFAULTS == reference
    config = ScalerConfig.from_deepspeed({"fp16": {"enabled": True}})
    args = DeepSpeedFP16Config(enabled=True).dynamic_loss_scale_args()
    assert config.policy == "deepspeed"
    assert config.init_scale == args["init_scale"] == 2.0**16
    assert config.growth_interval == args["scale_window"] == 1000
    assert config.hysteresis == args["delayed_shift"] == 2
    assert config.consecutive_hysteresis is args["consecutive_hysteresis"] is False
    assert config.min_scale == args["min_scale"] == 1
    assert config.raise_error_at_min_scale  # DynamicLossScaler's default
    assert (config.growth_factor, config.backoff_factor) == (2.0, 0.5)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_configs_load_here_and_in_deepspeed(path):
    raw = json.loads(path.read_text())
    whole = "fp16" in raw or "bf16" in raw
    get_float16_config(raw if whole else {"fp16": raw})  # DeepSpeed accepts it too
    config = ScalerConfig.from_deepspeed(path)
    assert config == ScalerConfig.from_deepspeed(str(path)) == ScalerConfig.from_deepspeed(raw)
    scaler = GradScaler.from_config(config, "cpu")
    assert scaler.get_scale() == config.init_scale


def test_section_whole_config_and_path_agree(tmp_path):
    section = {"enabled": True, "initial_scale_power": 8, "hysteresis": 3, "min_loss_scale": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": section}))
    a = ScalerConfig.from_deepspeed(section)
    assert a == ScalerConfig.from_deepspeed({"fp16": section}) == ScalerConfig.from_deepspeed(path)
    assert (a.init_scale, a.hysteresis, a.min_scale) == (256.0, 3, 2.0)


def test_static_bf16_and_fp32_configs():
    static = ScalerConfig.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    assert (static.policy, static.init_scale, static.skip_nonfinite) == ("static", 128.0, True)
    bf16 = ScalerConfig.from_deepspeed({"bf16": {"enabled": True}})
    assert (bf16.policy, bf16.init_scale, bf16.skip_nonfinite) == ("static", 1.0, True)
    no_check = ScalerConfig.from_deepspeed(
        {"bfloat16": {"enabled": True, "check_grad_overflow": False}}
    )
    assert no_check.skip_nonfinite is False
    fp32 = ScalerConfig.from_deepspeed({"train_batch_size": 8})
    assert (fp32.policy, fp32.init_scale, fp32.enabled) == ("static", 1.0, True)


def test_every_problem_is_reported_at_once():
    bad = {
        "fp16": {
            "enabled": True,
            "loss_scale_window": 0,
            "hysteresis": "two",
            "min_loss_scale": -1,
            "initial_scale_power": 200,
            "loss_scael": 1,
            "consecutive_hysteresis": 1,
        }
    }
    with pytest.raises(ValueError) as info:
        ScalerConfig.from_deepspeed(bad)
    message = str(info.value)
    for part in (
        "unknown fp16 key(s) ['loss_scael']",
        "fp16.loss_scale_window must be an integer in [1, 2147483647], got: 0",
        "fp16.hysteresis must be an integer in [1, 9223372036854775807], got: 'two'",
        "fp16.min_loss_scale must be a finite number in [1.1754943508222875e-38, "
        "3.4028234663852886e+38] (float32's normal range), got: -1",
        "fp16.initial_scale_power must be an integer in [-126, 127], got: 200",
        "fp16.consecutive_hysteresis must be a bool, got: 1",
    ):
        assert part in message, part


def test_auto_values_name_the_key():
    with pytest.raises(ValueError, match=r"fp16.loss_scale is 'auto': Accelerate and the HF"):
        ScalerConfig.from_deepspeed({"fp16": {"enabled": "auto", "loss_scale": "auto"}})
    with pytest.raises(ValueError, match=r"fp16.enabled is 'auto'"):
        ScalerConfig.from_deepspeed({"fp16": {"enabled": "auto"}})


def test_fp16_and_bf16_both_enabled_is_an_error():
    with pytest.raises(ValueError, match="fp16.enabled and bf16.enabled are both true"):
        ScalerConfig.from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_static_config_ignores_dynamic_only_values_as_deepspeed_does():
    section = {"enabled": True, "loss_scale": 64, "loss_scale_window": 0, "min_loss_scale": 0}
    DeepSpeedFP16Config(**section)  # DeepSpeed accepts this
    assert ScalerConfig.from_deepspeed(section).init_scale == 64.0


def test_auto_cast_warns_that_the_scaler_does_not_apply_it():
    with pytest.warns(UserWarning, match="fp16.auto_cast=true is not applied by the scaler"):
        ScalerConfig.from_deepspeed({"fp16": {"enabled": True, "auto_cast": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ScalerConfig.from_deepspeed({"fp16": {"enabled": True, "auto_cast": False}})


def test_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match="config must be a DeepSpeed config dict"):
        ScalerConfig.from_deepspeed(["fp16"])
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{fp16")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ScalerConfig.from_deepspeed(bad_json)
    with pytest.raises(FileNotFoundError):
        ScalerConfig.from_deepspeed(tmp_path / "missing.json")


def test_scaler_config_is_frozen_keyword_only_and_validates_everything():
    config = ScalerConfig(policy="megatron", hysteresis=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hysteresis = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScalerConfig(True)  # type: ignore[misc]
    with pytest.raises(ValueError) as info:
        ScalerConfig(init_scale=0.0, growth_interval=0, policy="torch", hysteresis=2)
    message = str(info.value)
    for part in (
        "init_scale must be a finite number in [1.1754943508222875e-38, 3.4028234663852886e+38]"
        " (float32's normal range), got: 0.0",
        "growth_interval must be an integer in [1, 2147483647], got: 0",
    ):
        assert part in message
    with pytest.raises(ValueError, match="hysteresis must be 1 for policy='torch'"):
        ScalerConfig(policy="torch", hysteresis=2)
    with pytest.raises(ValueError, match=r"init_scale must be in \[min_scale, max_scale\]"):
        ScalerConfig(init_scale=1.0, min_scale=2.0)


def test_from_config_builds_the_scaler():
    config = ScalerConfig.from_deepspeed({"fp16": {"enabled": True, "hysteresis": 3}})
    scaler = GradScaler.from_config(config, "cpu")
    assert (scaler.cur_hysteresis, scaler.cur_iter, scaler.last_overflow_iter) == (3, 0, -1)
    assert scaler.get_min_scale() == 1.0 and "policy='deepspeed'" in repr(scaler)
    with pytest.raises(TypeError, match="both in config and as keyword arguments"):
        GradScaler.from_config(config, "cpu", hysteresis=2)
    with pytest.raises(TypeError, match="config must be a ScalerConfig"):
        GradScaler.from_config({"fp16": {}}, "cpu")  # type: ignore[arg-type]


def test_from_deepspeed_scaler_follows_deepspeeds_scaler_built_from_the_same_config():
    """The DeepSpeed engine builds DynamicLossScaler(**fp16_config.dynamic_loss_scale_args())."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    section = {"enabled": True, "initial_scale_power": 5, "loss_scale_window": 3, "hysteresis": 2}
    ds = CreateLossScaler(
        torch.half, 0, True, DeepSpeedFP16Config(**section).dynamic_loss_scale_args()
    )
    ours = GradScaler.from_config(ScalerConfig.from_deepspeed({"fp16": section}), "cpu")
    overflows = (torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.3).tolist()
    raised = False
    for overflow in overflows:
        try:
            ds.update_scale(overflow)
        except Exception:
            raised = True
            with pytest.raises(Exception, match="already at minimum"):
                ours.update_scale(overflow)
            break
        ours.update_scale(overflow)
        assert (ours.cur_scale, ours.cur_hysteresis, ours.cur_iter, ours.last_overflow_iter) == (
            ds.cur_scale,
            ds.cur_hysteresis,
            ds.cur_iter,
            ds.last_overflow_iter,
        )
    assert raised  # min_loss_scale=1 and 2**5: 200 steps at 30% overflows reach the floor


# ----------------------------------------------------------------- random input against the kernels

_BAD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-45, 1e-39, 3.5e38, 1e40, 2**31, 2**63, 2**70, "2", "torch"]),
)


def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values three times out of four (boundaries included), anything else otherwise."""
    return st.one_of(valid, valid, valid, _BAD)


_SCALE = st.one_of(
    st.floats(1e-30, 1e30), st.sampled_from([1.1754943508222875e-38, 3.4028234663852886e38])
)
_SETTINGS = {
    "init_scale": _mostly(_SCALE),
    "growth_factor": _mostly(st.floats(1.0001, 1e6)),
    "backoff_factor": _mostly(st.floats(1e-6, 0.9999)),
    "growth_interval": _mostly(st.integers(1, 4) | st.just(2**31 - 1)),
    "min_scale": st.one_of(st.none(), st.none(), st.none(), _SCALE, _BAD),
    "max_scale": st.one_of(st.none(), st.none(), st.none(), _SCALE, _BAD),
    "hysteresis": st.one_of(st.just(1), st.just(1), st.integers(1, 3), _BAD),
    "policy": _mostly(st.sampled_from(["torch", "deepspeed", "megatron", "static"])),
}
_STATE = {
    "scale": _mostly(_SCALE),
    "_growth_tracker": _mostly(st.integers(0, 3) | st.just(2**31 - 1)),
    "growth_interval": _SETTINGS["growth_interval"],
    "growth_factor": _SETTINGS["growth_factor"],
    "min_scale": _SETTINGS["min_scale"],
    "max_scale": _SETTINGS["max_scale"],
    "num_updates": _mostly(st.integers(0, 2**40)),
}


def _train_two_steps(scaler: GradScaler) -> None:
    """A fused clip + step + update, clean then overflowing: every kernel the settings reach."""
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler.materialize("cpu")
    for fault in (False, True):
        for p in params:
            p.grad = torch.randn(8)
        if fault:
            params[1].grad[2] = float("inf")
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert scaler.step_was_skipped


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional=_SETTINGS))
def test_whatever_the_constructor_accepts_a_step_runs(kwargs):
    """Random settings: either a ValueError/TypeError that names a setting, raised up front, or a
    scaler whose steps run (the first step used to fail with "value cannot be converted to type
    float without overflow" or "Overflow when unpacking long long" for values it had accepted)."""
    try:
        scaler = GradScaler("cpu", **kwargs)
    except (ValueError, TypeError) as e:
        event("refused")
        assert any(name in str(e) for name in (*_SETTINGS, "hysteresis")), str(e)
        return
    event("accepted")
    _train_two_steps(scaler)
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional=_STATE))
def test_whatever_load_state_dict_accepts_a_step_runs(changes):
    """Random state values: a ValueError (never a bare OverflowError) that leaves the scaler as it
    was, or a loaded state whose steps run."""
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
    good = {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4}
    state = {**good, "_growth_tracker": 0, **changes}
    before = scaler.state_dict()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler.load_state_dict(state)
    except ValueError:
        event("refused")
        assert scaler.state_dict() == before
        return
    event("accepted")
    _train_two_steps(scaler)
