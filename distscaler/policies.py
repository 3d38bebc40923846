"""Loss-scale update rules ("policies"): the scale and its counters, updated on the device.

A policy turns the agreed ``found_inf`` of one iteration into the next loss scale. Each is one
[`LossScalePolicy`][distscaler.policies.LossScalePolicy] subclass, an abstract base class as
Megatron-core's ``MegatronGradScaler``: the counters it keeps (0-dim device tensors, saved in
``state_dict`` under [`state_keys`][distscaler.policies.LossScalePolicy.state_keys]), its
[`update_()`][distscaler.policies.LossScalePolicy.update_], the one method a rule must define
(tensor ops only: no host read, no Python branch on a tensor value, so ``GradScaler.update()`` adds
no host sync and a CUDA graph replays it), and the settings it accepts
([`settings_problems()`][distscaler.policies.LossScalePolicy.settings_problems], asked by
``ScalerConfig``). Every setting a rule reads comes from one
[`ScaleRule`][distscaler.policies.ScaleRule]; [`move_scale_()`][distscaler.policies.move_scale_]
grows or backs off the scale with torch's own kernel.

| policy | rule |
|---|---|
| ``"torch"`` | ``torch.amp.GradScaler``: back off on every overflow, grow after ``growth_interval`` clean steps (``torch._amp_update_scale_``, bit-identical). |
| ``"megatron"`` | Megatron-LM ``DynamicGradScaler``: back off once ``hysteresis`` overflows were seen since the last growth; grow after ``growth_interval`` clean steps in a row. |
| ``"deepspeed"`` | DeepSpeed ``DynamicLossScaler`` (ZeRO): hysteresis, optional consecutive hysteresis; grows on the (W+1)-th clean step after an overflow, then every W. |
| ``"static"`` | the scale never changes (a static DeepSpeed ``loss_scale``, bf16/fp32 at 1.0). |

Every policy skips the step of every overflow (the skip is the agreed ``found_inf``, decided before
and independently of the policy), including one that hysteresis absorbs.

Adding a policy: subclass [`LossScalePolicy`][distscaler.policies.LossScalePolicy] and pass it to
[`register_policy()`][distscaler.policies.register_policy]; then ``GradScaler(policy=its_name)``
runs it. For the op count, the DeepSpeed and Megatron rules give the scaler their counters packed
into two float32 values
([`packed_counters()`][distscaler.policies.LossScalePolicy.packed_counters], an optional hook;
their packed counters), with their plain ``update_`` here as the reference, step for step, in
``tests/test_policies.py``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

from . import _validation as V
from ._packed import DeepSpeedCounters, PackedCounters
from .errors import MIN_SCALE_MESSAGE, LossScaleAtMinimumError

__all__ = [
    "MIN_SCALE_MESSAGE",
    "POLICIES",
    "DeepSpeedPolicy",
    "LossScaleAtMinimumError",
    "LossScalePolicy",
    "MegatronPolicy",
    "PolicyName",
    "ScaleRule",
    "StaticPolicy",
    "TorchPolicy",
    "get_policy",
    "move_scale_",
    "policy_for",
    "policy_names",
    "register_policy",
]

#: The built-in policies' names ([`policy_names()`][distscaler.policies.policy_names] adds the
#: registered ones).
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

    def clamp_(self, scale: torch.Tensor) -> None:
        """Clamp ``scale`` in place to ``[min_scale, max_scale]``: one op with bounds, none
        without."""
        if self.bounded:
            scale.clamp_(min=self.min_scale, max=self.max_scale)

    def check_minimum(
        self, found_inf: torch.Tensor, scale: torch.Tensor, exhausted: torch.Tensor | None
    ) -> None:
        """Raise [`LossScaleAtMinimumError`][distscaler.policies.LossScaleAtMinimumError] where
        this update would back off a scale already at ``min_scale`` (``raise_error_at_min_scale``).

        Args:
            found_inf: the agreed flag (0-dim float32, 1.0 or 0.0).
            scale: the loss scale (0-dim float32).
            exhausted: 0-dim, nonzero where an overflow now backs off
                ([`LossScalePolicy.exhausted()`][distscaler.policies.LossScalePolicy.exhausted]);
                None: every overflow backs off.

        Cost: one host read of the flag, the scale and ``exhausted`` (``stack`` + ``tolist``).
        """
        parts = [found_inf, scale]
        if exhausted is not None:
            parts.append(exhausted.to(torch.float32))
        values = torch.stack(parts).tolist()
        exhausted_now = values[2] > 0 if exhausted is not None else True
        floor = self.min_scale
        if values[0] > 0 and exhausted_now and floor is not None and values[1] <= floor:
            raise LossScaleAtMinimumError(MIN_SCALE_MESSAGE)


class LossScalePolicy(ABC):
    """One loss-scale update rule, and the counters it keeps for one scaler.

    An abstract base class: a subclass sets [`name`][distscaler.policies.LossScalePolicy.name] and
    defines [`update_()`][distscaler.policies.LossScalePolicy.update_], the one abstract method.
    Everything else has a default a rule overrides only where it differs: its counters
    ([`state_keys`][distscaler.policies.LossScalePolicy.state_keys], their ranges in
    [`counter_ranges`][distscaler.policies.LossScalePolicy.counter_ranges], their values at the
    start in [`initial_state()`][distscaler.policies.LossScalePolicy.initial_state] and from a
    checkpoint in
    [`state_from_checkpoint()`][distscaler.policies.LossScalePolicy.state_from_checkpoint]), the
    settings it accepts (``accepts_*``,
    [`settings_problems()`][distscaler.policies.LossScalePolicy.settings_problems]), its hysteresis
    ([`exhausted()`][distscaler.policies.LossScalePolicy.exhausted]) and, optionally, a packed form
    of its counters
    ([`packed_counters()`][distscaler.policies.LossScalePolicy.packed_counters]). The class
    attributes and class methods are what the scaler asks before any device state exists
    (settings, checkpoints); an instance holds the scale, torch's growth tracker and the counters
    of one scaler as device tensors.

    Args:
        rule: the settings the rule reads.
        scale: 0-dim float32, the loss scale (the scaler's own tensor, updated in place).
        growth_tracker: 0-dim int32, torch's growth tracker (the scaler's own tensor).
        counters: host values of [`state_keys`][distscaler.policies.LossScalePolicy.state_keys],
            written once to the scale's device (int64 tensors,
            [`counters`][distscaler.policies.LossScalePolicy.counters]).
    """

    #: The name ``GradScaler(policy=...)`` takes.
    name: ClassVar[str] = ""
    #: Names of the policy's counters, as saved in ``state_dict`` (host ints).
    state_keys: ClassVar[tuple[str, ...]] = ()
    #: ``[minimum, maximum]`` of each counter a checkpoint may hold (``load_state_dict`` checks).
    counter_ranges: ClassVar[Mapping[str, tuple[int, int]]] = {}
    #: The state key holding the overflows still absorbed before a backoff, or None.
    hysteresis_counter: ClassVar[str | None] = None
    #: Whether ``hysteresis`` > 1 is accepted.
    accepts_hysteresis: ClassVar[bool] = False
    #: Whether ``consecutive_hysteresis=True`` is accepted.
    accepts_consecutive_hysteresis: ClassVar[bool] = False
    #: Whether the scale reacts to overflows (if not, ``skip_nonfinite=False`` is accepted).
    reacts_to_overflow: ClassVar[bool] = True
    #: Other stacks' loss scalers with the same rule (``"module.Class"``), whose configs and
    #: checkpoints this policy continues ([`policy_for()`][distscaler.policies.policy_for],
    #: [`distscaler.interop`][distscaler.interop]).
    same_rule_as: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ host side

    @classmethod
    def initial_state(cls, rule: ScaleRule) -> dict[str, int]:
        """Values of the counters at the start of training (host ints, one per state key)."""
        return {}

    @classmethod
    def state_from_checkpoint(
        cls, values: Mapping[str, int], growth_tracker: int, rule: ScaleRule
    ) -> dict[str, int]:
        """The counters to resume from ``values`` (checked counters of any policy, and
        ``num_updates`` where saved; host ints). Keys this policy needs but ``values`` lacks are
        derived from ``growth_tracker`` and ``values["num_updates"]`` where possible, else take
        their initial value."""
        return {k: values.get(k, v) for k, v in cls.initial_state(rule).items()}

    @classmethod
    def growth_tracker_from(cls, counters: Mapping[str, int], growth_interval: int) -> int | None:
        """torch's growth tracker as these counters (host ints, saved or read) imply it, or None
        where they do not (the growth tracker tensor is then the one the rule moves)."""
        return None

    @classmethod
    def packed_counters(
        cls,
        rule: ScaleRule,
        growth_tracker: int,
        counters: Mapping[str, int],
        device: torch.device,
    ) -> Any:
        """Optional hook: this rule's counters packed so that the scaler runs the rule in ops its
        update makes anyway (the torch rule's ops + 2), or None (the
        default): the scaler runs [`update_()`][distscaler.policies.LossScalePolicy.update_] on
        the counters as they are. The DeepSpeed and Megatron rules pack; a subclass of theirs that
        defines its own ``update_`` runs plainly.

        Args:
            rule: the settings.
            growth_tracker: torch's growth tracker (host int).
            counters: the values of [`state_keys`][distscaler.policies.LossScalePolicy.state_keys]
                (host ints).
            device: the scale's device.
        """
        return None

    @classmethod
    def settings_problems(cls, settings: Mapping[str, Any]) -> list[str]:
        """Problems of these scaler settings (the fields of ``ScalerConfig``, each valid alone)
        for this rule, each message naming the setting, its value and the policies that accept it.
        """
        problems = []
        if not cls.accepts_hysteresis and settings["hysteresis"] != 1:
            problems.append(
                f"hysteresis must be 1 for policy={cls.name!r} (it has none; use policy="
                f"{_names_with('accepts_hysteresis')}), got: {settings['hysteresis']}"
            )
        if not cls.accepts_consecutive_hysteresis and settings["consecutive_hysteresis"]:
            problems.append(
                "consecutive_hysteresis=True needs policy="
                f"{_names_with('accepts_consecutive_hysteresis')}, got: policy={cls.name!r}"
            )
        if cls.reacts_to_overflow and not settings["skip_nonfinite"]:
            problems.append(
                f"skip_nonfinite=False needs policy={_names_with('reacts_to_overflow', False)} (a "
                f"dynamic scale must skip the overflows it reacts to), got: policy={cls.name!r}"
            )
        return problems

    # ------------------------------------------------------------------ device side

    def __init__(
        self,
        rule: ScaleRule,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        counters: Mapping[str, int],
    ) -> None:
        self.rule = rule
        self.scale = scale
        self.growth_tracker = growth_tracker
        #: The counters of [`state_keys`][distscaler.policies.LossScalePolicy.state_keys]: 0-dim
        #: int64 tensors on the scale's device.
        self.counters = {
            k: torch.tensor(int(counters[k]), dtype=torch.int64).to(scale.device)
            for k in self.state_keys
        }

    def set_rule(self, rule: ScaleRule) -> None:
        """Follow changed settings (``set_growth_interval``...), keeping the counters."""
        self.rule = rule

    @abstractmethod
    def update_(self, found_inf: torch.Tensor) -> None:
        """One update from the agreed ``found_inf`` (0-dim float32, exactly 1.0 or 0.0): the scale
        and the counters, in place, with tensor ops only (the one method a rule must define)."""

    def exhausted(self) -> torch.Tensor | None:
        """0-dim, nonzero where an overflow now would back off; None (the default): every overflow
        backs off. ``raise_error_at_min_scale`` asks it
        ([`ScaleRule.check_minimum()`][distscaler.policies.ScaleRule.check_minimum])."""
        return None


# ---------------------------------------------------------------------- shared pieces


def move_scale_(
    scale: torch.Tensor, grow: torch.Tensor, backoff: torch.Tensor, rule: ScaleRule
) -> None:
    """Grow or back off ``scale`` in place with torch's scale kernel, then clamp it to the rule's
    bounds: the step a rule's [`update_()`][distscaler.policies.LossScalePolicy.update_] ends with.

    Args:
        scale: 0-dim float32, the loss scale.
        grow: 0-dim bool, True where ``scale *= rule.growth_factor`` (skipped where the product is
            not finite, as torch's).
        backoff: 0-dim float32, nonzero where ``scale *= rule.backoff_factor`` (it wins over
            ``grow``); the agreed ``found_inf`` for a rule that backs off at every overflow.
        rule: the settings (factors and bounds).

    The products are torch's to the bit (``torch._amp_update_scale_``, whose growth tracker, a
    throw-away here, reaches its interval of 2 exactly where ``grow``). Cost: three device ops (the
    tracker's cast, the kernel, the clamp with bounds), no host read.
    """
    tracker = grow.to(torch.int32)
    torch._amp_update_scale_(scale, tracker, backoff, rule.growth_factor, rule.backoff_factor, 2)
    rule.clamp_(scale)


def _saved_hysteresis(values: Mapping[str, int], own: str) -> tuple[str, int] | None:
    """The hysteresis counter a checkpoint holds: this policy's, else another's (same meaning)."""
    keys = [own] + [c.hysteresis_counter for c in _REGISTRY.values() if c.hysteresis_counter]
    for key in keys:
        if key in values:
            return key, values[key]
    return None


# ---------------------------------------------------------------------- the rules


class TorchPolicy(LossScalePolicy):
    """torch's rule, via the same kernel ``torch.amp.GradScaler.update`` uses (bit-identical).

    On overflow: ``scale *= backoff_factor`` and the growth tracker resets to 0. Otherwise the
    tracker counts clean steps; at ``growth_interval`` the scale is multiplied by ``growth_factor``
    (only if the result is finite) and the tracker resets. One kernel (plus one clamp with bounds).
    Source: ``torch._amp_update_scale_``.
    """

    name = "torch"
    same_rule_as = ("torch.amp.GradScaler",)

    def update_(self, found_inf: torch.Tensor) -> None:
        """torch's kernel on the scale and growth tracker, then the clamp (with bounds)."""
        r = self.rule
        torch._amp_update_scale_(
            self.scale, self.growth_tracker, found_inf, r.growth_factor, r.backoff_factor,
            r.growth_interval,
        )  # fmt: skip
        r.clamp_(self.scale)


class StaticPolicy(LossScalePolicy):
    """A fixed scale: overflows are skipped (unless the scaler is told not to) but change nothing.

    DeepSpeed's static ``loss_scale > 0``, and bf16/fp32 training at a scale of 1.0. No device op.
    """

    name = "static"
    reacts_to_overflow = False
    same_rule_as = ("deepspeed.LossScaler",)

    def update_(self, found_inf: torch.Tensor) -> None:
        """Nothing: the scale stays."""
        return None


class MegatronPolicy(LossScalePolicy):
    """Megatron-LM's ``DynamicGradScaler`` rule (``megatron/core/optimizer/grad_scaler.py``).

    On overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one; once it is
    <= 0, every overflow backs off: ``scale = max(scale * backoff_factor, min_scale)``. On a clean
    step the growth tracker counts; at ``growth_interval`` it resets, the hysteresis tracker refills
    to ``hysteresis`` and ``scale *= growth_factor``.

    Differences, both outside Megatron's own use: growth is skipped when it would make the float32
    scale infinite (as torch's; the tracker still resets and the hysteresis refills), and the
    growth test is ``tracker >= growth_interval`` instead of ``==`` so that lowering the interval
    mid-run with ``set_growth_interval`` cannot stop growth. The scaler runs it packed (torch's
    rule + 2 ops).
    """

    name = "megatron"
    state_keys = ("hysteresis_tracker",)
    # Megatron's tracker keeps counting down below 0 through a run of overflows.
    counter_ranges = {"hysteresis_tracker": (-(2**62), 2**62)}
    hysteresis_counter = "hysteresis_tracker"
    accepts_hysteresis = True
    same_rule_as = ("megatron.core.optimizer.DynamicGradScaler",)

    @classmethod
    def initial_state(cls, rule: ScaleRule) -> dict[str, int]:
        """The hysteresis tracker full: ``hysteresis``."""
        return {"hysteresis_tracker": rule.hysteresis}

    @classmethod
    def state_from_checkpoint(
        cls, values: Mapping[str, int], growth_tracker: int, rule: ScaleRule
    ) -> dict[str, int]:
        """The saved hysteresis tracker (or DeepSpeed's ``cur_hysteresis``), else a full one."""
        saved = _saved_hysteresis(values, "hysteresis_tracker")
        if saved is not None:  # DeepSpeed's counter has the same meaning
            return {"hysteresis_tracker": saved[1]}
        return cls.initial_state(rule)

    def exhausted(self) -> torch.Tensor:
        """Whether an overflow now backs off: the hysteresis tracker at 1 or below."""
        return self.counters["hysteresis_tracker"] <= 1

    def update_(self, found_inf: torch.Tensor) -> None:
        """Megatron's ``update(found_inf)``: the trackers, then the scale (torch's kernel)."""
        r = self.rule
        overflow = found_inf > 0
        tracker, hyst = self.growth_tracker, self.counters["hysteresis_tracker"]
        grow = overflow.logical_not() & (tracker >= r.growth_interval - 1)
        backoff = found_inf * self.exhausted()
        # overflow: tracker 0, hysteresis - 1; growth: tracker 0, hysteresis refilled.
        tracker.copy_(torch.where(overflow | grow, 0, tracker + 1))
        hyst.copy_(torch.where(overflow, hyst - 1, torch.where(grow, r.hysteresis, hyst)))
        move_scale_(self.scale, grow, backoff, r)

    @classmethod
    def packed_counters(
        cls,
        rule: ScaleRule,
        growth_tracker: int,
        counters: Mapping[str, int],
        device: torch.device,
    ) -> Any:
        """The growth and hysteresis trackers packed in two float32 values
        (packed)."""
        if cls.update_ is not MegatronPolicy.update_:  # a subclass's own rule runs plainly
            return None
        return PackedCounters(cls, rule, growth_tracker, counters, device)


class DeepSpeedPolicy(LossScalePolicy):
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
    overflow or growth (informative).

    The growth test counts with [`growth_count`][distscaler.policies.DeepSpeedPolicy.growth_count],
    ``(stable - 1) % growth_interval`` (-1 right after an overflow): torch's tracker that restarts
    at -1. The scaler runs it packed (torch's rule + 2 ops).

    Differences: the scale is float32 (DeepSpeed: a Python float), and a growth that would make it
    infinite (beyond 2**127) is skipped, as torch's; a growth interval changed mid-run keeps the
    current count (DeepSpeed takes ``stable`` modulo the new interval).
    """

    name = "deepspeed"
    state_keys = ("cur_iter", "last_overflow_iter", "cur_hysteresis")
    counter_ranges = {
        "cur_iter": (0, V.INT64_MAX),
        "last_overflow_iter": (-1, V.INT64_MAX),
        "cur_hysteresis": (1, V.INT64_MAX),
    }
    hysteresis_counter = "cur_hysteresis"
    accepts_hysteresis = True
    accepts_consecutive_hysteresis = True
    same_rule_as = ("deepspeed.DynamicLossScaler",)

    @classmethod
    def initial_state(cls, rule: ScaleRule) -> dict[str, int]:
        """DeepSpeed's: ``cur_iter`` 0, ``last_overflow_iter`` -1, ``cur_hysteresis`` full."""
        return {"cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": rule.hysteresis}

    @classmethod
    def state_from_checkpoint(
        cls, values: Mapping[str, int], growth_tracker: int, rule: ScaleRule
    ) -> dict[str, int]:
        """DeepSpeed's counters where saved; else ``cur_iter`` from ``num_updates``, the clean
        streak of torch's tracker, and Megatron's hysteresis tracker (kept in [1, hysteresis])."""
        if "cur_iter" in values:
            cur_iter = values["cur_iter"]
        else:
            cur_iter = max(values.get("num_updates", growth_tracker), growth_tracker)
        # Without DeepSpeed's counters, continue the clean streak that torch's tracker counted.
        last = values.get("last_overflow_iter", cur_iter - growth_tracker - 1)
        saved = _saved_hysteresis(values, "cur_hysteresis")
        if saved is None:
            hyst = rule.hysteresis
        elif saved[0] == "cur_hysteresis":
            hyst = saved[1]
        else:  # another rule's counter, which may go below 1
            hyst = min(max(saved[1], 1), rule.hysteresis)
        return {"cur_iter": cur_iter, "last_overflow_iter": last, "cur_hysteresis": hyst}

    @classmethod
    def growth_tracker_from(cls, counters: Mapping[str, int], growth_interval: int) -> int:
        """Clean steps since the last overflow or growth."""
        stable = counters["cur_iter"] - counters["last_overflow_iter"] - 1
        if stable <= growth_interval:
            return max(stable, 0)
        return (stable - growth_interval - 1) % growth_interval

    @staticmethod
    def growth_count_from(cur_iter: int, last_overflow_iter: int, growth_interval: int) -> int:
        """[`growth_count`][distscaler.policies.DeepSpeedPolicy.growth_count] for these counters: -1
        right after an overflow."""
        stable = cur_iter - last_overflow_iter - 1
        return -1 if stable <= 0 else (stable - 1) % growth_interval

    def __init__(
        self,
        rule: ScaleRule,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        counters: Mapping[str, int],
    ) -> None:
        super().__init__(rule, scale, growth_tracker, counters)
        count = self.growth_count_from(
            counters["cur_iter"], counters["last_overflow_iter"], rule.growth_interval
        )
        #: Clean steps towards the next growth (0-dim int64): the scale grows on the clean step
        #: that finds it at ``growth_interval - 1``; -1 after an overflow.
        self.growth_count = torch.tensor(count, dtype=torch.int64).to(scale.device)

    def exhausted(self) -> torch.Tensor | None:
        """Whether an overflow now backs off: ``cur_hysteresis`` at 1 (always with hysteresis 1)."""
        if self.rule.hysteresis == 1:  # DeepSpeed backs off at every overflow, whatever the counter
            return None
        return self.counters["cur_hysteresis"] <= 1

    def update_(self, found_inf: torch.Tensor) -> None:
        """DeepSpeed's ``update_scale(overflow)``: the counters, then the scale (torch's kernel)."""
        r = self.rule
        overflow = found_inf > 0
        c = self.counters
        cur_iter, last, hyst, count = (
            c["cur_iter"], c["last_overflow_iter"], c["cur_hysteresis"], self.growth_count,
        )  # fmt: skip
        exhausted = self.exhausted()
        backs_off = overflow if exhausted is None else overflow & exhausted
        grow = overflow.logical_not() & (count >= r.growth_interval - 1)
        refill = grow | r.consecutive_hysteresis
        # overflow: the hysteresis down by one unless exhausted; clean: refilled on a growth (or
        # at every step when consecutive).
        hyst.copy_(
            torch.where(
                overflow,
                torch.where(backs_off, hyst, hyst - 1),
                torch.where(refill, r.hysteresis, hyst),
            )
        )
        last.copy_(torch.where(overflow, cur_iter, last))
        count.copy_(torch.where(overflow, -1, torch.where(grow, 0, count + 1)))
        cur_iter.add_(1)
        move_scale_(self.scale, grow, backs_off.to(torch.float32), r)

    @classmethod
    def packed_counters(
        cls,
        rule: ScaleRule,
        growth_tracker: int,
        counters: Mapping[str, int],
        device: torch.device,
    ) -> Any:
        """The counters packed in two float32 values (``cur_iter`` and
        ``last_overflow_iter`` as host offsets plus the skip counters' counts)."""
        if cls.update_ is not DeepSpeedPolicy.update_:  # a subclass's own rule runs plainly
            return None
        return DeepSpeedCounters(cls, rule, growth_tracker, counters, device)


# ---------------------------------------------------------------------- the registry

_REGISTRY: dict[str, type[LossScalePolicy]] = {
    p.name: p for p in (TorchPolicy, DeepSpeedPolicy, MegatronPolicy, StaticPolicy)
}


def register_policy(cls: type[LossScalePolicy]) -> type[LossScalePolicy]:
    """Make ``GradScaler(policy=cls.name)`` (and ``ScalerConfig``, checkpoints) accept ``cls``.

    Usable as a class decorator. Register on every rank, before building the scaler and before
    loading a checkpoint saved with it.

    Raises:
        TypeError: ``cls`` is not a [`LossScalePolicy`][distscaler.policies.LossScalePolicy]
            subclass, or leaves an abstract method
            ([`update_()`][distscaler.policies.LossScalePolicy.update_]) undefined.
        ValueError: ``cls.name`` is empty or already taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, LossScalePolicy)):
        raise TypeError(f"policy must be a LossScalePolicy subclass, got: {cls!r}")
    if not cls.name or _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(
            f"policy name must be non-empty and not taken (taken: {policy_names()}), "
            f"got: {cls.name!r}"
        )
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise TypeError(
            f"policy must define {', '.join(missing)} (LossScalePolicy's abstract methods), got: "
            f"{cls.__qualname__}"
        )
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    """The names ``GradScaler(policy=...)`` accepts: the built-ins, then the registered ones."""
    return tuple(_REGISTRY)


def get_policy(name: str) -> type[LossScalePolicy]:
    """The policy class called ``name`` (its settings are in a
    [`ScaleRule`][distscaler.policies.ScaleRule]).

    Raises:
        ValueError: unknown name.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {policy_names()}, got: {name!r}") from None


def policy_for(scaler: str) -> str:
    """The name of the policy whose rule is another stack's ``scaler`` (``"module.Class"``, as in
    [`LossScalePolicy.same_rule_as`][distscaler.policies.LossScalePolicy.same_rule_as])."""
    for cls in _REGISTRY.values():
        if scaler in cls.same_rule_as:
            return cls.name
    raise KeyError(f"no policy has the rule of {scaler!r}")


def _names_with(attribute: str, value: bool = True) -> str:
    names = [n for n, c in _REGISTRY.items() if getattr(c, attribute) is value]
    return " or ".join(repr(n) for n in names)
