"""Loss-scale update rules ("policies"), applied on the device with no host read.

A policy turns the agreed ``found_inf`` of one iteration into the next loss scale. The scaler owns
``scale`` and torch's ``growth_tracker`` (so that ``state_dict`` stays torch-compatible); a policy
declares the extra 0-dim int64 state tensors it needs (``state_keys``: DeepSpeed's ``cur_iter``,
``last_overflow_iter``, ``cur_hysteresis``; Megatron's ``hysteresis_tracker``), the scaler creates
them next to the scale, and ``update_`` mutates all of them in place with tensor ops only.

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

from typing import Literal, Protocol, get_args

import torch

from . import _validation as V

__all__ = [
    "POLICIES",
    "DeepSpeedPolicy",
    "LossScaleAtMinimumError",
    "MegatronPolicy",
    "PolicyName",
    "ScalePolicy",
    "StaticPolicy",
    "TorchPolicy",
    "make_policy",
]

PolicyName = Literal["torch", "deepspeed", "megatron", "static"]
POLICIES: tuple[str, ...] = get_args(PolicyName)

#: DeepSpeed's message (``deepspeed/runtime/fp16/loss_scaler.py``), kept word for word.
MIN_SCALE_MESSAGE = (
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
)


class LossScaleAtMinimumError(RuntimeError):
    """An overflow would lower a scale already at ``min_scale`` (``raise_error_at_min_scale``).

    DeepSpeed raises a bare ``Exception`` with the same message; this is a subclass of it.
    """


class ScalePolicy(Protocol):
    """The seam every update rule implements.

    ``update_`` and ``at_minimum`` must run entirely on the device of ``scale`` (no ``.item()``, no
    Python branching on tensor values), so that ``GradScaler.update()`` adds no host sync.
    """

    name: str
    #: Names of the policy's extra state: 0-dim int64 tensors on the scale's device.
    state_keys: tuple[str, ...]

    def initial_state(self) -> dict[str, int]:
        """Values of the extra state at the start of training (host ints, one per state key)."""
        ...

    def state_from_checkpoint(self, values: dict[str, int], growth_tracker: int) -> dict[str, int]:
        """The extra state to resume from ``values`` (known state keys of any policy, host ints).

        Keys this policy needs but ``values`` lacks are derived from ``growth_tracker`` and
        ``values["num_updates"]`` where possible, else take their initial value.
        """
        ...

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float | None,
    ) -> None:
        """Update ``scale`` (0-dim float32), ``growth_tracker`` (0-dim int32) and ``state`` in place.

        ``found_inf`` is a 0-dim float32 tensor on the same device, > 0 when the step overflowed.
        ``min_scale`` is the floor of a backoff (None: no floor); the scaler clamps after as well.
        """
        ...

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        min_scale: float,
    ) -> torch.Tensor:
        """0-dim bool tensor: this update would back off a scale already equal to ``min_scale``."""
        ...


def _overflowed(found_inf: torch.Tensor) -> torch.Tensor:
    return found_inf > 0


def _backed_off(
    scale: torch.Tensor, backoff_factor: float, min_scale: float | None
) -> torch.Tensor:
    """``scale * backoff_factor``, floored at ``min_scale`` (Megatron's and DeepSpeed's ``max``)."""
    backed_off = scale * backoff_factor
    return backed_off if min_scale is None else torch.clamp(backed_off, min=min_scale)


def _grown(scale: torch.Tensor, growth_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scale * growth_factor``, whether it is finite): a growth past float32 is skipped."""
    grown = scale * growth_factor
    return grown, torch.isfinite(grown)


class _NoExtraState:
    """Policies whose whole state is torch's ``scale`` and growth tracker."""

    state_keys: tuple[str, ...] = ()

    def initial_state(self) -> dict[str, int]:
        return {}

    def state_from_checkpoint(self, values: dict[str, int], growth_tracker: int) -> dict[str, int]:
        return {}


class TorchPolicy(_NoExtraState):
    """torch's rule, via the same kernel ``torch.amp.GradScaler.update`` uses (bit-identical).

    On overflow: ``scale *= backoff_factor`` and the growth tracker resets to 0. Otherwise the tracker
    counts clean steps; at ``growth_interval`` the scale is multiplied by ``growth_factor`` (only if the
    result is finite) and the tracker resets. Source: ``torch._amp_update_scale_``.
    """

    name = "torch"

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float | None,
    ) -> None:
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        min_scale: float,
    ) -> torch.Tensor:
        return _overflowed(found_inf) & (scale <= min_scale)


class StaticPolicy(_NoExtraState):
    """A fixed scale: overflows are skipped (unless the scaler is told not to) but change nothing.

    DeepSpeed's static ``loss_scale > 0``, and bf16/fp32 training at a scale of 1.0.
    """

    name = "static"

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float | None,
    ) -> None:
        return None

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        min_scale: float,
    ) -> torch.Tensor:
        return torch.zeros((), dtype=torch.bool, device=scale.device)


class MegatronPolicy:
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
    state_keys: tuple[str, ...] = ("hysteresis_tracker",)

    def __init__(self, hysteresis: int) -> None:
        self.hysteresis = hysteresis

    def initial_state(self) -> dict[str, int]:
        return {"hysteresis_tracker": self.hysteresis}

    def state_from_checkpoint(self, values: dict[str, int], growth_tracker: int) -> dict[str, int]:
        if "hysteresis_tracker" in values:
            return {"hysteresis_tracker": values["hysteresis_tracker"]}
        if "cur_hysteresis" in values:  # DeepSpeed's counter has the same meaning
            return {"hysteresis_tracker": values["cur_hysteresis"]}
        return self.initial_state()

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float | None,
    ) -> None:
        found = _overflowed(found_inf)
        hyst = state["hysteresis_tracker"]
        hyst_after_overflow = hyst - 1
        backed_off = _backed_off(scale, backoff_factor, min_scale)
        tracker_clean = growth_tracker + 1
        grown, finite = _grown(scale, growth_factor)
        grow = (tracker_clean >= growth_interval) & finite
        clean_scale = torch.where(grow, grown, scale)
        overflow_scale = torch.where(hyst_after_overflow <= 0, backed_off, scale)
        scale.copy_(torch.where(found, overflow_scale, clean_scale))
        hyst.copy_(
            torch.where(
                found,
                hyst_after_overflow,
                torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst),
            )
        )
        growth_tracker.copy_(
            torch.where(found | grow, torch.zeros_like(growth_tracker), tracker_clean)
        )

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        min_scale: float,
    ) -> torch.Tensor:
        return _overflowed(found_inf) & (state["hysteresis_tracker"] <= 1) & (scale <= min_scale)


class DeepSpeedPolicy:
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
    state_keys: tuple[str, ...] = ("cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, hysteresis: int, consecutive_hysteresis: bool) -> None:
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis

    def initial_state(self) -> dict[str, int]:
        return {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": self.hysteresis}

    def state_from_checkpoint(self, values: dict[str, int], growth_tracker: int) -> dict[str, int]:
        if "cur_iter" in values:
            cur_iter = values["cur_iter"]
        else:
            cur_iter = max(values.get("num_updates", growth_tracker), growth_tracker)
        # Without DeepSpeed's counters, continue the clean streak that torch's tracker counted.
        last = values.get("last_overflow_iter", cur_iter - growth_tracker - 1)
        if "cur_hysteresis" in values:
            hyst = values["cur_hysteresis"]
        elif "hysteresis_tracker" in values:  # Megatron's counter, which may go below 1
            hyst = min(max(values["hysteresis_tracker"], 1), self.hysteresis)
        else:
            hyst = self.hysteresis
        return {"cur_iter": cur_iter, "last_overflow_iter": last, "cur_hysteresis": hyst}

    def _exhausted(self, hyst: torch.Tensor) -> torch.Tensor:
        if self.hysteresis == 1:
            return torch.ones_like(hyst, dtype=torch.bool)
        return hyst == 1

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float | None,
    ) -> None:
        found = _overflowed(found_inf)
        cur_iter = state["cur_iter"]
        last = state["last_overflow_iter"]
        hyst = state["cur_hysteresis"]
        backoff = found & self._exhausted(hyst)
        backed_off = _backed_off(scale, backoff_factor, min_scale)
        stable = cur_iter - last - 1
        grown, finite = _grown(scale, growth_factor)
        grow = (
            found.logical_not()
            & (stable > 0)
            & (torch.remainder(stable, growth_interval) == 0)
            & finite
        )
        full = torch.full_like(hyst, self.hysteresis)
        refill = found.logical_not() if self.consecutive_hysteresis else grow
        new_hyst = torch.where(found & backoff.logical_not(), hyst - 1, hyst)
        new_hyst = torch.where(refill, full, new_hyst)
        scale.copy_(torch.where(backoff, backed_off, torch.where(grow, grown, scale)))
        hyst.copy_(new_hyst)
        last.copy_(torch.where(found, cur_iter, last))
        cur_iter.add_(1)
        growth_tracker.copy_(
            torch.where(found | grow, torch.zeros_like(growth_tracker), growth_tracker + 1)
        )

    def at_minimum(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        min_scale: float,
    ) -> torch.Tensor:
        # DeepSpeed compares with ==; a scale below the floor (a loaded checkpoint) counts too.
        return (
            _overflowed(found_inf) & self._exhausted(state["cur_hysteresis"]) & (scale <= min_scale)
        )


def make_policy(
    name: str, *, hysteresis: int = 1, consecutive_hysteresis: bool = False
) -> ScalePolicy:
    """Build a policy by name.

    Args:
        name: one of ``"torch"``, ``"deepspeed"``, ``"megatron"``, ``"static"``.
        hysteresis: overflows tolerated before a backoff (>= 1); only ``"deepspeed"`` and
            ``"megatron"`` have hysteresis, the others need 1.
        consecutive_hysteresis: refill the hysteresis on every clean step (``"deepspeed"`` only).

    Raises:
        ValueError: unknown name, ``hysteresis`` out of range, or an option the policy lacks.
        TypeError: ``consecutive_hysteresis`` is not a bool.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got: {name!r}")
    hysteresis = V.check_int("hysteresis", hysteresis, minimum=1)
    consecutive_hysteresis = V.check_bool("consecutive_hysteresis", consecutive_hysteresis)
    if name in ("torch", "static") and hysteresis != 1:
        raise ValueError(
            f"hysteresis must be 1 for policy={name!r} (it has none; use policy='deepspeed' or "
            f"'megatron'), got: {hysteresis}"
        )
    if name != "deepspeed" and consecutive_hysteresis:
        raise ValueError(
            f"consecutive_hysteresis=True needs policy='deepspeed', got: policy={name!r}"
        )
    if name == "deepspeed":
        return DeepSpeedPolicy(hysteresis, consecutive_hysteresis)
    if name == "megatron":
        return MegatronPolicy(hysteresis)
    if name == "static":
        return StaticPolicy()
    return TorchPolicy()
