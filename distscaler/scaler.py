"""``distscaler.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose verdict every rank shares.

The torch-compatible face: constructor, per-optimizer call-order state and the step path's phases
(``unscale_``, ``clip_grad_norm_``, ``step``, ``update``). Its mixins: the host's reads and the
checkpoints (``get_scale``, ``step_was_skipped``, ``state_dict``, pickling) from
:mod:`distscaler._state_api`, ``register_model``/``register_params`` from
:mod:`distscaler._layouts_api`, the settings' getters and setters from
:class:`~distscaler.config.ScalerSettings`, DeepSpeed's loss-scaler attributes from
:mod:`~distscaler.deepspeed_api`, the overflow report from :mod:`~distscaler.attribution_api`. The
work is in :mod:`~distscaler.config`, :mod:`~distscaler.state`, :mod:`~distscaler.verdict`,
:mod:`~distscaler.fused`, :mod:`~distscaler.policies`, :mod:`~distscaler.persistence` and
:mod:`~distscaler.telemetry`.

Each phase is one straight path: the face checks the call order and decides what runs (the
optimizer's step contract, :mod:`~distscaler.contract`), the verdict computes
(:mod:`~distscaler.verdict`), the fused hand-off (:mod:`~distscaler.fused`) or the face's own host
step applies it, and the face keeps the outcome in the optimizer's
:class:`~distscaler.step_record.StepRecord`. Nothing calls back into the face but torch's
deprecated ``grad_scaler=`` optimizers, whose contract is to drive the scaler.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from . import _validation as V
from ._layouts_api import LayoutRegistrationAPI, check_grad_layout
from ._state_api import ScalerStateAPI
from .attribution import Coded, OverflowTracker
from .attribution_api import OverflowReportingAPI
from .config import ScalerConfig, ScalerSettings
from .contract import StepContract, step_contract, uses_fused_scaling
from .deepspeed_api import DeepSpeedScalerAPI
from .errors import CallOrderError
from .fused import fused_step
from .layouts import GradLayout, LayoutResolver
from .policies import PolicyName, get_policy
from .state import DeviceState, Epilogue, HostValues, ScalerState
from .step_record import StepRecord, torch_states
from .verdict import VerdictGroup

__all__ = ["GradScaler", "OptState"]


class GradScaler(
    ScalerSettings,
    ScalerStateAPI,
    LayoutRegistrationAPI,
    DeepSpeedScalerAPI,
    OverflowReportingAPI,
    torch.amp.GradScaler,
):
    """Gradient (loss) scaler whose skip decision and scale update are the same on every rank.

    A drop-in for :class:`torch.amp.GradScaler` (and a subclass of it): the same positional
    parameters, defaults, methods, call-order rules and error wording; for a single process the
    same parameters and scales, bit for bit. On top of torch: the per-rank verdicts are combined in
    **one** ``all_reduce`` of at most two float32 per step over ``process_group`` (every rank
    skips, or none does, and the scales stay equal); :meth:`clip_grad_norm_` rides on it; fused
    optimizers get ``grad_scale`` and ``found_inf`` (no host read, gradients not rewritten); every
    counter lives on the device, updated by a handful of ops, so a step can be replayed from a
    CUDA graph; :attr:`last_overflow` names the ranks and parameters of the last inf/NaN.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: torch's, in
            its order, with its defaults (``"cuda"`` without CUDA warns and disables). Disabled:
            every method is a no-op (``step`` calls ``optimizer.step()``).
        process_group (ProcessGroup | None): the ranks that must agree; None: WORLD once
            ``torch.distributed`` is initialized.
        grad_layout (``"replicated"`` | ``"sharded"`` | None): how plain-tensor gradients nothing
            else describes lie across the group, for :meth:`clip_grad_norm_`
            (:mod:`distscaler.layouts`).
        min_scale ... skip_log_interval: keyword-only settings, each with its range on
            :class:`~distscaler.config.ScalerConfig` (bounds, the update rule of
            :mod:`distscaler.policies`, DeepSpeed's hysteresis options, skip-log interval).

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
        policy: PolicyName = "torch",
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
        skip_nonfinite: bool = True,
        skip_log_interval: int = 100,
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
        )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got: {process_group!r}")
        check_grad_layout(grad_layout)
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
        # torch's names for the scale and growth tracker (its scale() reads _scale).
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        #: This iteration's record per optimizer (``id(optimizer)``), dropped by :meth:`update`.
        self._records: dict[int, StepRecord] = {}
        self._verdict = VerdictGroup(process_group, LayoutResolver(grad_layout))
        self._overflows = OverflowTracker()

    # ------------------------------------------------------------------ helpers

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

    def _record_of(self, optimizer: torch.optim.Optimizer) -> StepRecord:
        record = self._records.get(id(optimizer))
        if record is None:
            record = self._records[id(optimizer)] = StepRecord()
        return record

    def _agreed(self, found_inf: torch.Tensor) -> torch.Tensor:
        # The flag a record keeps: a static scale told to step through inf/NaN keeps 0.0.
        if self._config.skip_nonfinite:
            return found_inf
        assert self._state.device is not None
        return self._state.device.zero

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

    # ------------------------------------------------------------------ the public API

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and agree on ``found_inf``.

        Same semantics and errors as :meth:`torch.amp.GradScaler.unscale_`, plus the verdict: one
        read+write pass (torch's check-and-unscale kernel, one launch per device/dtype group), then
        one ``all_reduce`` of 2 float32 on ``process_group`` (every rank must call). No host read.
        Prefer :meth:`clip_grad_norm_` to ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``.

        Raises:
            CallOrderError: called twice for ``optimizer`` since the last :meth:`update`, or after
                :meth:`step` (a ``RuntimeError``).
            ValueError: a gradient is fp16 ("Attempting to unscale FP16 gradients.").
        """
        if not self._enabled:
            return
        device_state = self._device_state("unscale_")
        record = self._record_of(optimizer)
        if record.stage is OptState.UNSCALED:
            raise CallOrderError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.STEPPED:
            raise CallOrderError("unscale_() is being called after step().")
        found_inf = self._verdict.unscale(optimizer, device_state)
        record.agreed(self._agreed(found_inf), grad_scale=None, stage=OptState.UNSCALED)

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the optimizer's gradients to a global norm, folded into the overflow verdict.

        The norm is that of the *unscaled* gradients over every rank of ``process_group``, each
        gradient value counted once whatever the layout (DTensor placements, :meth:`register_model`,
        ``grad_layout``; see :mod:`distscaler.layouts`), as ``torch.nn.utils.clip_grad_norm_`` would
        compute it on the full, gathered, unscaled gradients. The gradients are then scaled by
        ``min(1, max_norm / norm)`` (torch's coefficient without its 1e-6 guard, which this form
        does not need: see :mod:`distscaler.verdict`). ``max_norm=math.inf`` measures only, as
        torch's ``clip_grad_norm_(..., inf)`` does (its coefficient clamps to 1): the same pass and
        collective, the norm returned, the gradients only unscaled (fused optimizers get
        ``grad_scale = scale``); Transformers' Trainer measures this way with ``max_grad_norm=0``.

        Cost: one read pass (``_foreach_norm``), one ``all_reduce`` of 2 float32 when the group
        has several ranks (every rank must call; it *is* the step's verdict), a few device ops
        (:mod:`distscaler.verdict`), no host read. Fused optimizers get ``grad_scale = scale /
        clip_coef`` (gradients not rewritten); others are divided in place. After an explicit
        :meth:`unscale_` the norm is taken from the unscaled gradients (a second all_reduce unless
        all are replicated). A disabled scaler only clips.

        Args:
            max_norm (float): > 0, or ``math.inf`` to measure only. norm_type (float): p of the
                p-norm, > 0 or inf.

        Returns:
            0-dim float32 tensor on the scale's device: the global norm before clipping, the same on
            every rank; non-finite when any rank saw inf/NaN (the step is then skipped everywhere).

        Raises:
            ValueError: ``max_norm`` or ``norm_type`` out of range.
            UnknownLayoutError: (a ValueError) the group has more than one rank and the layout of
                some gradients is unknown (p < inf only); raised before anything is changed.
            CallOrderError: called twice for ``optimizer`` since the last :meth:`update`, or after
                :meth:`step`.
        """
        max_norm, norm_type = V.check_clip(max_norm, norm_type)
        if not self._enabled:
            return self._verdict.clip_unscaled(optimizer, max_norm, norm_type, None, codes=False)[0]
        device_state = self._device_state("clip_grad_norm_")
        record = self._record_of(optimizer)
        if record.stage is OptState.STEPPED:
            raise CallOrderError("clip_grad_norm_() is being called after step().")
        if record.clipped:
            raise CallOrderError(
                "clip_grad_norm_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.UNSCALED:
            norm, codes = self._verdict.clip_unscaled(
                optimizer, max_norm, norm_type, device_state.device, codes=self._attributing
            )
            assert record.found_inf is not None
            nonfinite = torch.nan_to_num(norm * 0.0, nan=1.0)  # a non-finite norm skips too
            record.agreed(
                self._agreed(torch.fmax(record.found_inf, nonfinite)),
                clipped=True,
                coded=Coded(optimizer, codes, False),
            )
            return norm
        fused = uses_fused_scaling(optimizer)
        verdict = self._verdict.clip(
            optimizer,
            device_state,
            max_norm,
            norm_type,
            fused=fused,
            skip_nonfinite=self._config.skip_nonfinite,
            codes=self._attributing,
        )
        record.agreed(
            self._agreed(verdict.found_inf),
            grad_scale=verdict.grad_scale if fused else None,
            epilogue=verdict.ends,
            stage=OptState.UNSCALED,
            clipped=True,
            coded=Coded(optimizer, verdict.codes, verdict.after_read),
        )
        return verdict.norm

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """Agree on ``found_inf`` without changing the gradients (one check pass + the collective).

        torch's hook, which optimizers of torch's deprecated ``grad_scaler=`` contract call from
        their step (they drive the scaler); returns torch's ``{device: found_inf}``.
        """
        device_state = self._device_state("_check_inf_per_device")
        verdict = self._verdict.check(optimizer, device_state, codes=self._attributing)
        found_inf = self._agreed(verdict.found_inf)
        self._record_of(optimizer).agreed(
            found_inf,
            grad_scale=device_state.scale,
            epilogue=verdict.ends,
            coded=Coded(optimizer, verdict.codes, verdict.after_read),
        )
        return {found_inf.device: found_inf}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step(*args, **kwargs)`` unless any rank found inf/NaN gradients.

        torch's semantics, return value and errors. Without an earlier :meth:`unscale_` or
        :meth:`clip_grad_norm_` the verdict runs here (one ``all_reduce`` of 1 or 2 float32; every
        rank must call). Fused optimizers: one read-only check pass, then ``grad_scale`` and
        ``found_inf`` go to the kernel, no host read (:mod:`distscaler.fused`); others: the unscale
        pass and one host read of the agreed flag, and on a skipped step one more read pass that
        codes the gradients for :attr:`last_overflow`. After an explicit :meth:`unscale_` (and no
        :meth:`clip_grad_norm_`) a fused step takes that read pass at every step.

        Raises:
            CallOrderError: ``step()`` already called since the last :meth:`update`, or
                :meth:`scale` never called.
            RuntimeError: a ``closure`` keyword is passed.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        device_state = self._device_state("step")
        record = self._record_of(optimizer)
        if record.stage is OptState.STEPPED:
            raise CallOrderError("step() has already been called since the last update().")
        contract = step_contract(optimizer)  # the face decides
        if contract is StepContract.DRIVES_THE_SCALER:
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
        fused = contract is StepContract.FUSED
        agreed = record.found_inf
        verdict = self._verdict.for_step(  # the verdict computes
            optimizer,
            device_state,
            fused=fused,
            agreed=agreed,
            codes=self._attributing and record.coded is None,
            skip_nonfinite=self._config.skip_nonfinite,
        )
        found_inf = verdict.found_inf
        if agreed is None:  # this step's own verdict; kept before the step, as torch keeps it
            if fused:
                record.agreed(found_inf, grad_scale=device_state.scale, epilogue=verdict.ends)
            else:
                record.agreed(found_inf, grad_scale=None, stage=OptState.UNSCALED)
        if verdict.coded:
            record.coded = Coded(optimizer, verdict.codes, verdict.after_read)
        if fused:  # the fused hand-off applies the verdict
            retval = fused_step(optimizer, record.grad_scale, found_inf, args, kwargs)
        else:  # the gradients are unscaled: the host's flag decides
            retval = None if verdict.skipped else optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from the agreed ``found_inf`` of every optimizer stepped this iteration.

        torch's semantics (``policy="torch"``; others: :mod:`distscaler.policies`), clamped to
        ``[min_scale, max_scale]``. A handful of device ops (one ``lerp_`` per optimizer keeps the
        overflow record, :mod:`distscaler.attribution`), no collective, no host read but one every
        ``skip_log_interval`` calls (never inside CUDA graph capture): the periodic skip report,
        which, when a step was skipped since the last one, also attributes it (:attr:`last_overflow`:
        one more host read and, at world size > 1, one ``all_gather`` on every rank together).

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
        device_state = self._device_state("update")
        if new_scale is not None:
            self._state.set_scale(new_scale, self._device)
        else:
            records = [r for r in self._records.values() if r.found_inf is not None]
            if not records:
                raise CallOrderError("No inf checks were recorded prior to update.")
            found = [r.found_inf for r in records if r.found_inf is not None]
            found_inf = found[0].to(device_state.device, non_blocking=True)
            for other in found[1:]:
                found_inf = torch.fmax(found_inf, other.to(device_state.device, non_blocking=True))
            lerps: list = []  # the overflow record's, run in the skip record's one op
            if self._attributing:
                coded = [r.coded for r in records if r.coded is not None]
                self._overflows.record_(found_inf, coded, self._state.num_host_updates + 1, lerps)
            self._apply(found_inf, records[0].epilogue if len(found) == 1 else None, lerps)
        # Cleared in place: torch 2.6's dynamo gives a dict made in a compiled graph back as a
        # plain dict.
        self._records.clear()

    def _apply(self, found_inf: torch.Tensor, ends: Epilogue | None, lerps: Sequence = ()) -> None:
        if self._state.update(found_inf, ends, self._config, lerps):
            self._report(self._read()[2])  # the periodic report, the same update on every rank

    # ------------------------------------------------------------------ device state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        # Idempotent: integrations (Accelerate's FSDP2 load_state) call it on a scaler in use,
        # where torch's version fails with "_growth_tracker initialized before _scale".
        state = self._state.materialize(dev)
        self._scale, self._growth_tracker = state.scale, state.growth_tracker

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Create the device state on ``device`` (default: the device type) without scaling a loss.

        For ranks that never compute a loss (the first stages of a pipeline); :meth:`scale` does it
        lazily on the others. No-op when disabled or once created. No collective, no host read.
        """
        if self._enabled:
            self._lazy_init_scale_growth_tracker(device or self._device)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._config.scaler_kwargs().items())
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
        """Build a scaler from a :class:`~distscaler.config.ScalerConfig`.

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

    # ------------------------------------------------------------------ settings

    # get_/set_growth_factor, get_/set_backoff_factor, get_/set_growth_interval, get_min_scale,
    # get_max_scale and config: from ScalerSettings, over self._config.

    @property
    def device_type(self) -> str:
        """The device type of the scale (the ``device`` argument)."""
        return self._device

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group given at construction (None: the default group when initialized)."""
        return self._verdict.process_group

    # ------------------------------------------------------------------ DeepSpeed-style access
    # cur_scale, loss_scale, cur_iter, last_overflow_iter, cur_hysteresis, update_scale: from
    # DeepSpeedScalerAPI, over these three hooks.

    def _policy_keys(self) -> tuple[str, tuple[str, ...]]:
        return self._config.policy, get_policy(self._config.policy).state_keys

    def _policy_values(self) -> dict[str, int]:
        return (self._read()[1] if self._enabled else self._state.initial).policy

    def _update_from_overflow(self, overflow: bool) -> None:
        if not self._enabled:
            return
        self.materialize()
        state = self._device_state("update_scale")
        self._apply(state.one if overflow else state.zero, None)
        self._records.clear()
