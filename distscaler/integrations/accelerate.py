"""HuggingFace Accelerate: one call puts ``distscaler.GradScaler`` into an ``Accelerator``.

```python
from accelerate import Accelerator
from distscaler.integrations.accelerate import install

accelerator = Accelerator(mixed_precision="fp16")
scaler = install(accelerator)            # before or after accelerator.prepare(...)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    with accelerator.accumulate(model):
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)           # scaler.scale(loss).backward()
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # rides on the step's one collective
        optimizer.step()                     # every rank skips, or none does
        optimizer.zero_grad()
    if not accelerator.optimizer_step_was_skipped:
        lr_scheduler.step()
```

What Accelerate (1.x, ``accelerator.py`` / ``optimizer.py`` / ``checkpointing.py``) does with its own
``torch.amp.GradScaler`` and what changes here:

* **Skip detection.** ``AcceleratedOptimizer.step`` swaps the wrapped optimizer's ``step`` for a
  function that records whether it was called, and reports a skip when it was not. A fused optimizer
  (``AdamW(fused=True)``) is always called (it receives ``found_inf`` and skips inside the kernel),
  so Accelerate never sees its skips (accelerate issue 4242). Here the prepared optimizers become
  [`ScaledAcceleratedOptimizer`][distscaler.integrations.accelerate.ScaledAcceleratedOptimizer],
  whose ``step`` calls ``scaler.step`` / ``scaler.update`` on the wrapped optimizer *without*
  swapping its ``step``, and whose ``step_was_skipped`` is the scaler's agreed ``found_inf``: right
  on every rank, for every kind of optimizer, including overflows that a hysteresis policy absorbs
  (those skip the step too).
* **Clipping.** ``accelerator.clip_grad_norm_`` unscales every optimizer and then calls torch's
  ``clip_grad_norm_`` (a second pass and, when sharded, a second collective). Here it goes to
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] of the optimizer that
  holds exactly those parameters: the global norm of the unscaled gradients, computed in the step's
  one collective.
* **CPU.** Accelerate creates no fp16 scaler and no autocast on the CPU (``mixed_precision="fp16"``
  then silently trains in fp32). With ``install`` the CPU gets fp16 autocast (the accelerator's
  ``native_amp`` is switched on, so ``prepare``'s forward wrapper and ``accelerator.autocast()``
  use it) and the scaler; MULTI_CPU (gloo) jobs work like multi-GPU ones.
* **FSDP2 ``load_state``.** Accelerate loads the scaler first and then lets
  ``torch.distributed.checkpoint.set_optimizer_state_dict`` run a dummy optimizer step (zero
  gradients, ``lr=0``) through ``AcceleratedOptimizer.step``, which calls ``scaler.update()``: the
  restored growth tracker moves by one and the scale can grow (accelerate issue 4289). Here a
  ``register_load_state_pre_hook`` hook, which Accelerate runs after the optimizers are loaded,
  loads the saved scaler state again, so the restored scale, tracker and counters are the saved
  ones exactly.

``save_state`` / ``load_state`` store the scaler through ``accelerator.scaler`` as Accelerate does
(``scaler.pt``, loadable by ``torch.amp.GradScaler`` too).

* **LR scheduler on skipped steps.** Accelerate's ``AcceleratedScheduler.step`` does not step after a
  step its optimizers report skipped. Since every skip is reported here, the LR is held on every
  skipped step (default, ``lr_on_skip="hold"``), also where Accelerate would not see the skip (fused
  optimizers, the CPU). ``install(accelerator, lr_on_skip="step")`` steps the prepared schedulers
  whether or not the step was skipped; ``optimizer_step_was_skipped`` still tells the truth.
* **``optimizer._is_overflow``.** Code that marks a skipped step by writing it (Accelerate's tests,
  trainers) is honoured: the written value is ``step_was_skipped`` until the next ``step()``.
* **Pickling.** Everything [`install()`][distscaler.integrations.accelerate.install] stores on the
  accelerator is picklable, so ``pickle.dumps(accelerator)`` works as it does without it.

Not supported: DeepSpeed and Megatron-LM plugins (they scale the loss themselves; to keep a
DeepSpeed ``fp16`` section's behaviour on FSDP, pass ``ScalerConfig.from_deepspeed(...)`` to
[`install()`][distscaler.integrations.accelerate.install]), XLA, and MS-AMP's fp8 optimizers.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Literal

import torch

from . import _common
from ._common import INSTALLED, check_lr_on_skip, requires

with requires("accelerate", "HuggingFace Accelerate", "accelerate"):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import (
        DistributedType,
        convert_outputs_to_fp32,
        get_mixed_precision_context_manager,
    )
    from accelerate.utils.constants import SCALER_NAME

from .._scaler import GradScaler
from ._scaler_arg import scaler_from_argument

__all__ = ["ScaledAcceleratedOptimizer", "install", "installed_scaler", "uninstall"]

_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales the loss itself",
    DistributedType.MEGATRON_LM: "Megatron-LM scales the loss itself",
    DistributedType.XLA: "XLA is not supported",
}


class ScaledAcceleratedOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` whose step and skip flag come from distscaler's agreed ``found_inf``.

    [`install()`][distscaler.integrations.accelerate.install] turns the accelerator's prepared
    optimizers into this class (same object, same state; ``isinstance(opt, AcceleratedOptimizer)``
    still holds). ``step()`` runs ``scaler.step(wrapped)`` and ``scaler.update()`` when gradients
    are synchronized (not on gradient-accumulation micro-steps), as Accelerate's does, but leaves
    the wrapped optimizer's ``step`` alone. ``step_was_skipped`` is the agreed flag of this
    optimizer's last step.
    """

    # The agreed found_inf (0-dim float32 on the scale's device) of the last step; None before it.
    _distscaler_found_inf: torch.Tensor | None = None
    # A value written to ``_is_overflow`` since the last step; None when none was written.
    _distscaler_written_overflow: bool | None = None

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step through the scaler when gradients are synchronized: every rank skips, or none does.

        Args:
            closure (callable | None): passed to the wrapped optimizer's ``step`` when the scaler is
                disabled (``GradScalerKwargs(enabled=False)``), as Accelerate does. Default: None.

        Raises:
            RuntimeError: a ``closure`` with an enabled scaler (torch's ``GradScaler`` refuses it).
        """
        scaler = self.scaler
        if not isinstance(scaler, GradScaler):  # uninstalled: Accelerate's own behaviour
            return super().step(closure)
        if not self.gradient_state.sync_gradients:
            return None
        self.__dict__.pop("_distscaler_written_overflow", None)
        if not scaler.is_enabled():
            # A true no-op scaler: the optimizer's own step, closure included (torch's and
            # Accelerate's behaviour with a disabled scaler).
            self._distscaler_found_inf = None
            if closure is None:
                self.optimizer.step()
            else:
                self.optimizer.step(closure)
            return None
        if closure is not None:
            # torch.amp.GradScaler.step's wording.
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scaler.step(self.optimizer)
        scaler.update()
        # update() recorded the flag every rank agreed on; keep this optimizer's (no host read).
        self._distscaler_found_inf = scaler.found_inf
        return None

    @property
    def step_was_skipped(self) -> bool:
        """Whether this optimizer's last step was skipped, the same on every rank.

        Reads the agreed device flag (one host read, the explicit sync). False before the first
        step and with a disabled scaler. A value written to ``_is_overflow`` since the last step
        (how Accelerate's tests and trainers mark a skipped step) is returned instead.
        """
        written = self._distscaler_written_overflow
        if written is not None:
            return written
        flag = self._distscaler_found_inf
        if not isinstance(self.scaler, GradScaler) or flag is None:
            return False
        return bool(flag.item())

    # Accelerate's attribute behind ``step_was_skipped``: reads give the agreed flag, writes are
    # kept until the next step (a data descriptor, so the instance's own ``_is_overflow`` set by
    # ``AcceleratedOptimizer.__init__`` is shadowed while the class is this one).
    @property
    def _is_overflow(self) -> bool:
        return self.step_was_skipped

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self.__dict__["_distscaler_written_overflow"] = bool(value)


class _LRStepsOnSkip(AcceleratedScheduler):
    """An ``AcceleratedScheduler`` that steps whether or not its optimizers skipped the step.

    [`install()`][distscaler.integrations.accelerate.install] with ``lr_on_skip="step"`` turns the
    prepared schedulers into this class (same object). Accelerate's own ``step`` runs with no
    optimizers to ask, so its accumulation and ``num_processes`` rules stay Accelerate's.
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        state = self.__dict__
        optimizers = state["optimizers"]
        state["optimizers"] = []
        try:
            super().step(*args, **kwargs)
        finally:
            state["optimizers"] = optimizers


@dataclass(slots=True)
class _Installation:
    """What [`install()`][distscaler.integrations.accelerate.install] changed on one accelerator, so
    that [`uninstall()`][distscaler.integrations.accelerate.uninstall] can undo it."""

    scaler: GradScaler
    old_scaler: Any
    old_native_amp: bool
    lr_on_skip: str = "hold"
    hook: Any = None
    optimizers: list[tuple[AcceleratedOptimizer, type, Any]] = field(default_factory=list)
    schedulers: list[tuple[AcceleratedScheduler, type]] = field(default_factory=list)
    autocast_models: list[torch.nn.Module] = field(default_factory=list)
    registered_models: list[torch.nn.Module] = field(default_factory=list)
    warned_unmatched: bool = False


def install(
    accelerator: Accelerator,
    scaler: Any = None,
    *,
    lr_on_skip: Literal["hold", "step"] = "hold",
) -> GradScaler:
    """Make ``accelerator`` scale, skip, clip and checkpoint with a ``distscaler.GradScaler``.

    One call, before or after ``accelerator.prepare(...)``, on every rank. It sets
    ``accelerator.scaler`` (Accelerate's own seam: ``backward`` scales the loss with it,
    ``save_state`` / ``load_state`` store it), turns the prepared optimizers, and every optimizer
    prepared later, into
    [`ScaledAcceleratedOptimizer`][distscaler.integrations.accelerate.ScaledAcceleratedOptimizer],
    routes ``accelerator.clip_grad_norm_`` to
    [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_], registers the prepared
    models' layouts with the scaler, and adds a ``load_state`` hook that keeps FSDP2's dummy
    optimizer step from changing the restored scale. On the CPU it also switches on fp16 autocast
    (see the module docstring). Undo with
    [`uninstall()`][distscaler.integrations.accelerate.uninstall].

    Args:
        accelerator: an ``accelerate.Accelerator`` (single process, MULTI_CPU, MULTI_GPU, FSDP1 or
            FSDP2).
        scaler: ``None`` (default): a new ``GradScaler`` on the accelerator's device type, with
            the ``GradScalerKwargs`` given to the accelerator, if any; the state of a scaler
            Accelerate already used is carried over. A ``distscaler.GradScaler``: used as given
            (its device type must be the accelerator's). A ``distscaler.ScalerConfig`` (for
            example ``ScalerConfig.from_deepspeed("ds_config.json")``): a scaler built from it. A
            DeepSpeed config itself (a dict, its ``"fp16"`` section, or a path to its JSON file):
            the same, through ``ScalerConfig.from_deepspeed``, so a DeepSpeed user moving to FSDP
            keeps the loss-scale behaviour in one call.
            Without ``mixed_precision="fp16"`` a scaler must be given explicitly.
        lr_on_skip: ``"hold"`` (default): a prepared LR scheduler does not step after a skipped
            step (Accelerate's rule, applied to every skip since every skip is reported).
            ``"step"``: prepared schedulers step after every optimizer step, skipped or not, as
            Accelerate's do where it does not see the skip (fused optimizers, the CPU).

    Returns:
        The installed scaler (also ``accelerator.scaler``).

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator``, or ``scaler`` is none of the above
            (a ``torch.amp.GradScaler`` included: it decides per rank).
        ValueError: the accelerator uses DeepSpeed, Megatron-LM, XLA or MS-AMP; ``scaler`` is None
            and ``mixed_precision`` is not ``"fp16"``; the scaler's device type differs from the
            accelerator's; ``lr_on_skip`` is not ``"hold"`` or ``"step"``.
        RuntimeError: distscaler is already installed on ``accelerator``.

    Cost: no collective and no host read here. Per optimizer step afterwards: the scaler's (one
    ``all_reduce`` of 2 float32; no host read with a fused optimizer); ``step_was_skipped`` /
    ``accelerator.optimizer_step_was_skipped`` read one flag per optimizer on the host.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got: {type(accelerator).__name__}"
        )
    if getattr(accelerator, INSTALLED, None) is not None:
        raise RuntimeError(
            "distscaler is already installed on this accelerator; call uninstall(accelerator) "
            "before installing another scaler."
        )
    check_lr_on_skip(lr_on_skip)
    reason = _UNSUPPORTED.get(accelerator.distributed_type)
    if reason is not None:
        raise ValueError(
            f"accelerator.distributed_type must not be {accelerator.distributed_type}: {reason}. "
            "To keep a DeepSpeed fp16 section's loss-scale behaviour, train with FSDP or DDP and "
            "install(accelerator, ScalerConfig.from_deepspeed(ds_config))."
        )
    if getattr(accelerator, "fp8_backend", None) is not None and "MSAMP" in str(
        accelerator.fp8_backend
    ):
        raise ValueError("accelerator.fp8_backend MSAMP brings its own scaler; not supported")
    device_type = accelerator.device.type
    new_scaler = _resolve_scaler(accelerator, scaler, device_type)

    # -- from here on, every change is recorded for uninstall() --
    inst = _Installation(
        scaler=new_scaler,
        old_scaler=accelerator.scaler,
        old_native_amp=accelerator.native_amp,
        lr_on_skip=lr_on_skip,
    )
    accelerator.scaler = new_scaler
    if accelerator.mixed_precision == "fp16" and not accelerator.native_amp:
        # Accelerate leaves fp16 off on the CPU; native_amp is what its autocast paths test.
        accelerator.native_amp = True
        for model in accelerator._models:
            _add_autocast(accelerator, model, inst)
    for optimizer in accelerator._optimizers:
        _adopt(optimizer, new_scaler, inst)
    for scheduler in accelerator._schedulers:
        _adopt_scheduler(scheduler, inst)
    _register_models(accelerator, inst)
    # Instance attributes shadow the methods; uninstall() deletes them again. Module functions
    # bound with functools.partial, not closures: the accelerator stays picklable.
    inst.hook = accelerator.register_load_state_pre_hook(
        functools.partial(_restore_scaler, accelerator)
    )
    accelerator.prepare_optimizer = functools.partial(_prepare_optimizer, accelerator)  # type: ignore[method-assign]
    accelerator.prepare_scheduler = functools.partial(_prepare_scheduler, accelerator)  # type: ignore[method-assign]
    accelerator.clip_grad_norm_ = functools.partial(_clip_grad_norm, accelerator)  # type: ignore[method-assign]
    setattr(accelerator, INSTALLED, inst)
    return new_scaler


def installed_scaler(accelerator: Accelerator) -> GradScaler | None:
    """The scaler [`install()`][distscaler.integrations.accelerate.install] put into
    ``accelerator``, or None."""
    return _common.installed_scaler(accelerator)


def uninstall(accelerator: Accelerator) -> GradScaler:
    """Undo [`install()`][distscaler.integrations.accelerate.install]: restore Accelerate's scaler,
    optimizers, methods and autocast setting.

    The optimizers go back to ``AcceleratedOptimizer`` with the scaler they had; models wrapped in
    autocast by [`install()`][distscaler.integrations.accelerate.install] get their forward back.
    Returns the removed scaler.

    Raises:
        RuntimeError: distscaler is not installed on ``accelerator``.
    """
    inst: _Installation | None = getattr(accelerator, INSTALLED, None)
    if inst is None:
        raise RuntimeError("distscaler is not installed on this accelerator")
    for optimizer, cls, old_scaler in inst.optimizers:
        skipped = optimizer.step_was_skipped  # Accelerate's flag keeps saying the same
        optimizer.__class__ = cls
        optimizer.scaler = old_scaler
        optimizer.__dict__.pop("_distscaler_found_inf", None)
        optimizer.__dict__.pop("_distscaler_written_overflow", None)
        optimizer._is_overflow = skipped
    for scheduler, cls in inst.schedulers:
        scheduler.__class__ = cls
    for model in inst.autocast_models:
        model.forward = model.__dict__.pop("_original_forward")  # type: ignore[method-assign]
    if inst.hook is not None:
        inst.hook.remove()
    for name in ("prepare_optimizer", "prepare_scheduler", "clip_grad_norm_"):
        accelerator.__dict__.pop(name, None)
    accelerator.scaler = inst.old_scaler
    accelerator.native_amp = inst.old_native_amp
    delattr(accelerator, INSTALLED)
    return inst.scaler


# ---------------------------------------------------------------------- helpers


def _resolve_scaler(accelerator: Accelerator, scaler: Any, device_type: str) -> GradScaler:
    resolved = scaler_from_argument(scaler, device_type, "the accelerator's")
    if resolved is not None:
        return resolved
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            "install(accelerator) without a scaler needs Accelerator(mixed_precision='fp16'), "
            f"got: mixed_precision={accelerator.mixed_precision!r}; pass a GradScaler or "
            "ScalerConfig to agree on non-finite steps without fp16"
        )
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    new = GradScaler(device_type, **kwargs)
    old = accelerator.scaler
    if isinstance(old, torch.amp.GradScaler) and getattr(old, "_scale", None) is not None:
        new.load_state_dict(old.state_dict())  # Accelerate's scaler already ran: keep its state
    return new


def _adopt(optimizer: Any, scaler: GradScaler, inst: _Installation) -> None:
    """Turn a prepared optimizer into a ScaledAcceleratedOptimizer that uses ``scaler``."""
    if not isinstance(optimizer, AcceleratedOptimizer):
        return
    if any(optimizer is o for o, _, _ in inst.optimizers):
        optimizer.scaler = scaler
        return
    inst.optimizers.append((optimizer, type(optimizer), optimizer.scaler))
    if type(optimizer) is AcceleratedOptimizer:
        # Same instance layout (no new slots): only step and step_was_skipped change.
        optimizer.__class__ = ScaledAcceleratedOptimizer
    elif not isinstance(optimizer, ScaledAcceleratedOptimizer):
        raise TypeError(
            "cannot take over a subclass of AcceleratedOptimizer: "
            f"{type(optimizer).__qualname__}; its step would not use distscaler's agreed found_inf"
        )
    optimizer.scaler = scaler


def _adopt_scheduler(scheduler: Any, inst: _Installation) -> None:
    """With ``lr_on_skip="step"``, let a prepared scheduler step on skipped steps too."""
    if inst.lr_on_skip == "hold" or type(scheduler) is not AcceleratedScheduler:
        return
    inst.schedulers.append((scheduler, type(scheduler)))
    scheduler.__class__ = _LRStepsOnSkip  # same instance layout: only step changes


def _prepare_optimizer(
    accelerator: Accelerator, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
) -> AcceleratedOptimizer:
    """``accelerator.prepare_optimizer`` after
    [`install()`][distscaler.integrations.accelerate.install]: Accelerate's, then adopted."""
    prepared = type(accelerator).prepare_optimizer(
        accelerator, optimizer, device_placement=device_placement
    )
    inst: _Installation | None = getattr(accelerator, INSTALLED, None)
    if inst is not None:
        _adopt(prepared, inst.scaler, inst)
    return prepared


def _prepare_scheduler(accelerator: Accelerator, scheduler: Any) -> AcceleratedScheduler:
    """``accelerator.prepare_scheduler`` after
    [`install()`][distscaler.integrations.accelerate.install]: Accelerate's, then adopted."""
    prepared = type(accelerator).prepare_scheduler(accelerator, scheduler)
    inst: _Installation | None = getattr(accelerator, INSTALLED, None)
    if inst is not None:
        _adopt_scheduler(prepared, inst)
    return prepared


def _add_autocast(accelerator: Accelerator, model: torch.nn.Module, inst: _Installation) -> None:
    """Wrap an already prepared model's forward in fp16 autocast, as ``prepare_model`` would have
    (a bound method stays a bound method, so the model pickles as Accelerate's does)."""
    inner = accelerator.unwrap_model(model, keep_fp32_wrapper=True)
    if hasattr(inner, "_original_forward"):
        return
    context = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    forward = inner.forward
    inner._original_forward = forward
    if hasattr(forward, "__func__"):
        inner.forward = MethodType(convert_outputs_to_fp32(context(forward.__func__)), inner)
    else:
        inner.forward = convert_outputs_to_fp32(context(forward))
    inst.autocast_models.append(inner)


def _register_models(accelerator: Accelerator, inst: _Installation) -> None:
    """Tell the scaler how each prepared model's gradients lie across ranks, for the norm.

    Accelerate keeps the *unwrapped* module in ``_models`` for DDP (MULTI_CPU, MULTI_GPU, ...):
    its gradients are replicated over every rank. FSDP1 keeps the FSDP module, which the scaler
    reads itself; FSDP2 gradients are DTensors and need nothing.
    """
    ddp = str(accelerator.distributed_type.value).startswith("MULTI_")
    for model in accelerator._models:
        if not any(model is m for m in inst.registered_models):
            inst.scaler.register_model(model, grad_layout="replicated" if ddp else None)
            inst.registered_models.append(model)


def _clip_grad_norm(
    accelerator: Accelerator,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2,
) -> torch.Tensor:
    """``Accelerator.clip_grad_norm_`` through distscaler: the global norm of the unscaled
    gradients, folded into the step's one collective (see ``GradScaler.clip_grad_norm_``)."""
    inst: _Installation = getattr(accelerator, INSTALLED)
    params = list(parameters)
    optimizer = _optimizer_holding(accelerator, params)
    if optimizer is None:
        if not inst.warned_unmatched:
            warnings.warn(
                "accelerator.clip_grad_norm_: the parameters are not exactly those of one "
                "prepared optimizer, so clipping falls back to Accelerate's unscale_ + "
                "torch.nn.utils.clip_grad_norm_ (an extra pass and, when sharded, an extra "
                "collective); pass all of one optimizer's parameters to fold it into the step's one collective",
                stacklevel=2,
            )
            inst.warned_unmatched = True
        return type(accelerator).clip_grad_norm_(accelerator, params, max_norm, norm_type=norm_type)
    _register_models(accelerator, inst)
    return inst.scaler.clip_grad_norm_(optimizer.optimizer, max_norm, norm_type=norm_type)


def _optimizer_holding(
    accelerator: Accelerator, params: list[torch.Tensor]
) -> AcceleratedOptimizer | None:
    """The prepared optimizer whose parameters with gradients are exactly those of ``params``."""
    wanted = {id(p) for p in params if p.grad is not None}
    for optimizer in accelerator._optimizers:
        held = {
            id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        }
        if held == wanted and (held or len(accelerator._optimizers) == 1):
            return optimizer
    return None


def _restore_scaler(accelerator: Accelerator, models: list[Any], input_dir: str) -> None:
    """The ``load_state`` pre-hook: load the saved scaler state again after FSDP2's dummy step.

    Accelerate runs load-state pre-hooks after the optimizers are loaded. Under FSDP2 that load ran
    a dummy optimizer step, whose ``scaler.update()`` moved the restored state.
    """
    inst: _Installation | None = getattr(accelerator, INSTALLED, None)
    if inst is None or not accelerator.is_fsdp2:
        return
    path = os.path.join(input_dir, SCALER_NAME)
    if not os.path.isfile(path):
        return
    inst.scaler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    for optimizer, _, _ in inst.optimizers:
        optimizer.__dict__.pop("_distscaler_found_inf", None)  # the dummy step's flag
