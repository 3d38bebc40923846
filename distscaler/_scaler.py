"""``distscaler.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose skip decision every rank
shares.

One class, as torch's ``grad_scaler.py`` is, whose public methods are short forwards to the parts
it holds, each an object with its own module:

| attribute | what it holds |
|---|---|
| ``_state`` | the scale, the growth tracker and the policy's counters, on the device, and the update that moves them (`distscaler._state`, [`distscaler.policies`][distscaler.policies]) |
| ``_layouts`` | how gradients lie across the ranks, for norms ([`distscaler.layouts`][distscaler.layouts]) |
| ``_overflows`` | the per-tensor flags of the last skipped step and the overflow report ([`distscaler.attribution`][distscaler.attribution]) |
| ``_group`` | the ranks that must agree (`distscaler._process_group`) |
| ``_records`` | this iteration's `StepRecord` per optimizer |
| ``_checks`` | the checks that ride the step's collective, each declaring its contribution, its reading and what it settles at ``update()`` (`distscaler.checks`); the first is the replica check, ``_replicas`` ([`distscaler.replica_check`][distscaler.replica_check]) |

A step for one optimizer is one straight path: the scaler checks torch's call order and decides what
the step does (a `StepPlan`), the layouts gather the gradients, `distscaler._inf_check.run()` carries
the plan out (one pass, the step's one collective) and returns a `StepResult`, the record keeps it,
and the fused hand-off (`distscaler._fused`) or the scaler itself steps the optimizer on it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from . import _validation as V
from ._contract import step_contract
from ._fused import fused_step
from ._inf_check import StepResult, run, triton_runs
from ._persistence import export_state, parse_state
from ._plan import (
    GradPass,
    checked_world,
    host_read_is_free,
    plan_check,
    plan_clip,
    plan_step,
    plan_unscale,
)
from ._process_group import ScalerGroup
from ._replica import ReplicaCheck
from ._state import HostValues, ScalerState
from ._step_record import StepRecord, torch_states
from .attribution import OverflowTracker
from .config import ScalerConfig
from .errors import CallOrderError, TrainingCollapsedError
from .layouts import GRAD_LAYOUTS, LayoutResolver
from .policies import get_policy, policy_names
from .telemetry import CollapseReport, CollapseWatch, SkipReport, SkipTotals

if TYPE_CHECKING:
    from ._plan import PassKernels, PlanFor, StepPlan
    from ._state import DeviceState, NextCounters
    from .attribution import OverflowReport
    from .checks import Check, Settlement
    from .config import CollapseAction, Kernels, OnMismatch
    from .layouts import GradLayout
    from .policies import PolicyName
    from .replica_check import ReplicaLedger

__all__ = ["GradScaler", "OptState"]

#: The methods of `distscaler.checks.Check` (`GradScaler.add_check()` refuses an object without).
_CHECK_METHODS = ("contribution", "end_iteration", "count", "name", "note_overflow", "at_fault",
                  "nonfinite_seen", "forget", "configure")  # fmt: skip


def _choose_kernels(setting: str, device: str) -> PassKernels:
    """``kernels``: ``"triton"`` where the Triton pass runs (`_inf_check.triton_runs()`: CUDA with
    triton importable) and asked for or ``"auto"``, else ``"torch"``.

    Raises:
        ValueError: ``kernels="triton"`` where it cannot run.
    """
    if setting == "torch":
        return "torch"
    runs = triton_runs(device)
    if setting == "triton":
        if not runs:
            raise ValueError(
                f"kernels='triton' needs a CUDA device with triton importable (or the CPU under "
                f"TRITON_INTERPRET=1 with a Triton whose interpreter runs the kernels, 3.9), got: "
                f"device={device!r}; use kernels='auto' or 'torch'"
            )
        return "triton"
    return "triton" if runs and device.startswith("cuda") else "torch"


def _check_grad_layout(grad_layout: object) -> None:
    if grad_layout is not None and grad_layout not in GRAD_LAYOUTS:
        raise ValueError(f"grad_layout must be one of {GRAD_LAYOUTS} or None, got: {grad_layout!r}")


class GradScaler(torch.amp.GradScaler):
    """Gradient (loss) scaler whose skip decision and scale update are the same on every rank.

    A drop-in for `torch.amp.GradScaler` (and a subclass of it): the same positional parameters,
    defaults, methods, call-order rules and error wording; for a single process the same parameters
    and scales, bit for bit. On top of torch: each rank's ``found_inf`` is combined in **one**
    ``all_reduce`` per optimizer step over ``process_group`` (one float32 reduced with MAX, or two
    with SUM when clipping: every rank skips, or none does, and the scales stay equal);
    [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] rides on it; fused optimizers get
    ``grad_scale`` and ``found_inf`` (no host read, gradients not rewritten); every counter lives on
    the device, updated by a handful of ops, so a step can be replayed from a CUDA graph;
    [`last_overflow`][distscaler.GradScaler.last_overflow] names the ranks and parameters of the
    last inf/NaN; ranks holding the same gradients compare them on the same collective (2 more
    float32) and a mismatch skips the step everywhere
    ([`distscaler.replica_check`][distscaler.replica_check]). The settings and their ranges are those of
    [`ScalerConfig`][distscaler.ScalerConfig].

    Args:
        device (str): torch's device type, default ``"cuda"`` (``"cuda"`` without CUDA warns and
            disables, as torch does).
        init_scale (float): the initial scale, default ``2.0**16``, a normal float32 > 0.
        growth_factor (float): factor (> 1) applied to the scale when it grows, default 2.0.
        backoff_factor (float): factor in (0, 1) applied to the scale when it backs off, default
            0.5.
        growth_interval (int): clean steps, in optimizer steps, before the scale grows, default
            2000, in [1, 2**31 - 1].
        enabled (bool): default True. False: a disabled scaler only clips: ``clip_grad_norm_`` is
            ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, ``step`` calls
            ``optimizer.step()``, every other method is a no-op; no collective, no host read.
        process_group (ProcessGroup | None): the ranks that must agree; default None: WORLD once
            ``torch.distributed`` is initialized.
        grad_layout ("replicated" | "sharded" | None): how plain-tensor gradients nothing
            else describes lie across the group, for
            [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_]
            ([`distscaler.layouts`][distscaler.layouts]); default None: unknown (an error in a
            multi-rank norm).
        min_scale (float | None): keyword-only, floor of the scale; default None: none.
        max_scale (float | None): keyword-only, ceiling of the scale; default None: none.
        policy (str): keyword-only, the update rule, default ``"torch"``: ``"deepspeed"``,
            ``"megatron"``, ``"static"`` or a registered one
            ([`distscaler.policies`][distscaler.policies]).
        hysteresis (int): keyword-only, overflows absorbed before a backoff, default 1 (> 1 for
            ``"deepspeed"`` and ``"megatron"`` only).
        consecutive_hysteresis (bool): keyword-only, default False; True refills the hysteresis
            on every clean step (``"deepspeed"`` only).
        raise_error_at_min_scale (bool): keyword-only, default False; True raises
            [`LossScaleAtMinimumError`][distscaler.LossScaleAtMinimumError] at an overflow with the
            scale at ``min_scale`` (one host read per update).
        skip_nonfinite (bool): keyword-only, default True; False steps on inf/NaN gradients too
            (``"static"`` only).
        skip_log_interval (int): keyword-only, updates between two reads of the skip counters for
            the skip log, default 100 (0: only when read anyway).
        replica_check (bool): keyword-only, default True: ranks holding the same gradients
            (DDP, HSDP's replicate dimension, ``grad_layout="replicated"``) compare them on the
            step's collective, and a mismatch skips the step on every rank
            ([`distscaler.replica_check`][distscaler.replica_check]). False: never.
        replica_check_interval (int | None): keyword-only, updates between two gradient checks
            (at least 1); default None: every update on CUDA with ``kernels="triton"`` (the
            checksum rides in the kernel's read): with a
            fused optimizer and ``skip_log_interval > 0`` the check's reading waits for the
            periodic read (its mismatch flag skips the step and holds the update on the device: no
            host read; see [`distscaler.replica_check`][distscaler.replica_check]), with another
            optimizer it is read beside the ``found_inf`` its step reads anyway; every 32
            (`distscaler.replica_check.INTERVAL`) with torch's kernels, the CPU's and a GPU's
            without Triton (a checked step there costs a read pass over the gradients, and on a
            GPU one host read). An int reads every check at its step.
        param_check_interval (int): keyword-only, updates between two comparisons of the
            replicated parameters and their optimizer state, default 1000 (0: never).
        on_replica_mismatch ("skip" | "raise" | callable): keyword-only, default
            ``"skip"``; ``"raise"`` raises `ReplicaMismatchError` on every rank before the
            optimizer steps (where the reading waits: from the ``update()`` of the periodic read
            that names it, once that update is complete); a callable is called with the
            [`ReplicaMismatch`][distscaler.replica_check.ReplicaMismatch] on every rank and the
            step is skipped.

    Raises:
        ValueError: a setting out of its range (all problems in one message naming each setting,
            value and range), before anything else happens, also when disabled.
        TypeError: ``device`` not a string, ``process_group`` not a ProcessGroup, a bool setting
            not a bool.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        process_group: dist.ProcessGroup | None = None,
        grad_layout: GradLayout | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        policy: PolicyName | str = "torch",
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
        skip_nonfinite: bool = True,
        skip_log_interval: int = 100,
        replica_check: bool = True,
        replica_check_interval: int | None = None,
        param_check_interval: int = 1000,
        on_replica_mismatch: OnMismatch = "skip",
        collapse_window: int = 2000,
        on_collapse: CollapseAction = "warn",
        kernels: Kernels = "auto",
    ) -> None:
        if not isinstance(device, str):
            raise TypeError(f"device must be a device type string such as 'cuda', got: {device!r}")
        config = ScalerConfig.of_arguments(
            "GradScaler arguments",
            enabled=enabled,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            policy=policy,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            raise_error_at_min_scale=raise_error_at_min_scale,
            skip_nonfinite=skip_nonfinite,
            skip_log_interval=skip_log_interval,
            replica_check=replica_check,
            replica_check_interval=replica_check_interval,
            param_check_interval=param_check_interval,
            on_replica_mismatch=on_replica_mismatch,
            collapse_window=collapse_window,
            on_collapse=on_collapse,
            kernels=kernels,
        )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got: {process_group!r}")
        _check_grad_layout(grad_layout)
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and torch.cuda.amp.common.amp_definitely_not_available():
            warnings.warn(  # torch's wording
                "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        self._config = config
        policy_state = get_policy(config.policy).initial_state(config.rule())
        self._state = ScalerState(HostValues(config.init_scale, 0, policy_state))
        self._layouts = LayoutResolver(grad_layout)
        self._overflows = OverflowTracker()
        self._group = ScalerGroup(process_group)
        #: Whether found_inf may be read on the host without a sync (the CPU): a property of the
        #: device, decided here (`distscaler._plan.host_read_is_free()`). Tests set it to False
        #: to run a GPU's path on the CPU.
        self._host_reads = host_read_is_free(device)
        #: Which kernels read the gradients (``kernels``), decided here: "triton" or "torch".
        self._kernels: PassKernels = (
            _choose_kernels(config.kernels, device) if self._enabled else "torch"
        )
        #: The replica check (its ledger is public: `replica_ledger`).
        self._replicas = ReplicaCheck.from_config(config)
        #: The checks that ride the step's collective, in the order their slots take in it.
        self._checks: list[Check] = [self._replicas]
        # torch's names for the scale and growth tracker (its scale() reads _scale).
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        #: This iteration's record per optimizer (``id(optimizer)``), dropped by
        #: [`update()`][distscaler.GradScaler.update].
        self._records: dict[int, StepRecord] = {}
        self._collapse = CollapseWatch()
        #: (host update count, cause, report) of the last skip only the host knows the cause of.
        self._last_host_skip: tuple[int, str, Any] | None = None
        #: An error a check's periodic naming gave, raised when its update completes.
        self._check_error: Exception | None = None
        #: The most recent collapse report (``collapse_window``), or None.
        self.last_collapse: CollapseReport | None = None

    # ------------------------------------------------------------------ the step path

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and agree on ``found_inf``.

        Same semantics and errors as `torch.amp.GradScaler.unscale_()`, plus the agreement: one
        read+write pass (torch's check-and-unscale kernel, one launch per device/dtype group), then
        one ``all_reduce`` of 2 float32 on ``process_group`` (every rank must call), 16 float32 more
        where the replica check rides in it (up to 4,096 ranks; 24 up to 65,536, 32 above; twice
        that at a parameter check; its first check in a run is preceded by one ``broadcast`` of
        its key; each check added with [`add_check()`][distscaler.GradScaler.add_check] adds its
        own). No host read.
        Prefer [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] to ``unscale_`` +
        ``torch.nn.utils.clip_grad_norm_``.

        Raises:
            CallOrderError: called twice for ``optimizer`` since the last
                [`update()`][distscaler.GradScaler.update], or after
                [`step()`][distscaler.GradScaler.step] (a ``RuntimeError``).
            ValueError: a gradient is fp16 ("Attempting to unscale FP16 gradients.").
        """
        if not self._enabled:
            return
        state = self._device_state("unscale_")
        record = self._records.setdefault(id(optimizer), StepRecord())
        if record.stage is OptState.UNSCALED:
            raise CallOrderError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.STEPPED:
            raise CallOrderError("unscale_() is being called after step().")
        _, result = self._check(optimizer, state, plan_unscale, weighted=False)
        record.keep(optimizer, result, stage=OptState.UNSCALED, grad_scale=False)

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the optimizer's gradients to a global norm, computed with the inf check.

        The norm is that of the *unscaled* gradients over every rank of ``process_group``, each
        gradient value counted once whatever the layout (DTensor placements,
        [`register_model()`][distscaler.GradScaler.register_model], ``grad_layout``; see
        [`distscaler.layouts`][distscaler.layouts]), as ``torch.nn.utils.clip_grad_norm_`` would
        compute it on the full, gathered, unscaled gradients. The gradients are then scaled by
        ``clip_coef = min(1, max_norm / total_norm)`` (torch's coefficient without its 1e-6 guard,
        which this form does not need: it never divides by the norm). ``max_norm=math.inf`` measures
        only, as torch's ``clip_grad_norm_(..., inf)`` does (its coefficient clamps to 1): the same
        pass and collective, the norm returned, the gradients only unscaled (fused optimizers get
        ``grad_scale = scale``); Transformers' Trainer measures this way with ``max_grad_norm=0``.

        Cost: one read pass (``_foreach_norm``), one ``all_reduce`` of 2 float32 when the group has
        several ranks (every rank must call; it *is* the step's collective), 16 float32 more where
        the replica check rides in it (up to 4,096 ranks, twice that at a parameter check, its
        first check preceded by one ``broadcast`` of its key; then at ``norm_type=inf`` one
        ``all_gather`` of as many float32 per rank instead, reduced on each rank), a few device
        ops ([Concepts](../concepts.md#the-inf-check-and-its-one-collective)), no host read.
        Fused optimizers get ``grad_scale = scale / clip_coef`` (gradients not rewritten); others
        are divided in place. After an explicit [`unscale_()`][distscaler.GradScaler.unscale_]
        the norm is taken from the unscaled gradients with a second ``all_reduce`` of 2 float32,
        replicated gradients too (so that a rank whose copy differs cannot give the ranks two
        norms).

        A disabled scaler only clips: it returns ``torch.nn.utils.clip_grad_norm_(params, max_norm,
        norm_type)`` over the optimizer's parameters, torch's norm and torch's clipping of the
        local gradients whatever their layout (no collective of the scaler's, no layout needed).

        Args:
            max_norm (float): greater than 0, or ``math.inf`` to measure only.
            norm_type (float): p of the p-norm, greater than 0, or ``math.inf``. Default: 2.0.

        Returns:
            0-dim float32 tensor on the scale's device: the global norm before clipping, the same
                on every rank; non-finite when any rank saw inf/NaN (the step is then skipped
                everywhere). A disabled scaler returns what ``torch.nn.utils.clip_grad_norm_``
                returns.

        Raises:
            ValueError: ``max_norm`` or ``norm_type`` out of range.
            UnknownLayoutError: (a ValueError) the scaler is enabled, the group has more than one
                rank and the layout of some gradients is unknown (p < inf only); raised before
                anything is changed.
            CallOrderError: called twice for ``optimizer`` since the last
                [`update()`][distscaler.GradScaler.update], or after
                [`step()`][distscaler.GradScaler.step].
        """
        max_norm, norm_type = V.check_clip(max_norm, norm_type)
        if not self._enabled:  # a disabled scaler only clips, as torch's clip_grad_norm_ would
            params = [p for group in optimizer.param_groups for p in group["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        state = self._device_state("clip_grad_norm_")
        record = self._records.setdefault(id(optimizer), StepRecord())
        if record.stage is OptState.STEPPED:
            raise CallOrderError("clip_grad_norm_() is being called after step().")
        if record.clipped:
            raise CallOrderError(
                "clip_grad_norm_() has already been called on this optimizer since the last "
                "update()."
            )
        unscaled = record.stage is OptState.UNSCALED
        plan_for = functools.partial(
            plan_clip, unscaled=unscaled, per_tensor_flags=self._attributing,
            max_norm=max_norm, norm_type=norm_type,
        )  # fmt: skip
        plan, result = self._check(optimizer, state, plan_for, weighted=True,
                                   found_inf=record.found_inf,
                                   max_norm=None if unscaled else state.max_norm(max_norm))  # fmt: skip
        record.keep(optimizer, result, stage=OptState.UNSCALED, grad_scale=plan.fused,
                    counters=not unscaled, clipped=True)  # fmt: skip
        assert result.total_norm is not None
        return result.total_norm

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """Agree on ``found_inf`` without changing the gradients (one check pass + the collective).

        torch's hook, which optimizers of torch's deprecated ``grad_scaler=`` contract call from
        their step (they drive the scaler); returns torch's ``{device: found_inf}``.
        """
        state = self._device_state("_check_inf_per_device")
        plan_for = functools.partial(plan_check, per_tensor_flags=self._attributing)
        _, result = self._check(optimizer, state, plan_for, weighted=False)
        record = self._records.setdefault(id(optimizer), StepRecord())
        record.keep(optimizer, result)
        assert result.found_inf is not None
        found = record.step_flag(result.found_inf, state.one)
        return {found.device: found}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step(*args, **kwargs)`` unless any rank found inf/NaN gradients.

        torch's semantics, return value and errors. Without an earlier
        [`unscale_()`][distscaler.GradScaler.unscale_] or
        [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] the inf check runs here (one
        ``all_reduce`` of 1 float32 for a fused optimizer, 2 for another, 16 more where the replica
        check rides in it; every rank must call). Fused optimizers: one read-only
        check pass, then ``grad_scale`` and ``found_inf`` go to the kernel, no host read
        (torch's fused-optimizer contract); others: the unscale pass and one host read of the agreed
        ``found_inf``, and on a skipped step one more read pass for the per-tensor flags of
        [`last_overflow`][distscaler.GradScaler.last_overflow]. After an explicit
        [`unscale_()`][distscaler.GradScaler.unscale_] (and no
        [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_]) a fused step takes that read
        pass at every step.

        Raises:
            CallOrderError: ``step()`` already called since the last
                [`update()`][distscaler.GradScaler.update], or
                [`scale()`][distscaler.GradScaler.scale] never called.
            RuntimeError: a ``closure`` keyword is passed.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._device_state("step")
        record = self._records.setdefault(id(optimizer), StepRecord())
        if record.stage is OptState.STEPPED:
            raise CallOrderError("step() has already been called since the last update().")
        plan_for = functools.partial(
            plan_step, checked=record.found_inf is not None,
            per_tensor_flags=self._attributing and record.flags is None,
        )  # fmt: skip
        plan, result = self._check(
            optimizer, state, plan_for, weighted=False, found_inf=record.found_inf
        )
        if plan.grad_pass is GradPass.DRIVEN:  # torch's deprecated contract
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                "directly.",
                FutureWarning,
                stacklevel=2,
            )
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})  # type: ignore[call-overload]
            record.stage = OptState.STEPPED
            return retval
        if plan.grad_pass is GradPass.NONE:
            record.keep_flags(optimizer, result)
        elif plan.fused:  # kept before the step, as torch keeps its found_inf
            record.keep(optimizer, result)
        else:
            record.keep(optimizer, result, stage=OptState.UNSCALED, grad_scale=False)
        if plan.fused:
            assert result.found_inf is not None
            # A check's reading may skip the step (found_inf 1.0 for the kernel) without being an
            # overflow: the update still sees the agreed found_inf.
            found = record.step_flag(result.found_inf, state.one)
            retval = fused_step(optimizer, record.grad_scale, found, args, kwargs)
        elif result.skipped or record.host_skip:
            retval = None
        else:  # the gradients are unscaled: the host's reading of found_inf decides
            retval = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from the agreed ``found_inf`` of every optimizer stepped this iteration.

        torch's semantics (``policy="torch"``; others:
        [`distscaler.policies`][distscaler.policies]), clamped to ``[min_scale, max_scale]``. A
        handful of device ops (the overflow flags ride in the skip counters' ``_foreach_lerp_``
        where the inf check gave ``found_inf`` in their shape, as a fused step's check on a GPU
        does; else one ``lerp_`` per optimizer keeps them:
        [`distscaler.attribution`][distscaler.attribution]), no collective, no host read but one
        every ``skip_log_interval`` calls (never inside CUDA graph capture): the periodic skip
        report, which, when a step was skipped since the last one, also attributes it
        ([`last_overflow`][distscaler.GradScaler.last_overflow]: one more host read and, at world
        size > 1, one ``all_gather`` on every rank together).

        Args:
            new_scale (float | Tensor | None): set the scale to this instead (a normal float32 > 0,
                or a 1-element float32 tensor without grad on the scaler's device type).

        Raises:
            CallOrderError: no inf check was recorded since the last update ("No inf checks were
                recorded prior to update.").
            ValueError / TypeError: ``new_scale`` is invalid.
        """
        if not self._enabled:
            return
        state = self._device_state("update")
        update = self._state.num_host_updates + 1
        # Each check's reading settles (`distscaler.checks`): a skip of its own cause keeps the
        # scale where it is; a flag held on the device holds the update there. The agreed
        # found_inf is read on the host only where a reading's cause depends on it.
        readings = [reading for r in self._records.values() for reading in r.readings]
        stepped = list(self._records.values())

        def found_on_host() -> bool:
            return any(bool(r.found_inf.item()) for r in stepped if r.found_inf is not None)

        settled = [reading.settle(found_on_host) for reading in readings]
        own: Settlement | None = next((x for x in settled if x.cause is not None), None)
        found_inf = state.zero
        counters: NextCounters | None = None
        lerps: list = []  # the overflow flags', run beside the skip counters' lerp
        if new_scale is None and own is None:
            records = [r for r in self._records.values() if r.found_inf is not None]
            if not records:
                raise CallOrderError("No inf checks were recorded prior to update.")
            found = [r.found_inf for r in records if r.found_inf is not None]
            found_inf = found[0].to(state.device, non_blocking=True)
            for other in found[1:]:
                found_inf = torch.fmax(found_inf, other.to(state.device, non_blocking=True))
            if len(found) == 1:
                counters = records[0].next_counters
            if self._attributing:
                flagged = [r.flags for r in records if r.flags is not None]
                # one record: its check's found_inf is the agreed one, and so are its flags'
                # weights (found_inf in every element)
                self._overflows.record_(found_inf, flagged, update, lerps,
                                        own_weights=len(found) == 1)  # fmt: skip
        counted = new_scale is None and own is None
        for reading in readings:  # before the update's periodic read, which counts them
            reading.close(update, found_inf, counted=counted)
        if new_scale is not None:
            self._state.set_scale(new_scale, self._device)
        elif own is not None:
            assert own.cause is not None
            due = self._state.skip(own.cause, self._config)
            self._last_host_skip = (self._state.num_host_updates, own.cause, own.report)
            if due:
                self._periodic()
        else:
            held = None
            for x in settled:
                if x.held is not None:
                    held = x.held if held is None else torch.fmax(held, x.held)
            self._apply(found_inf, counters, lerps, held)
        self._end_iteration(own.cause if own is not None and new_scale is None else None)
    def _end_iteration(self, cause: str | None) -> None:
        # The checks learn that the iteration ended (``cause``: a settlement's skip cause); the
        # records go; an error a check's naming gave is raised now that the update is complete.
        if not torch.compiler.is_compiling():  # (an int a compiled update wrote would recompile it)
            optimizers = self._optimizers()
            for check in self._checks:
                check.end_iteration(cause, optimizers)
        # Cleared in place: torch 2.6's dynamo gives a dict made in a compiled graph back as a
        # plain dict.
        self._records.clear()
        self._raise_check_error()

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        # The optimizers of this iteration (their records keep them), for the parameter check.
        return [r.optimizer for r in self._records.values() if r.optimizer is not None]

    def _skip(self, cause: str, report: Any = None) -> None:
        # An iteration whose step was skipped for ``cause`` without moving the scale (torchft's
        # uncommitted step): counted in the one skip account, as update() counts a check's skip.
        self._device_state("update")
        due = self._state.skip(cause, self._config)
        self._last_host_skip = (self._state.num_host_updates, cause, report)
        if due:
            self._periodic()
        self._end_iteration(cause)

    # ------------------------------------------------------------------ the parts, used

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = (
            "This may indicate your script did not use scaler.scale(loss or outputs) earlier in "
            "the iteration."
        )
        if self._scale is None:
            raise CallOrderError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise CallOrderError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _device_state(self, funcname: str) -> DeviceState:
        self._check_scale_growth_tracker(funcname)
        assert self._state.device is not None
        return self._state.device

    @property
    def _attributing(self) -> bool:
        # Per-tensor flags are kept only while a periodic report will read them.
        return self._config.skip_log_interval > 0

    def _apply(
        self,
        found_inf: torch.Tensor,
        counters: NextCounters | None,
        lerps: Sequence = (),
        held: torch.Tensor | None = None,
    ) -> None:
        if self._state.update(found_inf, counters, self._config, lerps, held):
            self._periodic()

    def _periodic(self) -> None:
        # The periodic read (the same update on every rank): the skip log, what the checks'
        # waiting readings found (named here, where every rank is), the overflow report, the
        # collapse watch.
        _, values, totals = self._read()
        self._name_waiting()
        self._report(totals, values.scale)

    def _count_waiting(self) -> None:
        # The checks' readings that waited on the device, read on the host (nothing when none
        # wait; no collective): each that held its update is a skip of its own cause.
        for check in self._checks:
            for update, cause in check.count():
                self._state.skips.note_cause(cause)
                last = self._last_host_skip
                if last is None or last[0] <= update:
                    self._last_host_skip = (update, cause, None)

    def _name_waiting(self) -> None:
        # What those skips were (every rank together); an error waits for `_raise_check_error` at
        # the end of the update.
        for check in self._checks:
            named, error = check.name()
            for update, report in named:
                last = self._last_host_skip
                if last is not None and last[0] == update:
                    self._last_host_skip = (update, last[1], report)
            if error is not None and self._check_error is None:
                self._check_error = error

    def _raise_check_error(self) -> None:
        # An error a check's naming gave at the periodic read, once the update is complete (its
        # step was skipped and the update held on the device).
        error, self._check_error = self._check_error, None
        if error is not None:
            raise error

    def _watch_collapse(self, totals: SkipTotals, scale: float) -> None:
        # Every rank sees the same totals at the same update, so every rank reports (or raises)
        # together.
        found = self._collapse.observe(totals, scale, self._config.collapse_window)
        nonfinite = any([check.nonfinite_seen() for check in self._checks])  # (each resets)
        if found is None and not nonfinite:
            return
        since, causes = found if found is not None else (totals.num_updates, {})
        report = CollapseReport(totals.num_updates, since, causes, tuple(self._collapse.scales),
                                self._named_at_fault(), nonfinite)  # fmt: skip
        self.last_collapse = report
        if self._config.on_collapse == "raise":
            raise TrainingCollapsedError(report)
        warnings.warn(report.describe(), RuntimeWarning, stacklevel=3)

    def _named_at_fault(self) -> tuple[str, ...]:
        # What the scaler last named at fault, for a collapse report.
        named: list[str] = []
        overflow = self._overflows.last_overflow
        if overflow is not None:
            named += [f"rank {r}" for r in sorted({e.rank for e in overflow.entries})]
        for check in self._checks:
            named += check.at_fault()
        return tuple(named)

    def _check(
        self,
        optimizer: torch.optim.Optimizer,
        state: DeviceState | None,
        plan_for: PlanFor,
        *,
        weighted: bool,
        found_inf: torch.Tensor | None = None,
        max_norm: torch.Tensor | None = None,
    ) -> tuple[StepPlan, StepResult]:
        # The entry points' one path. The plan, once: from the world (the group, whether a
        # collective runs), the optimizer's step contract, the scaler's own facts and the entry
        # point's ``plan_for`` (a `distscaler._plan` function); then what rides in its collective
        # (the plan asks each check for its contribution: `StepPlan.with_contributions`); then the
        # gradients (the layouts) and the pass with its collective (the runner). Nothing runs
        # where the optimizer drives the scaler itself (torch's deprecated contract: a DRIVEN
        # plan).
        contract = step_contract(optimizer)
        world = checked_world(self._group.world(), self._checks)
        plan = plan_for(world, contract, kernels=self._kernels,
                        host_reads=self._host_reads, periodic_read=self._attributing,
                        skip_nonfinite=self._config.skip_nonfinite)  # fmt: skip
        if plan.grad_pass is GradPass.DRIVEN:
            return plan, StepResult(None)
        world = plan.world
        if state is not None:
            plan = plan.with_contributions(self._checks, self._layouts, optimizer, state.device)
        grads = self._layouts.local_grads(optimizer, world.group, world.size, weighted=weighted,
                                          allow_fp16=plan.allow_fp16, needed=plan.reads_gradients)  # fmt: skip
        return plan, run(plan, *grads, state, found_inf=found_inf, max_norm=max_norm)

    def _read(self, *extra: torch.Tensor) -> tuple[list[float], HostValues, SkipTotals]:
        # ``extra`` 0-dim tensors and the state in one host transfer; new skips logged. Between
        # iterations (no inf check awaiting its update) the device's counts fold into the host's. Never asks the
        # process group (safe on another thread: torchft's quorum calls state_dict there).
        fold = not self._records
        self._count_waiting()
        return self._state.read(*extra, fold=fold, world_size=self._group.last_world_size)

    def _report(self, totals: SkipTotals, scale: float | None = None) -> None:
        # The periodic report's attribution (every rank at the same update), or report_overflow's;
        # the collapse watch at the periodic read.
        if scale is not None:
            self._watch_collapse(totals, scale)
        if totals.last_skipped and self._attributing and self._host_skip(totals) is None:
            group, world_size = self._group.resolve()
            report = self._overflows.report(
                totals.last_skipped,
                totals.last_skipped_scale,
                group=group,
                world_size=world_size,
                device=self._device_state("update").device,
            )
            if report is not None:
                for check in self._checks:
                    check.note_overflow(report.step, {e.rank for e in report.entries})

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        # torch's private per-optimizer state, for code that reads it (torch's tests, optimizers
        # of the deprecated grad_scaler= contract): a defaultdict of torch's fresh state, one entry
        # per optimizer of this iteration (stage, found_inf_per_device). A view of the records.
        return torch_states(self._records)

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: dict[int, dict[str, Any]]) -> None:
        # torch resets it with a fresh defaultdict (its update()): that drops the records.
        if value:
            raise ValueError("_per_optimizer_states can only be reset to an empty mapping")
        self._records.clear()

    # ------------------------------------------------------------------ device state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        # Idempotent: integrations (Accelerate's FSDP2 load_state) call it on a scaler in use,
        # where torch's version fails with "_growth_tracker initialized before _scale".
        state = self._state.materialize(dev)
        self._scale, self._growth_tracker = state.scale, state.growth_tracker
        self._prepare_counters()

    def _prepare_counters(self) -> None:
        # The policy's counters on the device now rather than at the first update, so that a
        # compiled phase sees them as they stay (dynamo would compile it again at its second call).
        if self._state.device is not None:
            self._state.device.prepare(get_policy(self._config.policy), self._config.rule())

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Create the device state on ``device`` (default: the device type) without scaling a loss.

        For ranks that never compute a loss (the first stages of a pipeline);
        [`scale()`][distscaler.GradScaler.scale] does it lazily on the others. No-op when disabled
        or once created. No collective, no host read.
        """
        if self._enabled:
            self._lazy_init_scale_growth_tracker(device or self._device)

    def __repr__(self) -> str:
        kwargs = {**self._config.scaler_kwargs(), "kernels": self._kernels}  # the choice made
        settings = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return f"{type(self).__name__}(device={self._device!r}, {settings})"

    @classmethod
    def from_config(
        cls,
        config: ScalerConfig,
        device: str = "cuda",
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> GradScaler:
        """Build a scaler from a [`ScalerConfig`][distscaler.ScalerConfig].

        ``ScalerConfig.from_deepspeed(ds_config)`` gives DeepSpeed's fp16 behaviour. ``kwargs``:
        constructor arguments a config does not hold (``grad_layout``...).

        Raises:
            TypeError: ``config`` is not a ScalerConfig, or ``kwargs`` repeats one of its fields.
        """
        if not isinstance(config, ScalerConfig):
            raise TypeError(f"config must be a ScalerConfig, got: {type(config).__name__}")
        settings = config.scaler_kwargs()
        repeated = sorted(set(settings) & set(kwargs))
        if repeated:
            raise TypeError(
                f"from_config got {repeated} both in config and as keyword arguments; "
                "use dataclasses.replace(config, ...) to change a config"
            )
        return cls(device, process_group=process_group, **settings, **kwargs)

    # ------------------------------------------------------------------ layouts

    def register_model(
        self, model: torch.nn.Module, *, grad_layout: GradLayout | None = None
    ) -> GradScaler:
        """Learn how ``model``'s gradients are laid out across the ranks, for
        [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_].

        Call once after wrapping, on every rank (no collective, no host read), for DDP, FSDP1 and
        plain modules such as a pipeline stage (``grad_layout`` for parameters no DDP/FSDP1 wrapper
        covers). DTensor gradients need nothing. A later call wins
        ([`distscaler.layouts`][distscaler.layouts]). Also names the parameters in the overflow
        report ([`last_overflow`][distscaler.GradScaler.last_overflow]).

        Returns:
            this scaler.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``grad_layout`` is not one of the layouts.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got: {type(model).__name__}")
        _check_grad_layout(grad_layout)
        self._layouts.register_model(model, grad_layout)
        self._overflows.register_model(model)
        return self

    def register_params(self, params: Sequence[torch.Tensor], *, replicas: float) -> GradScaler:
        """Declare that each gradient of ``params`` is held identically by ``replicas`` ranks.

        For gradients whose layout neither the tensor nor a DDP/FSDP wrapper tells (an engine's main
        parameters, [`distscaler.integrations.megatron`][distscaler.integrations.megatron]): in
        [`clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_]'s norm each rank's ``sum
        |g|**2`` of them is weighted ``1 / replicas``, so that one SUM over ``process_group`` counts
        each value once. ``replicas=math.inf`` leaves them out of the norm (a copy that another rank
        counts, such as Megatron's tensor-parallel duplicates); the inf check still sees every
        gradient. Call on every rank (no collective, no host read); a later call wins.

        Returns:
            this scaler.

        Raises:
            TypeError: ``params`` holds something other than tensors.
            ValueError: ``replicas`` is not a number in ``[1, inf]``.
        """
        params = list(params)
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"params must be tensors, got: {', '.join(sorted(set(bad)))}")
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, (int, float))
            or not replicas >= 1
        ):
            raise ValueError(f"replicas must be a number in [1, inf], got: {replicas!r}")
        self._layouts.register_params(params, float(replicas), f"replicas={replicas}")
        return self

    # ------------------------------------------------------------------ host reads

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Incurs one host read (sync)."""
        if not self._enabled:
            return 1.0
        return self._read()[1].scale

    def _get_growth_tracker(self) -> int:
        return self._read()[1].growth_tracker if self._enabled else 0

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The agreed flag of the last [`update()`][distscaler.GradScaler.update] (0-dim float32 on
        the device, 1.0 if inf/NaN was found, else 0.0; no host read; never written again): a step
        skipped for another cause (a finite replica mismatch) has 0.0 here and
        [`step_was_skipped`][distscaler.GradScaler.step_was_skipped] True. None before one and
        when disabled."""
        return self._state.last_found_inf if self._enabled else None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the optimizer step(s) of the last iteration were skipped, for any cause
        (`skip_totals` counts each), the same on every rank.

        One host read (the explicit sync). False before the first update and when disabled.
        """
        flag = self._state.last_found_inf
        if not self._enabled or flag is None:
            return False
        found = self._read(flag)[0][0]  # (counts the checks' waiting readings too)
        host = self._last_host_skip  # a skip whose cause only the host knows (no inf found)
        if host is not None and host[0] == self._state.num_host_updates:
            return True
        return bool(found)

    @property
    def skip_totals(self) -> SkipTotals:
        """Updates, skipped updates, the last skip's number and scale, so far (one host read).

        For a step replayed from a CUDA graph it is the periodic report's read: call it outside the
        graph, at least every 2**24 steps (the device counts are float32).
        """
        return self._read()[2] if self._enabled else SkipTotals()

    def metrics(self) -> dict[str, float | int]:
        """The scaler's numbers for a training log, under the keys every integration logs them
        (Lightning, Transformers, torchtitan, verl; torchft's scaler is this one):

        | key | value |
        |---|---|
        | ``distscaler/scale`` | the loss scale (float) |
        | ``distscaler/updates`` | updates so far ([`skip_totals`][distscaler.GradScaler.skip_totals] ``num_updates``) |
        | ``distscaler/skipped_total`` | skipped updates so far, every cause (``num_skipped``); each counted once, under one cause |
        | ``distscaler/skipped_overflow`` | of those, the ones whose agreed ``found_inf`` was 1.0: inf/NaN gradients, the scale backed off; a replica mismatch where some rank held that inf/NaN is one of these ([`SkipTotals.causes`][distscaler.SkipTotals.causes]) |
        | ``distscaler/skipped_replica_mismatch`` | of those, the ones skipped for a replica mismatch with no agreed inf/NaN: the scale did not move |
        | ``distscaler/skipped_not_committed`` | of those, the ones torchft did not commit: the scale did not move (the three sum to ``skipped_total``) |
        | ``distscaler/overflow_step`` | the update number (1-based) of the last skipped step reported ([`last_overflow`][distscaler.GradScaler.last_overflow]); present once one was |
        | ``distscaler/overflow_tensors`` | gradient tensors that held inf/NaN at that step, all ranks; with ``overflow_step`` |
        | ``distscaler/replica_checks`` | gradient comparisons across replicas, one per optimizer per checked update ([`replica_ledger`][distscaler.GradScaler.replica_ledger] ``checks``); present once replicas were compared, as the three below |
        | ``distscaler/replica_mismatches`` | replica mismatches found, one per check that found one, whatever the skip's cause (the ledger's ``mismatch_events``) |
        | ``distscaler/replica_skipped`` | the ledger's ``skipped``: ``skipped_replica_mismatch`` counted from the scaler's start (the same number in a run that did not load a checkpoint; the older key) |
        | ``distscaler/suspects`` | ranks named suspects |

        The key names are stable; keys are added, never renamed. An integration adds
        ``distscaler/skipped``, the skipped steps since its previous log. Empty when disabled.
        The same on every rank of ``process_group`` (the report and the ledger are).

        Cost: one host read (the scale and the counts in one transfer); no collective. Reading
        [`last_overflow`][distscaler.GradScaler.last_overflow] fills no report: call
        [`report_overflow()`][distscaler.GradScaler.report_overflow] first (every rank) for the
        report of a step that just skipped.
        """
        if not self._enabled:
            return {}
        _, values, totals = self._read()
        metrics: dict[str, float | int] = {
            "distscaler/scale": values.scale,
            "distscaler/updates": totals.num_updates,
            "distscaler/skipped_total": totals.num_skipped,
            **{f"distscaler/skipped_{cause}": n for cause, n in totals.causes.items()},
        }
        report = self.last_overflow
        if report is not None:
            metrics["distscaler/overflow_step"] = report.step
            metrics["distscaler/overflow_tensors"] = len(report.entries) + report.unlisted
        ledger = self.replica_ledger
        if ledger.checks or ledger.param_checks:
            metrics["distscaler/replica_checks"] = ledger.checks
            metrics["distscaler/replica_mismatches"] = ledger.mismatch_events
            metrics["distscaler/replica_skipped"] = ledger.skipped
            metrics["distscaler/suspects"] = len(ledger.suspects)
        return metrics

    # ------------------------------------------------------------------ checks on the collective

    def add_check(self, check: Check) -> GradScaler:
        """Add a check that rides the step's one collective
        ([`distscaler.checks`][distscaler.checks]): from the next step on, its contribution's
        slots travel after the replica check's, its readings skip steps or hold updates as it
        declares, and its skips are counted under their cause in
        [`skip_totals`][distscaler.GradScaler.skip_totals]. The loss scale moves on ``found_inf``
        alone, never on a check.

        Every rank of the scaler's group must add the same checks in the same order (the
        collective's size and layout rely on it). Call it between iterations (before the first
        ``scale()``, or after an ``update()``). Returns the scaler.

        Raises:
            TypeError: ``check`` lacks a method of [`Check`][distscaler.checks.Check].
            CallOrderError: called inside an iteration (an inf check is recorded).
        """
        missing = [name for name in _CHECK_METHODS if not callable(getattr(check, name, None))]
        if not isinstance(getattr(check, "every_step", None), bool):
            missing.append("every_step (a bool)")
        if missing:
            raise TypeError(
                f"check must implement distscaler.checks.Check; {type(check).__name__} lacks: "
                + ", ".join(missing)
            )
        if self._records:
            raise CallOrderError("add_check() must be called between iterations, after update().")
        self._checks.append(check)
        check.configure(self._config)
        return self

    # ------------------------------------------------------------------ the replica check

    @property
    def replica_ledger(self) -> ReplicaLedger:
        """Per-rank counts of the run: replica checks, replica mismatches per rank, steps skipped
        because of them, overflow reports where one rank alone held inf/NaN, and the ranks named
        suspects
        ([`distscaler.replica_check`][distscaler.replica_check]). The same on every rank of
        ``process_group``; reading it costs nothing (its ``skipped`` counts what the skip account
        counts under ``causes["replica_mismatch"]`` in this run, as the host knows it: a mismatch
        a deferred reading holds on the device is counted at the next read of ``skip_totals`` or
        ``metrics()``; the skip account also carries the counts of a loaded checkpoint, the ledger
        counts from the scaler's start)."""
        return self._replicas.ledger

    @property
    def last_replica_mismatch(self) -> Any:
        """The most recent [`ReplicaMismatch`][distscaler.replica_check.ReplicaMismatch] (the
        step, gradients or parameters, the ranks named), or None. Costs nothing."""
        return self._replicas.ledger.last_mismatch

    # ------------------------------------------------------------------ the overflow report

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Which ranks and parameters held inf/NaN at the most recent skipped step reported, or None.

        Filled by the periodic skip report (every ``skip_log_interval`` updates, at the same update
        on every rank; with ``skip_log_interval=1`` it is current after every
        [`update()`][distscaler.GradScaler.update]), so it is identical on every rank of
        ``process_group``; never with ``skip_log_interval=0``. Reading it costs nothing (see
        [`distscaler.attribution`][distscaler.attribution] for what it costs to fill).
        """
        return self._overflows.last_overflow

    def report_overflow(self) -> OverflowReport | None:
        """Attribute the most recent skipped step now, instead of at the next periodic report,
        and return [`last_overflow`][distscaler.GradScaler.last_overflow].

        For a loop that already reads the agreed skip flag
        ([`step_was_skipped`][distscaler.GradScaler.step_was_skipped]) and wants the report of that
        very step. Every rank of ``process_group`` must call it at the same iteration, after
        [`update()`][distscaler.GradScaler.update]. Cost: one host read; when a skipped step is not
        yet attributed, one more and, at world size > 1, one ``all_gather`` of a fixed size
        ([`distscaler.attribution`][distscaler.attribution]). None when disabled, with
        ``skip_log_interval=0``, or before any skipped step.

        Raises:
            CallOrderError: called after an inf check and before
                [`update()`][distscaler.GradScaler.update].
        """
        if not self._enabled:
            return None
        if self._records:
            raise CallOrderError("report_overflow() must be called after update().")
        self._report(self._read()[2])
        return self.last_overflow

    def report_skip(self) -> SkipReport | None:
        """The most recent skipped step's report, whatever its cause: an overflow (with
        [`report_overflow()`][distscaler.GradScaler.report_overflow]'s report), a replica mismatch
        (the ranks named) or, under torchft, a step that did not commit. None only before any
        skipped step and when disabled.

        Every rank of ``process_group`` must call it at the same iteration, after
        [`update()`][distscaler.GradScaler.update] (an overflow's report may gather, as
        ``report_overflow()`` does). Cost: one host read, plus ``report_overflow()``'s for an
        overflow not yet attributed.

        Raises:
            CallOrderError: called after an inf check and before ``update()``.
        """
        if not self._enabled:
            return None
        if self._records:
            raise CallOrderError("report_skip() must be called after update().")
        totals = self._read()[2]
        self._name_waiting()
        self._raise_check_error()
        if not totals.last_skipped:
            return None
        host = self._host_skip(totals)
        if host is not None:
            return SkipReport(host[1], totals.last_skipped, host[2])
        return SkipReport("overflow", totals.last_skipped, self.report_overflow())

    def _host_skip(self, totals: SkipTotals) -> tuple[int, str, Any] | None:
        # The last skip's (update, cause, report) when its cause is one only the host knows (a
        # replica mismatch, an uncommitted step: no inf/NaN to attribute), else None.
        host = self._last_host_skip
        ago = totals.num_updates - totals.last_skipped  # updates since the last skip
        if host is not None and self._state.num_host_updates - host[0] == ago:
            return host
        return None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers (one host read); empty when disabled.

        torch's five keys, so `torch.amp.GradScaler.load_state_dict()` loads it, plus the bounds,
        the run's counts, the policy and its counters, so that a run
        resumed mid-hysteresis continues exactly. Safe under ``torch.load(weights_only=True)``.
        Never touches the process group.
        """
        if not self._enabled:
            return {}
        _, values, totals = self._read()
        return export_state(self._config, values, totals)

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a scaler state saved by this class, by another stack, and continue its trajectory.

        torch's and Megatron's ``state_dict``, DeepSpeed's fp16 optimizer state, its loss scaler
        object or the ZeRO state holding it ([`distscaler.interop`][distscaler.interop]). Settings a
        format carries replace the constructor's, as torch does; a replaced bound or hysteresis, or
        another policy, warns. Every value is checked first, all problems
        in one error, and on error nothing changes. No-op when disabled.

        Raises:
            RuntimeError: ``state_dict`` is empty (saved from a disabled scaler; torch's wording).
            ValueError: a key is missing or a value has the wrong type or range.
            TypeError: ``state_dict`` is neither a mapping nor a DeepSpeed loss scaler.
        """
        if not self._enabled:
            return
        loaded = parse_state(state_dict, self._config)
        for message in loaded.warnings:
            warnings.warn(message, stacklevel=2)
        self._config = loaded.config
        self._configure_checks()
        for check in self._checks:
            check.forget()  # what waits belongs to the run the loaded state replaces
        self._state.load(loaded.values, loaded.num_updates, loaded.num_skipped,
                         loaded.skip_causes)  # fmt: skip
        self._prepare_counters()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._records:
                raise CallOrderError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            _, values, totals = self._read()
            state.update(_state=self._state.portable(values, totals), _scale=None)
            state["_growth_tracker"] = None
        state["_records"] = {}
        state["_check_error"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_per_optimizer_states", None)  # an older pickle's: the records hold it
        state.setdefault("_records", {})
        state.setdefault("_host_reads", host_read_is_free(state.get("_device", "cuda")))
        state.setdefault("_kernels", "torch")
        state.setdefault("_check_error", state.pop("_deferred_error", None))
        self.__dict__.update(state)
        if "_checks" not in state:  # an older pickle: the replica check alone
            self._checks = [self._replicas]

    # ------------------------------------------------------------------ settings

    @property
    def config(self) -> ScalerConfig:
        """The scaler's settings (a frozen [`ScalerConfig`][distscaler.ScalerConfig])."""
        return self._config

    def _set_config(self, **changes: Any) -> None:
        self._config = dataclasses.replace(self._config, **changes)  # validated there
        self._configure_checks()

    def _configure_checks(self) -> None:
        # The checks' settings follow the config (one object holds every setting).
        for check in self._checks:
            check.configure(self._config)

    def get_growth_factor(self) -> float:
        """The scale growth factor."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). ValueError naming the value otherwise; nothing changes."""
        self._set_config(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The scale backoff factor."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). ValueError naming the value otherwise."""
        self._set_config(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval, in optimizer steps."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (in [1, 2**31 - 1] steps). ValueError naming the value
        otherwise."""
        self._set_config(growth_interval=new_interval)

    def get_min_scale(self) -> float | None:
        """The lower bound of the scale, or None."""
        return self._config.min_scale

    def get_max_scale(self) -> float | None:
        """The upper bound of the scale, or None."""
        return self._config.max_scale

    @property
    def device_type(self) -> str:
        """The device type of the scale (the ``device`` argument)."""
        return self._device

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group given at construction (None: the default group when initialized)."""
        return self._group.process_group

    # torch's private fields, which other libraries read (Accelerate's tests read _init_scale):
    # the same meaning as torch's, over the config and the state.

    @property
    def _init_scale(self) -> float:
        # torch: the constructor's init_scale, replaced by load_state_dict's "scale".
        return self._state.initial.scale

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._state.initial = dataclasses.replace(self._state.initial, scale=float(value))

    @property
    def _growth_factor(self) -> float:
        return self._config.growth_factor

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self._set_config(growth_factor=value)

    @property
    def _backoff_factor(self) -> float:
        return self._config.backoff_factor

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self._set_config(backoff_factor=value)

    @property
    def _growth_interval(self) -> int:
        return self._config.growth_interval

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self._set_config(growth_interval=value)

    @property
    def _init_growth_tracker(self) -> int:
        # torch: the tracker the device state starts from (0; the loaded one after
        # load_state_dict; the pickled one after unpickling). No host read.
        return self._state.initial.growth_tracker

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        # Before the first scale() it is where the device state starts, as in torch.
        self._state.initial = dataclasses.replace(self._state.initial, growth_tracker=int(value))

    # ------------------------------------------------------------------ DeepSpeed's names
    # Code written against DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py)
    # reads these; with policy="deepspeed" the values follow DeepSpeed's rules.

    @property
    def cur_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.cur_scale``):
        [`get_scale()`][distscaler.GradScaler.get_scale]."""
        return self.get_scale()

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.loss_scale``):
        [`get_scale()`][distscaler.GradScaler.get_scale]."""
        return self.get_scale()

    @property
    def cur_iter(self) -> int:
        """Updates so far (DeepSpeed's; ``policy="deepspeed"``, else AttributeError). A host read."""
        return self._policy_counter("cur_iter")

    @property
    def last_overflow_iter(self) -> int:
        """``cur_iter`` of the last overflow, -1 before any (as ``cur_iter``). A host read."""
        return self._policy_counter("last_overflow_iter")

    @property
    def cur_hysteresis(self) -> int:
        """Overflows left before the next backoff (DeepSpeed's ``cur_hysteresis``; Megatron's
        ``hysteresis_tracker`` for ``policy="megatron"``). One host read.

        Raises:
            AttributeError: the policy has no hysteresis (``"torch"``, ``"static"``).
        """
        return self._policy_counter(
            get_policy(self._config.policy).hysteresis_counter or "cur_hysteresis"
        )

    def update_scale(self, overflow: Any) -> None:
        """Update the scale as if an iteration had (``overflow=True``) or had not overflowed.

        DeepSpeed's ``DynamicLossScaler.update_scale(overflow)``: an
        [`update()`][distscaler.GradScaler.update] whose agreed ``found_inf`` was ``overflow``
        (``overflow`` must already be agreed: no collective). No-op when disabled.

        Raises:
            TypeError: ``overflow`` is not a bool.
            LossScaleAtMinimumError: see ``raise_error_at_min_scale``.
        """
        overflow = V.check_bool("overflow", overflow)
        if not self._enabled:
            return
        self.materialize()
        state = self._device_state("update_scale")
        self._apply(state.one if overflow else state.zero, None)
        self._records.clear()

    def _policy_counter(self, key: str) -> int:
        # A policy's counters (DeepSpeed's names), as state_dict() saves them (one host read).
        policy = self._config.policy
        if key not in get_policy(policy).state_keys:
            owners = [n for n in policy_names() if key in get_policy(n).state_keys]
            raise AttributeError(
                f"{key} exists for policy={' or '.join(map(repr, owners))}; this scaler has "
                f"policy={policy!r}"
            )
        if not self._enabled:
            return self._state.initial.policy[key]
        return int(self.state_dict()[key])
