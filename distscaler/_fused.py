"""The optimizer step on the agreed ``found_inf``, and the hand-off to fused optimizers.

Optimizers with ``_step_supports_amp_scaling`` (``Adam``/``AdamW``/``SGD(fused=True)``, and any
optimizer that follows torch's contract, `distscaler._contract`) read ``optimizer.grad_scale`` and
``optimizer.found_inf`` inside their step: they divide the gradients by ``grad_scale`` and skip (and
undo their step count) when ``found_inf`` is exactly 1.0. The scaler sets both for the duration of
the step only, so no value is read on the host and the gradients are never rewritten (other
optimizers step in the scaler, unless the agreed flag, read once on the host, says overflow).
Source: ``torch/amp/grad_scaler.py`` (``GradScaler.step``), ``torch/optim/adam.py``
(``_fused_adam``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._torch_compat import fused_handoff
from ._traced_step import NOT_TRACED, traced_step

__all__ = ["fused_step"]

_ATTRIBUTES = ("grad_scale", "found_inf")


@fused_handoff
def fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``optimizer.step(*args, **kwargs)`` with ``grad_scale`` and ``found_inf`` handed over.

    Args:
        grad_scale: 0-dim float32 the gradients are divided by (``scale / clip_coef``), or None when
            they are already unscaled. A ``grad_scale`` the user set on the optimizer stays a factor
            (torch's rule); None there, as torch's own scaler leaves it after an ``unscale_()``
            step, means none.
        found_inf: 0-dim float32, exactly 1.0 to skip the step.

    The optimizer's ``grad_scale``/``found_inf`` attributes are left as they were, also when the
    step raises. No host read, no collective. While ``torch.compile`` traces, a fused torch
    ``Adam``/``AdamW`` step is traced into the same graph (`distscaler._traced_step`; no attribute is
    set: dynamo cannot set attributes on an optimizer).
    """
    prior = {k: optimizer.__dict__[k] for k in _ATTRIBUTES if k in vars(optimizer)}
    user_scale = prior.get("grad_scale")
    if grad_scale is None:
        grad_scale = user_scale
    elif user_scale is not None:
        grad_scale = grad_scale * user_scale
    stepped = traced_step(optimizer, grad_scale, found_inf, args, kwargs)  # compiling only
    if stepped is not NOT_TRACED:
        return stepped
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        for key in _ATTRIBUTES:
            if key in prior:
                setattr(optimizer, key, prior[key])
            else:
                delattr(optimizer, key)
