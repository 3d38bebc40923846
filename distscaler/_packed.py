"""The DeepSpeed and Megatron rules on packed counters: the torch rule's ops + 2 per update.

Run plainly ([`DeepSpeedPolicy`][distscaler.policies.DeepSpeedPolicy],
[`MegatronPolicy`][distscaler.policies.MegatronPolicy]), a hysteresis rule costs a dozen small
device ops. Here the same rule keeps its counters in two float32 values of one device tensor and
moves them in ops the update runs anyway: the terms it needs are made in the inf check's one
``_foreach_addcdiv`` (`PackedCounters.operands()`), the overflow values ride in the skip counters'
``_foreach_lerp_``, and torch's scale kernel moves the scale, so that `packed_update_()` adds one
``_foreach_clamp_min`` and one ``_foreach_lerp_`` to the torch rule (pinned in
``tests/test_step_cost.py``). The plain rules are its reference: ``tests/test_policies.py`` runs
both over random overflow sequences and compares the scale and every counter at every step.

A rule packs through its own hook,
[`LossScalePolicy.packed_counters()`][distscaler.policies.LossScalePolicy.packed_counters], which
returns one of the forms here (`PackedCounters`: Megatron's; `DeepSpeedCounters`); each form says
what differs in its update (`PackedCounters.backoff_input()`, `PackedCounters.lerps()`), so that
`packed_update_()` runs any of them without asking which it is. This module imports nothing of the
package: ``distscaler.policies`` imports it.

The two values, with ``n`` the skip counters' update count (so that a clean step changes nothing
here) and ``W`` the growth interval:

* ``anchor = n - g + W - 2``, where ``g`` is the growth counter (Megatron's growth tracker;
  DeepSpeed's [`growth_count`][distscaler.policies.DeepSpeedPolicy.growth_count]): ``G = n - anchor
  = g - (W - 2)`` is 1.0 exactly when this clean step grows, <= 0.0 otherwise;
* ``hyst = 2 - hysteresis counter``: > 0.0 exactly when an overflow now backs off.

DeepSpeed's ``cur_iter`` and ``last_overflow_iter`` are the skip counters' update count and last skipped
update (every overflow skips its step) plus host offsets, exact at any length. Counters are exact
while ``growth_interval`` <= `EXACT_GROWTH_INTERVAL` and the hysteresis fits float32's 24-bit
integers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch

__all__ = [
    "EXACT_GROWTH_INTERVAL",
    "DeepSpeedCounters",
    "Lerp",
    "PackedCounters",
    "PackedTerms",
    "packed_update_",
]

#: Above this growth interval the packed counters (float32) no longer count every step exactly.
EXACT_GROWTH_INTERVAL = 1 << 22
#: torch's scale kernel's growth interval here: its growth tracker is the int32 view of a float32
#: that holds exactly 1.0 (bits 0x3F800000) when the scale must grow and 0.0 when it must not, so
#: ``tracker + 1 == interval`` only for 1.0.
_GROW_BITS = 0x3F800000 + 1

#: One in-place lerp of the skip counters' ``_foreach_lerp_``: (tensor, end, weight of 0.0 or 1.0).
Lerp = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: In-place lerps as three lists (tensors, ends, weights), and the overflow lerps.
Lerps = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[Lerp]]


class Rule(Protocol):
    """What a packed form reads of its settings: a ``distscaler.policies.ScaleRule`` (not imported
    here: that module imports this one)."""

    @property
    def growth_factor(self) -> float: ...
    @property
    def backoff_factor(self) -> float: ...
    @property
    def growth_interval(self) -> int: ...
    @property
    def min_scale(self) -> float | None: ...
    @property
    def hysteresis(self) -> int: ...
    @property
    def consecutive_hysteresis(self) -> bool: ...
    def clamp_(self, scale: torch.Tensor) -> None: ...
    def check_minimum(
        self, found_inf: torch.Tensor, scale: torch.Tensor, exhausted: torch.Tensor | None
    ) -> None: ...


class PackedTerms(NamedTuple):
    """What the inf check's ``_foreach_addcdiv`` makes for a packed update (0-dim float32)."""

    #: ``G = n - anchor``: the growth counter relative to ``growth_interval - 2``.
    growth: torch.Tensor
    #: ``n + W - 1``: the anchor that puts the counter at 0 after this update.
    reset: torch.Tensor
    #: ``hyst + 1``: its value after an overflow that does not back off.
    hyst_plus_one: torch.Tensor
    #: DeepSpeed only: ``n + W``, the anchor after an overflow (the counter at -1).
    overflow_anchor: torch.Tensor | None = None
    #: DeepSpeed only: a copy of ``hyst`` (its value where an exhausted overflow keeps it).
    hyst_copy: torch.Tensor | None = None


class PackedCounters:
    """One scaler's counters of a packed rule: Megatron's (`DeepSpeedCounters` for DeepSpeed's).

    Args:
        policy: the rule's ``LossScalePolicy`` subclass, whose hook made this form.
        rule: the settings.
        growth_tracker, values: torch's growth tracker and the policy's counters (host ints).
        device: the scale's device.
    """

    #: Number of operands this rule takes from the inf check's ``_foreach_addcdiv``.
    num_terms = 3

    def __init__(
        self,
        policy: Any,
        rule: Rule,
        growth_tracker: int,
        values: Mapping[str, int],
        device: torch.device,
    ) -> None:
        #: The rule's class (``distscaler.policies``), for the scaler's "same rule?" test.
        self.policy = policy
        values_on_host, self.host = self._pack(growth_tracker, values, rule)
        self.anchor, self.hyst = torch.tensor(values_on_host, dtype=torch.float32).to(device)
        self.device = device
        self._set_constants(rule)

    def _set_constants(self, rule: Rule) -> None:
        self.rule = rule
        w = rule.growth_interval
        # W - 1, W, 2 - hysteresis (``hyst`` after a refill)
        values = torch.tensor([w - 1, w, 2 - rule.hysteresis], dtype=torch.float32)
        self.interval_minus_one, self.interval, self.refill = values.to(self.device)

    def set_rule(self, rule: Rule, num_updates: torch.Tensor) -> None:
        """Follow changed settings; a changed growth interval keeps the count, and past the new
        interval the next clean step grows (``num_updates``: the skip counters' count)."""
        old = self.rule.growth_interval
        if old != rule.growth_interval:
            self.anchor.add_(rule.growth_interval - old)
            self.anchor.copy_(torch.maximum(self.anchor, num_updates - 1.0))
        self._set_constants(rule)

    def _pack(
        self, growth_tracker: int, values: Mapping[str, int], rule: Rule
    ) -> tuple[list[float], dict[str, int]]:
        tracker = min(growth_tracker, rule.growth_interval - 1)
        anchor = rule.growth_interval - 2 - tracker
        return [float(anchor), float(2 - values["hysteresis_tracker"])], {}

    def read(self, values: list[float], counts: list[float]) -> tuple[int, dict[str, int]]:
        """(growth tracker, counters) from `tensors()` and the skip counters read on the host
        (``[num_updates, num_skipped, last_skipped, scale]`` since the last fold)."""
        anchor, hyst = values
        tracker = int(counts[0] - anchor) + self.rule.growth_interval - 2
        return tracker, {"hysteresis_tracker": 2 - int(hyst)}

    def tensors(self) -> list[torch.Tensor]:
        """The two packed values, for the host read."""
        return [self.anchor, self.hyst]

    def fold(self, counts: list[float], num_updates: torch.Tensor) -> None:
        """The skip counters (``counts``, as read) move to the host: rebase ``anchor`` on their
        ``num_updates`` before the state zeroes them (one op)."""
        self.anchor.sub_(num_updates)

    def operands(
        self, n: torch.Tensor, one: torch.Tensor, zero: torch.Tensor, minus_one: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(a, b, c)`` lists of the ``a + b / c`` the inf check's ``_foreach_addcdiv`` makes
        (``n``: the skip counters' update count), in the order of `PackedTerms`."""
        # G = n - anchor, n + W - 1, hyst + 1
        return [n, n, self.hyst], [self.anchor, self.interval_minus_one, one], [minus_one, one, one]

    def terms(self, values: list[torch.Tensor]) -> PackedTerms:
        """The results of `operands()`, named."""
        return PackedTerms(*values)

    def backoff_input(self, one: torch.Tensor) -> torch.Tensor:
        """What `packed_update_()` clamps at 0 into "exhausted" (an overflow now backs off where
        it is > 0): ``hyst``."""
        return self.hyst

    def lerps(
        self,
        terms: PackedTerms,
        grow: torch.Tensor,
        exhausted: torch.Tensor,
        found: torch.Tensor,
        one: torch.Tensor,
    ) -> Lerps:
        """The counters' lerps of one update: those of `packed_update_()`'s ``_foreach_lerp_`` (the
        counters as after a clean step) and the overflow lerps that ride in the skip counters'."""
        anchor, hyst = self.anchor, self.hyst
        # clean: a growth resets the tracker and refills; overflow: reset, hysteresis - 1.
        overflow = [(anchor, terms.reset, found), (hyst, terms.hyst_plus_one, found)]
        return [anchor, hyst], [terms.reset, self.refill], [grow, grow], overflow


class DeepSpeedCounters(PackedCounters):
    """DeepSpeed's: ``cur_iter`` and ``last_overflow_iter`` are host offsets plus the
    skip counters; the growth counter restarts at -1 after an overflow; with ``hysteresis`` 1
    every overflow backs off."""

    num_terms = 5

    def _pack(self, growth_tracker, values, rule):  # type: ignore[no-untyped-def]
        g = self.policy.growth_count_from(
            values["cur_iter"], values["last_overflow_iter"], rule.growth_interval
        )
        host = {"iter": values["cur_iter"], "last": values["last_overflow_iter"]}
        return [float(rule.growth_interval - 2 - g), float(2 - values["cur_hysteresis"])], host

    def read(self, values, counts):  # type: ignore[no-untyped-def]
        num_updates, _, last, _ = counts
        counters = {
            "cur_iter": self.host["iter"] + int(num_updates),
            "last_overflow_iter": self.host["iter"] + int(last) - 1
            if last > 0
            else self.host["last"],
            "cur_hysteresis": 2 - int(values[1]),
        }
        return self.policy.growth_tracker_from(counters, self.rule.growth_interval), counters

    def fold(self, counts, num_updates):  # type: ignore[no-untyped-def]
        n, _, last, _ = counts
        if last > 0:
            self.host["last"] = self.host["iter"] + int(last) - 1
        self.host["iter"] += int(n)
        super().fold(counts, num_updates)

    def operands(self, n, one, zero, minus_one):  # type: ignore[no-untyped-def]
        a, b, c = super().operands(n, one, zero, minus_one)
        # n + W (the counter after an overflow: -1), and a copy of hyst.
        return [*a, n, self.hyst], [*b, self.interval, zero], [*c, one, one]

    def backoff_input(self, one: torch.Tensor) -> torch.Tensor:
        """``hyst``; with ``hysteresis`` 1 a constant 1.0: DeepSpeed backs off at every overflow
        with ``delayed_shift`` 1, whatever ``cur_hysteresis``."""
        return one if self.rule.hysteresis == 1 else self.hyst

    def lerps(self, terms, grow, exhausted, found, one):  # type: ignore[no-untyped-def]
        assert terms.overflow_anchor is not None and terms.hyst_copy is not None
        anchor, hyst = self.anchor, self.hyst
        refill = one if self.rule.consecutive_hysteresis else grow
        # clean: a growth resets the counter to 0 (refills too); overflow: the counter at -1 and
        # the hysteresis down by one unless exhausted (then it stays at 1).
        selves = [anchor, hyst, terms.hyst_plus_one]
        targets = [terms.reset, self.refill, terms.hyst_copy]
        overflow = [(anchor, terms.overflow_anchor, found), (hyst, terms.hyst_plus_one, found)]
        return selves, targets, [grow, refill, exhausted], overflow


def packed_update_(
    counters: PackedCounters,
    found_inf: torch.Tensor,
    terms: PackedTerms,
    lerp_counters: Callable[[list[Lerp]], None],
    *,
    scale: torch.Tensor,
    one: torch.Tensor,
    zero: torch.Tensor,
    minus_one: torch.Tensor,
    raise_at_minimum: bool,
) -> None:
    """One update of a packed rule: the plain rule's ``update_`` in torch's rule's ops + 2.

    1. ``_foreach_clamp_min`` of ``[G, G, hyst, -1]`` at 0 (``hyst``: the form's
       `PackedCounters.backoff_input()`): ``[grow, grow, exhausted, 0]``
       (``g`` never exceeds ``growth_interval - 1`` and a DeepSpeed counter never drops below 1,
       so the first three are exactly 0.0 or 1.0; Megatron's may exceed 1, read only as nonzero);
    2. one ``_foreach_lerp_``: the counters as after a clean step (a growth resets the counter and
       refills the hysteresis; the form's `PackedCounters.lerps()`), the overflow values, and for
       the scale kernel a "grow now" flag (``grow`` unless overflow) and a "back off now" flag
       (``found_inf * exhausted``);
    3. ``lerp_counters`` runs the skip counters' ``_foreach_lerp_`` (there anyway) with the counters'
       overflow lerps (to their overflow values where ``found_inf`` is 1.0);
    4. ``torch._amp_update_scale_`` backs off where "back off now" is nonzero and grows where the
       int32 view of "grow now" is the bits of 1.0 (`_GROW_BITS`), so growth and backoff are torch's
       exact products and a growth past float32 is skipped as torch skips it; then the clamp to
       ``[min_scale, max_scale]`` (with bounds).
    """
    rule = counters.rule
    found = found_inf
    grow, grow_now, exhausted, backoff_now = torch._foreach_clamp_min(
        [terms.growth, terms.growth, counters.backoff_input(one), minus_one], 0.0
    )
    if raise_at_minimum:
        rule.check_minimum(found, scale, exhausted)
    selves, targets, weights, overflow = counters.lerps(terms, grow, exhausted, found, one)
    torch._foreach_lerp_(
        [*selves, grow_now, backoff_now], [*targets, zero, exhausted], [*weights, found, found]
    )
    lerp_counters(overflow)
    torch._amp_update_scale_(
        scale, grow_now.view(torch.int32), backoff_now, rule.growth_factor, rule.backoff_factor,
        _GROW_BITS,
    )  # fmt: skip
    rule.clamp_(scale)
