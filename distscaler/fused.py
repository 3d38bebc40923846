"""The optimizer step on the agreed verdict, and the hand-off to fused optimizers.

Optimizers with ``_step_supports_amp_scaling`` (``Adam``/``AdamW``/``SGD(fused=True)``, and any
optimizer that follows torch's contract) read ``optimizer.grad_scale`` and ``optimizer.found_inf``
inside their step: they divide the gradients by ``grad_scale`` and skip (and undo their step count)
when ``found_inf`` is exactly 1.0. The scaler sets both for the duration of the step only, so no
value is read on the host and the gradients are never rewritten. Other optimizers step unless the
agreed flag, read once on the host, says overflow. Source:
``torch/amp/grad_scaler.py`` (``GradScaler.step``), ``torch/optim/adam.py`` (``_fused_adam``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ._torch_compat import fused_handoff
from .errors import CallOrderError
from .traced_step import NOT_TRACED, traced_step

__all__ = ["fused_step", "run_step", "takes_grad_scaler", "uses_fused_scaling"]

#: ``step`` function -> whether it takes torch's deprecated ``grad_scaler`` keyword. Reading a
#: signature costs tens of microseconds, once per step otherwise. A plain dict, not a
#: ``WeakKeyDictionary``: torch.compile traces this lookup, and dynamo fails on a weak mapping
#: ("weak object has gone away"). Step functions live as long as their classes.
_TAKES_GRAD_SCALER: dict[Any, bool] = {}
_ATTRIBUTES = ("grad_scale", "found_inf")


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes torch's deprecated ``grad_scaler=`` keyword."""
    # Keyed by the class's step: the deprecated keyword is a class's contract (an instance patch
    # such as an LR scheduler's keeps the signature), and dynamo traces a class attribute where
    # torch 2.6 cannot trace a bound method's __func__.
    func = type(optimizer).step
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):
        pass
    takes = "grad_scaler" in inspect.signature(optimizer.step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:  # not hashable: not cached
        pass
    return takes


def uses_fused_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes ``grad_scale``/``found_inf`` attributes (not the old keyword)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        not takes_grad_scaler(optimizer)
    )


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
    ``Adam``/``AdamW`` step is traced into the same graph (:mod:`distscaler.traced_step`; no
    attribute is set: dynamo cannot set attributes on an optimizer).
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


def run_step(
    optimizer: torch.optim.Optimizer,
    verdict: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    scaler: Any,
    check: Any,
    unscale: Any,
    on_skip: Any = None,
) -> Any:
    """Run ``optimizer``'s step on the agreed verdict, as ``torch.amp.GradScaler.step`` does.

    Args:
        verdict: the scaler's per-optimizer state of this iteration (``stage``,
            ``found_inf_per_device``, ``grad_scale``); ``check()`` / ``unscale()`` fill it when no
            verdict ran yet.
        scaler: passed as ``grad_scaler=`` to optimizers of torch's deprecated contract.

    Fused optimizers get ``grad_scale``/``found_inf`` (no host read); others step unless the agreed
    flag, read once on the host, says overflow. Returns what ``optimizer.step`` returned, or None
    for a skipped step.

    Raises:
        CallOrderError: no verdict was recorded for ``optimizer`` (torch's wording).
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        if takes_grad_scaler(optimizer):  # torch's deprecated contract: it drives the scaler
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=3,
            )
            return optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})  # type: ignore[call-overload]
        if verdict["stage"] is OptState.READY:
            check()
        (found_inf,) = verdict["found_inf_per_device"].values()
        return fused_step(optimizer, verdict["grad_scale"], found_inf, args, kwargs)
    if verdict["stage"] is OptState.READY:
        unscale()
    if len(verdict["found_inf_per_device"]) == 0:
        raise CallOrderError("No inf checks were recorded for this optimizer.")
    (found_inf,) = verdict["found_inf_per_device"].values()
    if found_inf.item():  # the step's one host read: the agreed flag
        if on_skip is not None:
            on_skip()
        return None
    return optimizer.step(*args, **kwargs)
