"""Argument checks shared by the scaler and its configs.

Every check names the argument, the value and the valid range, and raises before anything is mutated.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = [
    "check_bool",
    "check_factor",
    "check_int",
    "check_positive_finite",
    "is_real",
]


def is_real(value: object) -> bool:
    """A real number that is not a bool (True is an int to Python, not a value to us)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_positive_finite(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite real number > 0, else raise ValueError."""
    if not is_real(value) or not math.isfinite(float(value)) or float(value) <= 0.0:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number > 0, got: {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_factor(name: str, value: object, *, low: float, high: float | None) -> float:
    """Check an open-interval factor: ``low < value < high`` (``high=None`` means ``value > low``)."""
    ok = is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = v > low and (high is None or v < high)
    if not ok:
        valid = f"in ({low}, {high})" if high is not None else f"a finite number > {low}"
        raise ValueError(f"{name} must be {valid}, got: {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Check that ``value`` is an integer (not a bool) >= ``minimum``."""
    if not isinstance(value, Integral) or isinstance(value, bool) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got: {value!r}")
    return int(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got: {value!r}")
    return value
