"""DeepSpeed's loss-scaler attributes on :class:`distscaler.GradScaler`.

Code written against DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``)
reads ``cur_scale``, ``loss_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis`` and
calls ``update_scale(overflow)``. :class:`DeepSpeedScalerAPI` gives a scaler those names over the
hooks the scaler implements; with ``policy="deepspeed"`` the values follow DeepSpeed's rules
(:mod:`distscaler.policies`).
"""

from __future__ import annotations

from typing import Any

from . import _validation as V

__all__ = ["DeepSpeedScalerAPI"]


class DeepSpeedScalerAPI:
    """Mixin: DeepSpeed's ``DynamicLossScaler`` attributes, read from the scaler's own state.

    The class it is mixed into implements :meth:`get_scale`, :meth:`_policy_keys`,
    :meth:`_policy_values` and :meth:`_update_from_overflow`.
    """

    def get_scale(self) -> float:
        raise NotImplementedError

    def _policy_keys(self) -> tuple[str, tuple[str, ...]]:
        """The policy's name and the names of its counters (no host read)."""
        raise NotImplementedError

    def _policy_values(self) -> dict[str, int]:
        """The policy's counters (one host read)."""
        raise NotImplementedError

    def _update_from_overflow(self, overflow: bool) -> None:
        """An update whose agreed verdict is ``overflow``."""
        raise NotImplementedError

    @property
    def cur_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.cur_scale``); ``get_scale()``."""
        return self.get_scale()

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.loss_scale``); ``get_scale()``."""
        return self.get_scale()

    def _policy_counter(self, key: str) -> int:
        policy, keys = self._policy_keys()
        if key not in keys:
            raise AttributeError(
                f"{key} exists for policy='deepspeed' (DeepSpeed's DynamicLossScaler); this scaler "
                f"has policy={policy!r}"
            )
        return self._policy_values()[key]

    @property
    def cur_iter(self) -> int:
        """Updates so far (DeepSpeed's; ``policy="deepspeed"``, else AttributeError). A host read."""
        return self._policy_counter("cur_iter")

    @property
    def last_overflow_iter(self) -> int:
        """``cur_iter`` of the last overflow, -1 before any (as ``cur_iter``). A host read."""
        return self._policy_counter("last_overflow_iter")

    @property
    def cur_hysteresis(self) -> int:
        """Overflows left before the next backoff (DeepSpeed's ``cur_hysteresis``; Megatron's
        ``hysteresis_tracker`` for ``policy="megatron"``). One host read.

        Raises:
            AttributeError: the policy has no hysteresis (``"torch"``, ``"static"``).
        """
        policy, _ = self._policy_keys()
        if policy == "megatron":
            return self._policy_counter("hysteresis_tracker")
        return self._policy_counter("cur_hysteresis")

    def update_scale(self, overflow: Any) -> None:
        """Update the scale as if an iteration had (``overflow=True``) or had not overflowed.

        DeepSpeed's ``DynamicLossScaler.update_scale(overflow)``: an ``update()`` whose verdict
        was ``overflow`` (``overflow`` must already be agreed: no collective). No-op when disabled.

        Raises:
            TypeError: ``overflow`` is not a bool.
            LossScaleAtMinimumError: see ``raise_error_at_min_scale``.
        """
        self._update_from_overflow(V.check_bool("overflow", overflow))
