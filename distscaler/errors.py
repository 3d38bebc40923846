"""Exception types raised by distscaler."""

from __future__ import annotations

__all__ = ["CallOrderError"]


class CallOrderError(RuntimeError, AssertionError):
    """A scaler method was called out of order (for example ``update()`` before any ``step()``).

    torch's ``GradScaler`` raises ``RuntimeError`` for some call-order mistakes and ``AssertionError``
    for others ("No inf checks were recorded prior to update."). This class derives from both, so code
    written against either type of torch's keeps working, while the messages keep torch's wording.
    """
