"""torchft in fp16: replica groups that fail, rejoin and heal keep one loss scale and skip together.

One line after the torchft objects are built (``Manager``, its ``DistributedDataParallel`` and
``OptimizerWrapper``):

```python
from distscaler.integrations.torchft import install

manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=..., state_dict=...)
model = DistributedDataParallel(manager, net)
optimizer = OptimizerWrapper(manager, torch.optim.AdamW(net.parameters(), fused=True))
scaler = install(manager, optimizer, scaler=GradScaler("cuda", init_scale=2.0**16))

for batch in batches:
    optimizer.zero_grad()                   # torchft's quorum starts here
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()           # torchft DDP averages the gradients over groups
    scaler.clip_grad_norm_(optimizer, 1.0)  # optional
    scaler.step(optimizer)                  # should_commit() once; steps only if committed and finite
    scaler.update()                         # discarded when the step did not commit
```

Call ``scaler.step(optimizer)``, never ``optimizer.step()``: the scaler calls
``manager.should_commit()`` itself, once per step, on skipped steps too.

What a step does, on every rank of every replica group (torchft 0.2.0, ``manager.py``):

* **Inside the replica group**: the scaler's one all-reduce over the group's own process
  group (the scaler's ``process_group``, else the default group of the group's ``torchrun``;
  nothing at 1 rank).
* **Across replica groups**: found_inf, once agreed inside the group, goes through one
  ``manager.allreduce(..., ReduceOp.MAX)`` of 4 float32 over torchft's cross-replica group: the
  non-finite flag, the norm statistic (every group holds the same averaged gradients, so the
  largest is any group's; a healing group's part is zeroed by torchft and never wins) and the
  replica rank of the lowest and the highest group that went non-finite. An inf before the gradient
  average already reached every group through the average; this all-reduce also catches one that
  appears after it, on one group only (local corruption, a faulty device). **Cost**: one more
  latency-bound all-reduce of 16 bytes per step on the cross-replica group (the scaler's own collective
  is the only collective inside the group); its ``wait()`` blocks the host as the gradient
  all-reduce's already does (torchft's DDP waits in its comm hook, ``should_commit`` synchronizes).
* **Commit**: right after that all-reduce, ``manager.should_commit()``, exactly once per step,
  whether the step is skipped or not. A step that does not commit is skipped (its found_inf is
  forced to non-finite: no optimizer step, `clip_grad_norm_()` returns inf) and its scale update is
  discarded: [`update()`][distscaler.integrations.torchft.FaultTolerantGradScaler.update] leaves the
  scale, the trackers and the counts as they were, as the manager leaves its step. The optimizer
  steps only when the step commits and nothing is non-finite anywhere.
* **Healing**: the scaler's ``state_dict`` is registered with the manager
  (``register_state_dict_fn("distscaler", ...)``), so it travels with torchft's healed state. With
  the default async quorum torchft applies that state inside ``should_commit()``, after the
  gradients were checked and unscaled; here the scaler takes its part of the pending state first, at
  the step's first scaler call after the backward (`unscale_()`, `clip_grad_norm_()` or `step()`),
  so that the rejoiner unscales its first gradients by the healed scale. With
  ``use_async_quorum=False`` torchft applies it in ``zero_grad()``. ``state_dict()`` never touches a
  process group (torchft calls it on its quorum thread). Since ``should_commit()`` runs on skipped
  steps too, an overflow in the heal step never drops the heal.
* **Which group went non-finite**: when exactly one of several participating groups holds inf/NaN
  after the average,
  [`replica_overflow`][distscaler.integrations.torchft.FaultTolerantGradScaler.replica_overflow]
  names its replica rank (and the ranks and parameters inside it:
  [`last_overflow`][distscaler.GradScaler.last_overflow]). By default every group skips the step and
  backs off, as for any overflow. With ``report_lone_replica=True`` (opt-in) that group calls
  ``manager.report_error(...)`` instead: it does not commit, falls one step behind and heals from a
  healthy peer at the next quorum, while the other groups step normally (their gradients are
  finite). Cost: one host read of the cross-replica found_inf per step (free on the CPU; a sync on a
  GPU, where torchft's ``should_commit`` synchronizes anyway).
* **Logs**: torchft brings no metrics logger; the scaler's
  [`metrics()`][distscaler.GradScaler.metrics] gives the ``distscaler/*`` entries under the keys
  every integration logs (the scale, the skips, the last overflow, the replica check's counts; one
  host read), for the job's own logger.

What it relies on in torchft 0.2.0 (changes there break it; pinned in the ``torchft`` extra):
``Manager.allreduce`` (``reduce_op``; a non-participating group's tensor zeroed), ``should_commit``,
``report_error``, ``participating_rank``, ``num_participants``, ``register_state_dict_fn``,
``wait_quorum``, the private ``Manager._healing`` and ``Manager._pending_state_dict`` (the async
heal's staged state, ``{"user": {key: state}}``), ``optim.OptimizerWrapper.optim``/``manager``.
Not covered: LocalSGD/DiLoCo (``torchft.local_sgd``: inner steps are not synchronized across
groups, there is no per-step gradient average to agree on), the quantized all-reduce
(``should_quantize=True``, CUDA/triton), DTensor gradients (FSDP2/HSDP through torchft's
``ManagedDeviceMesh``): their mesh is not a group this scaler can check.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._common import TESTED_VERSIONS, requires

with requires("torchft", f"torchft {TESTED_VERSIONS['torchft']}", "torchft"):
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

from .._process_group import ScalerGroup, has_dynamic_membership
from .._scaler import GradScaler
from ._scaler_arg import scaler_from_argument

__all__ = [
    "STATE_KEY",
    "TESTED_TORCHFT",
    "FaultTolerantGradScaler",
    "NonFiniteAfterAverage",
    "CrossReplicaGroup",
    "ReplicaOverflow",
    "install",
]

logger = logging.getLogger(__name__)

#: The torchft release this integration was written against and tested with.
TESTED_TORCHFT = TESTED_VERSIONS["torchft"]
#: The key of the scaler's state in torchft's healed state (``register_state_dict_fn``).
STATE_KEY = "distscaler"
#: Elements of the cross-replica found_inf: [flag or statistic, statistic, hi, lo].
_CROSS_NUMEL = 4
#: Encodes the lowest non-finite replica rank under a MAX (``_LO_BASE - (rank + 1)``); larger than
#: any replica count.
_LO_BASE = float(2**20)

class NonFiniteAfterAverage(RuntimeError):
    """Reported to torchft (``manager.report_error``) by the one replica group whose gradients were
    non-finite after the cross-replica average while every other group's were finite
    (``report_lone_replica=True``): the group does not commit and heals from a peer."""


@dataclass(frozen=True, slots=True)
class ReplicaOverflow:
    """The replica group that alone held inf/NaN gradients after the average, at one step.

    Attributes:
        step: the manager step (``manager.current_step()`` before the step) it happened at.
        replica_rank: its participating replica rank in that step's quorum.
        this_group: whether it is the group of this process.
        num_participants: replica groups participating in that step.
        reported: whether it was reported to torchft (``report_lone_replica=True``, or a healing
            group): then that group did not commit and heals, and the others stepped.
        healing: it was this group's heal step (its replica rank is then -1: torchft zeroes a
            healing group's part, and its own gradients held inf/NaN after the average).
    """

    step: int
    replica_rank: int
    this_group: bool
    num_participants: int
    reported: bool
    healing: bool = False

    def describe(self) -> str:
        """One line for a log."""
        if self.healing:
            return (
                f"this replica group held inf/NaN gradients after the cross-replica average in "
                f"its heal step {self.step}; it does not step or commit and heals again from a "
                "peer, the others stepped"
            )
        who = "this replica group" if self.this_group else f"replica group {self.replica_rank}"
        then = (
            "reported to torchft: it heals from a peer, the others stepped"
            if self.reported
            else "every group skipped the step"
        )
        return (
            f"{who} (replica rank {self.replica_rank} of {self.num_participants}) alone held "
            f"inf/NaN gradients after the cross-replica average at step {self.step}; {then}"
        )


class _Done(dist.Work):
    """A completed ``Work`` (the agreement waited for its collectives)."""

    def __init__(self, result: torch.Tensor) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result([result])

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class CrossReplicaGroup(dist.ProcessGroup):
    """The scaler's process group under torchft: the replica group's own group, then across groups.

    A ``ProcessGroup`` whose ``allreduce`` is the scaler's one collective: the reduction over the
    replica group's process group (skipped at 1 rank), then the cross-replica exchange and
    ``should_commit``
    ([`FaultTolerantGradScaler`][distscaler.integrations.torchft.FaultTolerantGradScaler]).
    ``size()`` is the replica group's, for gradient layouts (the groups hold replicas of the
    averaged gradients, so a norm sums inside the group only). ``dynamic_membership`` makes the core
    issue it at every step, also at 1 rank (a group whose membership changes).
    ``all_gather_single`` (the overflow report) stays inside the replica group.
    """

    dynamic_membership = True

    def __init__(self, scaler: FaultTolerantGradScaler, replica_group: dist.ProcessGroup | None):
        rank, size = (0, 1) if replica_group is None else (replica_group.rank(), replica_group.size())
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's (rank, size) overload
        self._scaler = scaler
        #: None: the default group once initialized (the replica group's torchrun), else 1 rank.
        self.replica_group = replica_group

    def _replica_size(self) -> int:
        if self.replica_group is not None:
            return self.replica_group.size()
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def size(self) -> int:  # type: ignore[override]
        """The replica group's size (1 without one), asked at every call."""
        return self._replica_size()

    def rank(self) -> int:  # type: ignore[override]
        """This process's rank in the replica group."""
        if self.replica_group is not None:
            return self.replica_group.rank()
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def getBackendName(self) -> str:  # type: ignore[override]  # noqa: N802 - torch's name
        """``"distscaler-torchft"``."""
        return "distscaler-torchft"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:  # type: ignore[override]
        """The agreement: over the replica group (at more than one rank), then across replica groups
        and ``should_commit``
        ([`FaultTolerantGradScaler`][distscaler.integrations.torchft.FaultTolerantGradScaler]).
        Returns a completed ``Work``."""
        (buffer,) = tensors
        op = opts if isinstance(opts, ReduceOp) else opts.reduceOp
        if self._replica_size() > 1:
            dist.all_reduce(buffer, op=op, group=self.replica_group)
        self._scaler._across_replicas_(buffer)
        return _Done(buffer)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:  # noqa: A002
        """The overflow report's gather, inside the replica group only."""
        if self._replica_size() > 1:
            dist.all_gather_into_tensor(output, input, group=self.replica_group)
        else:
            output.copy_(input.reshape(output.shape))
        return _Done(output)


@dataclass(slots=True)
class _Step:
    """What the integration knows about the current step (reset by ``update``)."""

    #: The scaler's part of torchft's pending healed state was loaded before the check.
    settled: bool = False
    preloaded: Any = None
    #: should_commit()'s answer, None before it is asked.
    committed: bool | None = None
    step: int = 0
    num_participants: int = 0
    replica_rank: int | None = None
    #: The cross-replica found_inf (float32 (4,)) of this step, for `replica_overflow`.
    cross: torch.Tensor | None = None
    lone: ReplicaOverflow | None = None


class FaultTolerantGradScaler(GradScaler):
    """A [`distscaler.GradScaler`][distscaler.GradScaler] that agrees with torchft: made by
    [`install()`][distscaler.integrations.torchft.install] (through
    [`from_scaler()`][distscaler.integrations.torchft.FaultTolerantGradScaler.from_scaler]).

    A scaler's settings, state and registered layouts, plus torchft's protocol: the agreement
    across replica groups, ``should_commit()`` once per step, the heal applied before the check and
    the scale update discarded when the step does not commit (see
    [`distscaler.integrations.torchft`][distscaler.integrations.torchft]). Takes torchft's
    ``OptimizerWrapper`` wherever a ``GradScaler`` takes an optimizer (it steps the wrapped one).
    """

    _manager: Manager
    _report_lone: bool
    _ft: _Step
    _preloaded_state: Any
    _pending_cross: tuple[torch.Tensor, int, int, int | None] | None
    _replica_overflow: ReplicaOverflow | None
    _last_committed: bool | None
    _state_key: str

    @classmethod
    def from_scaler(
        cls,
        scaler: GradScaler,
        manager: Manager,
        *,
        replica_group: dist.ProcessGroup | None = None,
        report_lone_replica: bool = False,
    ) -> FaultTolerantGradScaler:
        """A scaler for torchft that takes ``scaler`` over: its settings, its state and counts,
        its registered models and parameters (not copied: use the returned scaler from here on,
        not ``scaler``), committing through ``manager``.

        [`install()`][distscaler.integrations.torchft.install] builds its scaler with it and also
        registers the scaler's state with ``manager`` (healing) and the model.

        Args:
            scaler: a ``distscaler.GradScaler``; its ``process_group``, if any, is the replica
                group's own group.
            manager: the replica group's torchft ``Manager``.
            replica_group: the ranks of this replica group; default: ``scaler.process_group``
                (see [`install()`][distscaler.integrations.torchft.install]).
            report_lone_replica: see [`install()`][distscaler.integrations.torchft.install].

        Raises:
            TypeError: ``scaler`` is not a ``distscaler.GradScaler``.
            ValueError: ``scaler`` is one already (installed on a torchft ``Manager``); its process
                group is one of torchft's (pass the replica group's own group: the integration adds
                the cross-replica agreement). Nothing is changed when it raises.

        Cost: no collective, no host read.
        """
        if not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a distscaler.GradScaler, got: {type(scaler).__name__}")
        if isinstance(scaler, FaultTolerantGradScaler):
            raise ValueError("scaler is already installed on a torchft Manager")
        own = scaler.process_group
        if own is not None and has_dynamic_membership(own):
            raise ValueError(
                "scaler's process_group is a torchft group whose membership changes "
                f"({type(own).__name__}); pass the replica group's own process group (or none): "
                "the integration adds the agreement across replica groups"
            )
        ft = cls.__new__(cls)
        ft.__dict__.update(scaler.__dict__)  # the scaler's parts, as they are
        ft._manager = manager
        ft._report_lone = bool(report_lone_replica)
        ft._ft = _Step()
        ft._preloaded_state = None
        ft._pending_cross = None
        ft._replica_overflow = None
        ft._last_committed = None
        ft._state_key = STATE_KEY
        group = CrossReplicaGroup(ft, replica_group if replica_group is not None else own)
        ft._group = ScalerGroup(group)
        return ft

    # ------------------------------------------------------------------ the step

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """[`GradScaler.unscale_()`][distscaler.GradScaler.unscale_] after taking a pending healed
        scale (async quorum)."""
        self._settle()
        super().unscale_(_inner(optimizer))

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """[`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] after taking a
        pending healed scale; the norm is that of one replica group's averaged gradients (each value
        once), inf when the step does not commit."""
        self._settle()
        return super().clip_grad_norm_(_inner(optimizer), max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step the (wrapped) optimizer only if torchft commits the step and no group found inf/NaN.

        Calls ``manager.should_commit()`` exactly once per step, skipped or not (inside the
        step's collective). ``optimizer``: torchft's ``OptimizerWrapper`` (its wrapped optimizer
        is stepped; never call the wrapper's own ``step``) or a plain optimizer.
        """
        inner = _inner(optimizer)
        self._settle()
        if not self._enabled:  # no inf check: torchft's own protocol
            if self._commit():
                return inner.step(*args, **kwargs)
            return None
        retval = super().step(inner, *args, **kwargs)
        if self._ft.committed is None:  # pragma: no cover - every enabled step runs the inf check
            raise RuntimeError("distscaler: the step ran without its inf check; should_commit() was not called")
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """[`GradScaler.update()`][distscaler.GradScaler.update], or nothing when torchft did not
        commit this step: the scale, trackers and counts stay as they were (the step did not
        happen)."""
        step = self._ft
        self._ft = _Step()
        if step.lone is not None:
            self._replica_overflow = step.lone
        elif step.cross is not None and not self._report_lone:
            self._pending_cross = (step.cross, step.step, step.num_participants, step.replica_rank)
        if step.committed is False and new_scale is None:
            self._skip("not_committed", step.lone)  # counted as a skip; the scale stays
            return
        super().update(new_scale)

    @property
    def last_step_committed(self) -> bool | None:
        """Whether torchft committed the last step (None before one). A step that did not commit
        did not change the parameters, the optimizer or the scaler."""
        return self._last_committed

    @property
    def replica_overflow(self) -> ReplicaOverflow | None:
        """The replica group that alone held inf/NaN after the average, at the most recent step
        where one did; None if none did. Reading it costs one host read when a step since the last
        read has not been looked at (with ``report_lone_replica=True`` it is always current)."""
        pending = self._pending_cross
        if pending is not None:
            self._pending_cross = None
            cross, step, num_participants, replica_rank = pending
            lone = _lone(cross.tolist(), num_participants)
            if lone is not None:
                self._replica_overflow = ReplicaOverflow(
                    step, lone, lone == replica_rank, num_participants, reported=False
                )
        return self._replica_overflow

    @property
    def manager(self) -> Manager:
        """The torchft ``Manager`` this scaler commits through."""
        return self._manager

    # ------------------------------------------------------------------ torchft's protocol

    def _settle(self) -> None:
        # Once per step, before the first check: with the async quorum a healing group's staged
        # state is applied by torchft only inside should_commit(), after the check would have
        # unscaled by the stale scale. Take the scaler's part now (the rest follows in
        # should_commit, before the optimizer steps).
        step = self._ft
        if step.settled:
            return
        step.settled = True
        manager = self._manager
        if getattr(manager, "_quorum_future", None) is None:
            return  # no quorum started (start_quorum / OptimizerWrapper.zero_grad not called)
        manager.wait_quorum()  # the gradient average already waited for it
        if not manager._healing:
            return
        pending = manager._pending_state_dict
        state = None if pending is None else pending.get("user", {}).get(self._state_key)
        if state is not None:
            self.load_state_dict(state)
            self._preloaded_state = state

    def _load_healed(self, state: Any) -> None:
        # torchft's load function for the scaler's key (registered by install).
        if state is self._preloaded_state:  # taken before the check (_settle)
            self._preloaded_state = None
            return
        self.load_state_dict(state)

    def _commit(self) -> bool:
        step = self._ft
        if step.committed is None:
            step.committed = bool(self._manager.should_commit())
            self._last_committed = step.committed
        return step.committed

    def _across_replicas_(self, buffer: torch.Tensor) -> None:
        """The agreement across replica groups, then should_commit: ``buffer`` (found_inf agreed
        inside the replica group: a flag, or [flag or statistic, statistic]) becomes found_inf of
        every participating group, forced to non-finite when the step does not commit."""
        manager = self._manager
        step = self._ft
        flat = buffer.view(-1)
        numel = flat.numel()
        first = step.committed is None
        if first:
            step.step = manager.current_step()
            step.replica_rank = manager.participating_rank()  # None: this group heals (zeroed)
            step.num_participants = manager.num_participants()
        ident = 0.0 if step.replica_rank is None else float(step.replica_rank + 1)
        # This group's own found_inf: a flag > 0, or a non-finite statistic.
        bad = torch.logical_or(flat[0] > 0, flat.isfinite().all().logical_not()).to(torch.float32)
        # NaN as inf: a MAX over NaN depends on the order of the operands.
        values = torch.nan_to_num(flat, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        ends = bad * torch.tensor(
            [ident, _LO_BASE - ident if ident else 0.0], dtype=torch.float32, device=flat.device
        )
        parts = [values, ends] if numel == 2 else [values, values.new_zeros(2 - numel), ends]
        cross = torch.cat(parts)  # (4,): [v0, v1, hi, lo]
        manager.allreduce(cross, reduce_op=ReduceOp.MAX).wait()
        step.cross = cross
        if step.replica_rank is None and getattr(self, "_heal_counts_own", True):
            # A healing group's part was zeroed in the exchange: its own gradients' flag is
            # added back, so that it never steps on its own inf/NaN. It then does not commit and
            # heals again at the next quorum, while the participants step on theirs.
            cross[:numel] = torch.maximum(cross[:numel], values[:numel])
            if bool(bad):  # one host read, on a healing step only
                step.lone = ReplicaOverflow(step.step, -1, True, step.num_participants,
                                            reported=True, healing=True)  # fmt: skip
                logger.warning("%s", step.lone.describe())
                manager.report_error(NonFiniteAfterAverage(step.lone.describe()))
        keep_own = False
        if self._report_lone and step.num_participants > 1:
            lone = _lone(cross.tolist(), step.num_participants)  # the opt-in's host read
            if lone is not None:
                mine = lone == step.replica_rank
                step.lone = ReplicaOverflow(
                    step.step, lone, mine, step.num_participants, reported=True
                )
                if mine:
                    logger.warning("distscaler: %s", step.lone.describe())
                    manager.report_error(NonFiniteAfterAverage(step.lone.describe()))
                else:
                    keep_own = True  # that group drops out; these gradients are finite
        if not keep_own:
            flat.copy_(cross[:numel])
        if not self._commit():
            flat[0] = 1.0
            flat[1:] = math.inf

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_manager", "_ft", "_preloaded_state", "_pending_cross"):
            state.pop(key, None)
        state["_group"] = ScalerGroup(None)
        return state


def _lone(cross: list[float], num_participants: int) -> int | None:
    # The replica rank of the only group that went non-finite, from [v0, v1, hi, lo] after the MAX.
    hi, lo = cross[2], cross[3]
    if num_participants < 2 or hi <= 0 or hi + lo != _LO_BASE:
        return None
    return int(hi) - 1


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optim if isinstance(optimizer, OptimizerWrapper) else optimizer


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
        scaler: a ``distscaler.GradScaler`` (taken over by the returned
            [`FaultTolerantGradScaler`][distscaler.integrations.torchft.FaultTolerantGradScaler],
            [`from_scaler()`][distscaler.integrations.torchft.FaultTolerantGradScaler.from_scaler]:
            use the returned one; its ``process_group``, if any, is the replica group's own
            group), a ``ScalerConfig``, a DeepSpeed config, or None (``GradScaler(device_type)``).
        model (nn.Module | None): registered with ``scaler.register_model`` (parameter names in
            the overflow report; DDP layouts for clipping).
        replica_group (ProcessGroup | None): the ranks of this replica group (an FSDP/TP group
            inside it); default: the scaler's ``process_group``, else the default group once
            initialized (the group's own ``torchrun``), else this process alone.
        report_lone_replica (bool): report a group that alone holds inf/NaN after the average to
            torchft (``manager.report_error``) so that it heals from a peer while the others step.
            Default False: every group skips and backs off. One host read per step when True.
        device_type (str | None): the scaler's device type when ``scaler`` is not a GradScaler;
            default ``"cuda"`` when available, else ``"cpu"``.

    Raises:
        TypeError: ``manager`` is not a torchft ``Manager``; ``scaler`` of the wrong type.
        ValueError: ``optimizer`` wraps another manager; the scaler's process group is one of
            torchft's (pass the replica group's own group: the integration adds the cross-replica
            agreement); the manager already holds a ``"distscaler"`` state.
    """
    if not isinstance(manager, Manager):
        raise TypeError(f"manager must be a torchft.Manager, got: {type(manager).__name__}")
    if isinstance(optimizer, OptimizerWrapper) and optimizer.manager is not manager:
        raise ValueError("optimizer is an OptimizerWrapper of another Manager than manager")
    if isinstance(scaler, GradScaler):
        device_type = scaler.device_type
    elif device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    built = scaler_from_argument(scaler, device_type, "device_type")
    ft = FaultTolerantGradScaler.from_scaler(
        GradScaler(device_type) if built is None else built,
        manager,
        replica_group=replica_group,
        report_lone_replica=report_lone_replica,
    )  # refuses an installed scaler and a torchft group before anything changes
    if STATE_KEY in manager._user_state_dicts:
        raise ValueError(
            f"manager already holds a state named {STATE_KEY!r} (register_state_dict_fn): "
            "install() once per manager"
        )
    if model is not None:
        ft.register_model(model)
    manager.register_state_dict_fn(STATE_KEY, ft._load_healed, ft.state_dict)
    return ft
