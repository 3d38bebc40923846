"""The ``scaler=`` argument every integration takes, resolved the same way."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._scaler import GradScaler
from ..config import ScalerConfig

__all__ = ["ConfigFileNotFoundError", "scaler_from_argument"]


class ConfigFileNotFoundError(FileNotFoundError, ValueError):
    """A ``scaler`` path that is not a file: the ``ValueError`` the integrations document for a
    bad ``scaler``, and the ``FileNotFoundError`` ``ScalerConfig.from_deepspeed`` raises for it
    (as ``io.UnsupportedOperation`` is both an ``OSError`` and a ``ValueError``)."""


def scaler_from_argument(scaler: Any, device_type: str, owner: str) -> GradScaler | None:
    """A ``GradScaler`` from an integration's ``scaler`` argument, or None for None.

    Args:
        scaler: a ``distscaler.GradScaler`` (its ``device_type`` must be ``device_type``), a
            ``distscaler.ScalerConfig``, a DeepSpeed config (a dict, its ``"fp16"`` section, or a
            JSON path; DeepSpeed's semantics,
            [`ScalerConfig.from_deepspeed()`][distscaler.config.ScalerConfig.from_deepspeed]), or
            None.
        device_type: the integration's device type.
        owner: what sets the device type, for the error message ("the accelerator's").

    Raises:
        ValueError: a GradScaler on another device type; a DeepSpeed config that does not parse;
            a path that is not a file (`ConfigFileNotFoundError`, a ``FileNotFoundError`` too).
        TypeError: anything else.
    """
    if isinstance(scaler, GradScaler):
        if scaler.device_type != device_type:
            raise ValueError(
                f"scaler's device type must be {owner} ({device_type!r}), got: "
                f"{scaler.device_type!r}"
            )
        return scaler
    if isinstance(scaler, (str, os.PathLike)) and not os.path.isfile(scaler):
        raise ConfigFileNotFoundError(
            "scaler must be a path to a DeepSpeed config JSON file when it is a path, got: "
            f"{os.fspath(scaler)!r} (no such file)"
        )
    if isinstance(scaler, (Mapping, str, os.PathLike)):
        scaler = ScalerConfig.from_deepspeed(scaler)  # DeepSpeed's fp16 section semantics
    if isinstance(scaler, ScalerConfig):
        return GradScaler.from_config(scaler, device_type)
    if scaler is not None:
        raise TypeError(
            "scaler must be None, a distscaler.GradScaler, a distscaler.ScalerConfig or a "
            "DeepSpeed config (dict or JSON path), got: "
            f"{type(scaler).__module__}.{type(scaler).__qualname__}"
        )
    return None
