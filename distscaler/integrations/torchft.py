"""torchft in fp16: replica groups that fail, rejoin and heal keep one loss scale and skip together.

``scaler = install(manager, optimizer, scaler=GradScaler("cuda"))`` after the torchft objects are
built; the loop is a ``GradScaler``'s, with ``scaler.step(optimizer)`` (never ``optimizer.step()``).
`install()` adds one [`Check`][distscaler.checks.Check],
[`TorchftCheck`][distscaler.integrations.torchft.TorchftCheck], to the scaler. It rides the
scaler's one collective inside the replica group at every step (``every_step``: also at one rank)
and its reading, right after that collective, does on every rank what the torchft page of the
documentation details (costs, scenarios):

* one ``manager.allreduce(..., ReduceOp.MAX)`` across replica groups of the agreed flag and norm
  statistic (``reads_agreed``: raised in place to the groups' MAX, so an inf that appears after the
  average on one group skips every group), the lowest and highest replica rank that went non-finite,
  and one row per participating group: the checksums of its averaged gradients and, at the first
  step where every group participates after a quorum change or a heal, of its parameters, optimizer
  state and scaler state, compared on the host (a group that differs reports to torchft: skip cause
  ``replica_mismatch``);
* then ``manager.should_commit()``, once per step: a step that does not commit is skipped (its
  found_inf forced to non-finite) and settles as skip cause ``not_committed`` (the scale stays).

The scaler's ``state_dict`` travels with torchft's healed state (``STATE_KEY``); with the async
quorum the scaler takes its part before the step's first check. It relies on torchft 0.2.0's
``Manager.allreduce`` (``reduce_op``), ``should_commit``, ``report_error``, ``errored``,
``current_step``, ``participating_rank``, ``num_participants``, ``register_state_dict_fn``,
``wait_quorum``, the private ``_healing``, ``_quorum_id``, ``_quorum_future``, ``_replica_id``,
``_user_state_dicts``, ``_pg.size()`` and ``_pending_state_dict``, and on
``OptimizerWrapper.optim``/``manager``.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._common import TESTED_VERSIONS, requires

with requires("torchft", f"torchft {TESTED_VERSIONS['torchft']}", "torchft"):
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

from .._plan import host_read_is_free
from .._process_group import has_dynamic_membership
from .._replica.checksum import Key, digest
from .._scaler import GradScaler
from ..checks import Contribution, Reading, Settlement
from ..errors import ReplicaMismatchError
from ..replica_check import GPU_INTERVAL, ReplicaMismatch
from ._scaler_arg import scaler_from_argument
from ._torchft_compare import REFERENCE, REJOINED, compare, divergence, row_width, state_parts
from ._torchft_cross_flag import CROSS_NUMEL, cross_part, lone
from ._torchft_heal import Heal
from ._torchft_reports import (
    HealMismatch,
    NonFiniteAfterAverage,
    NotCommitted,
    ReplicaDivergence,
    ReplicaGradientMismatch,
    ReplicaOverflow,
)

__all__ = [
    "STATE_KEY",
    "TESTED_TORCHFT",
    "FaultTolerantGradScaler",
    "HealMismatch",
    "NonFiniteAfterAverage",
    "NotCommitted",
    "ReplicaDivergence",
    "ReplicaGradientMismatch",
    "ReplicaOverflow",
    "TorchftCheck",
    "install",
]

logger = logging.getLogger(__name__)

#: The torchft release this integration was written against and tested with.
TESTED_TORCHFT = TESTED_VERSIONS["torchft"]
#: The key of the scaler's state in torchft's healed state (``register_state_dict_fn``).
STATE_KEY = "distscaler"
#: Scalers with a torchft check (one per scaler).
_INSTALLED: weakref.WeakSet[GradScaler] = weakref.WeakSet()


@dataclass(slots=True)
class _Step:
    """What the check knows about the current step (reset when the iteration ends)."""

    settled: bool = False  # the pending healed state was looked at (`settle_heal`)
    committed: bool | None = None  # should_commit()'s answer, None before it is asked
    step: int = 0
    num_participants: int = 0
    replica_rank: int | None = None
    cross: torch.Tensor | None = None  # the cross-replica found_inf, for `replica_overflow`
    lone: ReplicaOverflow | None = None
    optimizer: torch.optim.Optimizer | None = None  # whose state a heal check compares
    divergence: ReplicaDivergence | None = None  # this group does not commit when named
    state_checked: bool = False  # a heal check ran
    verified: bool = False  # this group passed it
    keep_due: bool = False  # a rejoined group was named: every group checks again
    rejoined: set[int] | None = None  # the participating replica ranks that healed


class TorchftCheck:
    """torchft's protocol as a [`Check`][distscaler.checks.Check] on the scaler's collective: the
    exchange across replica groups and ``should_commit()`` in its reading (module docstring).
    Added by [`install()`][distscaler.integrations.torchft.install], one per scaler and manager;
    its contribution has no slots inside the group (it reads the agreed buffer), and it is its own
    reading."""

    every_step = True  # every group joins the exchange at every step, also at one rank
    host_skip = False  # an uncommitted step skips on its forced found_inf

    def __init__(self, scaler: GradScaler, manager: Manager, report_lone_replica: bool = False):
        self.scaler, self.manager, self.report_lone = scaler, manager, bool(report_lone_replica)
        self.heal_counts_own = True  # a healing group adds its own found_inf back (tests: off)
        self.state = _Step()
        self.world: tuple[dist.ProcessGroup | None, int] = (None, 1)
        self.iteration = 0
        self.pending_cross: tuple[torch.Tensor, int, int, int | None] | None = None
        self.replica_overflow: ReplicaOverflow | None = None
        self.replica_divergence: ReplicaDivergence | None = None
        self.last_committed: bool | None = None
        self.heal = Heal(scaler, manager, STATE_KEY)
        self.enabled, self.interval_setting, self.param_interval = True, None, 1000
        self.on_mismatch: Any = "skip"
        self.host_reads = host_read_is_free(scaler.device_type)

    # ------------------------------------------------------------------ Check, Contribution, Reading

    def contribution(
        self, plan: Any, layouts: Any, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> Contribution | None:
        """At every step: no slots, and a reading of the agreed buffer (``reads_agreed``: it raises
        the agreed flag and statistic in place to the groups' MAX); `Check.contribution()`."""
        self.state.optimizer, self.world = optimizer, (plan.world.group, plan.world.size)
        return Contribution(0, _no_slots, self.read_agreed, reads_agreed=True)

    def read_agreed(self, reduced: torch.Tensor, local_flag: torch.Tensor | None = None,
                    agreed: torch.Tensor | None = None) -> Reading | None:  # fmt: skip
        """`across()` on the agreed buffer, which it raises in place to the groups' MAX (or forces
        to a skip); returns itself."""
        assert agreed is not None, "the scaler's collective hands the agreed buffer"
        self.across(agreed)
        return self

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        """What the step takes: the agreed ``found_inf`` as the exchange left it."""
        return found_inf

    def settle(self, found_inf: Callable[[], bool]) -> Settlement:
        """An uncommitted step: ``replica_mismatch`` where this group was named, else
        ``not_committed`` (the scale stays); nothing of its own otherwise."""
        step = self.state
        if step.committed is not False:
            return Settlement()
        if step.divergence is not None and step.divergence.this_group:
            return Settlement("replica_mismatch", step.divergence)  # the scale stays
        return Settlement("not_committed", step.lone or self._not_committed(step))

    def close(self, number: int, found_inf: torch.Tensor, *, counted: bool) -> None:
        """Nothing to keep: the exchange was read at the step."""

    def end_iteration(self, cause: str | None, optimizers: Sequence[Any] = ()) -> None:
        """Keep what the step found (a lone overflow, a divergence, a verified heal) for the
        properties and the next step."""
        step, self.state = self.state, _Step()
        self.iteration += 1
        if step.lone is not None:
            self.replica_overflow = step.lone
        elif step.cross is not None and not self.report_lone:
            self.pending_cross = (step.cross, step.step, step.num_participants, step.replica_rank)
        if step.divergence is not None:
            self.replica_divergence = step.divergence
        if step.state_checked:
            self.heal.checked(step.verified, step.keep_due)

    def count(self) -> list[tuple[int, str]]:
        """Nothing waits on the device: no skips to count later."""
        return []  # every reading settles on the host

    def name(self) -> tuple[list[tuple[int, Any]], Exception | None]:
        """Nothing to name later: the exchange named the groups at the step."""
        return [], None

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        """Nothing: the replica check's ledger counts overflow reports."""

    def at_fault(self) -> tuple[str, ...]:
        """Nothing: a collapse report names the ranks the scaler's own checks named."""
        return ()

    def nonfinite_seen(self) -> bool:
        """False: the heal check reports what differs through its divergence."""
        return False

    def forget(self) -> None:
        """Nothing waits across a loaded state."""

    def configure(self, config: Any) -> None:
        """The replica check's settings of ``config`` (cadence, parameter check,
        ``on_replica_mismatch``) for the comparison across groups."""
        self.enabled, self.interval_setting = config.replica_check, config.replica_check_interval
        self.param_interval, self.on_mismatch = config.param_check_interval, config.on_replica_mismatch

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a torchft scaler holds its Manager: save its state_dict() instead")

    # ------------------------------------------------------------------ torchft's protocol

    def settle_heal(self) -> None:
        """Once per step, before the first check: the scaler's part of a pending healed state
        (async quorum; torchft applies the rest in should_commit). Waits for the quorum."""
        if not self.state.settled:
            self.state.settled = True
            self.heal.preload()

    def load_healed(self, state: Any) -> None:
        """torchft's load function for ``STATE_KEY``: this group healed, so its next step where
        every group participates compares its state."""
        self.heal.load(state)

    def commit(self) -> bool:
        """``manager.should_commit()``, asked once per step."""
        if self.state.committed is None:
            self.state.committed = self.last_committed = bool(self.manager.should_commit())
        return self.state.committed

    def lone_overflow(self) -> ReplicaOverflow | None:
        """`replica_overflow`: a pending exchange read on the host (one read) first."""
        pending, self.pending_cross = self.pending_cross, None
        if pending is not None:
            cross, step, num_participants, replica_rank = pending
            rank = lone(cross.tolist(), num_participants)
            if rank is not None:
                self.replica_overflow = ReplicaOverflow(
                    step, rank, rank == replica_rank, num_participants, reported=False
                )
        return self.replica_overflow

    def _not_committed(self, step: _Step) -> NotCommitted:
        """The report of a step this group did not commit (`NotCommitted`)."""
        error = self.manager.errored()
        replica_id = getattr(self.manager, "_replica_id", None)  # torchft: "<replica_id>:<uuid>"
        return NotCommitted(
            step=step.step,
            replica_id=None if replica_id is None else str(replica_id).split(":")[0],
            num_participants=step.num_participants,
            error=None if error is None else repr(getattr(error, "original_exception", error)),
        )

    def across(self, buffer: torch.Tensor) -> None:
        """``buffer`` (found_inf agreed inside the replica group: a flag, or [flag or statistic,
        statistic]) becomes found_inf of every participating group, forced to non-finite when the
        step does not commit. The same exchange carries each participating group's row, compared
        on the host; a group named reports to torchft before should_commit."""
        manager, step = self.manager, self.state
        flat = buffer.view(-1)
        numel = flat.numel()
        step.step = manager.current_step()
        step.replica_rank = manager.participating_rank()  # None: this group heals (zeroed)
        step.num_participants = manager.num_participants()
        self.heal.note_quorum(step.replica_rank, step.num_participants)
        part, bad = cross_part(flat, step.replica_rank)
        rows, grads_checked, state_checked = self._rows(step, flat, bad)
        exchange = torch.cat([part, rows])  # (4 + num_participants * row width,)
        manager.allreduce(exchange, reduce_op=ReduceOp.MAX).wait()
        cross = step.cross = exchange[:CROSS_NUMEL]  # [v0, v1, hi, lo]
        if step.replica_rank is None and self.heal_counts_own:
            # A healing group's part was zeroed: its own flag is added back, so that it never
            # steps on its own inf/NaN; it then does not commit and heals again.
            cross[:numel] = torch.maximum(cross[:numel], part[:numel])
            if bool(bad):  # one host read, on a healing step only
                step.lone = ReplicaOverflow(step.step, -1, True, step.num_participants,
                                            reported=True, healing=True)  # fmt: skip
                logger.warning("%s", step.lone.describe())
                manager.report_error(NonFiniteAfterAverage(step.lone.describe()))
        if grads_checked or state_checked:  # one host read of the rows
            finding, step.rejoined = compare(exchange[CROSS_NUMEL:].tolist(), step.num_participants,
                                             _checksum_numel(), step.replica_rank, grads_checked,
                                             state_checked)  # fmt: skip
            group, size = self.world
            if size > 1:  # the group's ranks merge their findings (a MAX): each its own shard
                merged = torch.tensor(finding, dtype=torch.float32, device=flat.device)
                dist.all_reduce(merged, op=ReduceOp.MAX, group=group)
                finding = merged.tolist()
            self._act(step, finding, grads_checked, state_checked)
        keep_own = False
        if self.report_lone and step.num_participants > 1:
            rank = lone(cross.tolist(), step.num_participants)  # the opt-in's host read
            if rank is not None:
                mine = rank == step.replica_rank
                step.lone = ReplicaOverflow(step.step, rank, mine, step.num_participants, True)
                if mine:
                    logger.warning("distscaler: %s", step.lone.describe())
                    manager.report_error(NonFiniteAfterAverage(step.lone.describe()))
                keep_own = not mine  # that group drops out; these gradients are finite
        if not keep_own:
            flat.copy_(cross[:numel])
        if not self.commit():
            flat[0] = 1.0
            flat[1:] = math.inf

    # ------------------------------------------------------------------ the replica check

    def _rows(
        self, step: _Step, flat: torch.Tensor, bad: torch.Tensor
    ) -> tuple[torch.Tensor, bool, bool]:
        """The rows of the exchange (float32, one per participant, empty below 2), this group's
        written at its participating rank: [role, gradients' checksum, the state's parts'],
        each checksum plus 1 (0: absent); and whether it wrote its gradients' and its state's.
        ``bad``: this group's found_inf (then no gradients' checksum: the overflow is it)."""
        n, fp = step.num_participants, _checksum_numel()
        width = row_width(fp)
        rows = flat.new_zeros(n * width if n >= 2 else 0, dtype=torch.float32)
        rank, optimizer = step.replica_rank, step.optimizer
        if n < 2 or rank is None or rank >= n or not self.enabled or optimizer is None:
            return rows, False, False
        interval = self.interval_setting or (1 if self.host_reads else GPU_INTERVAL)
        grads_due = step.step % interval == 0
        state_due = self.heal.due and self.param_interval > 0 and n >= self.heal.quorum_size()
        if not (grads_due or state_due):
            return rows, False, False
        row = rows[rank * width : (rank + 1) * width]
        row[0] = REJOINED if self.heal.rejoined else REFERENCE
        if grads_due:
            grads = [getattr(p.grad, "_local_tensor", p.grad)
                     for g in optimizer.param_groups for p in g["params"] if p.grad is not None]  # fmt: skip
            row[1 : 1 + fp] = (_checksum(grads, flat.device, step.step) + 1).mul_(1.0 - bad)
        if state_due:
            parts = state_parts(optimizer, self.scaler.state_dict())  # one host read
            row[1 + fp :] = torch.cat([_checksum(t, flat.device, step.step) for t in parts]) + 1
            step.state_checked = True
        return rows, grads_due, state_due

    def _act(self, step: _Step, finding: list[float], grads_checked: bool,
             state_checked: bool) -> None:  # fmt: skip
        # The group's merged finding: counted, recorded, logged; a named group reports to
        # torchft (it does not commit).
        ledger = self.scaler.replica_ledger
        ledger.checks += grads_checked
        ledger.param_checks += state_checked
        found = divergence(finding, step.step, step.num_participants, step.replica_rank)
        if state_checked:
            named = found.replica_ranks if found and found.what == "healed state" else ()
            step.verified = step.replica_rank not in named
            step.keep_due = any(i in (step.rejoined or ()) for i in named)
        if found is None:
            return
        step.divergence = found
        on_mismatch = self.on_mismatch
        mismatch = ReplicaMismatch(
            self.iteration + 1, "parameters" if found.what == "healed state" else "gradients",
            found.replica_ranks, action=on_mismatch if isinstance(on_mismatch, str) else "callback",
        )  # fmt: skip
        ledger.note_mismatch(mismatch)
        logger.warning("%s", found.describe())
        if found.this_group and found.reported:
            error = HealMismatch if found.what == "healed state" else ReplicaGradientMismatch
            self.manager.report_error(error(found.describe()))
        if on_mismatch == "raise":
            raise ReplicaMismatchError(mismatch)
        if callable(on_mismatch):
            on_mismatch(mismatch)


class FaultTolerantGradScaler:
    """What [`install()`][distscaler.integrations.torchft.install] returns: the user's
    [`GradScaler`][distscaler.GradScaler] (``scaler``; every attribute and method of it, through
    this object) with a [`TorchftCheck`][distscaler.integrations.torchft.TorchftCheck] added
    (``check``), plus torchft's loop: ``unscale_``/``clip_grad_norm_``/``step`` take torchft's
    ``OptimizerWrapper`` (they step the wrapped optimizer) and first take a pending healed scale."""

    def __init__(self, scaler: GradScaler, check: TorchftCheck) -> None:
        self.scaler, self.check = scaler, check

    def __getattr__(self, name: str) -> Any:
        if name in ("scaler", "check"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.scaler, name)

    def __repr__(self) -> str:
        return f"FaultTolerantGradScaler({self.scaler!r})"

    @classmethod
    def from_scaler(
        cls,
        scaler: GradScaler,
        manager: Manager,
        *,
        replica_group: dist.ProcessGroup | None = None,
        report_lone_replica: bool = False,
    ) -> FaultTolerantGradScaler:
        """``scaler`` with a ``TorchftCheck`` on ``manager`` added (not copied: ``scaler`` itself
        now agrees across replica groups). ``replica_group``: None or ``scaler.process_group``
        (the replica group's own group); ``report_lone_replica``: see `install()`.

        Raises:
            TypeError: ``scaler`` is not a ``distscaler.GradScaler``.
            ValueError: ``scaler`` is installed already; its process group is one of torchft's
                (pass the replica group's own group) or not ``replica_group``. Nothing changes.

        Cost: no collective, no host read.
        """
        if not isinstance(scaler, GradScaler | FaultTolerantGradScaler):
            raise TypeError(f"scaler must be a distscaler.GradScaler, got: {type(scaler).__name__}")
        if isinstance(scaler, FaultTolerantGradScaler) or scaler in _INSTALLED:
            raise ValueError("scaler is already installed on a torchft Manager")
        own = scaler.process_group
        if own is not None and has_dynamic_membership(own):
            raise ValueError(
                "scaler's process_group is a torchft group whose membership changes "
                f"({type(own).__name__}); pass the replica group's own process group (or none): "
                "the integration adds the agreement across replica groups"
            )
        if replica_group is not None and replica_group is not own:
            raise ValueError("replica_group must be the scaler's process_group: pass it there")
        check = TorchftCheck(scaler, manager, report_lone_replica)
        scaler.add_check(check)
        _INSTALLED.add(scaler)
        return cls(scaler, check)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """[`GradScaler.unscale_()`][distscaler.GradScaler.unscale_]."""
        self.scaler.unscale_(self._enter(optimizer))

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """[`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_]: the norm of one
        replica group's averaged gradients (each value once), inf when the step does not commit."""
        return self.scaler.clip_grad_norm_(self._enter(optimizer), max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step the (wrapped) optimizer only if torchft commits the step and no group found
        inf/NaN; ``manager.should_commit()`` is called exactly once per step, skipped or not."""
        inner = self._enter(optimizer)
        if not self.scaler.is_enabled():  # no inf check: torchft's own protocol
            return inner.step(*args, **kwargs) if self.check.commit() else None
        retval = self.scaler.step(inner, *args, **kwargs)
        if self.check.state.committed is None:  # pragma: no cover - every enabled step reads it
            raise RuntimeError("distscaler: the step ran without its inf check; should_commit() was not called")
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """[`GradScaler.update()`][distscaler.GradScaler.update]; a step torchft did not commit
        leaves the scale, trackers and counts as they were (the check's settlement)."""
        self.scaler.update(new_scale)
        if not self.scaler.is_enabled():
            self.check.end_iteration(None)

    def _enter(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.check.settle_heal()
        inner = optimizer.optim if isinstance(optimizer, OptimizerWrapper) else optimizer
        self.check.state.optimizer = inner
        return inner

    @property
    def last_step_committed(self) -> bool | None:
        """Whether torchft committed the last step (None before one). A step that did not commit
        did not change the parameters, the optimizer or the scaler."""
        return self.check.last_committed

    @property
    def replica_overflow(self) -> ReplicaOverflow | None:
        """The replica group that alone held inf/NaN after the average, at the most recent step
        where one did, else None. One host read when a step since the last read was not looked
        at (with ``report_lone_replica=True`` it is always current)."""
        return self.check.lone_overflow()

    @property
    def replica_divergence(self) -> ReplicaDivergence | None:
        """The most recent step where participating replica groups differed (a bad heal, or
        averaged gradients that differ with every value finite), else None. No host read."""
        return self.check.replica_divergence

    @property
    def manager(self) -> Manager:
        """The torchft ``Manager`` this scaler commits through."""
        return self.check.manager

    @property
    def _heal_counts_own(self) -> bool:
        return self.check.heal_counts_own

    @_heal_counts_own.setter
    def _heal_counts_own(self, value: bool) -> None:
        self.check.heal_counts_own = value


@functools.lru_cache(maxsize=4)
def _key(step: int) -> Key:
    """The keyed weights of the exchange's checksums at ``step`` (torchft's step, the same in
    every group of the quorum): every group holds the same key without an exchange of its own,
    and a new one at each step, so that a fault that repeats meets fresh weights each time."""
    return Key(0x64697374 ^ ((int(step) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)))


def _checksum(tensors: Sequence[torch.Tensor], device: torch.device, step: int) -> torch.Tensor:
    """The checksum of ``tensors`` read as one stream of 16-bit words: float32 ``(6,)``, residues
    below ``2**24`` (`distscaler._replica.checksum.digest()`: two streams that differ in at most
    two words never share it; any other difference shares it for at most ``(3 / P1) (3 / P2)``
    of the keys), keyed by ``step`` (`_key()`). Tensors on another device are copied to
    ``device``. No host read."""
    return digest(tensors, _key(step), device)


def _no_slots(
    params: tuple[torch.Tensor, ...],
    grads: Sequence[torch.Tensor],
    moments: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> torch.Tensor:
    # The exchange's contribution has no slots inside the group: an empty float32 tensor.
    return torch.zeros(0, dtype=torch.float32)


@functools.cache
def _checksum_numel() -> int:
    return _checksum([], torch.device("cpu"), 0).numel()


def install(
    manager: Manager,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scaler: Any = None,
    model: torch.nn.Module | None = None,
    replica_group: dist.ProcessGroup | None = None,
    report_lone_replica: bool = False,
    device_type: str | None = None,
) -> FaultTolerantGradScaler:
    """Put distscaler in charge of loss scaling for a torchft job: returns the scaler to use.

    Args:
        manager (torchft.Manager): the replica group's manager.
        optimizer (OptimizerWrapper | Optimizer | None): torchft's ``OptimizerWrapper`` (checked to
            wrap ``manager``); pass it (or its wrapped optimizer) to ``scaler.step``.
        scaler: a ``distscaler.GradScaler`` (the check is added to it; its ``process_group``, if
            any, is the replica group's own group), a ``ScalerConfig``, a DeepSpeed config, or
            None (``GradScaler(device_type)``).
        model (nn.Module | None): registered with ``scaler.register_model``.
        replica_group (ProcessGroup | None): this replica group's ranks (an FSDP/TP group inside
            it): the process group of a scaler built here; a given scaler's must be it. Default:
            the scaler's, else the default group once initialized, else this process alone.
        report_lone_replica (bool): a group that alone holds inf/NaN after the average reports to
            torchft and heals while the others step (one host read per step). Default False:
            every group skips and backs off.
        device_type (str | None): the device type of a scaler built here; default ``"cuda"`` when
            available, else ``"cpu"``.

    Raises:
        TypeError: ``manager`` is not a torchft ``Manager``; ``scaler`` of the wrong type.
        ValueError: ``optimizer`` wraps another manager; the scaler is installed already, or its
            process group is torchft's or not ``replica_group``; the manager holds a
            ``"distscaler"`` state already.
    """
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a torchft.Manager, got: {type(manager).__name__}")
    if isinstance(optimizer, OptimizerWrapper) and optimizer.manager is not manager:
        raise ValueError("optimizer is an OptimizerWrapper of another Manager than manager")
    if STATE_KEY in manager._user_state_dicts:
        raise ValueError(
            f"manager already holds a state named {STATE_KEY!r} (register_state_dict_fn): "
            "install() once per manager"
        )
    if isinstance(scaler, FaultTolerantGradScaler):
        raise ValueError("scaler is already installed on a torchft Manager")
    if isinstance(scaler, GradScaler):
        device_type = scaler.device_type
    elif device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    built = scaler_from_argument(scaler, device_type, "device_type")
    if built is None:
        built = GradScaler(device_type, process_group=replica_group)
    elif built is not scaler and replica_group is not None:  # built here from a config
        built = GradScaler.from_config(built.config, device_type, process_group=replica_group)
    ft = FaultTolerantGradScaler.from_scaler(
        built, manager, replica_group=replica_group, report_lone_replica=report_lone_replica
    )  # refuses an installed scaler and a torchft group before anything changes
    if model is not None:
        ft.register_model(model)
    manager.register_state_dict_fn(STATE_KEY, ft.check.load_healed, ft.state_dict)
    return ft
