"""``ScalerConfig``: every setting of a ``GradScaler`` in one validated, frozen value.

``ScalerConfig.from_deepspeed`` reads DeepSpeed's ``fp16`` (and ``bf16``) config sections with
DeepSpeed's key names, defaults and meaning (``deepspeed/runtime/precision_config.py``,
``deepspeed/runtime/fp16/loss_scaler.py``); ``GradScaler.from_config`` builds the scaler.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from . import _validation as V
from .policies import POLICIES, PolicyName, make_policy

__all__ = ["DEEPSPEED_FP16_DEFAULTS", "ScalerConfig"]

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalerConfig:
    """Settings of a :class:`distscaler.GradScaler`; see its docstring for each one's meaning.

    Every field is checked in ``__post_init__``; all problems are reported in one ``ValueError``.
    """

    enabled: bool = True
    """False: the scaler is a no-op (no collective, no host read)."""
    init_scale: float = 2.0**16
    """Initial loss scale, finite and > 0 (the fixed scale for ``policy="static"``)."""
    growth_factor: float = 2.0
    """Factor (> 1) applied to the scale when it grows."""
    backoff_factor: float = 0.5
    """Factor in (0, 1) applied to the scale when it backs off."""
    growth_interval: int = 2000
    """Clean steps, in optimizer steps, before the scale grows (DeepSpeed's ``loss_scale_window``)."""
    policy: PolicyName = "torch"
    """The update rule: ``"torch"``, ``"deepspeed"``, ``"megatron"`` or ``"static"``."""
    hysteresis: int = 1
    """Overflows tolerated before a backoff (>= 1; > 1 for ``"deepspeed"``/``"megatron"`` only)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every clean step (``"deepspeed"`` only)."""
    min_scale: float | None = None
    """Floor of the scale, or None."""
    max_scale: float | None = None
    """Ceiling of the scale, or None."""
    raise_error_at_min_scale: bool = False
    """Raise at an overflow with the scale at ``min_scale`` (one host read per update)."""
    skip_nonfinite: bool = True
    """Skip steps with inf/NaN gradients (False only with ``policy="static"``)."""
    skip_log_interval: int = 100
    """Updates between two reads of the skip record for logging (0: only when read anyway)."""

    def __post_init__(self) -> None:
        problems: list[str] = []

        def check(fn: Any, name: str, *args: Any, **kwargs: Any) -> None:
            try:
                fn(name, getattr(self, name), *args, **kwargs)
            except (TypeError, ValueError) as e:
                problems.append(str(e))

        check(V.check_bool, "enabled")
        check(V.check_positive_finite, "init_scale")
        check(V.check_factor, "growth_factor", low=1.0, high=None)
        check(V.check_factor, "backoff_factor", low=0.0, high=1.0)
        check(V.check_int, "growth_interval", minimum=1)
        check(V.check_bool, "raise_error_at_min_scale")
        check(V.check_bool, "skip_nonfinite")
        check(V.check_int, "skip_log_interval", minimum=0)
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                check(V.check_positive_finite, name)
        if self.policy not in POLICIES:
            problems.append(f"policy must be one of {POLICIES}, got: {self.policy!r}")
        else:
            try:
                make_policy(
                    self.policy,
                    hysteresis=self.hysteresis,
                    consecutive_hysteresis=self.consecutive_hysteresis,
                )
            except (TypeError, ValueError) as e:
                problems.append(str(e))
        if not problems:  # the cross-field checks need valid fields
            low = self.min_scale if self.min_scale is not None else 0.0
            high = self.max_scale if self.max_scale is not None else math.inf
            if low > high:
                problems.append(
                    f"min_scale must be <= max_scale, got: min_scale={self.min_scale}, "
                    f"max_scale={self.max_scale}"
                )
            elif not low <= self.init_scale <= high:
                problems.append(
                    f"init_scale must be in [min_scale, max_scale] = [{self.min_scale}, "
                    f"{self.max_scale}], got: {self.init_scale}"
                )
            if self.raise_error_at_min_scale and self.min_scale is None:
                problems.append("raise_error_at_min_scale=True needs min_scale, got: None")
            if not self.skip_nonfinite and self.policy != "static":
                problems.append(
                    f"skip_nonfinite=False needs policy='static', got: policy={self.policy!r}"
                )
        if problems:
            raise ValueError("invalid ScalerConfig:\n- " + "\n- ".join(problems))

    def scaler_kwargs(self) -> dict[str, Any]:
        """The config as keyword arguments of :class:`distscaler.GradScaler` (without ``device``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ScalerConfig:
        """Read a DeepSpeed config: the whole config, its ``"fp16"`` section, or a JSON file path.

        Keys of the ``fp16`` section, with DeepSpeed's defaults: ``enabled`` (False),
        ``loss_scale`` (0: dynamic; > 0: that static scale), ``initial_scale_power`` (16: the
        dynamic scale starts at 2**16), ``loss_scale_window`` (1000), ``hysteresis`` (2),
        ``consecutive_hysteresis`` (False), ``min_loss_scale`` (1); ``auto_cast`` and
        ``fp16_master_weights_and_grads`` are accepted and warn when true (they configure
        DeepSpeed's engine, not a scaler). From a whole config, ``bf16`` (or ``bfloat16``)
        ``enabled`` and ``check_grad_overflow`` (True) are read too.

        The result:

        * fp16 with ``loss_scale == 0``: ``policy="deepspeed"``, ``init_scale =
          2**initial_scale_power``, ``growth_interval = loss_scale_window``, ``hysteresis``,
          ``consecutive_hysteresis``, ``min_scale = min_loss_scale``, factors 2 and 0.5,
          ``raise_error_at_min_scale=True`` (DeepSpeed ZeRO's ``DynamicLossScaler`` default; it
          costs one host read per update: ``dataclasses.replace(config,
          raise_error_at_min_scale=False)`` clamps at the minimum instead, as DeepSpeed's stage-0
          fp16 optimizer does).
        * fp16 with ``loss_scale > 0``: ``policy="static"`` at that scale.
        * fp16 not enabled (bf16 or fp32 training): ``policy="static"`` at 1.0; non-finite steps
          are still agreed on and skipped, unless bf16's ``check_grad_overflow`` is false.

        Which is which: a mapping with an ``"fp16"``, ``"bf16"`` or ``"bfloat16"`` key is a whole
        config; one whose keys include an fp16 key is the section; any other mapping is a whole
        config without fp16 or bf16 (fp32 training).

        Raises:
            ValueError: unknown keys, invalid values, ``"auto"`` values (Accelerate and the HF
                Trainer fill those in: pass the filled config), fp16 and bf16 both enabled; every
                problem in one error naming each key.
            TypeError: ``config`` is not a mapping or a path.
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
        if not fp16_values["enabled"]:
            return cls(policy="static", init_scale=1.0, skip_nonfinite=bool(check_overflow))
        if fp16_values["loss_scale"] > 0:
            return cls(policy="static", init_scale=float(fp16_values["loss_scale"]))
        return cls(
            policy="deepspeed",
            init_scale=2.0 ** fp16_values["initial_scale_power"],
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=fp16_values["loss_scale_window"],
            hysteresis=fp16_values["hysteresis"],
            consecutive_hysteresis=fp16_values["consecutive_hysteresis"],
            min_scale=float(fp16_values["min_loss_scale"]),
            raise_error_at_min_scale=True,
        )


# ---------------------------------------------------------------------- DeepSpeed key readers


def _section(config: Mapping[str, Any], name: str, problems: list[str]) -> dict[str, Any]:
    section = config.get(name, {})
    if not isinstance(section, Mapping):
        problems.append(f"{name} must be a JSON object, got: {section!r}")
        return {}
    return dict(section)


def _bool(name: str, value: object) -> bool:
    return V.check_bool(name, value)


def _integral(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    # DeepSpeed's pydantic ints take 1000 and 1000.0, not 1000.5 nor True.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    number = V.check_int(name, value, minimum=minimum)
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got: {value!r}")
    return number


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
    if not V.is_real(value) or not math.isfinite(float(value)) or float(value) < 0:  # type: ignore[arg-type]
        raise ValueError(
            f"{name} must be a finite number >= 0 (0: dynamic loss scaling), got: {value!r}"
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
            "fp16.loss_scale_window", problems, minimum=1,
        )  # fmt: skip
        out["min_loss_scale"] = _read(
            fp16, "min_loss_scale", d["min_loss_scale"], V.check_positive_finite,
            "fp16.min_loss_scale", problems,
        )  # fmt: skip
        if not problems and 2.0 ** out["initial_scale_power"] < out["min_loss_scale"]:
            problems.append(
                f"fp16.initial_scale_power={out['initial_scale_power']} starts the scale at "
                f"{2.0 ** out['initial_scale_power']}, below fp16.min_loss_scale="
                f"{out['min_loss_scale']}"
            )
    return out
