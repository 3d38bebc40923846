"""Other stacks' loss-scaler formats: DeepSpeed's ``fp16`` config section and saved scaler states.

Nothing here imports DeepSpeed or Megatron; the formats are recognised by their keys or attributes.
Which policy continues another stack's scaler is the policy's to say (``same_rule_as``,
[`distscaler.policies.policy_for()`][distscaler.policies.policy_for]); this module holds only the
formats.

Configs: [`read_deepspeed_config()`][distscaler.interop.read_deepspeed_config] reads DeepSpeed's
``fp16`` (and ``bf16``) sections with DeepSpeed's key names, defaults and meaning
(``deepspeed/runtime/precision_config.py``, ``deepspeed/runtime/fp16/loss_scaler.py``) into
``ScalerConfig`` settings.

Checkpoints ([`to_native_state()`][distscaler.interop.to_native_state], read into
``GradScaler.load_state_dict``'s layout):

* ``torch.amp.GradScaler.state_dict()`` and distscaler's own: passed through unchanged.
* Megatron-LM ``DynamicGradScaler.state_dict()``: ``{scale, growth_tracker, hysteresis_tracker}``,
  ``scale`` a 1-element tensor (``megatron/core/optimizer/grad_scaler.py``).
* DeepSpeed's fp16 optimizer (ZeRO stage 0, ``deepspeed/runtime/fp16/fused_optimizer.py``
  ``state_dict``): ``cur_scale``, ``cur_iter``, ``dynamic_loss_scale`` and, when dynamic,
  ``last_overflow_iter``, ``scale_factor``, ``scale_window`` (other keys, the optimizer's, ignored).
  That optimizer has no hysteresis: the scaler's own ``hysteresis`` applies, refilled.
* DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` object, which ZeRO stage 1-3 checkpoints pickle
  whole under ``"loss_scaler"`` (``deepspeed/runtime/fp16/loss_scaler.py``): the object itself or
  the ZeRO optimizer state dict that holds it. Unpickling it needs deepspeed; reading it does not.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import _validation as V
from .policies import get_policy, policy_for

__all__ = ["DEEPSPEED_FP16_DEFAULTS", "detect_format", "read_deepspeed_config", "to_native_state"]

#: DeepSpeed's ``fp16`` section keys and defaults (``deepspeed/runtime/constants.py``).
DEEPSPEED_FP16_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "auto_cast": False,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
    "fp16_master_weights_and_grads": False,
}
# The bf16 keys the scaler uses; DeepSpeed's others configure its optimizer and are ignored.
_BF16_KEYS = ("enabled", "check_grad_overflow")
_BF16_SECTIONS = ("bf16", "bfloat16")  # "bfloat16": DeepSpeed's older name
# DeepSpeed caps nothing; 2**p must be a normal float32 for our scale.
_SCALE_POWER_RANGE = (-126, 127)
# The other stacks' scaler classes, by their rule (``LossScalePolicy.same_rule_as``).
_DEEPSPEED_DYNAMIC = "deepspeed.DynamicLossScaler"
_DEEPSPEED_STATIC = (
    "deepspeed.LossScaler"  # also DeepSpeed's bf16 and fp32 (no scaler): a fixed scale
)
_MEGATRON = "megatron.core.optimizer.DynamicGradScaler"


def read_deepspeed_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """``ScalerConfig`` keyword arguments for a DeepSpeed config (see ``ScalerConfig.from_deepspeed``).

    Raises:
        ValueError: unknown keys, invalid or ``"auto"`` values, fp16 and bf16 both enabled (all
            problems in one error).
        TypeError: ``config`` is neither a mapping nor a path.
        FileNotFoundError: the path does not exist.
    """
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(config, Mapping):
            raise ValueError(
                f"DeepSpeed config {str(path)!r} must hold a JSON object, "
                f"got: {type(config).__name__}"
            )
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a DeepSpeed config dict, its 'fp16' section, or a path to a JSON "
            f"file, got: {type(config).__name__}"
        )
    whole = any(k in config for k in ("fp16", *_BF16_SECTIONS)) or not any(
        k in DEEPSPEED_FP16_DEFAULTS for k in config
    )
    problems: list[str] = []
    if whole:
        fp16 = _section(config, "fp16", problems)
        bf16 = {}
        for name in _BF16_SECTIONS:
            if name in config:
                bf16 = _section(config, name, problems)
                bf16 = {k: v for k, v in bf16.items() if k in _BF16_KEYS}
                prefix = name
                break
        else:
            prefix = "bf16"
    else:
        fp16, bf16, prefix = dict(config), {}, "bf16"

    fp16_values = _read_fp16(fp16, problems)
    bf16_enabled = _read(bf16, "enabled", False, _bool, f"{prefix}.enabled", problems)
    check_overflow = _read(
        bf16, "check_grad_overflow", True, _bool, f"{prefix}.check_grad_overflow", problems
    )
    if fp16_values.get("enabled") and bf16_enabled:
        problems.append(
            f"fp16.enabled and {prefix}.enabled are both true (DeepSpeed rejects this too)"
        )
    if problems:
        raise ValueError("invalid DeepSpeed config:\n- " + "\n- ".join(problems))

    if fp16_values.get("auto_cast"):
        warnings.warn(
            "fp16.auto_cast=true is not applied by the scaler: run the forward pass under "
            "torch.autocast(device_type, dtype=torch.float16)",
            stacklevel=2,
        )
    if fp16_values.get("fp16_master_weights_and_grads"):
        warnings.warn(
            "fp16.fp16_master_weights_and_grads=true configures DeepSpeed's optimizer and is "
            "not applied by the scaler",
            stacklevel=2,
        )
    static = policy_for(_DEEPSPEED_STATIC)
    if not fp16_values["enabled"]:
        return {"policy": static, "init_scale": 1.0, "skip_nonfinite": bool(check_overflow)}
    if fp16_values["loss_scale"] > 0:
        return {"policy": static, "init_scale": float(fp16_values["loss_scale"])}
    return {
        "policy": policy_for(_DEEPSPEED_DYNAMIC),
        "init_scale": 2.0 ** fp16_values["initial_scale_power"],
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": fp16_values["loss_scale_window"],
        "hysteresis": fp16_values["hysteresis"],
        "consecutive_hysteresis": fp16_values["consecutive_hysteresis"],
        "min_scale": float(fp16_values["min_loss_scale"]),
        "raise_error_at_min_scale": True,
    }


# ---------------------------------------------------------------------- DeepSpeed config keys


def _section(config: Mapping[str, Any], name: str, problems: list[str]) -> dict[str, Any]:
    section = config.get(name, {})
    if not isinstance(section, Mapping):
        problems.append(f"{name} must be a JSON object, got: {section!r}")
        return {}
    return dict(section)


def _bool(name: str, value: object) -> bool:
    return V.check_bool(name, value)


def _integral(name: str, value: object, minimum: int, maximum: int = V.INT64_MAX) -> int:
    # DeepSpeed's pydantic ints take 1000 and 1000.0, not 1000.5 nor True.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return V.check_int(name, value, minimum=minimum, maximum=maximum)


def _read(
    section: Mapping[str, Any],
    key: str,
    default: Any,
    fn: Any,
    name: str,
    problems: list[str],
    **kwargs: Any,
) -> Any:
    value = section.get(key, default)
    if isinstance(value, str) and value == "auto":
        problems.append(
            f"{name} is 'auto': Accelerate and the HF Trainer replace 'auto' values when they "
            f"build the DeepSpeed engine; give a number (or pass the config they filled in)"
        )
        return default
    try:
        return fn(name, value, **kwargs)
    except (TypeError, ValueError) as e:
        problems.append(str(e))
        return default


def _loss_scale(name: str, value: object) -> float:
    ok = V.is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if not ok or not (float(value) == 0 or V.FLOAT32_TINY <= float(value) <= V.FLOAT32_MAX):  # type: ignore[arg-type]
        raise ValueError(
            f"{name} must be 0 (dynamic loss scaling) or a static scale in [{V.FLOAT32_TINY}, "
            f"{V.FLOAT32_MAX}], got: {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def _read_fp16(fp16: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    unknown = sorted(set(fp16) - set(DEEPSPEED_FP16_DEFAULTS))
    if unknown:
        problems.append(
            f"unknown fp16 key(s) {unknown}; DeepSpeed's are {sorted(DEEPSPEED_FP16_DEFAULTS)}"
        )
    d = DEEPSPEED_FP16_DEFAULTS
    out: dict[str, Any] = {}
    for key in ("enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"):
        out[key] = _read(fp16, key, d[key], _bool, f"fp16.{key}", problems)
    out["loss_scale"] = _read(
        fp16, "loss_scale", d["loss_scale"], _loss_scale, "fp16.loss_scale", problems
    )
    low, high = _SCALE_POWER_RANGE
    out["initial_scale_power"] = _read(
        fp16, "initial_scale_power", d["initial_scale_power"], _integral,
        "fp16.initial_scale_power", problems, minimum=low, maximum=high,
    )  # fmt: skip
    # As DeepSpeed: these only matter (and are checked) for a dynamic scale.
    dynamic = out["enabled"] and out["loss_scale"] == 0
    if dynamic:
        out["hysteresis"] = _read(
            fp16, "hysteresis", d["hysteresis"], _integral, "fp16.hysteresis", problems, minimum=1
        )
        out["loss_scale_window"] = _read(
            fp16, "loss_scale_window", d["loss_scale_window"], _integral,
            "fp16.loss_scale_window", problems, minimum=1, maximum=V.INT32_MAX,
        )  # fmt: skip
        out["min_loss_scale"] = _read(
            fp16, "min_loss_scale", d["min_loss_scale"], V.check_scale,
            "fp16.min_loss_scale", problems,
        )  # fmt: skip
        if not problems and 2.0 ** out["initial_scale_power"] < out["min_loss_scale"]:
            problems.append(
                f"fp16.initial_scale_power={out['initial_scale_power']} starts the scale at "
                f"{2.0 ** out['initial_scale_power']}, below fp16.min_loss_scale="
                f"{out['min_loss_scale']}"
            )
    return out


# ---------------------------------------------------------------------- saved scaler states

_ZERO_KEY = "loss_scaler"  # deepspeed.checkpoint.constants.LOSS_SCALER


def _is_deepspeed_scaler(obj: object) -> bool:
    return not isinstance(obj, Mapping) and hasattr(obj, "cur_scale") and hasattr(obj, "dynamic")


def detect_format(state: object) -> str:
    """``"native"`` (torch/distscaler), ``"megatron"``, ``"deepspeed_fp16"`` or ``"deepspeed_object"``.

    Anything unrecognised is ``"native"``: its validation then names the missing keys.
    """
    if _is_deepspeed_scaler(state):
        return "deepspeed_object"
    if not isinstance(state, Mapping):
        return "native"
    if _is_deepspeed_scaler(state.get(_ZERO_KEY)):
        return "deepspeed_object"
    if "cur_scale" in state:
        return "deepspeed_fp16"
    if "scale" in state and "growth_tracker" in state and "_growth_tracker" not in state:
        return "megatron"
    return "native"


def _from_deepspeed(
    cur_scale: Any,
    dynamic: bool,
    cur_iter: Any,
    last_overflow_iter: Any,
    scale_factor: Any,
    scale_window: Any,
    current: Mapping[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = {"scale": cur_scale, "cur_iter": cur_iter}
    if not dynamic:
        out.update(
            {k: current[k] for k in ("growth_factor", "backoff_factor", "growth_interval")},
            _growth_tracker=0,
        )
        return out
    window = scale_window
    out.update(
        growth_factor=scale_factor,
        backoff_factor=1.0 / scale_factor if isinstance(scale_factor, (int, float)) else None,
        growth_interval=window,
        last_overflow_iter=last_overflow_iter,
    )
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (cur_iter, window))
    tracker = None
    if ints and isinstance(last_overflow_iter, int) and window >= 1:
        # The clean steps since the last overflow or growth, as the policy counts them.
        counters = {"cur_iter": cur_iter, "last_overflow_iter": last_overflow_iter}
        tracker = get_policy(policy_for(_DEEPSPEED_DYNAMIC)).growth_tracker_from(counters, window)
    # None: the invalid values above are reported by the validation.
    out["_growth_tracker"] = 0 if tracker is None else tracker
    return out


def to_native_state(state: object, current: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Convert ``state`` to distscaler's ``state_dict`` layout; return (format, converted state).

    ``current`` holds this scaler's ``growth_factor``, ``backoff_factor`` and ``growth_interval``,
    used where the saved format does not carry them (Megatron's). The result may also hold
    ``policy`` (the policy whose rule saved the state,
    [`policy_for()`][distscaler.policies.policy_for]), the counters the format saves under their own
    names (DeepSpeed's ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``; Megatron's
    ``hysteresis_tracker``), and DeepSpeed's ``hysteresis``, ``consecutive_hysteresis`` and
    ``min_scale``. Values are not validated here.
    """
    fmt = detect_format(state)
    if fmt == "native":
        return fmt, state  # type: ignore[return-value]
    if fmt == "megatron":
        assert isinstance(state, Mapping)
        out = {k: current[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
        out.update(
            scale=state["scale"],
            _growth_tracker=state["growth_tracker"],
            policy=policy_for(_MEGATRON),
        )
        if "hysteresis_tracker" in state:
            out["hysteresis_tracker"] = state["hysteresis_tracker"]
        return fmt, out
    if fmt == "deepspeed_fp16":
        assert isinstance(state, Mapping)
        dynamic = bool(state.get("dynamic_loss_scale", "scale_window" in state))
        out = _from_deepspeed(
            state["cur_scale"],
            dynamic,
            state.get("cur_iter", 0),
            state.get("last_overflow_iter", -1),
            state.get("scale_factor", 2.0),
            state.get("scale_window", current["growth_interval"]),
            current,
        )
        out["policy"] = policy_for(_DEEPSPEED_DYNAMIC if dynamic else _DEEPSPEED_STATIC)
        return fmt, out
    obj: Any = state if _is_deepspeed_scaler(state) else state[_ZERO_KEY]  # type: ignore[index]
    dynamic = bool(getattr(obj, "dynamic", False))
    out = _from_deepspeed(
        obj.cur_scale,
        dynamic,
        getattr(obj, "cur_iter", 0),
        getattr(obj, "last_overflow_iter", -1),
        getattr(obj, "scale_factor", 2.0),
        getattr(obj, "scale_window", current["growth_interval"]),
        current,
    )
    out["policy"] = policy_for(_DEEPSPEED_DYNAMIC if dynamic else _DEEPSPEED_STATIC)
    if dynamic:
        out.update(
            hysteresis=getattr(obj, "delayed_shift", 1),
            consecutive_hysteresis=getattr(obj, "consecutive_hysteresis", False),
            cur_hysteresis=getattr(obj, "cur_hysteresis", getattr(obj, "delayed_shift", 1)),
            min_scale=getattr(obj, "min_scale", None),
        )
    return fmt, out
