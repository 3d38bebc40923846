"""The scaler's state, on the device and packed so that a step updates it with a handful of ops.

Everything that changes from step to step lives here as device tensors, so that a step never reads
a value on the host and a CUDA graph replay advances it exactly as an eager step does:

| tensor | what it holds |
|---|---|
| ``scale`` | 0-dim float32, the loss scale (torch's ``_scale``). |
| ``growth_tracker`` | 0-dim int32, clean steps since the last backoff or growth (torch's ``_growth_tracker``, for ``torch._amp_update_scale_``). |
| ``policy`` | the policy holding its counters ([`distscaler.policies`][distscaler.policies]), or for the DeepSpeed and Megatron rules ``packed``: their counters packed in two float32 values, updated with the skip counters (`distscaler._packed`); made at the first update, until then host numbers. |
| ``skip_counters`` | float32 ``(4,)``: updates, skipped updates, the number (1-based) of the last skipped update, all counted since the last *fold*, and the loss scale that update used. |
| constants | ``zero``, ``one``, ``minus_one``, ``inf`` and one tensor per ``max_norm``, made once, so that no step writes a host number into a tensor. |

The skip counters are float32 so that one foreach op updates them together with the scale used
(float32 counts integers exactly up to 2**24); the host folds them into Python ints whenever it
reads them between iterations (`DeviceState.fold()`), which the scaler does at least every
``skip_log_interval`` updates and every `FOLD_EVERY` updates.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._packed import EXACT_GROWTH_INTERVAL, packed_update_
from ._torch_compat import wide_dtype
from ._validation import check_scale
from .policies import get_policy
from .telemetry import SkipLog

if TYPE_CHECKING:
    from ._packed import Lerp, PackedCounters
    from .policies import LossScalePolicy, ScaleRule
    from .telemetry import SkipTotals

if TYPE_CHECKING:
    from .config import ScalerConfig

__all__ = [
    "FOLD_EVERY",
    "SKIP_COUNTER_KEYS",
    "DeviceState",
    "NextCounters",
    "HostValues",
    "ScalerState",
]

#: Names of the skip counters' values, in order.
SKIP_COUNTER_KEYS = ("num_updates", "num_skipped", "last_skipped", "last_skipped_scale")
#: The host folds the skip counters at least this often (in updates): float32 counts stay exact.
FOLD_EVERY = 1 << 20


class NextCounters(NamedTuple):
    """The counters' next values an update needs, computed ahead by the inf check in the one
    ``_foreach_addcdiv`` it runs anyway (`DeviceState.counter_terms()`): the skip counters' next
    counts and the packed counters' terms, each 0-dim float32 on the scale's device."""

    #: The skip counters' ``num_updates + 1``.
    num_updates: torch.Tensor
    #: The skip counters' ``num_skipped + 1``.
    num_skipped: torch.Tensor
    #: The packed counters' terms (`PackedCounters.terms()`); ``()`` when not packed.
    policy: tuple[torch.Tensor | None, ...]
    #: The packing they were made for (see `DeviceState.counters_valid()`).
    packed: Any


@dataclass
class HostValues:
    """The state as host numbers: before the device state exists, or as read from it."""

    scale: float
    growth_tracker: int
    policy: dict[str, int] = field(default_factory=dict)


class DeviceState:
    """The device tensors of one scaler (see the module docstring). Made once per scaler.

    Args:
        device: where the scale lives (the device of the first scaled loss).
        values: initial scale, growth tracker and policy counters.
        pack_counters: run the DeepSpeed and Megatron rules on packed counters (the torch rule's
            ops + 2, `distscaler._packed`); False runs every policy's plain ``update_`` (their
            reference, for tests).

    Creating it costs a few small device writes, once; nothing here reads a value on the host.
    """

    def __init__(
        self, device: torch.device, values: HostValues, *, pack_counters: bool = True
    ) -> None:
        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((), value, dtype=dtype, device=device)

        if device.type == "cuda" and device.index is None:  # "cuda" means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.scale = full(values.scale, torch.float32)
        self.growth_tracker = full(values.growth_tracker, torch.int32)
        self.pack_counters = pack_counters
        #: The policy's counters as host numbers, until the first update makes them tensors.
        self.host_counters = values
        #: The policy with its counters on the device, None before the first update or if packed.
        self.policy: LossScalePolicy | None = None
        #: The DeepSpeed or Megatron rule's packed counters, None if not packed.
        self.packed: PackedCounters | None = None
        #: The settings the counters follow (see ``prepare``).
        self._rule: ScaleRule | None = None
        #: Changes whenever the packed operands do (a new packing, a changed rule).
        self._packing: object | None = None
        self._operands_for: PackedCounters | None = None
        self._operands_key: object | None = None
        self._terms: tuple[Any, tuple[list, list, list]] | None = None
        self.skip_counters = torch.zeros(len(SKIP_COUNTER_KEYS), dtype=torch.float32, device=device)
        #: 0-dim views of the skip counters' values, for the foreach update.
        self.counts = list(self.skip_counters.unbind())
        self.zero = full(0.0, torch.float32)
        self.one = full(1.0, torch.float32)
        self.minus_one = full(-1.0, torch.float32)
        self.inf = full(float("inf"), torch.float32)
        #: ``[found_inf, sum of squares]`` of a clip at world size > 1 (all-reduced in place; float64,
        #: `wide_dtype()`).
        self.norm_buffer = torch.zeros(2, dtype=wide_dtype(device), device=device)
        self._max_norm: tuple[float, torch.Tensor] | None = None
        # The unpacked counter terms from the start (no op: existing tensors), so that a compiled phase
        # sees the same cache at its first and later calls (dynamo guards on it: recompiles).
        self.counter_terms()

    # ------------------------------------------------------------------ constants

    def max_norm(self, value: float) -> torch.Tensor:
        """0-dim float32 tensor holding ``value``; remade (one fill) only when ``value`` changes.

        Under CUDA graph capture, warm up with the same ``max_norm`` first: a tensor made during
        capture holds its value only once the graph is replayed. Inside ``torch.compile`` it is a
        constant of the graph, and the cache is left alone: dynamo would guard on the cache it saw
        change at the first call, and compile the phase a second time at the next.
        """
        if torch.compiler.is_compiling():
            return torch.full((), value, dtype=torch.float32, device=self.device)
        if self._max_norm is None or self._max_norm[0] != value:
            self._max_norm = (value, torch.full((), value, dtype=torch.float32, device=self.device))
        return self._max_norm[1]

    # ------------------------------------------------------------------ the skip counters

    def skip_counters_(self, found_inf: torch.Tensor, counters: NextCounters, extra: Sequence[Lerp] = ()) -> None:
        """Fold one update in: count it, count it as skipped if ``found_inf``, remember its number
        and the scale it used; ``extra`` lerps ride in the same ``_foreach_lerp_``, the one op of
        this call, where the weight has the tensor's sizes (the policy's 0-dim counters; the
        overflow flags with their own weight, found_inf in every element); a vector with a 0-dim
        weight (the overflow flags' otherwise) is a ``lerp_`` of its own. Call before the policy
        changes the scale.

        Args:
            found_inf: 0-dim float32, exactly 1.0 (skipped) or 0.0.
            counters: `next_counters()`'s: ``num_updates + 1``, ``num_skipped + 1``.
            extra: ``(tensor, end, weight)`` triples, lerped in place with the skip counters.
        """
        nu1, ns1 = counters.num_updates, counters.num_skipped
        one = self.one
        targets, ends = [*self.counts], [nu1, ns1, nu1, self.scale]
        weights = [one, found_inf, found_inf, found_inf]
        apart = []
        for t, e, w in extra:
            if t.shape == w.shape:
                targets.append(t)
                ends.append(e)
                weights.append(w)
            else:  # a vector (the overflow flags) with a 0-dim weight: torch's CUDA foreach
                # kernels take their per-tensor path for the whole list when the sizes of a
                # tensor and of its weight differ (a kernel per entry, 5 in place of 1, seen on
                # an H100), so it runs apart, one lerp_ of its own
                apart.append((t, e, w))
        # lerp with a weight of exactly 0 or 1 selects its start or its end, bit for bit.
        torch._foreach_lerp_(targets, ends, weights)
        for t, e, w in apart:
            t.lerp_(e, w)

    def counter_terms(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(a, b, c)`` lists of the ``a + b / c`` an update needs, for the inf check's own
        multi-tensor op (``_foreach_addcdiv``): ``[num_updates + 1, num_skipped + 1]`` and the
        packed counters' operands (`PackedCounters.operands()`)."""
        self._operands_for = packed = self.packed
        self._operands_key = key = self._packing
        cached = self._terms
        if cached is not None and cached[0] is key:  # the same tensors at every step
            return cached[1]
        one = self.one
        a, b, c = [self.counts[0], self.counts[1]], [one, one], [one, one]
        if packed is not None:
            pa, pb, pc = packed.operands(self.counts[0], one, self.zero, self.minus_one)
            a, b, c = a + pa, b + pb, c + pc
        self._terms = (key, (a, b, c))
        return a, b, c

    def next_counters(self, values: Sequence[torch.Tensor]) -> NextCounters:
        """The results of `counter_terms()`' ``_foreach_addcdiv`` (past the inf check's own), named:
        the skip counters' next counts and the packed counters' terms."""
        packed = self._operands_for
        policy = packed.terms(list(values[2:])) if packed is not None else ()
        return NextCounters(values[0], values[1], policy, self._operands_key)

    def counters_valid(self, counters: NextCounters | None) -> bool:
        """Whether ``counters`` came from `counter_terms()` of the counters as they are packed
        now."""
        return counters is not None and counters.packed is self._packing

    # ------------------------------------------------------------------ policy counters

    def prepare(self, policy: type[LossScalePolicy], rule: ScaleRule) -> None:
        """Make the policy's counters device tensors at their first update (host numbers written
        to the device, no read), or follow a changed rule (the counters keep their values)."""
        held = self.packed.policy if self.packed is not None else type(self.policy)
        if held is policy and (self._rule is rule or self._rule == rule):
            return
        if self.policy is None and self.packed is None or held is not policy:
            host = self.host_counters
            packed = None
            if self.pack_counters:  # the rule's optional hook (None: it runs plainly)
                packed = policy.packed_counters(
                    rule, host.growth_tracker, host.policy, self.device
                )
            if packed is not None:
                if rule.growth_interval > EXACT_GROWTH_INTERVAL:
                    warnings.warn(
                        f"policy={policy.name!r} counts its growth interval in float32: with "
                        f"growth_interval={rule.growth_interval} > {EXACT_GROWTH_INTERVAL} growth "
                        "may come a few steps early or late",
                        stacklevel=4,
                    )
                self.packed = packed
                self.policy = None
                self._packing = object()
            else:
                self.policy = policy(rule, self.scale, self.growth_tracker, host.policy)
                self.packed = None
                self._packing = None
        elif self.packed is not None:
            self.packed.set_rule(rule, self.counts[0])
            self._packing = object()
        else:
            assert self.policy is not None
            self.policy.set_rule(rule)
        self._rule = rule
        if not torch.compiler.is_compiling():
            # The counter terms of the new counters now (no op: existing tensors), so that a
            # compiled phase sees the same cache at its first and later calls.
            self.counter_terms()

    def update_(
        self,
        found_inf: torch.Tensor,
        counters: NextCounters,
        raise_at_minimum: bool,
        extra: Sequence[Lerp] = (),
        held: torch.Tensor | None = None,
    ) -> None:
        """The skip counters (with ``extra`` lerps) and the policy's update, after `prepare()`
        (``counters``: `next_counters()` of the counters as they are now).

        ``held``: 0-dim float32, exactly 1.0 or 0.0, a mismatch flag read on no host (a deferred
        replica check): where it is 1.0 the skip counters count the update as skipped, and where
        ``found_inf`` is 0.0 too the scale, the growth tracker and the policy's counters stay as
        they were (a copy of each before, one ``_foreach_lerp_`` back for the float ones, a
        ``where`` into each integer one): `ScalerState.skip()` without a host read."""
        skipped = found_inf
        kept: list[torch.Tensor] = []
        saved: list[torch.Tensor] = []
        if held is not None:
            skipped = torch.fmax(found_inf, held)
            kept = self._held_tensors()
            saved = [t.clone() for t in kept]
        self._update_(found_inf, skipped, counters, raise_at_minimum, extra)
        if held is not None:
            hold = held > found_inf  # a mismatch with every value finite: not an overflow
            weight = hold.to(torch.float32)
            floats = [(t, s) for t, s in zip(kept, saved) if t.is_floating_point()]
            torch._foreach_lerp_([t for t, _ in floats], [s for _, s in floats],
                                 [weight] * len(floats))  # fmt: skip
            for t, s in zip(kept, saved):
                if not t.is_floating_point():
                    torch.where(hold, s, t, out=t)  # t in place (it overlaps out whole)

    def _held_tensors(self) -> list[torch.Tensor]:
        # What an update moves besides the skip counters: the scale, the growth tracker, the packed
        # counters or every tensor the policy holds (its counters, its own, as DeepSpeed's count).
        tensors = [self.scale, self.growth_tracker]
        if self.packed is not None:
            tensors += self.packed.tensors()
        elif self.policy is not None:
            found = [*self.policy.counters.values(), *vars(self.policy).values()]
            tensors += [t for t in found if isinstance(t, torch.Tensor)]
        unique: dict[int, torch.Tensor] = {}
        for t in tensors:
            unique.setdefault(id(t), t)
        return list(unique.values())

    def _update_(
        self,
        found_inf: torch.Tensor,
        skipped: torch.Tensor,
        counters: NextCounters,
        raise_at_minimum: bool,
        extra: Sequence[Lerp],
    ) -> None:
        if self.packed is not None:

            def lerp_counters(lerps: list[Lerp]) -> None:
                self.skip_counters_(skipped, counters, [*extra, *lerps])

            packed_update_(
                self.packed,
                found_inf,
                counters.policy,  # type: ignore[arg-type]
                lerp_counters,
                scale=self.scale,
                one=self.one,
                zero=self.zero,
                minus_one=self.minus_one,
                raise_at_minimum=raise_at_minimum,
            )
            return
        policy = self.policy
        assert policy is not None
        if raise_at_minimum:
            policy.rule.check_minimum(found_inf, policy.scale, policy.exhausted())
        self.skip_counters_(skipped, counters, extra)
        policy.update_(found_inf)

    # ------------------------------------------------------------------ host reads

    def read(self, *extra: torch.Tensor) -> tuple[list[float], HostValues, list[float]]:
        """Read ``extra`` 0-dim tensors, the state and the skip counters in one host transfer.

        Returns (values of ``extra``, the state as host numbers, the skip counters' four values).
        """
        if self.packed is not None:
            counters = self.packed.tensors()
        else:
            counters = list(self.policy.counters.values()) if self.policy is not None else []
        parts = [t.reshape(1).to(torch.float64) for t in (*extra, self.scale, self.growth_tracker)]
        parts += [t.reshape(1).to(torch.float64) for t in counters]
        parts.append(self.skip_counters.to(torch.float64))
        values = torch.cat(parts).tolist()
        n = len(extra)
        tracker = int(values[n + 1])
        counts_read = values[-len(SKIP_COUNTER_KEYS) :]
        counter_values = values[n + 2 : n + 2 + len(counters)]
        if self.packed is not None:
            tracker, policy_values = self.packed.read(counter_values, counts_read)
        elif self.policy is not None:
            policy = self.policy
            policy_values = {k: int(v) for k, v in zip(policy.state_keys, counter_values)}
            implied = policy.growth_tracker_from(policy_values, policy.rule.growth_interval)
            tracker = tracker if implied is None else implied
        else:
            policy_values = dict(self.host_counters.policy)
        return values[:n], HostValues(values[n], tracker, policy_values), counts_read

    def fold(self, counts_read: list[float]) -> None:
        """Zero the skip counters (``counts_read``: their values as read) after the host has added
        them to its own (between iterations only: an inf check not yet updated holds ``num_updates + 1`` from before
        the fold). Packed counters follow (one more op)."""
        if self.packed is not None:
            self.packed.fold(counts_read, self.counts[0])
        self.skip_counters[:3].zero_()

    def write(self, values: HostValues) -> None:
        """Set the scale, growth tracker and policy counters (``load_state_dict``), with fills; the
        counters become tensors again at the next update."""
        self.scale.fill_(values.scale)
        self.growth_tracker.fill_(values.growth_tracker)
        self.host_counters = values
        self.packed = self.policy = self._rule = None
        self._packing = None
        self.skip_counters.zero_()


class ScalerState:
    """A scaler's state wherever it lives: host numbers until the first scaled loss, then the device
    tensors; the host's side of the skip counters; the update that moves both.

    Args:
        initial: scale, growth tracker and policy counters to start from.
        pack_counters: see `DeviceState` (False: every policy's plain ``update_``).
    """

    def __init__(self, initial: HostValues, *, pack_counters: bool = True) -> None:
        self.initial = initial
        self.pack_counters = pack_counters
        self.device: DeviceState | None = None
        self.skips = SkipLog()
        #: The agreed flag of the last update (0-dim float32 on the device), None before one.
        self.last_found_inf: torch.Tensor | None = None
        self._host_updates = 0  # update() calls seen by the host, for the periodic read
        self._config: ScalerConfig | None = None
        self._rule: ScaleRule | None = None

    @property
    def num_host_updates(self) -> int:
        """``update()`` calls the host has seen (restored with a checkpoint's count)."""
        return self._host_updates

    def materialize(self, device: torch.device | str) -> DeviceState:
        """The device state, created on ``device`` the first time (idempotent)."""
        if self.device is None:
            self.device = DeviceState(
                torch.device(device), self.initial, pack_counters=self.pack_counters
            )
        return self.device

    def read(
        self, *extra: torch.Tensor, fold: bool, world_size: int
    ) -> tuple[list[float], HostValues, SkipTotals]:
        """Read ``extra`` 0-dim tensors and the state in one host transfer; log new skips.

        Returns (values of ``extra``, the state, the run's totals). With ``fold`` (between
        iterations only) the skip counters' counts move into the host's totals.
        """
        state = self.device
        if state is None:
            return [], self.initial, self.skips.totals(None)
        values, host, counts_read = state.read(*extra)
        totals = self.skips.totals(counts_read)
        if fold:
            self.skips.fold(counts_read)
            state.fold(counts_read)
        self.skips.report(totals, host.scale, world_size)
        return values, host, totals

    def update(
        self,
        found_inf: torch.Tensor,
        counters: NextCounters | None,
        config: ScalerConfig,
        extra: Sequence[Lerp] = (),
        held: torch.Tensor | None = None,
    ) -> bool:
        """One update from an agreed ``found_inf`` (0-dim float32, exactly 0.0 or 1.0): the skip
        counters (with ``extra`` lerps, the overflow flags', in its one op where their weight has
        their shape: `DeviceState.skip_counters_()`), then the policy, on
        the device (two ops with the torch policy, four with DeepSpeed's or Megatron's packed, plus
        the clamp with bounds; ``counters``: what the inf check's ``_foreach_addcdiv`` made,
        `DeviceState.counter_terms()`, else one more op makes them); ``held``: a deferred replica
        check's mismatch flag, which skips and holds the update on the device
        (`DeviceState.update_()`). Returns whether the periodic host read is due (every
        ``skip_log_interval`` and `FOLD_EVERY` updates, the same update on every rank; never inside
        CUDA graph capture).

        Raises:
            LossScaleAtMinimumError: ``raise_error_at_min_scale`` and the overflow would lower a
                scale already at ``min_scale`` (checked with one host read), before anything moves.
        """
        state = self.device
        assert state is not None
        rule = self._rule
        if config is not self._config:  # a config is frozen: its rule too
            rule = config.rule()
            if not torch.compiler.is_compiling():  # no cache written while traced (recompiles)
                self._config, self._rule = config, rule
        assert rule is not None
        state.prepare(get_policy(config.policy), rule)
        if counters is None or not state.counters_valid(counters):
            counters = state.next_counters(torch._foreach_addcdiv(*state.counter_terms()))
        state.update_(found_inf, counters, config.raise_error_at_min_scale, extra, held)
        self.last_found_inf = found_inf
        return self._tick(config)

    def skip(self, cause: str, config: ScalerConfig) -> bool:
        """A skipped update that leaves the scale, the growth tracker and the policy's counters as
        they are (a replica mismatch; torchft's uncommitted step): the skip counters count it as
        skipped (two device ops: its counters and the skip counters' ``_foreach_lerp_``), the host keeps
        its ``cause``. Returns whether the periodic host read is due, as `update()`."""
        state = self.device
        assert state is not None
        counters = state.next_counters(torch._foreach_addcdiv(*state.counter_terms()))
        state.skip_counters_(state.one, counters)
        self.last_found_inf = state.zero  # no inf/NaN was found: the step was skipped for `cause`
        self.skips.note_cause(cause)
        return self._tick(config)

    def _tick(self, config: ScalerConfig) -> bool:
        # One update seen by the host: whether the periodic read is due.
        state = self.device
        assert state is not None
        if torch.compiler.is_compiling():
            # As in a CUDA graph replay, the host's count stays where it was inside compiled code:
            # the device counts, and an int that changed at every call would make dynamo guard on
            # it and recompile. No periodic read inside a compiled step.
            return False
        self._host_updates += 1
        interval = config.skip_log_interval
        due = (interval and self._host_updates % interval == 0) or (
            self._host_updates % FOLD_EVERY == 0
        )
        capturing = state.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return bool(due) and not capturing

    def set_scale(self, new_scale: float | torch.Tensor, device_type: str) -> None:
        """``update(new_scale)``: a normal float32 > 0, or a 1-element float32 tensor without grad
        on ``device_type`` (ValueError otherwise, before anything changes)."""
        state = self.device
        assert state is not None
        if not isinstance(new_scale, torch.Tensor):
            state.scale.fill_(check_scale("new_scale", new_scale))
        elif (
            new_scale.device.type != device_type
            or new_scale.numel() != 1
            or new_scale.requires_grad
        ):
            raise ValueError(
                "new_scale must be a float or a 1-element tensor on device type "
                f"{device_type!r} with requires_grad=False, got: {new_scale!r}"
            )
        else:
            state.scale.copy_(new_scale.reshape(()))

    def load(
        self, values: HostValues, num_updates: int, num_skipped: int, causes: dict[str, int]
    ) -> None:
        """Continue from a saved state (``load_state_dict``); ``causes``: the skips of a cause
        the host knows, of ``num_skipped``."""
        self.initial = values
        self.skips.restore(num_updates, num_skipped, causes)
        self._host_updates = num_updates
        if self.device is not None:
            self.device.write(values)

    def portable(self, values: HostValues, totals: SkipTotals) -> ScalerState:
        """A copy holding host numbers only (for pickling): ``values`` and ``totals`` as read."""
        copy = ScalerState(values)
        copy.skips.folded, copy.skips.num_reported = totals, self.skips.num_reported
        copy._host_updates = self._host_updates
        return copy
