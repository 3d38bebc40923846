"""The entry points' checks of their arguments: each bad argument named, with the value and the
valid range, before anything is launched; and ``norm_type`` as the kernels' ``NORM``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .tables import DTYPE_KIND, KEY_ROW_WORDS

__all__ = [
    "NORM_MODE",
    "check_float32",
    "check_keys",
    "check_norm_type",
    "check_pass",
    "check_primes",
    "check_tensors",
    "check_weights",
    "stat_dtype",
]

#: norm_type -> the kernels' NORM: 0 none, 1 sum |x|, 2 sum x**2, 3 max |x|.
NORM_MODE = {1.0: 1, 2.0: 2, math.inf: 3}


def stat_dtype(mode: int) -> torch.dtype:
    """The dtype of the pass's ``stat``: float64 where it holds a sum (p = 1, 2: no sum of float32
    gradients overflows it), else float32 (a flag, a largest magnitude)."""
    return torch.float64 if mode in (1, 2) else torch.float32
_PRIME_LIMIT = 1 << 24


def check_tensors(tensors: Sequence[torch.Tensor], name: str = "tensors") -> torch.device | None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of tensors, got: {type(tensors).__name__}")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got: {type(t).__name__}")
        if t.dtype not in DTYPE_KIND and t.dtype != torch.float64:
            raise TypeError(
                f"{name}[{i}] must be float32, float16, bfloat16 or float64, got: {t.dtype}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"{name} must all be on one device, got: {device} ({name}[0]) and {t.device} "
                f"({name}[{i}])"
            )
    return device


def check_norm_type(norm_type: float | None) -> int:
    if norm_type is None:
        return 0
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a float or None, got: {norm_type!r}")
    mode = NORM_MODE.get(float(norm_type))
    if mode is None:
        raise ValueError(
            f"norm_type must be 1.0, 2.0, inf or None for the Triton pass (other p: torch's "
            f"kernels), got: {norm_type!r}"
        )
    return mode


def check_float32(*named: tuple[str, Any], device: torch.device | None = None) -> None:
    """Each ``(name, value)`` a float32 tensor (or None: skipped) on ``device`` (default: the
    first one's)."""
    for name, value in named:
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor, got: {value!r}")
        device = value.device if device is None else device
        if value.device != device:
            raise ValueError(f"{name} must be on {device}, got: {value.device}")


def check_primes(primes: Sequence[int] | None) -> tuple[int, int] | None:
    if primes is None:
        return None
    if len(primes) != 2 or any(isinstance(p, bool) or not isinstance(p, int) for p in primes):
        raise ValueError(f"primes must be two ints (P1, P2), got: {primes!r}")
    if any(not (2 < p < _PRIME_LIMIT) or p % 2 == 0 for p in primes):
        raise ValueError(f"primes must be odd and in (2, 2**24), got: {tuple(primes)!r}")
    return int(primes[0]), int(primes[1])


def check_keys(keys: torch.Tensor | None, n: int, device: torch.device) -> None:
    """``keys``: None, or the int32 table of the keyed weights for ``n`` tensors on ``device``
    (at least the columns and one first row per tensor; its values are not read here)."""
    if keys is None:
        return
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int32 or keys.dim() != 1:
        raise ValueError(f"keys must be a 1-dim int32 tensor, got: {keys!r}")
    if keys.numel() < 2 * KEY_ROW_WORDS + n:
        raise ValueError(
            f"keys must hold at least {2 * KEY_ROW_WORDS + n} values (the columns and a first "
            f"row per tensor), got: {keys.numel()}"
        )
    if keys.device != device:
        raise ValueError(f"keys must be on the tensors' device {device}, got: {keys.device}")


def check_weights(weights: Sequence[float] | None, n: int) -> tuple[float, ...] | None:
    if weights is None:
        return None
    values = tuple(float(w) for w in weights)
    if len(values) != n:
        raise ValueError(f"weights must have one float per tensor ({n}), got: {len(values)}")
    if not all(math.isfinite(w) and w >= 0 for w in values):
        raise ValueError(f"weights must be finite and >= 0, got: {values!r}")
    return values


def check_pass(
    tensors: Sequence[torch.Tensor],
    norm_type: float | None,
    primes: Sequence[int] | None,
    weights: Sequence[float] | None,
    device: torch.device | str | None,
) -> tuple[torch.device, int, tuple[int, int] | None, tuple[float, ...] | None]:
    """`grad_pass()`'s checks of its arguments: the device, the norm's mode, the primes and the
    weights, as the pass takes them."""
    dev = check_tensors(tensors)
    mode = check_norm_type(norm_type)
    ps = check_primes(primes)
    ws = check_weights(weights, len(tensors))
    if dev is None:
        dev = torch.device("cpu" if device is None else device)
    return dev, mode, ps, ws
