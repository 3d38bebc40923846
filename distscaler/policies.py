"""Loss-scale update rules ("policies"), applied on the device with no host read.

A policy turns the agreed ``found_inf`` of one iteration into the next loss scale. The scaler's
device state owns ``scale`` and torch's ``growth_tracker`` (so that ``state_dict`` stays
torch-compatible); a policy declares the extra 0-dim int64 state tensors it needs (``state_keys``:
DeepSpeed's ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``; Megatron's
``hysteresis_tracker``), and ``update_`` mutates all of them in place with tensor ops only. Every
setting a rule reads comes from one :class:`ScaleRule`.

=============  ============================================================================
``"torch"``    ``torch.amp.GradScaler``: back off on every overflow, grow after
               ``growth_interval`` clean steps (``torch._amp_update_scale_``, bit-identical).
``"megatron"`` Megatron-LM ``DynamicGradScaler``: back off once ``hysteresis`` overflows
               were seen since the last growth; grow after ``growth_interval`` clean steps
               in a row.
``"deepspeed"`` DeepSpeed ``DynamicLossScaler`` (ZeRO): hysteresis, optional consecutive
               hysteresis; grows on the (W+1)-th clean step after an overflow, then every W.
``"static"``   the scale never changes (a static DeepSpeed ``loss_scale``, bf16/fp32 at 1.0).
=============  ============================================================================

Every policy skips the step of every overflow (the skip is the verdict's ``found_inf``, decided
before and independently of the policy), including one that hysteresis absorbs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from .errors import MIN_SCALE_MESSAGE, LossScaleAtMinimumError

__all__ = [
    "MIN_SCALE_MESSAGE",
    "POLICIES",
    "LossScaleAtMinimumError",
    "PolicyName",
    "ScalePolicy",
    "ScaleRule",
    "get_policy",
]

PolicyName = Literal["torch", "deepspeed", "megatron", "static"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


@dataclass(frozen=True, slots=True)
class ScaleRule:
    """The settings of a scale update rule, in one value (validated by ``ScalerConfig``).

    Attributes:
        growth_factor: factor (> 1) of a growth.
        backoff_factor: factor in (0, 1) of a backoff.
        growth_interval: clean steps, in optimizer steps, before a growth (DeepSpeed's
            ``loss_scale_window``).
        min_scale: floor of the scale, or None (torch's scale has none).
        max_scale: ceiling of the scale, or None.
        hysteresis: overflows tolerated before a backoff (DeepSpeed's ``delayed_shift``,
            Megatron's ``hysteresis``); 1 for ``"torch"`` and ``"static"``.
        consecutive_hysteresis: refill the hysteresis on every clean step (``"deepspeed"``).
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False

    @property
    def bounded(self) -> bool:
        """Whether the scale is clamped after each update."""
        return self.min_scale is not None or self.max_scale is not None


class ScalePolicy:
    """The seam every update rule implements; the base is the policy without extra state.

    ``update_`` and ``at_minimum`` run entirely on the device of ``scale`` (no ``.item()``, no
    Python branching on tensor values), so that ``GradScaler.update()`` adds no host sync and can be
    captured in a CUDA graph.
    """

    name: str = ""
    #: Names of the policy's extra state: 0-dim int64 tensors on the scale's device.
    state_keys: tuple[str, ...] = ()

    def initial_state(self, rule: ScaleRule) -> dict[str, int]:
        """Values of the extra state at the start of training (host ints, one per state key)."""
        return {}

    def state_from_checkpoint(
        self, values: dict[str, int], growth_tracker: int, rule: ScaleRule
    ) -> dict[str, int]:
        """The extra state to resume from ``values`` (known state keys of any policy, host ints).

        Keys this policy needs but ``values`` lacks are derived from ``growth_tracker`` and
        ``values["num_updates"]`` where possible, else take their initial value.
        """
        return {}

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        rule: ScaleRule,
    ) -> None:
        """Update ``scale`` (0-dim float32), ``growth_tracker`` (0-dim int32) and ``state`` in place.

        ``found_inf``: 0-dim float32 on the same device, exactly 1.0 when the step overflowed, else
        0.0. The result is clamped to ``[rule.min_scale, rule.max_scale]``.
        """
        raise NotImplementedError

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        rule: ScaleRule,
    ) -> torch.Tensor:
        """0-dim bool tensor: this update would back off a scale already at ``rule.min_scale``."""
        return torch.zeros((), dtype=torch.bool, device=scale.device)


def _clamp_(scale: torch.Tensor, rule: ScaleRule) -> None:
    if rule.bounded:
        scale.clamp_(min=rule.min_scale, max=rule.max_scale)


def _backed_off(scale: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """``scale * backoff_factor``, floored at ``min_scale`` (Megatron's and DeepSpeed's ``max``)."""
    backed_off = scale * rule.backoff_factor
    return backed_off if rule.min_scale is None else torch.clamp(backed_off, min=rule.min_scale)


def _grown(scale: torch.Tensor, rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scale * growth_factor``, whether it is finite): a growth past float32 is skipped."""
    grown = scale * rule.growth_factor
    return grown, torch.isfinite(grown)


class TorchPolicy(ScalePolicy):
    """torch's rule, via the same kernel ``torch.amp.GradScaler.update`` uses (bit-identical).

    On overflow: ``scale *= backoff_factor`` and the growth tracker resets to 0. Otherwise the tracker
    counts clean steps; at ``growth_interval`` the scale is multiplied by ``growth_factor`` (only if the
    result is finite) and the tracker resets. One kernel (plus one clamp with bounds). Source:
    ``torch._amp_update_scale_``.
    """

    name = "torch"

    def update_(self, scale, growth_tracker, found_inf, state, rule):  # type: ignore[override]
        torch._amp_update_scale_(
            scale,
            growth_tracker,
            found_inf,
            rule.growth_factor,
            rule.backoff_factor,
            rule.growth_interval,
        )
        _clamp_(scale, rule)

    def at_minimum(self, scale, found_inf, state, rule):  # type: ignore[override]
        return (found_inf > 0) & (scale <= rule.min_scale)


class StaticPolicy(ScalePolicy):
    """A fixed scale: overflows are skipped (unless the scaler is told not to) but change nothing.

    DeepSpeed's static ``loss_scale > 0``, and bf16/fp32 training at a scale of 1.0. No device op.
    """

    name = "static"

    def update_(self, scale, growth_tracker, found_inf, state, rule):  # type: ignore[override]
        return None


class MegatronPolicy(ScalePolicy):
    """Megatron-LM's ``DynamicGradScaler`` rule (``megatron/core/optimizer/grad_scaler.py``).

    On overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one; once it is
    <= 0, every overflow backs off: ``scale = max(scale * backoff_factor, min_scale)``. On a clean
    step the growth tracker counts; at ``growth_interval`` it resets, the hysteresis tracker refills
    to ``hysteresis`` and ``scale *= growth_factor``.

    Differences, both outside Megatron's own use: growth is skipped when it would make the float32
    scale infinite (as torch's), and the growth test is ``tracker >= growth_interval`` instead of
    ``==`` so that lowering the interval mid-run with ``set_growth_interval`` cannot stop growth.
    """

    name = "megatron"
    state_keys = ("hysteresis_tracker",)

    def initial_state(self, rule):  # type: ignore[override]
        return {"hysteresis_tracker": rule.hysteresis}

    def state_from_checkpoint(self, values, growth_tracker, rule):  # type: ignore[override]
        if "hysteresis_tracker" in values:
            return {"hysteresis_tracker": values["hysteresis_tracker"]}
        if "cur_hysteresis" in values:  # DeepSpeed's counter has the same meaning
            return {"hysteresis_tracker": values["cur_hysteresis"]}
        return self.initial_state(rule)

    def update_(self, scale, growth_tracker, found_inf, state, rule):  # type: ignore[override]
        found = found_inf > 0
        hyst = state["hysteresis_tracker"]
        hyst_after_overflow = hyst - 1
        tracker_clean = growth_tracker + 1
        grown, finite = _grown(scale, rule)
        grow = (tracker_clean >= rule.growth_interval) & finite
        clean_scale = torch.where(grow, grown, scale)
        overflow_scale = torch.where(hyst_after_overflow <= 0, _backed_off(scale, rule), scale)
        scale.copy_(torch.where(found, overflow_scale, clean_scale))
        hyst.copy_(
            torch.where(
                found,
                hyst_after_overflow,
                torch.where(grow, torch.full_like(hyst, rule.hysteresis), hyst),
            )
        )
        growth_tracker.copy_(
            torch.where(found | grow, torch.zeros_like(growth_tracker), tracker_clean)
        )
        _clamp_(scale, rule)

    def at_minimum(self, scale, found_inf, state, rule):  # type: ignore[override]
        return (found_inf > 0) & (state["hysteresis_tracker"] <= 1) & (scale <= rule.min_scale)


class DeepSpeedPolicy(ScalePolicy):
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (``deepspeed/runtime/fp16/loss_scaler.py``).

    State: ``cur_iter`` (0), ``last_overflow_iter`` (-1), ``cur_hysteresis`` (= ``hysteresis``,
    DeepSpeed's ``delayed_shift``). On overflow: if ``hysteresis == 1`` or ``cur_hysteresis == 1``,
    ``scale = max(scale * backoff_factor, min_scale)`` (DeepSpeed divides by its ``scale_factor``
    2.0: the same value), else ``cur_hysteresis -= 1``; then ``last_overflow_iter = cur_iter``. On
    a clean step: ``cur_hysteresis`` refills when ``consecutive_hysteresis``; with
    ``stable = cur_iter - last_overflow_iter - 1``, if ``stable > 0`` and ``stable %
    growth_interval == 0`` the scale grows by ``growth_factor`` (and ``cur_hysteresis`` refills
    when not consecutive). Always ``cur_iter += 1``. DeepSpeed's ``scale_window`` is
    ``growth_interval``. The torch-compatible growth tracker counts clean steps since the last
    overflow or growth (informative; the rule reads ``cur_iter`` and ``last_overflow_iter``).

    Differences: the scale is float32 (DeepSpeed: a Python float), and a growth that would make it
    infinite (beyond 2**127) is skipped, as torch's.
    """

    name = "deepspeed"
    state_keys = ("cur_iter", "last_overflow_iter", "cur_hysteresis")

    def initial_state(self, rule):  # type: ignore[override]
        return {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": rule.hysteresis}

    def state_from_checkpoint(self, values, growth_tracker, rule):  # type: ignore[override]
        if "cur_iter" in values:
            cur_iter = values["cur_iter"]
        else:
            cur_iter = max(values.get("num_updates", growth_tracker), growth_tracker)
        # Without DeepSpeed's counters, continue the clean streak that torch's tracker counted.
        last = values.get("last_overflow_iter", cur_iter - growth_tracker - 1)
        if "cur_hysteresis" in values:
            hyst = values["cur_hysteresis"]
        elif "hysteresis_tracker" in values:  # Megatron's counter, which may go below 1
            hyst = min(max(values["hysteresis_tracker"], 1), rule.hysteresis)
        else:
            hyst = rule.hysteresis
        return {"cur_iter": cur_iter, "last_overflow_iter": last, "cur_hysteresis": hyst}

    @staticmethod
    def _exhausted(hyst: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
        if rule.hysteresis == 1:
            return torch.ones_like(hyst, dtype=torch.bool)
        return hyst == 1

    def update_(self, scale, growth_tracker, found_inf, state, rule):  # type: ignore[override]
        found = found_inf > 0
        cur_iter = state["cur_iter"]
        last = state["last_overflow_iter"]
        hyst = state["cur_hysteresis"]
        backoff = found & self._exhausted(hyst, rule)
        stable = cur_iter - last - 1
        grown, finite = _grown(scale, rule)
        grow = (
            found.logical_not()
            & (stable > 0)
            & (torch.remainder(stable, rule.growth_interval) == 0)
            & finite
        )
        full = torch.full_like(hyst, rule.hysteresis)
        refill = found.logical_not() if rule.consecutive_hysteresis else grow
        new_hyst = torch.where(found & backoff.logical_not(), hyst - 1, hyst)
        new_hyst = torch.where(refill, full, new_hyst)
        scale.copy_(torch.where(backoff, _backed_off(scale, rule), torch.where(grow, grown, scale)))
        hyst.copy_(new_hyst)
        last.copy_(torch.where(found, cur_iter, last))
        cur_iter.add_(1)
        growth_tracker.copy_(
            torch.where(found | grow, torch.zeros_like(growth_tracker), growth_tracker + 1)
        )
        _clamp_(scale, rule)

    def at_minimum(self, scale, found_inf, state, rule):  # type: ignore[override]
        # DeepSpeed compares with ==; a scale below the floor (a loaded checkpoint) counts too.
        exhausted = self._exhausted(state["cur_hysteresis"], rule)
        return (found_inf > 0) & exhausted & (scale <= rule.min_scale)


_POLICIES: dict[str, ScalePolicy] = {
    p.name: p for p in (TorchPolicy(), DeepSpeedPolicy(), MegatronPolicy(), StaticPolicy())
}


def get_policy(name: str) -> ScalePolicy:
    """The policy called ``name`` (policies hold no settings; those are in a :class:`ScaleRule`).

    Raises:
        ValueError: unknown name.
    """
    try:
        return _POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {POLICIES}, got: {name!r}") from None
