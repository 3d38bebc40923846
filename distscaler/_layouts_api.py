"""``GradScaler``'s registration of gradient layouts: what neither a gradient nor a wrapper tells.

:meth:`LayoutRegistrationAPI.register_model` and :meth:`LayoutRegistrationAPI.register_params` teach
the scaler's verdict group how gradients lie across the ranks, for :meth:`GradScaler.clip_grad_norm_`'s
norm (the layouts and their weights are :mod:`distscaler.layouts`'), and the overflow report the
parameters' names (:mod:`distscaler.attribution`). Nothing here runs at a step. The mixin reads the
scaler through the attributes of the face it declares (``_verdict``, ``_overflows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .layouts import GRAD_LAYOUTS, GradLayout

if TYPE_CHECKING:
    from .attribution import OverflowTracker
    from .verdict import VerdictGroup

__all__ = ["LayoutRegistrationAPI", "check_grad_layout"]

_Scaler = TypeVar("_Scaler", bound="LayoutRegistrationAPI")


def check_grad_layout(grad_layout: object) -> None:
    """Raise ``ValueError`` unless ``grad_layout`` is one of :data:`~distscaler.layouts.GRAD_LAYOUTS`
    or None."""
    if grad_layout is not None and grad_layout not in GRAD_LAYOUTS:
        raise ValueError(f"grad_layout must be one of {GRAD_LAYOUTS} or None, got: {grad_layout!r}")


class LayoutRegistrationAPI:
    """The layouts' registration on :class:`~distscaler.GradScaler` (a mixin)."""

    _verdict: VerdictGroup
    _overflows: OverflowTracker

    def register_model(
        self: _Scaler, model: torch.nn.Module, *, grad_layout: GradLayout | None = None
    ) -> _Scaler:
        """Learn how ``model``'s gradients are laid out across the ranks, for :meth:`clip_grad_norm_`.

        Call once after wrapping, on every rank (no collective, no host read), for DDP, FSDP1 and
        plain modules such as a pipeline stage (``grad_layout`` for parameters no DDP/FSDP1 wrapper
        covers). DTensor gradients need nothing. A later call wins (:mod:`distscaler.layouts`).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``grad_layout`` is not one of the layouts.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got: {type(model).__name__}")
        check_grad_layout(grad_layout)
        self._verdict.layouts.register_model(model, grad_layout)
        self._overflows.register_model(model)
        return self

    def register_params(
        self: _Scaler, params: Sequence[torch.Tensor], *, replicas: float
    ) -> _Scaler:
        """Declare that each gradient of ``params`` is held identically by ``replicas`` ranks.

        For gradients whose layout neither the tensor nor a DDP/FSDP wrapper tells (an engine's
        main parameters, :mod:`distscaler.integrations.megatron`): in :meth:`clip_grad_norm_`'s
        norm each rank's ``sum |g|**2`` of them is weighted ``1 / replicas``, so that one SUM over
        ``process_group`` counts each value once. ``replicas=math.inf`` leaves them out of the norm
        (a copy that another rank counts, such as Megatron's tensor-parallel duplicates); the
        overflow flag still sees every gradient. Call on every rank (no collective, no host read);
        a later call wins.

        Raises:
            TypeError: ``params`` holds something other than tensors.
            ValueError: ``replicas`` is not a number in ``[1, inf]``.
        """
        params = list(params)
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"params must be tensors, got: {', '.join(sorted(set(bad)))}")
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, (int, float))
            or not replicas >= 1
        ):
            raise ValueError(f"replicas must be a number in [1, inf], got: {replicas!r}")
        self._verdict.layouts.register_params(params, float(replicas), f"replicas={replicas}")
        return self
