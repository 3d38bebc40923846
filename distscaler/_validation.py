"""Argument checks shared by ``ScalerConfig``, the scaler's setters and ``load_state_dict``.

Every check names the argument, the value and the valid range, and raises before anything is
mutated. The ranges are what the device state can hold: the scale is a float32 tensor, the growth
tracker an int32 tensor (``torch._amp_update_scale_``), policy counters int64 tensors.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT32_MAX",
    "INT64_MAX",
    "check_bool",
    "check_factor",
    "check_clip",
    "check_int",
    "check_scale",
    "is_real",
]

#: Largest finite float32: a larger scale becomes inf on the device.
FLOAT32_MAX = 3.4028234663852886e38
#: Smallest normal float32: a smaller scale loses precision, or becomes 0, on the device.
FLOAT32_TINY = 1.1754943508222875e-38
#: The growth tracker is an int32 tensor (``torch._amp_update_scale_``).
INT32_MAX = 2**31 - 1
#: Policy counters are int64 tensors.
INT64_MAX = 2**63 - 1


def is_real(value: object) -> bool:
    """A real number that is not a bool (True is an int to Python, not a value to us)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_scale(name: str, value: object) -> float:
    """A loss scale or bound: a finite number in float32's normal range, returned as a float."""
    ok = is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if ok:
        ok = FLOAT32_TINY <= float(value) <= FLOAT32_MAX  # type: ignore[arg-type]
    if not ok:
        raise ValueError(
            f"{name} must be a finite number in [{FLOAT32_TINY}, {FLOAT32_MAX}] "
            f"(float32's normal range), got: {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_factor(
    name: str, value: object, *, low: float, high: float | None, low_inclusive: bool = False
) -> float:
    """Check a factor: ``low < value < high`` (``low <= value`` with ``low_inclusive``;
    ``high=None`` means no upper bound)."""
    ok = is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v >= low if low_inclusive else v > low) and (high is None or v < high)
    if not ok:
        bracket = "[" if low_inclusive else "("
        valid = f"in {bracket}{low}, {high})" if high is not None else f"a finite number > {low}"
        raise ValueError(f"{name} must be {valid}, got: {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_int(name: str, value: object, *, minimum: int, maximum: int = INT64_MAX) -> int:
    """Check that ``value`` is an integer (not a bool) in ``[minimum, maximum]``."""
    ok = isinstance(value, Integral) and not isinstance(value, bool)
    if not ok or not minimum <= int(value) <= maximum:  # type: ignore[call-overload]
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got: {value!r}")
    return int(value)  # type: ignore[call-overload]


def check_bool(name: str, value: object) -> bool:
    """Check that ``value`` is a bool (1 and 0 are refused: a typo, not a choice)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got: {value!r}")
    return value


def check_clip(max_norm: object, norm_type: object) -> tuple[float, float]:
    """``clip_grad_norm_``'s arguments as floats: ``max_norm`` > 0 or inf (torch's "measure only":
    the coefficient clamps to 1), ``norm_type`` > 0 or inf. A ``max_norm`` past float32's largest
    value is taken as inf, as torch's ``clip_grad_norm_`` takes it (its float32 coefficient rounds
    to inf and clamps to 1: it clips nothing); docs/pass-semantics.md."""
    if not is_real(max_norm) or not float(max_norm) > 0:  # type: ignore[arg-type]
        raise ValueError(f"max_norm must be a number > 0 or math.inf, got: {max_norm!r}")
    if not is_real(norm_type) or not float(norm_type) > 0:  # type: ignore[arg-type]
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got: {norm_type!r}")
    clip = float(max_norm)  # type: ignore[arg-type]
    if clip > FLOAT32_MAX:
        clip = math.inf
    return clip, float(norm_type)  # type: ignore[arg-type]
