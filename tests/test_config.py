"""ScalerConfig and ScalerConfig.from_deepspeed, checked against DeepSpeed's own config classes."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_float16_config

from distscaler import GradScaler, ScalerConfig
from distscaler.interop import DEEPSPEED_FP16_DEFAULTS

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
