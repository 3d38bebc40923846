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
  ``manager.allreduce(..., ReduceOp.MAX)`` over torchft's cross-replica group: 4 float32, the
  non-finite flag, the norm statistic (every group holds the same averaged gradients, so the
  largest is any group's; a healing group's part is zeroed by torchft and never wins) and the
  replica rank of the lowest and the highest group that went non-finite; then, with two or more
  participating groups, one row of 17 float32 per participating group (below). An inf before the
  gradient average already reached every group through the average; this all-reduce also catches
  one that appears after it, on one group only (local corruption, a faulty device). **Cost**: one
  more latency-bound all-reduce per step on the cross-replica group, of ``4 + 17 n`` float32 for
  ``n`` participating groups (the scaler's own collective is the only collective inside the
  group); its ``wait()`` blocks the host as the gradient all-reduce's already does (torchft's DDP
  waits in its comm hook, ``should_commit`` synchronizes).
* **The replica check across groups** (``replica_check=True``, the default): after the average
  every participating group holds bit-identical gradients. Each group writes, in its row (at its
  participating replica rank; every other group writes zeros there, and torchft zeroes a healing
  group's), the exact fingerprint of its gradients (`distscaler.replica_check`'s moments of the
  16-bit words, ``A = sum w_k`` and ``B = sum k * w_k`` mod two primes, plus 1 so that 0 reads as
  absent), every ``replica_check_interval`` manager steps (on the CPU every step, on a GPU every
  32nd). The MAX hands every group every row whole: no coefficients and no cancellation across
  groups, the healing group excluded, the rows compared on the host (one read). A group whose own
  gradients hold inf/NaN writes none (the overflow is the finding). Where the rows differ with
  every value finite, the groups that differ from the majority (with two groups, both) report to
  torchft (``manager.report_error(ReplicaGradientMismatch)``) and do not commit: their step is
  skipped with cause ``replica_mismatch``, the scale unchanged; a minority heals from the majority
  at the next quorum, and with no majority every group retries the step.
* **A heal verified**: at the first step where every group of the quorum participates after a
  quorum change or a heal (async quorum: the step after the heal step; sync: the heal step,
  healed in ``zero_grad``), each group also writes the fingerprints of its parameters, its
  optimizer state (state tensors, step counts, and each param group's numbers: lr, betas,
  weight_decay...) and the scaler's scale and growth tracker, with its role: healed since its last
  verified step, or reference. A healed group whose state differs from the reference groups'
  (their majority) reports ``HealMismatch`` to torchft: it does not commit (cause
  ``replica_mismatch``) and heals again at the next quorum, then is verified again, so no replica
  trains on from a bad heal (torchtitan #4598: a rejoined replica with a stale LR diverged). The
  reference groups step on. Every group that compared records it:
  [`replica_divergence`][distscaler.integrations.torchft.FaultTolerantGradScaler.replica_divergence]
  (the step, the replica ranks named, the parts that differ), the replica ledger (``param_checks``
  per heal check, ``checks`` per gradient comparison, the mismatch events) and a log warning; with
  ``on_replica_mismatch="raise"`` or a callable, that too. **Cost** of a heal check, at those steps
  only: one fingerprint pass over the parameters and the optimizer state (reads them once, a copy
  of their words), one host read; of a gradient comparison: one pass over the gradients, one host
  read. In a replica group of several ranks each rank compares its own shard, and the ranks merge
  what they found with one all-reduce (MAX) of ``2 n + 4`` float32 over the replica group, at
  checked steps only, so every rank of a group records the same.
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
``wait_quorum``, the private ``Manager._healing``, ``Manager._quorum_id``, ``Manager._pg.size()``
(the groups in the quorum, healing or not) and ``Manager._pending_state_dict`` (the async heal's
staged state, ``{"user": {key: state}}``), ``optim.OptimizerWrapper.optim``/``manager``. The heal
check needs every group of the quorum participating: with torchft's ``FIXED_WITH_SPARES`` world
size mode (spares never participate) it does not run.
Not covered: LocalSGD/DiLoCo (``torchft.local_sgd``: inner steps are not synchronized across
groups, there is no per-step gradient average to agree on), the quantized all-reduce
(``should_quantize=True``, CUDA/triton), DTensor gradients (FSDP2/HSDP through torchft's
``ManagedDeviceMesh``): their mesh is not a group this scaler can check.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._common import TESTED_VERSIONS, requires

with requires("torchft", f"torchft {TESTED_VERSIONS['torchft']}", "torchft"):
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

from .._process_group import ScalerGroup, has_dynamic_membership
from .._replica.checksum import (
    checksum_slots,
    layout_terms,
    moduli,
    primes_tensor,
    word_moments,
)
from .._scaler import GradScaler
from ..errors import ReplicaMismatchError
from ..replica_check import ReplicaMismatch, ReplicaSet
from ._scaler_arg import scaler_from_argument

__all__ = [
    "STATE_KEY",
    "TESTED_TORCHFT",
    "FaultTolerantGradScaler",
    "NonFiniteAfterAverage",
    "CrossReplicaGroup",
    "HealMismatch",
    "NotCommitted",
    "ReplicaDivergence",
    "ReplicaGradientMismatch",
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
#: One participating group's row in the cross-replica exchange, after the 4 elements above:
#: [role, the gradients' fingerprint (4), the parameters' (4), the optimizer state's (4), the
#: scaler state's (4)]. Each fingerprint is `checksum_slots()`'s ``[A mod P1, A mod P2,
#: B mod P1, B mod P2]`` plus 1, so that 0 (a row nobody wrote, a healing group's zeroed part)
#: means absent.
_ROW = 17
#: The parts of the state compared at the first step after a heal, in row order.
STATE_PARTS = ("parameters", "optimizer", "scaler")
#: Row roles: a group that did not heal since its last verified step (the reference), a group
#: that healed (checked against the reference).
_REFERENCE, _REJOINED = 1, 2
#: The primes of the cross-replica fingerprints: the exchange is a MAX, so a slot never sums
#: over groups and the largest primes of `moduli()` serve any number of groups (values below
#: ``2**23``, exact in float32).
_PRIMES = moduli(2)

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


@dataclass(frozen=True, slots=True)
class NotCommitted:
    """A step torchft did not commit on this replica group (``should_commit()`` returned False):
    the report of a ``not_committed`` skip ([`report_skip()`][distscaler.GradScaler.report_skip]).

    Attributes:
        step: the manager step (``manager.current_step()`` before the step).
        replica_id: this replica group's id as given to torchft's ``Manager`` (``replica_id=``),
            None where torchft does not say.
        num_participants: replica groups participating in that step's quorum.
        error: what this rank reported to torchft in that step (``manager.errored()``), None
            where another rank of the group did (should_commit is the group's answer).
    """

    step: int
    replica_id: str | None
    num_participants: int
    error: str | None

    def describe(self) -> str:
        """One line for a log (the same on every rank of every group that did not commit)."""
        return (
            f"torchft did not commit step {self.step} on this replica group "
            f"({self.num_participants} replica groups took part): one of its ranks reported an "
            "error (manager.report_error), or too few replica groups took part; the scale did "
            "not move and the group heals or retries at the next quorum"
        )


class HealMismatch(RuntimeError):
    """Reported to torchft (``manager.report_error``) by a replica group whose state, at its first
    step after a heal, differs from the state of the groups it healed from: it does not commit and
    heals again at the next quorum."""


class ReplicaGradientMismatch(RuntimeError):
    """Reported to torchft by a replica group whose averaged gradients differed bit for bit from
    the other participating groups' (every value finite): it does not commit that step."""


@dataclass(frozen=True, slots=True)
class ReplicaDivergence:
    """Participating replica groups whose values differed at one step, the same on every group
    that compared them (see [`distscaler.integrations.torchft`][distscaler.integrations.torchft]).

    Attributes:
        step: the manager step (``manager.current_step()`` before the step).
        what: ``"healed state"`` (the first step after a heal: parameters, optimizer state and
            scaler state) or ``"gradients"`` (the averaged gradients, every value finite).
        replica_ranks: the participating replica ranks named: the groups that healed and differ
            from the reference groups; else those that differ from the majority, and with no
            majority (two groups) every group compared.
        this_group: whether this process's group is named.
        parts: the parts of the state that differed (``"parameters"``, ``"optimizer"``,
            ``"scaler"``) as seen by this group against the reference; empty for gradients.
        num_participants: replica groups participating in that step.
        reported: whether the named groups reported it to torchft (``manager.report_error``):
            then they did not commit and heal again (or, for gradients with no majority, every
            group retries the step), the others stepped.
    """

    step: int
    what: Literal["healed state", "gradients"]
    replica_ranks: tuple[int, ...]
    this_group: bool
    parts: tuple[str, ...]
    num_participants: int
    reported: bool

    def describe(self) -> str:
        """One line for a log."""
        who = ", ".join(str(r) for r in self.replica_ranks)
        if self.what == "healed state":
            names = {"parameters": "parameters", "optimizer": "optimizer state",
                     "scaler": "scaler state"}  # fmt: skip
            parts = ", ".join(names[p] for p in self.parts) or "state"
            return (
                f"replica group(s) {who} (replica rank, of {self.num_participants}) differ in "
                f"{parts} at step {self.step}, the first after their heal, from the groups they "
                "healed from; "
                + ("they do not commit and heal again" if self.reported else "reported only")
            )
        then = "they do not commit" if self.reported else "reported only"
        return (
            f"the averaged gradients of replica group(s) {who} (replica rank, of "
            f"{self.num_participants}) differ from the other groups' at step {self.step} "
            f"(every value finite: a silent corruption); {then}"
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
    #: The optimizer of the step's latest entry point (its state is what a heal check compares).
    optimizer: torch.optim.Optimizer | None = None
    #: A divergence this step found (it does not commit when it names this group).
    divergence: ReplicaDivergence | None = None
    #: This group compared its state (a heal check), and whether it passed (this group not
    #: named), or a rejoined group was named (every group checks again at the next chance).
    state_checked: bool = False
    verified: bool = False
    keep_due: bool = False
    #: The participating replica ranks of the groups that healed, from the heal check's rows.
    rejoined: set[int] | None = None


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
    _seen_quorum: Any
    _verify_due: bool
    _rejoined: bool
    _replica_divergence: ReplicaDivergence | None

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
        ft._seen_quorum = None
        ft._verify_due = True  # a new process: its first step where every group participates
        ft._rejoined = False
        ft._replica_divergence = None
        group = CrossReplicaGroup(ft, replica_group if replica_group is not None else own)
        ft._group = ScalerGroup(group)
        return ft

    # ------------------------------------------------------------------ the step

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """[`GradScaler.unscale_()`][distscaler.GradScaler.unscale_] after taking a pending healed
        scale (async quorum)."""
        self._settle()
        self._ft.optimizer = _inner(optimizer)
        super().unscale_(_inner(optimizer))

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """[`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] after taking a
        pending healed scale; the norm is that of one replica group's averaged gradients (each value
        once), inf when the step does not commit."""
        self._settle()
        self._ft.optimizer = _inner(optimizer)
        return super().clip_grad_norm_(_inner(optimizer), max_norm, norm_type)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step the (wrapped) optimizer only if torchft commits the step and no group found inf/NaN.

        Calls ``manager.should_commit()`` exactly once per step, skipped or not (inside the
        step's collective). ``optimizer``: torchft's ``OptimizerWrapper`` (its wrapped optimizer
        is stepped; never call the wrapper's own ``step``) or a plain optimizer.
        """
        inner = _inner(optimizer)
        self._settle()
        self._ft.optimizer = inner
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
        if step.divergence is not None:
            self._replica_divergence = step.divergence
        if step.state_checked:
            self._verify_due = self._verify_due and step.keep_due
            if step.verified:
                self._rejoined = False
        if step.committed is False and new_scale is None:
            if step.divergence is not None and step.divergence.this_group:
                self._skip("replica_mismatch", step.divergence)  # the scale stays
            else:  # counted as a skip; the scale stays
                self._skip("not_committed", step.lone or self._not_committed(step))
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
    def replica_divergence(self) -> ReplicaDivergence | None:
        """The most recent step where participating replica groups differed (a bad heal, or
        averaged gradients that differ with every value finite); None if none did. No host read
        (the comparison read the exchange when it ran)."""
        return self._replica_divergence

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
        # torchft's load function for the scaler's key (registered by install): this group
        # healed, so its next step where every group participates compares its state.
        self._rejoined = True
        self._verify_due = True
        if state is self._preloaded_state:  # taken before the check (_settle)
            self._preloaded_state = None
            return
        self.load_state_dict(state)

    def _not_committed(self, step: _Step) -> NotCommitted:
        error = self._manager.errored()
        replica_id = getattr(self._manager, "_replica_id", None)  # torchft: "<replica_id>:<uuid>"
        return NotCommitted(
            step=step.step,
            replica_id=None if replica_id is None else str(replica_id).split(":")[0],
            num_participants=step.num_participants,
            error=None if error is None else repr(getattr(error, "original_exception", error)),
        )

    def _commit(self) -> bool:
        step = self._ft
        if step.committed is None:
            step.committed = bool(self._manager.should_commit())
            self._last_committed = step.committed
        return step.committed

    def _across_replicas_(self, buffer: torch.Tensor) -> None:
        """The agreement across replica groups, then should_commit: ``buffer`` (found_inf agreed
        inside the replica group: a flag, or [flag or statistic, statistic]) becomes found_inf of
        every participating group, forced to non-finite when the step does not commit. The same
        exchange carries each participating group's row (`_rows`): its gradients' fingerprint
        when the replica check is due, its state's at the first step after a heal; compared on
        the host (`_compare`), a group named there reports to torchft before should_commit."""
        manager = self._manager
        step = self._ft
        flat = buffer.view(-1)
        numel = flat.numel()
        first = step.committed is None
        if first:
            step.step = manager.current_step()
            step.replica_rank = manager.participating_rank()  # None: this group heals (zeroed)
            step.num_participants = manager.num_participants()
            self._note_quorum(step)
        ident = 0.0 if step.replica_rank is None else float(step.replica_rank + 1)
        # This group's own found_inf: a flag > 0, or a non-finite statistic.
        bad = torch.logical_or(flat[0] > 0, flat.isfinite().all().logical_not()).to(torch.float32)
        # NaN as inf: a MAX over NaN depends on the order of the operands.
        values = torch.nan_to_num(flat, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        ends = bad * torch.tensor(
            [ident, _LO_BASE - ident if ident else 0.0], dtype=torch.float32, device=flat.device
        )
        rows, grads_checked, state_checked = self._rows(step, flat, bad)
        parts = [values, ends] if numel == 2 else [values, values.new_zeros(2 - numel), ends]
        exchange = torch.cat([*parts, rows])  # (4 + num_participants * _ROW,)
        manager.allreduce(exchange, reduce_op=ReduceOp.MAX).wait()
        cross = exchange[:_CROSS_NUMEL]  # [v0, v1, hi, lo]
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
        if grads_checked or state_checked:  # one host read of the rows
            finding = self._compare(step, exchange[_CROSS_NUMEL:].tolist(), grads_checked,
                                    state_checked)  # fmt: skip
            cross_group = self._group.process_group
            if isinstance(cross_group, CrossReplicaGroup) and cross_group.size() > 1:
                # The group's ranks merge their findings (a MAX): each compared its own shard.
                merged = torch.tensor(finding, dtype=torch.float32, device=flat.device)
                dist.all_reduce(merged, op=ReduceOp.MAX, group=cross_group.replica_group)
                finding = merged.tolist()
            self._act(step, finding, grads_checked, state_checked)
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

    # ------------------------------------------------------------------ the replica check

    def _note_quorum(self, step: _Step) -> None:
        # A heal check is due on every group from a quorum change or a step where some group of
        # the quorum did not participate (it healed) until a step where every group participates:
        # the same on every group that saw the same quorums (a new process starts due).
        manager = self._manager
        quorum = getattr(manager, "_quorum_id", None)
        if (
            quorum != self._seen_quorum
            or step.replica_rank is None
            or step.num_participants < _quorum_size(manager)
        ):
            self._verify_due = True
        self._seen_quorum = quorum

    def _rows(
        self, step: _Step, flat: torch.Tensor, bad: torch.Tensor
    ) -> tuple[torch.Tensor, bool, bool]:
        """The rows of the exchange, float32 ``(num_participants * _ROW,)``, this group's
        written at its participating rank (empty below 2 participants: nothing to compare), and
        whether it wrote its gradients' and its state's fingerprints. ``bad``: this group's own
        found_inf (a group holding inf/NaN sends no gradients' fingerprint: the overflow is the
        finding). Device ops only."""
        n = step.num_participants
        rows = flat.new_zeros(n * _ROW if n >= 2 else 0, dtype=torch.float32)
        rank, check, optimizer = step.replica_rank, self._replicas, step.optimizer
        if n < 2 or rank is None or rank >= n or not check.enabled or optimizer is None:
            return rows, False, False
        grads_due = step.step % check.interval(self._host_reads) == 0
        state_due = (
            self._verify_due and check.param_interval > 0 and n >= _quorum_size(self._manager)
        )
        if not (grads_due or state_due):
            return rows, False, False
        row = rows[rank * _ROW : (rank + 1) * _ROW]
        row[0] = _REJOINED if self._rejoined else _REFERENCE
        device = flat.device
        if grads_due:
            grads = [
                getattr(p.grad, "_local_tensor", p.grad)
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
            row[1:5] = (_fingerprint(grads, device) + 1).mul_(1.0 - bad)
        if state_due:
            row[5:] = torch.cat([_fingerprint(t, device) for t in self._state_parts(optimizer)]) + 1
            step.state_checked = True
        return rows, grads_due, state_due

    def _state_parts(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        # The tensors of the parts compared after a heal, in STATE_PARTS order: the parameters;
        # the optimizer's state tensors and numbers (steps) and its param groups' settings
        # (lr, betas...); the scaler's scale and growth tracker.
        params: list[torch.Tensor] = []
        optim: list[torch.Tensor] = []
        numbers: list[float] = []
        for group in optimizer.param_groups:
            for key in sorted(k for k in group if k != "params"):
                _collect(group[key], optim, numbers)
            for p in group["params"]:
                params.append(getattr(p, "_local_tensor", p).detach())
                state = optimizer.state.get(p, {})
                for key in sorted(state, key=str):
                    _collect(state[key], optim, numbers)
        if numbers:
            optim.append(torch.tensor(numbers, dtype=torch.float64))
        scaler = [
            t.detach().reshape(-1).to(torch.float64)
            for t in (self._scale, self._growth_tracker)
            if isinstance(t, torch.Tensor)
        ]
        return [params, optim, scaler]

    def _compare(
        self, step: _Step, host: list[float], grads_checked: bool, state_checked: bool
    ) -> list[float]:
        """What this rank's rows show, as a finding the group's ranks merge with a MAX: float32
        ``(2 n + 4,)`` host values, ``n`` participants: the groups named by the heal check (one
        0/1 per participant), those named by the gradient check, the parts of the state that
        differ (3), whether the heal check's named groups report (heal again). Host arithmetic
        on the rows already read."""
        n = step.num_participants
        rows = [host[i * _ROW : (i + 1) * _ROW] for i in range(n)]
        finding = [0.0] * (2 * n + len(STATE_PARTS) + 1)
        me = step.replica_rank
        if state_checked:
            state = {i: (int(r[0]), tuple(r[5:])) for i, r in enumerate(rows) if r[0] and r[5]}
            refs = {i: fp for i, (role, fp) in state.items() if role == _REFERENCE}
            rejoined = {i for i, (role, _) in state.items() if role == _REJOINED}
            reference = _majority(refs)
            named = {i for i in rejoined if state[i][1] != reference}
            reported = bool(named)  # a rejoined group heals again
            if not named and refs and reference is None:  # no rejoiner: references disagree
                named, reported = set(refs), False  # no majority to heal from: reported only
            elif not named:
                named = {i for i, fp in refs.items() if fp != reference}
                reported = bool(named)  # a minority of three or more: it heals from the majority
            step.rejoined = rejoined
            if named:
                who = me if me in named else min(named)
                against = reference if reference is not None else next(
                    (state[i][1] for i in state if i not in named), None
                )
                mine = state[who][1]
                for k in range(len(STATE_PARTS)):
                    if against is None or mine[4 * k : 4 * k + 4] != against[4 * k : 4 * k + 4]:
                        finding[2 * n + k] = 1.0
                for i in named:
                    finding[i] = 1.0
                finding[-1] = float(reported)
        if grads_checked:
            grads = {i: tuple(r[1:5]) for i, r in enumerate(rows) if r[1] > 0}
            for i in _outliers(grads):
                finding[n + i] = 1.0
        return finding

    def _act(self, step: _Step, finding: list[float], grads_checked: bool,
             state_checked: bool) -> None:  # fmt: skip
        # The group's merged finding (the same on each of its ranks): counted, recorded and
        # logged; a named group reports to torchft (it does not commit). The heal check's finding
        # comes first: its gradients' difference follows from the states'.
        n = step.num_participants
        me = step.replica_rank
        ledger = self._replicas.ledger
        ledger.checks += grads_checked
        ledger.param_checks += state_checked
        state_named = tuple(i for i in range(n) if finding[i] > 0)
        grad_named = tuple(i for i in range(n) if finding[n + i] > 0)
        if state_checked:
            step.state_checked = True
            step.verified = me not in state_named
            step.keep_due = any(i in (step.rejoined or ()) for i in state_named)
        if state_named:
            parts = tuple(p for k, p in enumerate(STATE_PARTS) if finding[2 * n + k] > 0)
            found = ReplicaDivergence(step.step, "healed state", state_named, me in state_named,
                                      parts, n, finding[-1] > 0)  # fmt: skip
        elif grad_named:
            found = ReplicaDivergence(step.step, "gradients", grad_named, me in grad_named, (),
                                      n, reported=True)  # fmt: skip
        else:
            return
        step.divergence = found
        on_mismatch = self._replicas.on_mismatch
        mismatch = ReplicaMismatch(
            self._replicas.iteration + 1,
            "parameters" if found.what == "healed state" else "gradients",
            found.replica_ranks,
            action=on_mismatch if isinstance(on_mismatch, str) else "callback",
        )
        ledger.note_mismatch(mismatch)
        logger.warning("%s", found.describe())
        if found.this_group and found.reported:
            error = HealMismatch if found.what == "healed state" else ReplicaGradientMismatch
            self._manager.report_error(error(found.describe()))
        if on_mismatch == "raise":
            raise ReplicaMismatchError(mismatch)
        if callable(on_mismatch):
            on_mismatch(mismatch)

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_manager", "_ft", "_preloaded_state", "_pending_cross", "_seen_quorum"):
            state.pop(key, None)
        state["_group"] = ScalerGroup(None)
        return state


def _quorum_size(manager: Manager) -> int:
    # The replica groups in the quorum, participating or healing (the size of torchft's
    # cross-replica process group).
    try:
        return int(manager._pg.size())
    except Exception:  # noqa: BLE001 - a group not configured yet: only the participants known
        return manager.num_participants()


def _fingerprint(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The exact fingerprint of ``tensors`` read as one stream of 16-bit words: float32 ``(4,)``,
    ``[A mod P1, A mod P2, B mod P1, B mod P2]`` (`distscaler.replica_check`: ``A = sum w_k``,
    ``B = sum k * w_k``, positions global over the tensors), each below ``2**23``. Tensors on
    another device are copied to ``device``. Cost: one ``word_moments`` pass (a copy of the
    words, two row reductions), no host read."""
    tensors = [t.to(device) for t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.zeros(4, dtype=torch.float32, device=device)
    sizes = [t.numel() * t.element_size() // 2 for t in tensors]
    # One replica set of which this group is the first member: coefficient 1, shift 0, so the
    # slots are the plain (A, B) of the concatenated words.
    sets: list[ReplicaSet | None] = [ReplicaSet((0, 1), 0)] * len(tensors)
    coefs, offsets, shift = layout_terms(sizes, sets, _PRIMES, device)
    moments = word_moments(tensors, _PRIMES, device)
    slots, _ = checksum_slots(moments, offsets, coefs, shift, primes_tensor(_PRIMES, device))
    return slots


def _collect(value: Any, tensors: list[torch.Tensor], numbers: list[float]) -> None:
    # An optimizer setting or state entry: tensors as float64 where not floating point, numbers
    # (bools, ints, floats, and tuples of them: betas) as float64; anything else is not compared.
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(-1)
        tensors.append(t if t.is_floating_point() else t.to(torch.float64))
    elif isinstance(value, bool | int | float):
        numbers.append(float(value))
    elif isinstance(value, tuple | list):
        for v in value:
            _collect(v, tensors, numbers)


def _majority(fingerprints: dict[int, tuple[float, ...]]) -> tuple[float, ...] | None:
    # The value more than half of them hold, else None.
    if not fingerprints:
        return None
    value, count = collections.Counter(fingerprints.values()).most_common(1)[0]
    return value if count * 2 > len(fingerprints) else None


def _outliers(fingerprints: dict[int, tuple[float, ...]]) -> set[int]:
    # Those that differ from the majority; with no majority, all of them; none when all agree.
    if len(set(fingerprints.values())) <= 1:
        return set()
    majority = _majority(fingerprints)
    return {i for i, fp in fingerprints.items() if fp != majority}


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
