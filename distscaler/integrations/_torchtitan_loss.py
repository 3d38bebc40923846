"""Scaling a loss whose backward runs inside the loss call (torchtitan's ``ChunkedLossWrapper``).

``scaler.scale(loss).backward()`` multiplies the gradient that reaches ``loss`` by the scale. A loss
that has already run its own backward (the chunked loss computes the output layer per sequence
chunk, calls ``chunk_loss.backward()`` for each, and hands the decoder the accumulated gradient
whatever reaches its result) never sees that factor: the gradients stay unscaled, and the scaler's
unscale then divides them by the scale. The scale has to enter where the backward starts, at the
inner loss: [`scaled_for_backward()`][distscaler.integrations.torchtitan.scaled_for_backward]
returns the same value with a gradient multiplied by the scale, and
[`scale_loss_fn()`][distscaler.integrations.torchtitan.scale_loss_fn] makes a torchtitan loss object
return that. Used by [`distscaler.integrations.torchtitan`][distscaler.integrations.torchtitan];
[`scaled_for_backward()`][distscaler.integrations.torchtitan.scaled_for_backward] needs nothing of
torchtitan.
"""

from __future__ import annotations

from typing import Any

import torch

from .._scaler import GradScaler

__all__ = ["scale_loss_fn", "scaled_for_backward"]


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the scaler's scale."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scaler: GradScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.scaler.scale(grad), None


def scaled_for_backward(loss: torch.Tensor, scaler: GradScaler) -> torch.Tensor:
    """``loss`` with the same value (bit for bit, inf and NaN included) whose gradient is multiplied
    by ``scaler``'s current scale: ``scaled_for_backward(loss, s).backward()`` gives the gradients
    of ``s.scale(loss).backward()``.

    For losses whose backward runs inside the loss call and ignores the gradient reaching their
    result (torchtitan's ``ChunkedLossWrapper``): scale the inner loss this way. Returns ``loss``
    itself when the scaler is disabled, gradients are off or ``loss`` does not require them.

    Args:
        loss: a tensor (a 0-dim float32 in torchtitan; DTensors too) on the scaler's device type.

    Cost: one clone in the forward, one multiply in the backward (the scale read on the device);
    no host read, no collective.
    """
    if not (scaler.is_enabled() and torch.is_grad_enabled() and loss.requires_grad):
        return loss
    return _ScaleGradient.apply(loss, scaler)


_SCALED_CLASSES: dict[type, type] = {}


def _scaled_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that scales the gradient of its loss (made once per class)."""
    scaled = _SCALED_CLASSES.get(cls)
    if scaled is None:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            loss, metrics = cls.__call__(self, *args, **kwargs)  # type: ignore[operator]
            return scaled_for_backward(loss, self._distscaler_scaler), metrics

        scaled = type(
            f"Scaled{cls.__name__}", (cls,), {"__call__": __call__, "__module__": __name__}
        )
        _SCALED_CLASSES[cls] = scaled
    return scaled


def scale_loss_fn(loss_fn: Any, scaler: GradScaler) -> Any:
    """Make a torchtitan loss object scale the gradients of its result, in place.

    The object whose result is backpropagated (``loss_fn`` itself, or the inner ``loss_fn`` of a
    ``ChunkedLossWrapper``) becomes an instance of a subclass of its class (one per class, made once)
    whose ``__call__`` returns ``(scaled_for_backward(loss, scaler), metrics)``; identity, attributes
    and ``isinstance`` are kept, so a pipeline schedule built around the object scales too (as
    ``fully_shard`` changes a module's class). Calling it again swaps the scaler. Returns ``loss_fn``.

    Raises:
        TypeError: the object is not callable as ``(pred, labels, ...) -> (loss, metrics)``.
    """
    from torchtitan.components.loss import ChunkedLossWrapper

    leaf = loss_fn.loss_fn if isinstance(loss_fn, ChunkedLossWrapper) else loss_fn
    if not callable(leaf):
        raise TypeError(f"loss_fn must be a torchtitan loss object, got: {type(leaf).__name__}")
    if type(leaf) not in _SCALED_CLASSES.values():
        leaf.__class__ = _scaled_class(type(leaf))
    leaf._distscaler_scaler = scaler
    return loss_fn
