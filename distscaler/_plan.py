"""What one optimizer's step does in one iteration, decided once up front: a `StepPlan`.

``GradScaler`` builds a plan at each of its entry points (``unscale_``, ``clip_grad_norm_``,
``step``, torch's ``_check_inf_per_device``) from what it knows before touching a gradient: the
ranks that must agree and whether they need a collective at all (`World`, resolved once), whether a
graph is being traced, the optimizer's step contract, what already ran in this iteration (an
explicit ``unscale_`` or ``clip_grad_norm_``), whether an overflow report will read per-tensor
flags, whether this scaler may read ``found_inf`` on the host, and what rides in the step's one
collective besides the non-finite flag and the norm statistic (the plan's contributions, each a
`distscaler.checks.Contribution` of a check the scaler holds: the replica check's checksum when
it is due, anything an integration adds).
``distscaler._inf_check.run()`` carries the plan out and returns one ``StepResult`` with every
contribution's reading; nothing downstream branches on these conditions again.

**The step's one collective**, as a plan declares it (`StepPlan.collective_op`):

| pass | built in | contributions | reduce |
|---|---|---|---|
| ``CHECK``, ``UNSCALE`` | the non-finite flag (0/1) | none | ``all_reduce(MAX)`` |
| ``CHECK``, ``UNSCALE`` | the flag | some (``"sum"``) | ``all_reduce(SUM)``, flag clamped to 1 |
| ``NORM`` (p < inf) | flag, ``sum w |g|**p`` | any | ``all_reduce(SUM)`` |
| ``NORM`` (p = inf) | flag, ``max |g|`` | none | ``all_reduce(MAX)`` |
| ``NORM`` (p = inf) | flag, ``max |g|`` | some | one ``all_gather``, reduced on each rank |
| any of the above | as above | one that combines by ``"max"`` | one ``all_gather``, reduced on each rank |
| ``NORM_UNSCALED`` | as ``NORM`` | none | as ``NORM`` |
| ``NONE`` | nothing | none | none (the iteration's flag is reused) |

Contributions ride only in the iteration's first collective (``StepPlan.carries_contributions``:
``CHECK``, ``UNSCALE``, ``NORM``): a later pass reuses what that one agreed.

**Where found_inf may be read on the host** is a property of the device, decided when the scaler is
built (`host_read_is_free()`): on the CPU a kernel has run when it returns, so reading its result
costs no sync, and a fused step there reads the agreed flag and takes per-tensor flags only on a
skipped step. On CUDA nothing is read (a fused step never syncs and can be captured in a CUDA
graph), and neither is anything while ``make_fx`` or ``torch.compile`` trace a step, which must
record what a GPU runs. Tests run the GPU's path on the CPU by building the scaler so
(``GradScaler._host_reads = False``, the ``gpu_path`` fixture of the tests).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict

import torch

from ._contract import StepContract
from ._process_group import World

if TYPE_CHECKING:
    from .checks import Check, Contribution

__all__ = [
    "HOST_READ_FREE",
    "GradPass",
    "PassKernels",
    "PlanFor",
    "StepPlan",
    "checked_world",
    "host_read_is_free",
    "is_tracing",
]

#: Device types where reading a value on the host costs no device sync (their kernels already ran
#: when they returned).
HOST_READ_FREE = frozenset({"cpu"})


def checked_world(world: World, checks: Sequence[Check]) -> World:
    """``world`` as the checks need it: where a check agrees beyond the group
    (`distscaler.checks.Check.every_step`), a collective at every step over a world treated as one
    whose membership changes."""
    if world.dynamic or not any(check.every_step for check in checks):
        return world
    return world._replace(collective=True, dynamic=True)


def host_read_is_free(device_type: str) -> bool:
    """Whether a scaler on ``device_type`` may read ``found_inf`` on the host without a sync: on
    the CPU only. Decided once, when the scaler is built."""
    return device_type in HOST_READ_FREE


def is_tracing() -> bool:
    """Whether a graph is being traced (``torch.compile``, ``make_fx``, fake tensors): a traced
    step records what a GPU runs and reads nothing on the host. Two C++ lookups, no Python walk."""
    if torch.compiler.is_compiling():
        return True
    return _dispatch_mode(_PROXY) is not None or _dispatch_mode(_FAKE) is not None


_dispatch_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE


#: Which kernels run the pass (``GradScaler``'s ``kernels`` once resolved).
PassKernels = Literal["torch", "triton"]


class PlanFor(Protocol):
    """An entry point's plan function with its own arguments bound (``functools.partial`` of
    `plan_unscale`, `plan_clip`, `plan_step` or `plan_check`); what every entry point shares
    comes in the call: the world, the optimizer's contract and the scaler's facts (its kernels,
    whether a host read is free, whether it reads periodically, whether it skips non-finite
    steps)."""

    def __call__(
        self,
        world: World,
        contract: StepContract,
        *,
        kernels: PassKernels,
        host_reads: bool,
        periodic_read: bool,
        skip_nonfinite: bool,
    ) -> StepPlan: ...


class _Readings(TypedDict):
    reading_free: bool
    reading_may_wait: bool


def _readings(
    contract: StepContract,
    fused: bool,
    kernels: PassKernels,
    host_reads: bool,
    periodic_read: bool,
) -> _Readings:
    """`StepPlan.reading_free` and `StepPlan.reading_may_wait` of a plan that is ``fused`` or not,
    from the optimizer's contract and the scaler's facts."""
    triton = kernels == "triton"
    return {
        "reading_free": host_reads or (triton and contract is not StepContract.FUSED),
        "reading_may_wait": fused and triton and periodic_read,
    }


class GradPass(enum.Enum):
    """The one pass over the gradients a plan runs."""

    #: The iteration's inf check already ran (an explicit ``unscale_`` or ``clip_grad_norm_``):
    #: the agreed ``found_inf`` is reused, the gradients are read again only for per-tensor flags.
    NONE = "none"
    #: Read-only inf check (a fused optimizer divides by ``grad_scale`` itself).
    CHECK = "check"
    #: torch's check-and-unscale kernel: the gradients are divided by the scale in place.
    UNSCALE = "unscale"
    #: The global norm of the unscaled gradients with the inf check (``clip_grad_norm_``); the
    #: gradients are clipped in place unless the optimizer is fused.
    NORM = "norm"
    #: The global norm of gradients that carry no loss scale (``clip_grad_norm_`` after
    #: ``unscale_``), clipped in place.
    NORM_UNSCALED = "norm of unscaled gradients"
    #: No pass: the optimizer drives the scaler itself (torch's deprecated ``grad_scaler=``
    #: contract: its step calls ``_check_inf_per_device`` and ``unscale_``).
    DRIVEN = "driven by the optimizer"


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What `distscaler._inf_check.run()` does for one optimizer in one call.

    Attributes:
        grad_pass: the pass over the gradients (`GradPass`).
        fused: the optimizer takes ``grad_scale``/``found_inf`` and divides its gradients itself
            (`FUSED`): they are not rewritten here.
        read_found_inf: the agreed ``found_inf`` is read on the host (a step that is not fused
            needs it; a fused one reads it where the read is free), so per-tensor flags are taken
            only on a skipped step.
        per_tensor_flags: an overflow report will read per-tensor flags of this step.
        skip_nonfinite: False: a static scale told to step through inf/NaN (``found_inf`` 0.0).
        max_norm: ``clip_grad_norm_``'s ``max_norm`` (``math.inf``: measure only), or None.
        norm_type: ``clip_grad_norm_``'s p.
        world: the ranks that must agree and whether the pass issues a collective at all.
        tracing: a graph is being traced (``torch.compile``, ``make_fx``): nothing is read on
            the host and no contribution rides.
        contributions: what the collective carries besides the flag and the norm statistic.
        kernels: ``"triton"``: the pass is one multi-tensor Triton read of every gradient
            (``distscaler._triton``) where it covers the pass (``CHECK``, ``UNSCALE``,
            ``NORM`` with p in 1, 2, inf, the gradients on the scale's device); else torch's.
        reading_free: a contribution's reading costs no host sync of its own at this step: a
            host read is free (the CPU), or the Triton kernels read its inputs and the step reads
            ``found_inf`` on the host anyway (an optimizer that is not fused).
        reading_may_wait: a contribution's reading may wait on the device until the host's next
            read of the scaler: a fused step with the Triton kernels, where a periodic read will
            name what waited (`distscaler.replica_check.DeferredReading`).
        host_read_free: a host read costs no sync (the CPU; not on the path a GPU runs, nor while
            tracing): the clip reads its float32 norm there before it takes float64 ones
            (`distscaler._inf_check._two_norm`).
    """

    grad_pass: GradPass
    fused: bool = False
    read_found_inf: bool = False
    per_tensor_flags: bool = False
    skip_nonfinite: bool = True
    max_norm: float | None = None
    norm_type: float = 2.0
    world: World = World(None, 1, False)
    tracing: bool = False
    contributions: tuple[Contribution, ...] = ()
    kernels: PassKernels = "torch"
    reading_free: bool = False
    reading_may_wait: bool = False
    host_read_free: bool = False

    def with_contributions(
        self,
        checks: Sequence[Check],
        layouts: Any,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> StepPlan:
        """This plan with what its collective carries besides the flag and the norm statistic:
        each check's `distscaler.checks.Check.contribution()` where it is due, in the checks'
        order, asked only where the collective is the iteration's first
        (`carries_contributions`). ``layouts``: the scaler's layout resolver; ``device``: the
        scale's. The checks read this plan's ``world``, ``reading_free`` and
        ``reading_may_wait``."""
        if not self.carries_contributions:
            return self
        parts = [check.contribution(self, layouts, optimizer, device) for check in checks]
        kept = tuple(part for part in parts if part is not None)
        return replace(self, contributions=kept) if kept else self

    @property
    def carries_contributions(self) -> bool:
        """Whether this pass's collective is the iteration's first, which contributions ride in
        (``CHECK``, ``UNSCALE``, ``NORM`` of any p), and the world issues one."""
        if self.tracing or not self.world.collective:
            return False
        return self.grad_pass in (GradPass.CHECK, GradPass.UNSCALE, GradPass.NORM)

    @property
    def collective_op(self) -> Literal["none", "max", "sum", "gather"]:
        """How the collective reduces (the module docstring's table)."""
        if not self.world.collective or self.grad_pass is GradPass.NONE:
            return "none"
        norm = self.grad_pass in (GradPass.NORM, GradPass.NORM_UNSCALED)
        max_of_values = norm and self.norm_type == math.inf
        if not self.contributions:
            return "max" if (max_of_values or not norm) else "sum"
        if max_of_values or any(c.combine == "max" for c in self.contributions):
            return "gather"
        return "sum"

    @property
    def allow_fp16(self) -> bool:
        """Whether fp16 gradients are accepted: not where they are divided in place by the scale
        (torch refuses to unscale fp16 gradients)."""
        if self.grad_pass is GradPass.UNSCALE:
            return False
        return not (self.grad_pass is GradPass.NORM and not self.fused)

    @property
    def reads_gradients(self) -> bool:
        """Whether the gradients are read at all (a plan that reuses an agreed ``found_inf``
        reads them only for per-tensor flags)."""
        return self.grad_pass is not GradPass.NONE or self.per_tensor_flags


def plan_unscale(
    world: World,
    contract: StepContract,
    *,
    kernels: PassKernels,
    host_reads: bool,
    periodic_read: bool,
    skip_nonfinite: bool,
) -> StepPlan:
    """``unscale_``: torch's check-and-unscale kernel whatever the ``contract``; no per-tensor
    flags (a later ``step`` or ``clip_grad_norm_`` takes them)."""
    return StepPlan(GradPass.UNSCALE, skip_nonfinite=skip_nonfinite, world=world,
                    tracing=is_tracing(), kernels=kernels,
                    **_readings(contract, False, kernels, host_reads, periodic_read))  # fmt: skip


def plan_clip(
    world: World,
    contract: StepContract,
    *,
    kernels: PassKernels,
    host_reads: bool,
    periodic_read: bool,
    unscaled: bool,
    per_tensor_flags: bool,
    skip_nonfinite: bool,
    max_norm: float,
    norm_type: float,
) -> StepPlan:
    """``clip_grad_norm_``: the global norm with the inf check, or, on gradients already unscaled
    (``unscaled``: after ``unscale_``), the norm alone. A fused step on the CPU reads
    ``found_inf`` (``host_reads``) and takes per-tensor flags only when it is skipped."""
    tracing = is_tracing()
    if unscaled:
        return StepPlan(
            GradPass.NORM_UNSCALED,
            per_tensor_flags=per_tensor_flags,
            skip_nonfinite=skip_nonfinite,
            max_norm=max_norm,
            norm_type=norm_type,
            world=world,
            tracing=tracing,
            kernels=kernels,
            **_readings(contract, False, kernels, host_reads, periodic_read),
        )
    fused = contract is StepContract.FUSED
    return StepPlan(
        GradPass.NORM,
        fused=fused,
        read_found_inf=fused and skip_nonfinite and host_reads and not tracing,
        per_tensor_flags=per_tensor_flags,
        skip_nonfinite=skip_nonfinite,
        max_norm=max_norm,
        norm_type=norm_type,
        world=world,
        tracing=tracing,
        kernels=kernels,
        host_read_free=host_reads and not tracing,
        **_readings(contract, fused, kernels, host_reads, periodic_read),
    )


def plan_step(
    world: World,
    contract: StepContract,
    *,
    kernels: PassKernels,
    host_reads: bool,
    periodic_read: bool,
    checked: bool,
    per_tensor_flags: bool,
    skip_nonfinite: bool,
) -> StepPlan:
    """``step``: a fused optimizer gets the read-only check (it divides by ``grad_scale``), any
    other the unscale pass and one host read of ``found_inf``. After an explicit ``unscale_`` or
    ``clip_grad_norm_`` (``checked``) the agreed flag is reused. An optimizer that drives the
    scaler itself (``DRIVES_THE_SCALER``, torch's deprecated contract) gets no pass (``DRIVEN``).

    Args:
        contract: the optimizer's step contract.
        kernels: the scaler's kernels (`StepPlan.kernels`).
        host_reads: this scaler may read ``found_inf`` on the host without a sync (the CPU).
        periodic_read: the scaler reads its state on the host every ``skip_log_interval``
            updates (`StepPlan.reading_may_wait`).
        checked: an inf check already ran in this iteration.
        per_tensor_flags: an overflow report will read per-tensor flags, and none were taken yet.
    """
    if contract is StepContract.DRIVES_THE_SCALER:
        return StepPlan(GradPass.DRIVEN, world=world, kernels=kernels)  # no pass: no reading
    fused = contract is StepContract.FUSED
    tracing = is_tracing()
    if fused:
        grad_pass = GradPass.NONE if checked else GradPass.CHECK
        # The CPU's fused check reads the flag and takes flags only on a skip; a fused step after
        # an explicit unscale_ takes them at once (nothing reads the flag after it).
        read = per_tensor_flags and host_reads and not checked and not tracing
    else:
        grad_pass = GradPass.NONE if checked else GradPass.UNSCALE
        read = True  # the step runs on the host's word
    return StepPlan(
        grad_pass,
        fused=fused,
        read_found_inf=read,
        per_tensor_flags=per_tensor_flags,
        skip_nonfinite=skip_nonfinite,
        world=world,
        tracing=tracing,
        kernels=kernels,
        **_readings(contract, fused, kernels, host_reads, periodic_read),
    )


def plan_check(
    world: World,
    contract: StepContract,
    *,
    kernels: PassKernels,
    host_reads: bool,
    periodic_read: bool,
    per_tensor_flags: bool,
    skip_nonfinite: bool,
) -> StepPlan:
    """torch's ``_check_inf_per_device`` hook: the read-only check, the gradients unchanged
    whatever the ``contract`` (the optimizer calling it drives the scaler)."""
    tracing = is_tracing()
    return StepPlan(
        GradPass.CHECK,
        fused=True,
        read_found_inf=per_tensor_flags and host_reads and not tracing,
        per_tensor_flags=per_tensor_flags,
        skip_nonfinite=skip_nonfinite,
        world=world,
        tracing=tracing,
        kernels=kernels,
        **_readings(contract, True, kernels, host_reads, periodic_read),
    )
