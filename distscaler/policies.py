"""Loss-scale update rules ("policies"), applied on the device with no host read.

A policy turns the agreed ``found_inf`` of one iteration into the next loss scale. The scaler's
device state owns ``scale`` and torch's ``growth_tracker`` (so that ``state_dict`` stays
torch-compatible); a policy names the counters it saves (``state_keys``: DeepSpeed's
``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``; Megatron's ``hysteresis_tracker``) and
keeps them *packed* on the device: a few float32 lanes that its ``update_`` moves in place with
multi-tensor ops, riding where it can in the ops an update runs anyway (the verdict's epilogue,
the skip record's ``_foreach_lerp_``), so that DeepSpeed's and Megatron's rules cost the torch
rule's ops + 2 (:class:`_PackedPolicy`). Every setting a rule reads comes from one
:class:`ScaleRule`.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch

from .errors import MIN_SCALE_MESSAGE, LossScaleAtMinimumError

__all__ = [
    "MIN_SCALE_MESSAGE",
    "POLICIES",
    "LossScaleAtMinimumError",
    "DeepSpeedEnds",
    "PackedEnds",
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


#: ``_amp_update_scale_``'s growth interval under a packed policy (see :class:`_PackedPolicy`): its
#: growth tracker is the int32 view of a float32 lane that holds exactly 1.0 (bits 0x3F800000) when
#: the scale must grow and 0.0 when it must not, so ``tracker + 1 == interval`` only for 1.0.
_GROW_BITS = 0x3F800000 + 1
#: Above this growth interval the packed counters (float32) no longer count every step exactly.
EXACT_GROWTH_INTERVAL = 1 << 22

#: One in-place lerp of the skip record's ``_foreach_lerp_``: (tensor, end, weight of 0.0 or 1.0).
Lerp = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class PolicyConstants:
    """A packed rule's device constants (0-dim float32), made once per rule."""

    interval_minus_one: torch.Tensor  # growth_interval - 1
    interval: torch.Tensor  # growth_interval
    refill: torch.Tensor  # 2 - hysteresis: the hysteresis lane after a refill

    @classmethod
    def make(cls, rule: ScaleRule, device: torch.device) -> PolicyConstants:
        values = torch.tensor(
            [rule.growth_interval - 1, rule.growth_interval, 2 - rule.hysteresis],
            dtype=torch.float32,
        ).to(device)
        return cls(*values.unbind())


class PackedEnds(NamedTuple):
    """A hysteresis policy's lanes of the verdict's epilogue (:meth:`ScalePolicy.operands`), each a
    0-dim float32 made in the verdict's one ``_foreach_addcdiv`` (``n``: the skip record's update
    count, ``W``: the growth interval)."""

    #: ``G = n - anchor``: the growth counter relative to ``growth_interval - 2``.
    growth: torch.Tensor
    #: ``n + W - 1``: the anchor that puts the counter at 0 after this update.
    reset: torch.Tensor
    #: The hysteresis lane plus one: its value after an overflow that does not back off.
    hyst_plus_one: torch.Tensor


class DeepSpeedEnds(NamedTuple):
    """DeepSpeed's lanes of the epilogue: :class:`PackedEnds`' and two more."""

    growth: torch.Tensor
    reset: torch.Tensor
    hyst_plus_one: torch.Tensor
    #: ``n + W``: the anchor after an overflow (the counter at -1).
    overflow_anchor: torch.Tensor
    #: A copy of the hysteresis lane (its value where an exhausted overflow keeps it).
    hyst_copy: torch.Tensor


class UpdateContext(NamedTuple):
    """What one update hands its policy (all tensors 0-dim float32 on the scale's device unless
    said).

    Attributes:
        scale: the loss scale, updated in place. growth_tracker: torch's (int32).
        found: the agreed flag, exactly 1.0 or 0.0.
        lanes: the policy's packed counters (views of one float32 tensor), updated in place.
        ends: the policy's part of the epilogue, named by the policy (:meth:`ScalePolicy.name_ends`
            of :meth:`ScalePolicy.operands`, made by the verdict in the same multi-tensor op as the
            skip record's next counts); ``()`` for policies without lanes.
        consts: the rule's constants (None for policies without lanes).
        one, zero, minus_one: constants.
        raise_at_minimum: raise :class:`LossScaleAtMinimumError` (one host read).
        record: runs the skip record's one ``_foreach_lerp_`` with these lerps added; the policy
            calls it exactly once, after its raise check and before it changes the scale.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    found: torch.Tensor
    lanes: list[torch.Tensor]
    ends: tuple[torch.Tensor, ...]
    consts: PolicyConstants | None
    one: torch.Tensor
    zero: torch.Tensor
    minus_one: torch.Tensor
    rule: ScaleRule
    raise_at_minimum: bool
    record: Callable[[list[Lerp]], None]


class ScalePolicy:
    """The seam every update rule implements; the base is the policy without extra state.

    ``update_`` runs entirely on the device of the scale (no ``.item()``, no Python branching on
    tensor values) unless ``raise_at_minimum`` asks for its one host read, so that
    ``GradScaler.update()`` adds no host sync and can be captured in a CUDA graph.

    A policy with counters keeps them *packed*: ``num_lanes`` float32 lanes of one device tensor
    (:meth:`pack` / :meth:`unpack` convert them from / to the counters of :attr:`state_keys`), and
    the verdict's epilogue computes what the update needs from them (:meth:`operands`) in the op it
    runs anyway, so that the rule costs a few multi-tensor ops.
    """

    name: str = ""
    #: Names of the policy's counters, as saved in ``state_dict`` (host ints).
    state_keys: tuple[str, ...] = ()
    #: float32 lanes the packed counters take on the device (0: none).
    num_lanes: int = 0

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

    # ------------------------------------------------------------------ packed counters

    def pack(
        self, growth_tracker: int, values: dict[str, int], rule: ScaleRule
    ) -> tuple[list[float], dict[str, int]]:
        """The lanes for these counters (with the skip record's update count at 0), and the host
        numbers the policy keeps beside them (see :meth:`unpack`)."""
        return [], {}

    def unpack(
        self, lanes: list[float], record: list[float], host: dict[str, int], rule: ScaleRule
    ) -> tuple[int, dict[str, int]]:
        """(growth tracker, counters) from lanes read on the host and the skip record's lanes
        (``[num_updates, num_skipped, last_skipped, scale]`` since the last fold)."""
        return 0, {}

    def fold(self, record: list[float], host: dict[str, int]) -> None:
        """The skip record's counts are moving to the host: keep what the policy derives from them
        (the device lanes are rebased by the state)."""

    def operands(
        self, lanes: list[torch.Tensor], n: torch.Tensor, consts: PolicyConstants, one, zero, minus
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(a, b, c)`` lists of the epilogue's ``a + b / c`` lanes (``n``: the record's update
        count), in the order of the fields of :meth:`name_ends`."""
        return [], [], []

    def name_ends(self, values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The epilogue's results of :meth:`operands`, as the named tuple :meth:`update_` reads
        (``ctx.ends``)."""
        return ()

    def update_(self, ctx: UpdateContext) -> None:
        """One update: ``ctx.record`` once, then the scale (clamped to the rule's bounds)."""
        raise NotImplementedError


def _clamp_(scale: torch.Tensor, rule: ScaleRule) -> None:
    if rule.bounded:
        scale.clamp_(min=rule.min_scale, max=rule.max_scale)


def _check_minimum(ctx: UpdateContext, exhausted: torch.Tensor | None) -> None:
    """Raise when this update would back off a scale already at ``min_scale``: one host read of the
    flag, whether the hysteresis is exhausted and the scale (``stack`` + ``tolist``)."""
    parts = [ctx.found, ctx.scale] if exhausted is None else [ctx.found, ctx.scale, exhausted]
    values = torch.stack(parts).tolist()
    exhausted_now = values[2] > 0 if exhausted is not None else True
    min_scale = ctx.rule.min_scale
    if values[0] > 0 and exhausted_now and min_scale is not None and values[1] <= min_scale:
        raise LossScaleAtMinimumError(MIN_SCALE_MESSAGE)


class TorchPolicy(ScalePolicy):
    """torch's rule, via the same kernel ``torch.amp.GradScaler.update`` uses (bit-identical).

    On overflow: ``scale *= backoff_factor`` and the growth tracker resets to 0. Otherwise the tracker
    counts clean steps; at ``growth_interval`` the scale is multiplied by ``growth_factor`` (only if the
    result is finite) and the tracker resets. One kernel (plus one clamp with bounds). Source:
    ``torch._amp_update_scale_``.
    """

    name = "torch"

    def update_(self, ctx: UpdateContext) -> None:
        if ctx.raise_at_minimum:
            _check_minimum(ctx, None)
        ctx.record([])
        r = ctx.rule
        torch._amp_update_scale_(
            ctx.scale, ctx.growth_tracker, ctx.found, r.growth_factor, r.backoff_factor,
            r.growth_interval,
        )  # fmt: skip
        _clamp_(ctx.scale, r)


class StaticPolicy(ScalePolicy):
    """A fixed scale: overflows are skipped (unless the scaler is told not to) but change nothing.

    DeepSpeed's static ``loss_scale > 0``, and bf16/fp32 training at a scale of 1.0. No device op.
    """

    name = "static"

    def update_(self, ctx: UpdateContext) -> None:
        ctx.record([])


class _PackedPolicy(ScalePolicy):
    """A hysteresis rule in three multi-tensor ops and torch's scale kernel.

    Two float32 lanes: ``anchor = num_updates - g + growth_interval - 2``, where ``g`` is the growth
    counter (the skip record's ``num_updates`` lane counts the steps, so a clean step changes
    nothing here) and ``hyst = 2 - hysteresis counter``. Per update, with ``G = g -
    (growth_interval - 2)`` and the other epilogue lanes made by the verdict's own multi-tensor op:

    1. ``_foreach_clamp_min`` of ``[G, G, hyst, -1]`` at 0: ``[grow, grow, exhausted, 0]``
       (``g`` never exceeds ``growth_interval - 1`` and a DeepSpeed counter never drops below 1,
       so the first three are exactly 0.0 or 1.0; Megatron's may exceed 1, read only as nonzero);
    2. one ``_foreach_lerp_``: the lanes as after a clean step (a growth resets the counter and
       refills the hysteresis), the overflow lanes, and for the scale kernel a "grow now" flag
       (``grow`` unless overflow) and a "back off now" flag (``found * exhausted``);
    3. the skip record's ``_foreach_lerp_`` (there anyway) takes the lanes to their overflow values
       where ``found`` is 1.0;
    4. ``torch._amp_update_scale_`` moves the scale: it backs off where "back off now" is nonzero
       and grows where the int32 view of "grow now" is the bits of 1.0 (its growth interval is
       those bits plus one), so growth and backoff are torch's exact products, a growth past
       float32 is skipped as torch skips it, and its own tracker is a throw-away lane; then the
       clamp to ``[min_scale, max_scale]`` (with bounds).

    Counters are exact while ``growth_interval`` <= :data:`EXACT_GROWTH_INTERVAL` and the
    hysteresis fits float32's 24-bit integers.
    """

    num_lanes = 2
    deepspeed = False

    def fold(self, record, host):  # type: ignore[override]
        return None

    def _hyst_input(self, ctx: UpdateContext) -> torch.Tensor:
        return ctx.lanes[1]

    def operands(self, lanes, n, consts, one, zero, minus):  # type: ignore[override]
        anchor, hyst = lanes
        # G = n - anchor, n + W - 1, hyst + 1
        return (
            [n, n, hyst],
            [anchor, consts.interval_minus_one, one],
            [minus, one, one],
        )

    def name_ends(self, values):  # type: ignore[override]
        return PackedEnds(*values)

    def update_(self, ctx: UpdateContext) -> None:
        consts = ctx.consts
        assert consts is not None
        g_rel = ctx.ends.growth  # type: ignore[attr-defined]
        found = ctx.found
        grow, grow_now, exhausted, backoff_now = torch._foreach_clamp_min(
            [g_rel, g_rel, self._hyst_input(ctx), ctx.minus_one], 0.0
        )
        if ctx.raise_at_minimum:
            _check_minimum(ctx, exhausted)
        selves, ends, weights, overflow = self._clean(ctx, grow, exhausted)
        torch._foreach_lerp_(
            [*selves, grow_now, backoff_now],
            [*ends, ctx.zero, exhausted],
            [*weights, found, found],
        )
        ctx.record(overflow)
        r = ctx.rule
        torch._amp_update_scale_(
            ctx.scale, grow_now.view(torch.int32), backoff_now, r.growth_factor,
            r.backoff_factor, _GROW_BITS,
        )  # fmt: skip
        _clamp_(ctx.scale, r)

    def _clean(self, ctx, grow, exhausted):
        raise NotImplementedError


class MegatronPolicy(_PackedPolicy):
    """Megatron-LM's ``DynamicGradScaler`` rule (``megatron/core/optimizer/grad_scaler.py``).

    On overflow: the growth tracker resets to 0 and the hysteresis tracker drops by one; once it is
    <= 0, every overflow backs off: ``scale = max(scale * backoff_factor, min_scale)``. On a clean
    step the growth tracker counts; at ``growth_interval`` it resets, the hysteresis tracker refills
    to ``hysteresis`` and ``scale *= growth_factor``.

    Differences, both outside Megatron's own use: growth is skipped when it would make the float32
    scale infinite (as torch's; the tracker still resets and the hysteresis refills), and the
    growth test is ``tracker >= growth_interval`` instead of ``==`` so that lowering the interval
    mid-run with ``set_growth_interval`` cannot stop growth. Packed (:class:`_PackedPolicy`): the
    update costs three multi-tensor ops and torch's scale kernel (plus the clamp with bounds).
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

    def pack(self, growth_tracker, values, rule):  # type: ignore[override]
        tracker = min(growth_tracker, rule.growth_interval - 1)
        anchor = rule.growth_interval - 2 - tracker
        return [float(anchor), float(2 - values["hysteresis_tracker"])], {}

    def unpack(self, lanes, record, host, rule):  # type: ignore[override]
        anchor, hyst = lanes
        tracker = int(record[0] - anchor) + rule.growth_interval - 2
        return tracker, {"hysteresis_tracker": 2 - int(hyst)}

    def _clean(self, ctx, grow, exhausted):
        anchor, hyst = ctx.lanes
        ends = ctx.ends
        reset, hyst_plus_one = ends.reset, ends.hyst_plus_one  # reset: the tracker at 0 after
        found = ctx.found
        # clean: a growth resets the tracker and refills; overflow: reset, hysteresis - 1.
        clean = ([anchor, hyst], [reset, ctx.consts.refill], [grow, grow])
        return (*clean, [(anchor, reset, found), (hyst, hyst_plus_one, found)])


class DeepSpeedPolicy(_PackedPolicy):
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

    Packed (:class:`_PackedPolicy`): the growth counter is ``(stable - 1) % growth_interval``
    (-1 right after an overflow), the same rule as torch's tracker that restarts at -1;
    ``cur_iter`` and ``last_overflow_iter`` are the skip record's update count and last skipped
    update (every overflow skips its step) plus host offsets, exact at any length. The update costs
    three multi-tensor ops and torch's scale kernel (plus the clamp with bounds).

    Differences: the scale is float32 (DeepSpeed: a Python float), and a growth that would make it
    infinite (beyond 2**127) is skipped, as torch's; a growth interval changed mid-run keeps the
    current count (DeepSpeed takes ``stable`` modulo the new interval).
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

    def pack(self, growth_tracker, values, rule):  # type: ignore[override]
        window = rule.growth_interval
        stable = values["cur_iter"] - values["last_overflow_iter"] - 1
        g = -1 if stable <= 0 else (stable - 1) % window
        host = {"iter": values["cur_iter"], "last": values["last_overflow_iter"]}
        return [float(window - 2 - g), float(2 - values["cur_hysteresis"])], host

    def unpack(self, lanes, record, host, rule):  # type: ignore[override]
        num_updates, _, last, _ = record
        cur_iter = host["iter"] + int(num_updates)
        last_overflow = host["iter"] + int(last) - 1 if last > 0 else host["last"]
        window = rule.growth_interval
        stable = cur_iter - last_overflow - 1  # as interop's _deepspeed_growth_tracker
        tracker = max(stable, 0) if stable <= window else (stable - window - 1) % window
        return tracker, {
            "cur_iter": cur_iter,
            "last_overflow_iter": last_overflow,
            "cur_hysteresis": 2 - int(lanes[1]),
        }

    def fold(self, record, host):  # type: ignore[override]
        num_updates, _, last, _ = record
        if last > 0:
            host["last"] = host["iter"] + int(last) - 1
        host["iter"] += int(num_updates)

    def _hyst_input(self, ctx: UpdateContext) -> torch.Tensor:
        # DeepSpeed backs off at every overflow with delayed_shift 1, whatever cur_hysteresis.
        return ctx.one if ctx.rule.hysteresis == 1 else ctx.lanes[1]

    def operands(self, lanes, n, consts, one, zero, minus):  # type: ignore[override]
        a, b, c = super().operands(lanes, n, consts, one, zero, minus)
        # n + W (the counter after an overflow: -1), and a copy of the hysteresis lane.
        return [*a, n, lanes[1]], [*b, consts.interval, zero], [*c, one, one]

    def name_ends(self, values):  # type: ignore[override]
        return DeepSpeedEnds(*values)

    def _clean(self, ctx, grow, exhausted):
        anchor, hyst = ctx.lanes
        ends = ctx.ends
        reset, hyst_plus_one = ends.reset, ends.hyst_plus_one
        overflow_anchor, hyst_copy = ends.overflow_anchor, ends.hyst_copy
        refill = ctx.one if ctx.rule.consecutive_hysteresis else grow
        found = ctx.found
        # clean: a growth resets the counter to 0 (refills too); overflow: the counter at -1 and
        # the hysteresis down by one unless exhausted (then it stays at 1).
        return (
            [anchor, hyst, hyst_plus_one],
            [reset, ctx.consts.refill, hyst_copy],
            [grow, refill, exhausted],
            [(anchor, overflow_anchor, found), (hyst, hyst_plus_one, found)],
        )


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
