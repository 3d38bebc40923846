"""``distscaler.GradScaler``: a drop-in ``torch.amp.GradScaler`` whose verdict every rank shares."""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from . import _validation as V
from .config import ScalerConfig
from .errors import CallOrderError
from .interop import to_native_state
from .layouts import GRAD_LAYOUTS, GradGroups, GradLayout, LayoutResolver, collect_grads
from .policies import (
    MIN_SCALE_MESSAGE,
    POLICIES,
    LossScaleAtMinimumError,
    PolicyName,
    make_policy,
)
from .telemetry import SkipRecord
from .verdict import (
    Verdict,
    all_reduce_verdict,
    check_and_unscale_,
    local_overflow_flag,
    local_verdict,
)

__all__ = ["GradScaler", "OptState"]


def _refresh_per_optimizer_state() -> dict[str, Any]:
    # torch's two keys, plus what the verdict decided for a fused step and whether clipping ran.
    return {
        "stage": OptState.READY,
        "found_inf_per_device": {},
        "grad_scale": None,
        "clipped": False,
    }


_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class GradScaler(torch.amp.GradScaler):
    """Gradient (loss) scaler whose skip decision and scale update are the same on every rank.

    A drop-in for :class:`torch.amp.GradScaler` (and a subclass of it): the same positional
    parameters, defaults, methods, per-optimizer call-order rules and error wording. For a single
    process, swapping the import changes no parameter and no scale, bit for bit. On top of torch:

    * Each rank checks its own gradients with fused multi-tensor kernels (one launch per
      device/dtype group) and the verdicts are combined in **one** ``all_reduce`` of two float32
      elements per optimizer step over ``process_group``, so every rank skips the step, or none
      does, and every rank updates the scale identically.
    * :meth:`clip_grad_norm_` folds gradient clipping into that same collective.
    * Fused optimizers (``_step_supports_amp_scaling``: ``Adam/AdamW/SGD(fused=True)``) receive
      ``grad_scale`` and the agreed ``found_inf``; no value is read on the host and the gradients
      are not rewritten. Other optimizers: one in-place multiply, then one host read of the agreed
      flag.

    Args:
        device (str, default ``"cuda"``): device type of the scale, as in torch. With ``"cuda"`` and no
            CUDA available the scaler warns and disables itself, as torch's does.
        init_scale (float, default ``2.0**16``): initial loss scale, finite and > 0.
        growth_factor (float, default 2.0): factor (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor (float, default 0.5): factor in (0, 1) applied after an overflow.
        growth_interval (int, default 2000): number of consecutive optimizer steps without inf/NaN
            gradients after which the scale grows (>= 1).
        enabled (bool, default True): if False, every method is a no-op (``step`` calls
            ``optimizer.step()``): no collective, no host read.
        process_group (ProcessGroup, keyword-only, default None): the ranks that must agree. None means
            the default (WORLD) group when ``torch.distributed`` is initialized when the verdict runs;
            no collective when it is not initialized or the group has one rank.
        grad_layout (``"replicated"`` | ``"sharded"`` | None, keyword-only, default None): how
            plain-tensor gradients whose layout is not otherwise known lie across
            ``process_group``; used only for the norm in :meth:`clip_grad_norm_`.
            ``"replicated"``: every rank holds the same gradients (DDP); ``"sharded"``: every rank
            holds different gradients (a manual shard, a pipeline stage). DTensor gradients (FSDP2,
            HSDP, tensor parallel) need nothing; DDP and FSDP1 models are learnt with
            :meth:`register_model`. With None, a norm over more than one rank of gradients of
            unknown layout raises :class:`~distscaler.layouts.UnknownLayoutError` rather than guess
            (see :mod:`distscaler.layouts`).
        min_scale (float | None, keyword-only): lower bound of the scale after each update (torch has
            none: its scale can decay toward 0).
        max_scale (float | None, keyword-only): upper bound of the scale after each update.
        policy (``"torch"`` | ``"deepspeed"`` | ``"megatron"`` | ``"static"``, keyword-only, default
            ``"torch"``): the scale update rule, each run on the device (see
            :mod:`distscaler.policies`): torch's, DeepSpeed's ``DynamicLossScaler`` (grows on the
            (W+1)-th clean step, W = ``growth_interval``), Megatron's ``DynamicGradScaler``, or a
            fixed scale (``init_scale``; 1.0 for bf16/fp32 training).
        hysteresis (int, keyword-only, default 1): overflows tolerated before a backoff
            (DeepSpeed's and Megatron's ``hysteresis``); > 1 only for ``"deepspeed"`` and
            ``"megatron"``. Every overflow skips the step all the same.
        consecutive_hysteresis (bool, keyword-only, default False): refill the hysteresis on every
            clean step (DeepSpeed's ``consecutive_hysteresis``; ``"deepspeed"`` only).
        raise_error_at_min_scale (bool, keyword-only, default False): raise
            :class:`~distscaler.policies.LossScaleAtMinimumError` with DeepSpeed's message when an
            overflow would lower a scale already at ``min_scale`` (which must be set), instead of
            clamping. Costs one host read of a flag in every :meth:`update`.
        skip_nonfinite (bool, keyword-only, default True): skip steps with inf/NaN gradients. False
            (``policy="static"`` only, DeepSpeed's bf16 ``check_grad_overflow: false``) steps with
            them; the verdict collective still runs.
        skip_log_interval (int, keyword-only, default 100): every this many ``update()`` calls the
            device-side skip record is read once on the host and new skips are logged (rank 0,
            logger ``"distscaler"``); 0 reads only when the host reads the scaler anyway.

    Raises:
        ValueError: an argument is out of its valid range (the message names it, its value and the
            range). Checked before anything else happens, also when ``enabled=False``.
        TypeError: ``process_group`` is not a ProcessGroup or ``enabled`` is not a bool.
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
        init_scale = V.check_positive_finite("init_scale", init_scale)
        growth_factor = V.check_factor("growth_factor", growth_factor, low=1.0, high=None)
        backoff_factor = V.check_factor("backoff_factor", backoff_factor, low=0.0, high=1.0)
        growth_interval = V.check_int("growth_interval", growth_interval, minimum=1)
        enabled = V.check_bool("enabled", enabled)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got: {process_group!r}")
        if grad_layout is not None and grad_layout not in GRAD_LAYOUTS:
            raise ValueError(
                f"grad_layout must be one of {GRAD_LAYOUTS} or None, got: {grad_layout!r}"
            )
        if min_scale is not None:
            min_scale = V.check_positive_finite("min_scale", min_scale)
        if max_scale is not None:
            max_scale = V.check_positive_finite("max_scale", max_scale)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got: min_scale={min_scale}, max_scale={max_scale}"
            )
        if not (min_scale or 0.0) <= init_scale <= (max_scale or math.inf):
            raise ValueError(
                f"init_scale must be in [min_scale, max_scale] = [{min_scale}, {max_scale}], "
                f"got: {init_scale}"
            )
        policy_obj = make_policy(
            policy, hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis
        )
        raise_error_at_min_scale = V.check_bool(
            "raise_error_at_min_scale", raise_error_at_min_scale
        )
        if raise_error_at_min_scale and min_scale is None:
            raise ValueError("raise_error_at_min_scale=True needs min_scale, got: min_scale=None")
        skip_nonfinite = V.check_bool("skip_nonfinite", skip_nonfinite)
        if not skip_nonfinite and policy != "static":
            raise ValueError(
                f"skip_nonfinite=False needs policy='static' (a dynamic scale must skip the "
                f"overflows it reacts to), got: policy={policy!r}"
            )
        skip_log_interval = V.check_int("skip_log_interval", skip_log_interval, minimum=0)

        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        # torch only sets these when enabled; keep them always so getters work on a disabled scaler.
        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale = None
        self._growth_tracker = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._process_group = process_group
        self._grad_layout = grad_layout
        self._layouts = LayoutResolver(grad_layout)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._policy = policy_obj
        self._hysteresis = hysteresis
        self._consecutive_hysteresis = consecutive_hysteresis
        self._raise_error_at_min_scale = raise_error_at_min_scale
        self._skip_nonfinite = skip_nonfinite
        # The policy's extra state: host values until the scale is materialised, then tensors.
        self._init_policy_state: dict[str, int] = policy_obj.initial_state()
        self._policy_state: dict[str, torch.Tensor] | None = None
        self._skip_log_interval = skip_log_interval
        self._skip_record = SkipRecord()
        self._last_found_inf: torch.Tensor | None = None

    # ------------------------------------------------------------------ process group

    def _group_and_world_size(self) -> tuple[dist.ProcessGroup | None, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self._process_group if self._process_group is not None else dist.group.WORLD
        return group, dist.get_world_size(group)

    def _agree(self, local: torch.Tensor, norm_type: float | None) -> Verdict:
        """The step's one collective (skipped when the group has a single rank)."""
        group, world_size = self._group_and_world_size()
        if world_size > 1:
            all_reduce_verdict(local, group, norm_type=norm_type)
        verdict = Verdict(local, norm_type)
        if not self._skip_nonfinite:  # a static scale told to step through inf/NaN
            verdict.found_inf = torch.zeros_like(verdict.found_inf)
        return verdict

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

    def _inv_scale(self) -> torch.Tensor:
        assert self._scale is not None
        # As torch: the reciprocal in fp64, so unscaled values match torch's bit for bit.
        return self._scale.double().reciprocal().float()

    @staticmethod
    def _uses_fused_scaling(optimizer: torch.optim.Optimizer) -> bool:
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
            not _step_takes_grad_scaler(optimizer.step)
        )

    def _record_verdict(
        self, state: dict[str, Any], verdict: Verdict, grad_scale: torch.Tensor | None
    ) -> None:
        state["found_inf_per_device"] = {verdict.found_inf.device: verdict.found_inf}
        state["grad_scale"] = grad_scale

    @staticmethod
    def _clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
        # torch.nn.utils.clip_grad_norm_'s coefficient, kept on the device.
        return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)

    # ------------------------------------------------------------------ the public API

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and agree on ``found_inf``.

        Same semantics and errors as :meth:`torch.amp.GradScaler.unscale_`, plus the verdict: one
        read+write pass over the gradients (``_amp_foreach_non_finite_check_and_unscale_``, one launch
        per device/dtype group), then one ``all_reduce`` of 2 float32 on ``process_group`` (every rank
        of it must call). No host read.

        Prefer :meth:`clip_grad_norm_` over ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``: it moves
        each gradient byte once with a fused optimizer (three times with others) instead of about
        five times, and needs no second collective.

        Raises:
            CallOrderError: called twice for ``optimizer`` since the last :meth:`update`, or after
                :meth:`step` (a ``RuntimeError``).
            ValueError: a gradient is fp16 ("Attempting to unscale FP16 gradients.").
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise CallOrderError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise CallOrderError("unscale_() is being called after step().")
        inv_scale = self._inv_scale()
        groups = collect_grads(optimizer, allow_fp16=False, coalesce_sparse=False)
        verdict = self._agree(check_and_unscale_(groups, inv_scale=inv_scale), None)
        self._record_verdict(state, verdict, grad_scale=None)
        state["stage"] = OptState.UNSCALED

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the optimizer's gradients to a global norm, folded into the overflow verdict.

        The norm is that of the *unscaled* gradients over every rank of ``process_group``, each
        gradient value counted once whatever the layout (DTensor placements, :meth:`register_model`,
        ``grad_layout``; see :mod:`distscaler.layouts`), as ``torch.nn.utils.clip_grad_norm_`` would
        compute it on the full, gathered, unscaled gradients. Then the gradients are scaled by
        ``min(max_norm / (norm + 1e-6), 1)``, as torch does.

        Cost: one read pass over the gradients (``_foreach_norm``, one launch per device/dtype group),
        one ``all_reduce`` of 2 float32 on ``process_group`` (every rank must call; it *is* the step's
        verdict, :meth:`step` adds none), no host read. Fused optimizers: the gradients are not
        rewritten; the optimizer gets ``grad_scale = scale / clip_coef``. Others: one in-place
        multiply by ``clip_coef / scale``. After an explicit :meth:`unscale_` the gradients are
        already unscaled: the norm is then taken from them (a second all_reduce unless every
        gradient is replicated over the whole group) and they are multiplied by the coefficient in
        place.

        A disabled scaler only clips (with a collective unless every gradient is replicated).

        Args:
            optimizer: the optimizer whose parameters' gradients are clipped.
            max_norm (float): maximum norm, finite and > 0.
            norm_type (float, default 2.0): p of the p-norm, > 0; ``math.inf`` for the max norm.

        Returns:
            0-dim float32 tensor on the scale's device: the global norm before clipping, identical on
            every rank. Non-finite when any rank saw inf/NaN; then the step is skipped everywhere.

        Raises:
            ValueError: ``max_norm`` or ``norm_type`` out of range.
            UnknownLayoutError: (a ValueError) the group has more than one rank and the layout of
                some gradients is unknown (p < inf only); raised before anything is changed.
            CallOrderError: called twice for ``optimizer`` since the last :meth:`update`, or after
                :meth:`step`.
        """
        max_norm = V.check_positive_finite("max_norm", max_norm)
        if not V.is_real(norm_type) or not float(norm_type) > 0:
            raise ValueError(f"norm_type must be a number > 0 or math.inf, got: {norm_type!r}")
        norm_type = float(norm_type)

        if not self._enabled:
            return self._clip_unscaled_(optimizer, max_norm, norm_type)

        scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise CallOrderError("clip_grad_norm_() is being called after step().")
        if state["clipped"]:
            raise CallOrderError(
                "clip_grad_norm_() has already been called on this optimizer since the last update()."
            )

        if state["stage"] is OptState.UNSCALED:
            total_norm = self._clip_unscaled_(optimizer, max_norm, norm_type)
            if self._skip_nonfinite:  # a non-finite norm skips, as an inf gradient does
                (found_inf,) = state["found_inf_per_device"].values()
                nonfinite = total_norm.isfinite().logical_not().to(found_inf.device, torch.float32)
                found_inf = torch.maximum(found_inf, nonfinite)
                state["found_inf_per_device"] = {found_inf.device: found_inf}
            state["clipped"] = True
            return total_norm

        fused = self._uses_fused_scaling(optimizer)
        inv_scale = self._inv_scale()
        groups = self._collect_weighted(optimizer, norm_type, allow_fp16=fused)
        local = local_verdict(groups, inv_scale=inv_scale, norm_type=norm_type)
        verdict = self._agree(local, norm_type)
        assert verdict.total_norm is not None
        clip_coef = self._clip_coef(max_norm, verdict.total_norm)
        if fused:
            self._record_verdict(state, verdict, grad_scale=scale / clip_coef)
        else:
            _mul_groups_(groups, inv_scale * clip_coef)
            self._record_verdict(state, verdict, grad_scale=None)
        state["stage"] = OptState.UNSCALED
        state["clipped"] = True
        return verdict.total_norm

    def _collect_weighted(
        self, optimizer: torch.optim.Optimizer, norm_type: float, *, allow_fp16: bool
    ) -> GradGroups:
        """The optimizer's local gradients grouped with their replication weights (for a norm).

        A max norm needs no weights (repeats do not change a max), so its layout may stay unknown.
        """
        group, world_size = self._group_and_world_size()
        return collect_grads(
            optimizer,
            allow_fp16=allow_fp16,
            coalesce_sparse=True,
            resolver=None if norm_type == math.inf else self._layouts,
            world_size=world_size,
            group=group,
        )

    def _clip_unscaled_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clip gradients that carry no loss scale.

        Adds a collective unless every local gradient is replicated over the whole group (then the
        local norm is already the global one).
        """
        groups = self._collect_weighted(optimizer, norm_type, allow_fp16=True)
        group, world_size = self._group_and_world_size()
        replicated = bool(groups) and all(key.weight == 1.0 / world_size for key in groups)
        if self._scale is not None:
            device = self._scale.device
        elif groups:
            device = next(iter(groups))[0]
        else:
            device = torch.device("cpu")
        one = torch.ones((), dtype=torch.float32, device=device)
        local = local_verdict(
            {key._replace(weight=1.0): grads for key, grads in groups.items()}
            if replicated
            else groups,
            inv_scale=one,
            norm_type=norm_type,
        )
        if world_size > 1 and not replicated:
            all_reduce_verdict(local, group, norm_type=norm_type)
        verdict = Verdict(local, norm_type)
        assert verdict.total_norm is not None
        _mul_groups_(groups, self._clip_coef(max_norm, verdict.total_norm))
        return verdict.total_norm

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """Agree on ``found_inf`` without changing the gradients (one check pass + the collective).

        Also the hook that custom optimizers of torch's ``grad_scaler=`` contract call.
        """
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        groups = collect_grads(optimizer, allow_fp16=True, coalesce_sparse=False)
        local = local_overflow_flag(groups, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        self._record_verdict(state, self._agree(local, None), grad_scale=scale)
        return state["found_inf_per_device"]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Run ``optimizer.step(*args, **kwargs)`` unless any rank found inf/NaN gradients.

        Same semantics, return value and errors as :meth:`torch.amp.GradScaler.step`. If neither
        :meth:`unscale_` nor :meth:`clip_grad_norm_` ran for ``optimizer`` in this iteration, the
        verdict runs here (one ``all_reduce`` of 2 float32 on ``process_group``; every rank must call).

        Cost: fused optimizers (``_step_supports_amp_scaling``): one check pass that leaves the
        gradients' values unchanged (read-only max-abs on accelerators; torch's check with a factor
        of 1.0 on CPU, where it is the faster kernel), the kernel gets ``grad_scale`` and
        ``found_inf``; no host read. Other optimizers: the unscale pass (read + write) and exactly
        one host read of the agreed flag.

        Raises:
            CallOrderError: ``step()`` already called since the last :meth:`update`, or
                :meth:`scale` never called.
            RuntimeError: a ``closure`` keyword is passed.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise CallOrderError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if not self._uses_fused_scaling(optimizer):
                # torch's deprecated contract: the optimizer drives the scaler itself.
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them "
                    "directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs["grad_scaler"] = self
                retval = optimizer.step(*args, **kwargs)
                state["stage"] = OptState.STEPPED
                return retval
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            (found_inf,) = state["found_inf_per_device"].values()
            # A grad_scale the user set stays a factor (torch's rule); None, as torch's own
            # scaler leaves it after an unscale_() step, means none.
            prior = {
                k: optimizer.__dict__[k]
                for k in ("grad_scale", "found_inf")
                if k in vars(optimizer)
            }
            user_scale = prior.get("grad_scale")
            if state["grad_scale"] is None:  # gradients already unscaled in place
                grad_scale = user_scale
            elif user_scale is None:
                grad_scale = state["grad_scale"]
            else:
                grad_scale = state["grad_scale"] * user_scale
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:  # leave the optimizer's attributes as they were
                for key in ("grad_scale", "found_inf"):
                    if key in prior:
                        setattr(optimizer, key, prior[key])
                    else:
                        delattr(optimizer, key)
            state["stage"] = OptState.STEPPED
            return retval

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise CallOrderError("No inf checks were recorded for this optimizer.")
        (found_inf,) = state["found_inf_per_device"].values()
        retval = None
        if not found_inf.item():  # the step's one host read: the agreed flag
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from the agreed ``found_inf`` of every optimizer stepped this iteration.

        Same semantics as :meth:`torch.amp.GradScaler.update`: on overflow the scale is multiplied by
        ``backoff_factor``, after ``growth_interval`` clean steps by ``growth_factor`` (policy
        ``"torch"``), then clamped to ``[min_scale, max_scale]``. Runs on the device: no collective
        (the verdict is already global) and no host read, except one read every
        ``skip_log_interval`` calls to log skips.

        Args:
            new_scale (float | Tensor | None): set the scale to this value instead (a finite float > 0,
                or a 1-element float32 tensor without grad on the scaler's device type).

        Raises:
            CallOrderError: no inf check was recorded since the last update ("No inf checks were
                recorded prior to update.").
            ValueError / TypeError: ``new_scale`` is invalid.
        """
        if not self._enabled:
            return
        scale, growth_tracker = self._check_scale_growth_tracker("update")

        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if (
                    new_scale.device.type != self._device
                    or new_scale.numel() != 1
                    or new_scale.requires_grad
                ):
                    raise ValueError(
                        "new_scale must be a float or a 1-element tensor on device type "
                        f"{self._device!r} with requires_grad=False, got: {new_scale!r}"
                    )
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(V.check_positive_finite("new_scale", new_scale))
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise CallOrderError("No inf checks were recorded prior to update.")
            found_inf = found_infs[0]
            for other in found_infs[1:]:
                found_inf = found_inf + other
            self._apply_policy(found_inf)

        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _apply_policy(self, found_inf: torch.Tensor) -> None:
        """One scale update from an agreed ``found_inf`` (0-dim float32 on the scale's device)."""
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        policy_state = self._materialised_policy_state()
        if self._raise_error_at_min_scale:
            assert self._min_scale is not None
            at_min = self._policy.at_minimum(
                scale, found_inf, policy_state, min_scale=self._min_scale
            )
            if bool(at_min):  # the documented host read of raise_error_at_min_scale
                raise LossScaleAtMinimumError(MIN_SCALE_MESSAGE)
        scale_before = scale.clone()
        self._policy.update_(
            scale,
            growth_tracker,
            found_inf,
            policy_state,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
            min_scale=self._min_scale,
        )
        if self._min_scale is not None or self._max_scale is not None:
            scale.clamp_(min=self._min_scale, max=self._max_scale)
        self._skip_record.record_(found_inf, scale_before, scale)
        self._last_found_inf = found_inf
        if self._skip_log_interval and self._skip_record.num_updates % self._skip_log_interval == 0:
            self._host_read()

    # ------------------------------------------------------------------ policy state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        # Idempotent: integrations (Accelerate's FSDP2 load_state) call it on a scaler in use,
        # where torch's version fails with "_growth_tracker initialized before _scale".
        if self._scale is not None and self._growth_tracker is not None:
            return
        super()._lazy_init_scale_growth_tracker(dev)
        self._policy_state = None
        self._materialised_policy_state()

    def _materialised_policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's state tensors, created next to the scale on first use."""
        if self._policy_state is None:
            assert self._scale is not None
            device = self._scale.device
            self._policy_state = {
                key: torch.full((), value, dtype=torch.int64, device=device)
                for key, value in self._init_policy_state.items()
            }
        return self._policy_state

    def _policy_state_values(self) -> dict[str, int]:
        """The policy's state as host ints (one host read when materialised)."""
        if self._policy_state is None:
            return dict(self._init_policy_state)
        keys = list(self._policy_state)
        if not keys:
            return {}
        values, _ = self._host_read(*(self._policy_state[k] for k in keys))
        return {k: int(v) for k, v in zip(keys, values)}

    def _require_state_key(self, key: str) -> int:
        if key not in self._policy.state_keys:
            raise AttributeError(
                f"{key} exists for policy='deepspeed' (DeepSpeed's DynamicLossScaler); this scaler "
                f"has policy={self._policy.name!r}"
            )
        if not self._enabled:
            return self._init_policy_state[key]
        return self._policy_state_values()[key]

    # ------------------------------------------------------------------ configs

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
        constructor arguments a config does not hold (``grad_layout``...); a setting given in
        both raises TypeError.

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

    # ------------------------------------------------------------------ DeepSpeed-style access

    @property
    def cur_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.cur_scale``); :meth:`get_scale`, one host read."""
        return self.get_scale()

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's ``loss_scaler.loss_scale``); :meth:`get_scale`, one host read."""
        return self.get_scale()

    @property
    def cur_iter(self) -> int:
        """Updates so far (DeepSpeed's ``cur_iter``; ``policy="deepspeed"``). One host read.

        Raises:
            AttributeError: the policy is not ``"deepspeed"``.
        """
        return self._require_state_key("cur_iter")

    @property
    def last_overflow_iter(self) -> int:
        """``cur_iter`` of the last overflow, -1 before any (``policy="deepspeed"``). One host read.

        Raises:
            AttributeError: the policy is not ``"deepspeed"``.
        """
        return self._require_state_key("last_overflow_iter")

    @property
    def cur_hysteresis(self) -> int:
        """Overflows left before the next backoff (DeepSpeed's ``cur_hysteresis``; Megatron's
        ``hysteresis_tracker`` for ``policy="megatron"``). One host read.

        Raises:
            AttributeError: the policy has no hysteresis (``"torch"``, ``"static"``).
        """
        if self._policy.name == "megatron":
            return self._require_state_key("hysteresis_tracker")
        return self._require_state_key("cur_hysteresis")

    def update_scale(self, overflow: bool) -> None:
        """Update the scale as if an iteration had (``overflow=True``) or had not overflowed.

        DeepSpeed's ``DynamicLossScaler.update_scale(overflow)``, for code written against it: the
        same as an :meth:`update` whose verdict was ``overflow``, instead of it (it also ends the
        iteration for every optimizer). Uses the policy of this scaler; no collective (``overflow``
        must already be agreed), no host read except the ``raise_error_at_min_scale`` check.
        No-op when disabled.

        Raises:
            TypeError: ``overflow`` is not a bool.
            LossScaleAtMinimumError: see ``raise_error_at_min_scale``.
        """
        overflow = V.check_bool("overflow", overflow)
        if not self._enabled:
            return
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        assert self._scale is not None
        found_inf = torch.full((), float(overflow), dtype=torch.float32, device=self._scale.device)
        self._apply_policy(found_inf)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # ------------------------------------------------------------------ host reads

    def _host_read(self, *extra: torch.Tensor) -> tuple[list[float], list[float] | None]:
        """Read ``extra`` 0-dim tensors and the skip record in one host transfer; log new skips.

        Returns the values of ``extra`` and those of the skip record (None before any update).
        """
        record = self._skip_record._record
        parts = [t.reshape(1).to(torch.float64) for t in extra]
        if record is not None:
            parts.append(record.to(parts[0].device) if parts else record)
        if not parts:
            return [], None
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        record_values = None
        if record is not None:
            record_values = values[len(extra) :]
            _, world_size = self._group_and_world_size()
            self._skip_record.report(record_values, world_size)
        return values[: len(extra)], record_values

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Incurs one host read (sync)."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return self._init_scale
        return self._host_read(self._scale)[0][0]

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._host_read(self._growth_tracker)[0][0])

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The agreed overflow flag of the last :meth:`update`, without reading it on the host.

        0-dim float32 on the scale's device, > 0 when that iteration's step(s) were skipped;
        identical on every rank. None before the first update and when disabled. The tensor is
        replaced (not mutated) by the next update, so a caller may keep it.
        """
        return self._last_found_inf if self._enabled else None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the optimizer step(s) of the last iteration were skipped, the same on every rank.

        Reads the agreed device flag recorded by the last :meth:`update` (one host read; this is the
        explicit sync). False before the first update and when disabled.
        """
        if not self._enabled or self._last_found_inf is None:
            return False
        return bool(self._host_read(self._last_found_inf)[0][0])

    # ------------------------------------------------------------------ knobs

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._growth_factor = V.check_factor("new_factor", new_factor, low=1.0, high=None)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._backoff_factor = V.check_factor("new_factor", new_factor, low=0.0, high=1.0)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (steps, >= 1)."""
        self._growth_interval = V.check_int("new_interval", new_interval, minimum=1)

    def get_min_scale(self) -> float | None:
        """The lower bound of the scale, or None."""
        return self._min_scale

    def get_max_scale(self) -> float | None:
        """The upper bound of the scale, or None."""
        return self._max_scale

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group given at construction (None: the default group when initialized)."""
        return self._process_group

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Create the scale (and policy state) on ``device`` without scaling a loss.

        For ranks whose gradients arrive already scaled but that never compute a loss themselves:
        the first stages of a pipeline, whose backward starts from the gradients the last stage
        sends. :meth:`scale` does this lazily on the ranks that do. No-op when disabled or once
        created. No collective, no host read.

        Args:
            device: where the scale lives (the gradients' device); default the scaler's device type.
        """
        if not self._enabled or self._scale is not None:
            return
        self._lazy_init_scale_growth_tracker(torch.device(device or self._device))

    def register_model(
        self, model: torch.nn.Module, *, grad_layout: GradLayout | None = None
    ) -> GradScaler:
        """Learn how ``model``'s gradients are laid out across the ranks, for :meth:`clip_grad_norm_`.

        Call once after wrapping, on every rank (no collective, no host read). Needed where the
        gradients do not say it themselves: DDP (its ``process_group`` replicates them), FSDP1
        (its sharding strategy and, for ``HYBRID_SHARD``, its replicate group), and plain modules
        such as a pipeline stage (pass ``grad_layout="sharded"``; or ``"replicated"``). FSDP2 /
        HSDP / tensor-parallel gradients are DTensors and need no registration; inside DDP their
        placements and DDP's replication combine. Can be called for several models (pipeline
        stages, a model and its EMA); a later call wins for a parameter registered twice.

        Args:
            model: the wrapped module (DDP, FSDP1, or any module containing them), or a plain one
                with ``grad_layout``.
            grad_layout (``"replicated"`` | ``"sharded"`` | None): layout of ``model``'s
                parameters that no DDP/FSDP1 wrapper inside it covers.

        Returns:
            ``self``, so that ``scaler = GradScaler(...).register_model(model)`` works.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: ``grad_layout`` is not one of the layouts.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got: {type(model).__name__}")
        if grad_layout is not None and grad_layout not in GRAD_LAYOUTS:
            raise ValueError(
                f"grad_layout must be one of {GRAD_LAYOUTS} or None, got: {grad_layout!r}"
            )
        self._layouts.register_model(model, grad_layout)
        return self

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers (one host read).

        torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``), so :meth:`torch.amp.GradScaler.load_state_dict` loads it, plus keys
        torch ignores: ``min_scale`` and ``max_scale`` (floats or None), ``num_updates`` (update()
        calls so far) and ``num_skipped_steps`` (of those, the skipped ones), so the skip log of a
        resumed run keeps counting; ``policy``, ``hysteresis`` and ``consecutive_hysteresis``; and
        the policy's state: ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis`` (DeepSpeed's
        names, ``policy="deepspeed"``) or ``hysteresis_tracker`` (Megatron's, ``"megatron"``), so a
        run resumed mid-hysteresis continues exactly. Safe under
        ``torch.load(weights_only=True)``. Empty when disabled, as torch's.
        """
        if not self._enabled:
            return {}
        scale: float = self._init_scale
        tracker: float = self._init_growth_tracker
        policy_values = dict(self._init_policy_state)
        if self._scale is None or self._growth_tracker is None:  # not materialised yet
            _, record_values = self._host_read()
        else:
            keys = list(self._materialised_policy_state())
            values, record_values = self._host_read(
                self._scale, self._growth_tracker, *self._materialised_policy_state().values()
            )
            scale, tracker = values[0], values[1]
            policy_values = {k: int(v) for k, v in zip(keys, values[2:])}
        record = self._skip_record
        return {
            "scale": float(scale),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(tracker),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "num_updates": record.num_updates,
            "num_skipped_steps": record.num_skipped(record_values),
            "policy": self._policy.name,
            "hysteresis": self._hysteresis,
            "consecutive_hysteresis": self._consecutive_hysteresis,
            **policy_values,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a scaler state saved by this class, by another stack, and continue its trajectory.

        Accepted (see :mod:`distscaler.interop`): :class:`torch.amp.GradScaler`'s ``state_dict``;
        Megatron-LM ``DynamicGradScaler``'s ``{scale, growth_tracker, hysteresis_tracker}``
        (``scale`` may be a tensor); DeepSpeed's fp16 optimizer ``state_dict`` (``cur_scale``,
        ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``...); a DeepSpeed
        ``DynamicLossScaler``/``LossScaler`` object, or the ZeRO optimizer state holding it under
        ``"loss_scaler"``. Settings a format carries replace the constructor's, as torch does for
        ``growth_factor`` etc.; a replaced ``min_scale``, ``max_scale``, ``hysteresis`` or
        ``consecutive_hysteresis`` warns, and so does a state saved under another policy (its
        counters are converted where they mean the same, else start fresh).

        Every value is checked first and all problems are reported in one error; on error nothing
        is changed. No-op when disabled. No host read (a tensor ``scale`` is read once).

        Raises:
            RuntimeError: ``state_dict`` is empty (saved from a disabled scaler; torch's wording).
            ValueError: a key is missing or a value has the wrong type or range.
            TypeError: ``state_dict`` is neither a mapping nor a DeepSpeed loss scaler.
        """
        if not self._enabled:
            return
        fmt, state_dict = to_native_state(
            state_dict,
            {
                "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
            },
        )
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got: {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        problems: list[str] = []
        parsed: dict[str, Any] = {}

        def check(key: str, fn: Any, *args: Any, **kwargs: Any) -> None:
            if key not in state_dict:
                problems.append(f"missing key {key!r}")
                return
            value = state_dict[key]
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            try:
                parsed[key] = fn(f"state_dict[{key!r}]", value, *args, **kwargs)
            except (TypeError, ValueError) as e:
                problems.append(str(e))

        check("scale", V.check_positive_finite)
        check("growth_factor", V.check_factor, low=1.0, high=None)
        check("backoff_factor", V.check_factor, low=0.0, high=1.0)
        check("growth_interval", V.check_int, minimum=1)
        check("_growth_tracker", V.check_int, minimum=0)
        for key in ("min_scale", "max_scale"):
            if state_dict.get(key) is not None:
                check(key, V.check_positive_finite)
        for key in ("num_updates", "num_skipped_steps"):
            if key in state_dict:
                check(key, V.check_int, minimum=0)
        for key, fn, kwargs in _POLICY_STATE_CHECKS:
            if key in state_dict:
                check(key, fn, **kwargs)
        policy = self._policy
        saved_policy = parsed.get("policy", self._policy.name)
        settings = (
            parsed.get("hysteresis", self._hysteresis),
            parsed.get("consecutive_hysteresis", self._consecutive_hysteresis),
        )
        replace_settings = (
            saved_policy == policy.name
            and settings != (self._hysteresis, self._consecutive_hysteresis)
            and "policy" in parsed
        )
        if replace_settings:
            try:
                policy = make_policy(
                    policy.name, hysteresis=settings[0], consecutive_hysteresis=settings[1]
                )
            except (TypeError, ValueError) as e:
                problems.append(f"state_dict settings: {e}")
        if problems:
            raise ValueError("invalid GradScaler state_dict:\n- " + "\n- ".join(problems))

        self._init_scale = parsed["scale"]
        self._growth_factor = parsed["growth_factor"]
        self._backoff_factor = parsed["backoff_factor"]
        self._growth_interval = parsed["growth_interval"]
        self._init_growth_tracker = parsed["_growth_tracker"]
        for key in ("min_scale", "max_scale"):
            if key in state_dict and parsed.get(key) != getattr(self, f"_{key}"):
                warnings.warn(
                    f"load_state_dict: {key}={getattr(self, f'_{key}')} given to the constructor is "
                    f"replaced by the checkpoint's {key}={parsed.get(key)}",
                    stacklevel=2,
                )
                setattr(self, f"_{key}", parsed.get(key))
        if saved_policy != policy.name:
            warnings.warn(
                f"load_state_dict: the {fmt} state was saved under policy={saved_policy!r}; this "
                f"scaler continues it with policy={policy.name!r}",
                stacklevel=2,
            )
        if replace_settings:
            warnings.warn(
                f"load_state_dict: hysteresis={self._hysteresis}, consecutive_hysteresis="
                f"{self._consecutive_hysteresis} given to the constructor are replaced by the "
                f"checkpoint's hysteresis={settings[0]}, consecutive_hysteresis={settings[1]}",
                stacklevel=2,
            )
            self._policy = policy
            self._hysteresis, self._consecutive_hysteresis = settings
        self._skip_record.restore(parsed.get("num_updates", 0), parsed.get("num_skipped_steps", 0))
        saved_state = {k: parsed[k] for k in (*_POLICY_STATE_KEYS, "num_updates") if k in parsed}
        self._init_policy_state = policy.state_from_checkpoint(
            saved_state, parsed["_growth_tracker"]
        )
        if self._scale is not None:
            self._scale.fill_(parsed["scale"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(parsed["_growth_tracker"])
        self._policy_state = None
        if self._scale is not None:
            self._materialised_policy_state()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise CallOrderError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_policy_state"] = self._policy_state_values()
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_policy_state"] = None
        # A ProcessGroup cannot be pickled: the copy uses the default group.
        state["_process_group"] = None
        state["_last_found_inf"] = None
        state["_per_optimizer_states"] = defaultdict(_refresh_per_optimizer_state)
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self._device!r}, enabled={self._enabled}, "
            f"growth_factor={self._growth_factor}, backoff_factor={self._backoff_factor}, "
            f"growth_interval={self._growth_interval}, grad_layout={self._grad_layout!r}, "
            f"min_scale={self._min_scale}, max_scale={self._max_scale}, "
            f"policy={self._policy.name!r}, hysteresis={self._hysteresis}, "
            f"consecutive_hysteresis={self._consecutive_hysteresis}, "
            f"raise_error_at_min_scale={self._raise_error_at_min_scale}, "
            f"skip_nonfinite={self._skip_nonfinite})"
        )


def _check_policy_name(name: str, value: object) -> str:
    if value not in POLICIES:
        raise ValueError(f"{name} must be one of {POLICIES}, got: {value!r}")
    return str(value)


# Keys of a policy's state and settings in a state_dict, with their checks.
_POLICY_STATE_KEYS = ("cur_iter", "last_overflow_iter", "cur_hysteresis", "hysteresis_tracker")
_POLICY_STATE_CHECKS: tuple[tuple[str, Any, dict[str, Any]], ...] = (
    ("policy", _check_policy_name, {}),
    ("hysteresis", V.check_int, {"minimum": 1}),
    ("consecutive_hysteresis", V.check_bool, {}),
    ("cur_iter", V.check_int, {"minimum": 0}),
    ("last_overflow_iter", V.check_int, {"minimum": -1}),
    ("cur_hysteresis", V.check_int, {"minimum": 1}),
    # Megatron's tracker keeps counting down below 0 through a run of overflows.
    ("hysteresis_tracker", V.check_int, {"minimum": -(2**62)}),
)


#: ``step`` function -> whether it takes torch's deprecated ``grad_scaler`` keyword. Reading a
#: signature costs tens of microseconds, once per step otherwise.
_TAKES_GRAD_SCALER: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _step_takes_grad_scaler(step: Any) -> bool:
    func = getattr(step, "__func__", step)  # the same function behind every bound method
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):
        pass
    takes = "grad_scaler" in inspect.signature(step).parameters
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:  # not weak-referenceable: not cached
        pass
    return takes


def _mul_groups_(groups: GradGroups, factor: torch.Tensor) -> None:
    """Multiply every gradient in place by a 0-dim tensor (one launch per device/dtype group)."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for key, grads in groups.items():
        if key.device not in per_device:
            per_device[key.device] = factor.to(key.device, non_blocking=True)
        torch._foreach_mul_(grads, per_device[key.device])
