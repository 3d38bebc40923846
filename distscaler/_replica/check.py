"""The replica check as the scaler runs it: when it is due, its part of the step's collective, its
reading at the step or later on the device, and what it settles at ``update()``.

`ReplicaCheck` is the `distscaler.checks.Check` the scaler holds; at each step it is due it makes a
`ReplicaSlots` and declares it as the `distscaler.checks.Contribution` (`ReplicaSlots.local_slots()`
and `ReplicaSlots.read_slots()`), whose reading is a `MismatchReading` (read on the host at the
step) or a `DeferredReading` (the mismatch flag kept on the device until the host's next read of the
scaler). The checksum is `distscaler._replica.checksum`'s, the naming of ranks
`distscaler._replica.naming`'s; what users see (the ledger, the mismatch) is
[`distscaler.replica_check`][distscaler.replica_check].
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..checks import Contribution, KernelPart, Settlement
from ..errors import ReplicaMismatchError
from ..replica_check import (
    INTERVAL,
    MAX_WORLD_SIZE,
    OnMismatch,
    ReplicaLedger,
    ReplicaMismatch,
    ReplicaSet,
    warn_rank0,
)
from .checksum import (
    PRIMES,
    RESIDUES,
    Key,
    global_rows,
    kernel_keys,
    layout_terms,
    mismatch_flag,
    mismatched,
    moduli_tensor,
    rank_slots,
    slot_numel,
    to_limbs,
    words,
)
from .naming import name_ranks

if TYPE_CHECKING:
    from .._plan import StepPlan
    from ..config import ScalerConfig

__all__ = ["DeferredReading", "MismatchReading", "ReplicaCheck", "ReplicaSlots"]


class ReplicaSlots:
    """The replica check's part of one step's collective (declared as a
    `distscaler.checks.Contribution` by `ReplicaCheck.contribution()`): its local part, the
    checksum slots of this rank's replicated gradients (and, when due, parameters and optimizer
    state), summed over the group; its reading, a `MismatchReading` (or None), with its
    consequences (the ledger, the log line, ``"raise"``, the callback).

    Made by `ReplicaCheck.contribution()` when the plan is built; the pass computes
    `local_slots()` from the gradients it reads, and `read_slots()` takes the reduced slots (one
    host read; on a mismatch one gather on every rank together), or, ``deferred``, keeps them with
    their mismatch flag on the device (`DeferredReading`) for `ReplicaCheck.count()` and
    `ReplicaCheck.name()`."""

    def __init__(
        self,
        check: ReplicaCheck,
        sets: dict[int, ReplicaSet | None],
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
        with_grads: bool,
        with_params: bool,
        deferred: bool = False,
        keyed: bool = True,
    ) -> None:
        self.check = check
        #: The Triton pass adds the keyed sums ``R`` at this check (`kernel_keys()`); without
        #: them its ``R`` is 0 on every rank (two changed words still certain).
        self.keyed = keyed
        #: The reading waits for `ReplicaCheck.count()` (`DeferredReading`): no host read; it
        #: keeps this rank's non-finite flag from before the reduce.
        self.deferred = deferred
        self.sets = sets
        self.optimizer = optimizer
        self.group = group
        self.world_size = world_size
        self.device = device
        self.with_grads = with_grads
        self.with_params = with_params
        #: Slots in the collective: the gradients' limbs, then the parameters' (zeros when not
        #: checked this step: the slots' places stay fixed).
        self.slots = slot_numel(world_size)
        self.numel = self.slots * (2 if with_params else 1)
        #: The keyed weights of this run (`ReplicaCheck.key()`: one broadcast, once).
        self.key = check.key(group, device)
        #: Per checked kind, each tensor's global checksum rows (or what makes them, on a
        #: mismatch only) and its replica set, for naming the ranks.
        self._global: dict[str, tuple[Any, list[ReplicaSet | None]]] = {}
        self._grads: Sequence[torch.Tensor] = ()
        self.param_nonfinite: torch.Tensor | None = None
        #: The Triton pass takes the word sums in its read and sums the slots in its reduction.
        self.kernel_part: KernelPart | None = KernelPart(PRIMES, self.kernel_terms,
                                                         self.kernel_keys)  # fmt: skip

    # -- the local part

    def kernel_terms(
        self, params: tuple[torch.Tensor, ...], grads: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """The gradients' terms for a pass that sums this check's ``A, B, C`` residues in its own
        reduction (`distscaler._triton.slot_sums()`): `layout_terms()`' int64 ``(len(grads),
        8)`` on the device; made once per layout. None where the gradients are not compared at
        this step. ``grads`` in the order of ``params``; the pass gives the sums to
        `local_slots()`."""
        if not self.with_grads:
            return None
        sets = [self.sets.get(id(p)) for p in params]
        return self.check.layout_terms("gradients", grads, sets, self.device)

    def kernel_keys(
        self, params: tuple[torch.Tensor, ...], grads: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """The gradients' keyed weights for the kernel's keyed sums (`kernel_keys()`' int32
        table on the device, for this run's secret); made once per layout. None where the
        gradients are not compared at this step, or compared without keyed sums (``keyed``)."""
        if not (self.with_grads and self.keyed):
            return None
        sets = [self.sets.get(id(p)) for p in params]
        return self.check.kernel_keys(grads, sets, self.key, self.device)

    def local_slots(
        self, params: tuple[torch.Tensor, ...], grads: Sequence[torch.Tensor],
        moments: torch.Tensor | None = None, sums: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's slots, float32 ``(numel,)`` on the device: the limbs of its residues
        (`distscaler._replica.checksum`). ``grads``: the gathered gradients in the order of
        ``params`` (as the pass reads them); ``moments``: their `word_moments()` when the pass
        computed them in its read (the Triton kernel: int64 ``(n, 6)`` with the keyed sums of
        `kernel_keys()`), else all is computed here (one read, the keyed sums included);
        ``sums``: the gradients' residues before their last reduction, int64 ``(8,)``, which the
        pass sums from `kernel_terms()` and `kernel_keys()` wherever it computed ``moments`` (``R``
        is 0 where it had no keys, on every rank: two changed words are still certain; then a few
        ops make the slots, and each tensor's global checksum is made only on a mismatch)."""
        sets = [self.sets.get(id(p)) for p in params]
        self._grads = grads  # read again only on a mismatch: whether a value is inf/NaN
        parts: list[torch.Tensor] = []
        if self.with_grads and moments is not None:
            assert sums is not None, "the pass sums the slots wherever it takes the moments"
            terms = self.check.layout_terms("gradients", grads, sets, self.device)
            residues = sums.remainder(moduli_tensor(self.device, RESIDUES))
            parts.append(to_limbs(residues, self.world_size))
            self._global["gradients"] = (functools.partial(_kernel_rows, moments, terms),
                                         list(sets))  # fmt: skip
        elif self.with_grads:
            taken = rank_slots(grads, sets, self.key, self.device)
            parts.append(to_limbs(taken.residues, self.world_size))
            self._global["gradients"] = (taken.rows, list(sets))
        else:
            parts.append(torch.zeros(self.slots, dtype=torch.float32, device=self.device))
        if self.with_params:
            tensors: list[torch.Tensor] = []
            owners: list[ReplicaSet | None] = []
            weights: list[torch.Tensor] = []
            for p, s in zip(params, sets):
                if s is None:
                    continue
                weights.append(getattr(p, "_local_tensor", p))
                for t in (p, *self.optimizer.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        tensors.append(getattr(t, "_local_tensor", t))
                        owners.append(s)
            if weights:  # a non-finite parameter, for the collapse report
                self.param_nonfinite = torch.stack(
                    [w.detach().isfinite().all() for w in weights]
                ).all().logical_not()
            taken = rank_slots(tensors, owners, self.key, self.device)
            parts.append(to_limbs(taken.residues, self.world_size))
            self._global["parameters"] = (taken.rows, list(owners))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- the reading

    def read_slots(
        self,
        reduced: torch.Tensor,
        local_flag: torch.Tensor | None = None,
        agreed: torch.Tensor | None = None,
    ) -> MismatchReading | DeferredReading | None:
        """What the reduced slots show, counted in the ledger. At once (one host read): the
        mismatch as a `MismatchReading` (or None when the replicas agree), acted on (``"raise"``:
        `ReplicaMismatchError`; a callable is called); every rank reads the same slots, so every
        rank returns the same. Where the check is ``deferred``: a `DeferredReading` holding the
        mismatch flag on the device (no host read; ``local_flag``: this rank's non-finite flag
        before the reduce), read by `ReplicaCheck.count()` and named by `ReplicaCheck.name()`
        later."""
        check = self.check
        step = check.iteration + 1
        ledger = check.ledger
        ledger.checks += self.with_grads
        ledger.param_checks += self.with_params
        if self.with_params:
            ledger.param_checks_at = step
        if self.deferred:
            assert local_flag is not None
            self._grads = ()  # nothing is read again: the flag before the reduce says it
            return DeferredReading(self, step, reduced, mismatch_flag(reduced, self.world_size),
                                   local_flag.reshape(-1)[:1])  # fmt: skip
        values = reduced.tolist()
        if self.param_nonfinite is not None and bool(self.param_nonfinite):
            check.nonfinite_parameters = True  # for the collapse report at the next read
        if not self.differs(values):
            return None
        local_nonfinite = any(
            not bool(g.isfinite().all()) for g in self._grads if g.is_floating_point()
        )  # a mismatch's one more read: an inf/NaN makes it an overflow too
        mismatch = self.mismatch_at(step, values, local_nonfinite)
        if check.on_mismatch == "raise":
            raise ReplicaMismatchError(mismatch)
        return MismatchReading(mismatch)

    def differs(self, values: Sequence[float]) -> list[str]:
        """What the reduced slots (host floats) show differing: ``"gradients"``, ``"parameters"``
        or both, in that order; empty when the replicas agree."""
        n = self.slots
        parts = [("gradients", values[0:n]), ("parameters", values[n : 2 * n])]
        return [what for what, slots in parts if slots and mismatched(slots, self.world_size)]

    def mismatch_at(
        self, step: int, values: Sequence[float], local_nonfinite: bool
    ) -> ReplicaMismatch:
        """The mismatch the reduced slots (``values``, host floats, some differing) show at update
        ``step``: the ranks named (`name_ranks()`: one gather on every rank together), noted in the
        ledger, logged on rank 0; a callable ``on_mismatch`` is called. ``local_nonfinite``: this
        rank's checked tensors held inf/NaN."""
        check = self.check
        what = self.differs(values)[0]
        rows, owners = self._global[what]
        if callable(rows):
            rows = rows()
        ranks, sets, nonfinite = name_ranks((rows, owners), self.group, local_nonfinite)
        on_mismatch = check.on_mismatch
        action = on_mismatch if isinstance(on_mismatch, str) else "callback"
        mismatch = ReplicaMismatch(step, what, ranks, sets, action, nonfinite)  # type: ignore[arg-type]
        check.ledger.note_mismatch(mismatch)
        warn_rank0("replica mismatch at %s; the step is skipped on every rank",
                    mismatch.describe())  # fmt: skip
        if callable(on_mismatch):
            on_mismatch(mismatch)
        return mismatch


@dataclass(frozen=True, slots=True)
class MismatchReading:
    """A replica mismatch read on the host at the step (a `distscaler.checks.Reading`): the
    step is skipped on every rank, and the iteration is a skip of its own cause
    (``"replica_mismatch"``: the scale does not move) unless some rank held inf/NaN and the
    overflow check saw it (the agreed ``found_inf`` is 1.0): then it is an overflow too, and every
    rank backs off alike. Below a loss scale of 1 the unscale can make an inf of a finite value
    after torch's kernel checked it: ``found_inf`` is then 0.0 and the skip is the mismatch's."""

    mismatch: ReplicaMismatch

    @property
    def host_skip(self) -> bool:
        """True: the step is skipped, known on the host."""
        return True

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """1.0 (``one``): the step is skipped."""
        return one

    def settle(self, found_inf: Callable[[], bool]) -> Settlement:
        """A skip of cause ``"replica_mismatch"`` with the mismatch as its report, or nothing of
        its own where it is an overflow too (one host read of ``found_inf``, at a mismatch that
        named a rank holding inf/NaN only)."""
        if self.mismatch.nonfinite and found_inf():
            return Settlement()
        return Settlement("replica_mismatch", self.mismatch)

    def close(self, number: int, found_inf: torch.Tensor, *, counted: bool) -> None:
        """Nothing: the ledger counted it when it was read."""


@dataclass(frozen=True, slots=True)
class DeferredReading:
    """A replica check whose reading waits (a fused step on CUDA with the Triton kernels, the
    default cadence; a `distscaler.checks.Reading`): the mismatch flag on the device, which the
    step and the update take without a host read, and what the later reading needs. Made by
    `ReplicaSlots.read_slots()`; `ReplicaCheck.count()` reads it at the host's next read of the
    scaler."""

    #: The check's part of the step (its checksums, for naming the ranks).
    slots: ReplicaSlots
    #: The 1-based update the check belongs to (as `ReplicaMismatch.step`).
    step: int
    #: The reduced slots, float32 ``(numel,)`` on the device.
    reduced: torch.Tensor
    #: `mismatch_flag()` of ``reduced``: 0-dim float32, 1.0 where the replicas differ.
    mismatch: torch.Tensor
    #: This rank's non-finite flag before the reduce, float32 ``(1,)`` (1.0: it held inf/NaN).
    local_found: torch.Tensor

    @property
    def host_skip(self) -> bool:
        """False: nothing is known on the host at the step."""
        return False

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """``max(found_inf, mismatch flag)`` on the device (one op): the step is skipped where
        the replicas differ, with no host read."""
        return torch.fmax(found_inf, self.mismatch)

    def settle(self, found_inf: Callable[[], bool]) -> Settlement:
        """The mismatch flag holds the update on the device (no host read)."""
        return Settlement(held=self.mismatch)

    def close(self, number: int, found_inf: torch.Tensor, *, counted: bool) -> None:
        """Kept for `ReplicaCheck.count()` (`ReplicaCheck.defer()`)."""
        self.slots.check.defer(number, [self], found_inf, counted=counted)



class ReplicaCheck:
    """The scaler's replica check (a `distscaler.checks.Check`): when it is due, its
    contribution to the step's collective, its readings' later count and naming, the ledger. See
    [`distscaler.replica_check`][distscaler.replica_check]; the settings are `ScalerConfig`'s."""

    #: It compares the scaler's own ranks, at its own cadence.
    every_step = False

    def __init__(
        self,
        enabled: bool,
        interval: int | None,
        param_interval: int,
        on_mismatch: OnMismatch,
    ) -> None:
        self.enabled = enabled
        #: The setting; None: `interval()` decides from where host reads are free.
        self.interval_setting = interval
        self.param_interval = param_interval
        self.on_mismatch = on_mismatch
        self.ledger = ReplicaLedger()
        #: Updates so far (the same count on every rank).
        self.iteration = 0
        #: The parameter check saw a non-finite parameter (the collapse watch takes it).
        self.nonfinite_parameters = False
        self._terms: dict[tuple, torch.Tensor] = {}
        #: The secret of the keyed weights: None draws one at the first check (`key()`).
        self.secret: int | None = None
        self._key: Key | None = None
        self._sets: dict[tuple, dict[int, ReplicaSet | None]] = {}
        #: Deferred readings of updates done, with the update's number, its agreed found_inf and
        #: whether its mismatch flag held the update (`defer()`), not read on the host yet.
        self.pending: list[tuple[int, DeferredReading, torch.Tensor, bool]] = []
        #: Mismatches counted by `count()`, to be named by `name()`: (update, reading, the
        #: reduced slots as host floats, whether this rank held inf/NaN).
        self.unnamed: list[tuple[int, DeferredReading, list[float], bool]] = []

    @classmethod
    def from_config(cls, config: ScalerConfig) -> ReplicaCheck:
        """The check with ``config``'s settings."""
        return cls(config.replica_check, config.replica_check_interval,
                   config.param_check_interval, config.on_replica_mismatch)  # fmt: skip

    def configure(self, config: ScalerConfig) -> None:
        """Take ``config``'s settings (a config replaced); the ledger and the count stay."""
        self.enabled, self.interval_setting = config.replica_check, config.replica_check_interval
        self.param_interval = config.param_check_interval
        self.on_mismatch = config.on_replica_mismatch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_terms"], state["_sets"] = {}, {}
        state["_key"] = None  # a run's own: the next run draws its own
        state["pending"], state["unnamed"] = [], []  # device tensors and a process group
        if not isinstance(self.on_mismatch, str):
            state["on_mismatch"] = "skip"  # a callable is not copied
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a check pickled by an older version: no deferred readings, no keyed weights)
        state.pop("_kernel_terms", None)
        state.setdefault("secret", None)
        state.setdefault("_key", None)
        state.setdefault("pending", [])
        state.setdefault("unnamed", [])
        self.__dict__.update(state)

    def interval(self, in_pass: bool) -> int:
        """Updates between two gradient checks: the setting, or 1 where the check costs neither a
        read of its own nor a host sync (``in_pass``: the Triton kernels take the checksum in
        their read, and its reading is free or waits) and `INTERVAL` elsewhere."""
        if self.interval_setting is not None:
            return self.interval_setting
        return 1 if in_pass else INTERVAL

    def due(self, world_size: int, dynamic: bool, in_pass: bool) -> tuple[bool, bool]:
        """(compare gradients, compare parameters) at this iteration: the same on every rank
        (the update count, the settings and the group's size). Never over a group whose
        membership changes (torchft's: a healing replica's contribution is zeroed there, which
        would read as a mismatch), nor above `MAX_WORLD_SIZE` ranks."""
        if not self.enabled or world_size < 2 or dynamic or world_size > MAX_WORLD_SIZE:
            return False, False
        n = self.iteration + 1
        params = self.param_interval > 0 and n % self.param_interval == 0
        return n % self.interval(in_pass) == 0, params

    def contribution(
        self,
        plan: StepPlan,
        layouts: Any,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> Contribution | None:
        """The check's part of this step's collective (a `ReplicaSlots`, declared), or None when it
        is not due or nothing of ``optimizer`` is replicated (the ranks of a group are alike in
        this: DDP, HSDP, FSDP2 + TP, pipeline stages each replicated or none, which the collective's
        size relies on). How it may be read is the ``plan``'s (`distscaler._plan.StepPlan`): with
        the Triton kernels (``plan.kernels``), which take the checksum in their read, the default
        interval checks every update, read at the step where ``plan.reading_free`` (a step that
        reads ``found_inf`` on the host anyway) or waiting on the device where
        ``plan.reading_may_wait`` (a fused step, a periodic read to come: `DeferredReading`); with
        torch's kernels (a read pass of its own) every `INTERVAL` updates, read at the step."""
        world = plan.world
        group, world_size = world.group, world.size
        free = plan.reading_free
        deferred = plan.reading_may_wait and not free and self.interval_setting is None
        in_pass = plan.kernels == "triton" and (free or deferred)
        with_grads, with_params = self.due(world_size, world.dynamic, in_pass)
        if not (with_grads or with_params):
            return None
        params = tuple(p for g in optimizer.param_groups for p in g["params"])
        sets = self._replica_sets(layouts, params, group, world_size)
        if all(s is None for s in sets.values()):
            return None
        # the kernel's keyed sums every INTERVAL updates (their read keeps fewer warps resident:
        # `distscaler._triton.launch`); every check of torch's kernels has them
        keyed = (self.iteration + 1) % INTERVAL == 0 or self.interval(in_pass) > 1
        slots = ReplicaSlots(self, sets, optimizer, group=group, world_size=world_size,
                             device=device, with_grads=with_grads, with_params=with_params,
                             deferred=deferred, keyed=keyed)  # fmt: skip
        return Contribution(slots.numel, slots.local_slots, slots.read_slots,
                            keeps_local_flag=deferred, kernel_part=slots.kernel_part)  # fmt: skip

    # -- deferred readings

    def defer(
        self,
        update: int,
        readings: Sequence[DeferredReading],
        found_inf: torch.Tensor,
        *,
        counted: bool = True,
    ) -> None:
        """Keep the deferred ``readings`` of update ``update`` (1-based, the host's count) and its
        agreed ``found_inf`` for `count()`; ``counted``: their mismatch flag held the update
        (False: the update did not run on it, ``update(new_scale)`` or a mismatch read at the step:
        the ledger takes them, no skip is reported). Not under CUDA graph capture: a replay runs no
        Python (its mismatch flag still skips the step and holds the update on the device)."""
        if found_inf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self.pending += [(update, r, found_inf, counted) for r in readings]

    def count(self) -> list[tuple[int, str]]:
        """Read the pending mismatch flags on the host (one transfer; nothing when none are
        pending, no collective: safe on one rank): each mismatch is kept for `name()`. Returns ``(update, "replica_mismatch")`` for each
        mismatch whose flag held its update where no rank held inf/NaN (where one did, the agreed
        ``found_inf`` backed the update off: an overflow, which the skip counters count as one)."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        parts = []
        for _, r, found, _ in pending:
            nonfinite = r.slots.param_nonfinite
            parts += [r.mismatch.reshape(1), found.reshape(1).to(r.mismatch.dtype), r.local_found,
                      (r.mismatch if nonfinite is None else nonfinite).reshape(1).to(torch.float32),
                      r.reduced]  # fmt: skip
        values = torch.cat([p.to(torch.float64) for p in parts]).tolist()
        events, i = [], 0
        for update, r, _, counted in pending:
            mismatch, found, local, param_nonfinite = values[i : i + 4]
            slots = values[i + 4 : i + 4 + r.reduced.numel()]
            i += 4 + r.reduced.numel()
            if r.slots.param_nonfinite is not None and param_nonfinite:
                self.nonfinite_parameters = True
            if mismatch:
                self.unnamed.append((update, r, slots, bool(local)))
                if counted and not found:
                    self.ledger.skipped += 1  # a skip of its own cause, as the account counts it
                    events.append((update, "replica_mismatch"))
        return events

    def forget(self) -> None:
        """Drop the deferred readings not yet counted or named (a loaded state replaces the run
        they belong to)."""
        self.pending, self.unnamed = [], []

    def name(self) -> tuple[list[tuple[int, Any]], Exception | None]:
        """Name the ranks of each mismatch `count()` kept (one gather each, on
        every rank together: call it where every rank is, the periodic read), note them in the
        ledger, log them, call a callable ``on_mismatch``. Returns ``(update, mismatch)`` for each
        and, for ``"raise"``, the error to raise (the first mismatch's) once the caller's update
        is complete."""
        unnamed, self.unnamed = self.unnamed, []
        named = [(u, r.slots.mismatch_at(r.step, slots, local)) for u, r, slots, local in unnamed]
        error = None
        if named and self.on_mismatch == "raise":
            error = ReplicaMismatchError(named[0][1])
        return named, error

    def _replica_sets(
        self, layouts: Any, params: tuple[torch.Tensor, ...], group: Any, world_size: int
    ) -> dict[int, ReplicaSet | None]:
        # Each parameter's replica set by id(), looked up once per layout.
        key = (tuple(id(p) for p in params), layouts.version, world_size, id(group))
        cached = self._sets.get(key)
        if cached is None:
            cached = {id(p): layouts.replica_set(p, p.grad, group, world_size) for p in params}
            if len(self._sets) > 8:
                self._sets.clear()
            self._sets[key] = cached
        return cached

    def layout_terms(
        self,
        what: str,
        tensors: Sequence[torch.Tensor],
        sets: Sequence[ReplicaSet | None],
        device: torch.device,
    ) -> torch.Tensor:
        """`layout_terms()`' terms, cached per layout (host arithmetic once)."""
        sizes = _word_counts(tensors)
        return self._cached((what, sizes, tuple(sets), device),
                            lambda: layout_terms(sizes, sets, device))  # fmt: skip

    def kernel_keys(
        self,
        tensors: Sequence[torch.Tensor],
        sets: Sequence[ReplicaSet | None],
        key: Key,
        device: torch.device,
    ) -> torch.Tensor:
        """`kernel_keys()`' table, cached per layout and secret (torch's ops once)."""
        sizes = _word_counts(tensors)
        return self._cached(("keys", sizes, tuple(sets), key.secret, device),
                            lambda: kernel_keys(sizes, sets, key, device))  # fmt: skip

    def _cached(self, key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        # A per-layout table, built once (the last few layouts kept).
        cached = self._terms.get(key)
        if cached is None:
            if len(self._terms) > 4:
                self._terms.clear()
            cached = self._terms[key] = build()
        return cached

    def key(self, group: dist.ProcessGroup | None, device: torch.device) -> Key:
        """This run's keyed weights: the ``secret`` set, or one drawn on the group's first rank
        and broadcast (one ``broadcast`` of 8 bytes and one host read, once per run: every rank
        of the group calls it at the same check)."""
        if self._key is None:
            secret = self.secret
            if secret is None:
                drawn = int.from_bytes(os.urandom(8), "little") >> 1
                value = torch.tensor([drawn], dtype=torch.int64, device=device)
                if dist.is_available() and dist.is_initialized():
                    src = dist.get_global_rank(group, 0) if group is not None else 0
                    dist.broadcast(value, src=src, group=group)
                secret = int(value.item())
            self._key = Key(secret)
        return self._key

    def nonfinite_seen(self) -> bool:
        """Whether the parameter check saw a non-finite parameter since the last call."""
        seen, self.nonfinite_parameters = self.nonfinite_parameters, False
        return seen

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        """An overflow report named ``ranks``: the ledger counts a rank alone at fault."""
        self.ledger.note_overflow(step, ranks)

    def at_fault(self) -> tuple[str, ...]:
        """The ranks the last mismatch named, ``"rank 3 (replica mismatch)"``."""
        mismatch = self.ledger.last_mismatch
        if mismatch is None:
            return ()
        return tuple(f"rank {r} (replica mismatch)" for r in mismatch.ranks)

    def end_iteration(self, cause: str | None, optimizers: Sequence[Any] = ()) -> None:
        """``update()``: the iteration ends (``cause``: a settlement's skip cause, or None). Where
        the parameter check was due but could not compare replicas (one rank; a group whose
        membership changes, torchft's), the parameters of ``optimizers`` are still checked for
        non-finite values, locally (one read of them, one host read), for the collapse report."""
        n = self.iteration + 1
        due = self.param_interval > 0 and n % self.param_interval == 0
        if due and optimizers and self.ledger.param_checks_at != n:
            params = [getattr(p, "_local_tensor", p).detach()
                      for opt in optimizers for g in opt.param_groups for p in g["params"]]  # fmt: skip
            if params and not bool(torch.stack([p.isfinite().all() for p in params]).all()):
                self.nonfinite_parameters = True
        if cause == "replica_mismatch":  # the skip account counted it under this cause
            self.ledger.skipped += 1
        self.iteration = n


def _word_counts(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    # Each tensor's 16-bit words (0: not checked), the layout's part of a table's cache key.
    return tuple(0 if w is None else w.numel() for w in map(words, tensors))


def _kernel_rows(moments: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    # The naming rows of the Triton pass: A, B global, and no keyed sums (zeros).
    rows = global_rows(moments, terms)
    return torch.cat([rows, rows.new_zeros(rows.shape[0], 2)], 1)
