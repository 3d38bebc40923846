"""Lightning: fp16 mixed precision with ``distscaler.GradScaler``, as one precision plugin.

```python
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from distscaler.integrations.lightning import DistScalerPrecision

trainer = L.Trainer(
    accelerator="cuda", devices=8, strategy=ModelParallelStrategy(),   # or "ddp", "fsdp"
    plugins=[DistScalerPrecision("16-mixed", device="cuda")],          # not precision=...
    gradient_clip_val=1.0,                   # folded into the scaler's one collective
)
trainer.fit(model)                           # AdamW(fused=True) welcome

fabric = L.Fabric(accelerator="cpu", devices=2, plugins=[DistScalerPrecision("16-mixed", "cpu")])
```

What Lightning 2.6.6 does with fp16 (``pytorch/plugins/precision/amp.py`` ``MixedPrecision``,
``pytorch/plugins/precision/fsdp.py`` ``FSDPPrecision``, ``pytorch/trainer/connectors/
accelerator_connector.py`` ``_check_and_init_precision`` / ``_validate_precision_choice``,
``pytorch/loops/training_epoch_loop.py`` ``_update_learning_rates``; the ``fabric`` twins) and what
changes with this plugin:

* **ModelParallelStrategy** (FSDP2 ``fully_shard``, tensor parallel) refuses ``"16-mixed"``: no
  sharded scaler. The plugin passes (a precision plugin leaves the precision flag at ``"32-true"``)
  and its scaler computes the norm from the DTensor gradients' placements.
* **Clipping.** ``MixedPrecision.clip_gradients`` raises for fused optimizers; for the others it
  unscales in place and clips with torch (a second pass; ``FSDPPrecision`` refuses norm clipping).
  Here ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` (and
  ``LightningModule.clip_gradients`` in manual optimization) calls
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_]: the global norm of the
  unscaled gradients in the step's one collective, fused optimizers included (they get
  ``grad_scale`` and ``found_inf``). ``"value"`` unscales through the scaler first. Consequence:
  ``on_before_optimizer_step`` sees the gradients still multiplied by the scale, for every optimizer
  (stock Lightning: only for fused ones).
* **CPU.** ``Trainer(accelerator="cpu", precision="16-mixed")`` silently becomes ``"bf16-mixed"``.
  ``DistScalerPrecision("16-mixed", device="cpu")`` runs fp16 autocast on the CPU (gloo included).
* **Skips.** torch's scaler decides per rank; nothing makes the ranks agree and LR schedulers step
  on skipped steps. Here every rank skips, or none does, and `connect()` puts a guard in front of
  each ``interval="step"`` scheduler's ``step``: it does nothing when every optimizer step of its
  optimizer since its last ``step`` was skipped (``last_epoch`` stays; Lightning's
  ``scheduler_progress`` still counts the call).
* **Logging.** After each optimizer step the plugin logs, through ``LightningModule.log``,
  ``distscaler/skipped`` (0/1 per step, ``_step``; summed per epoch, ``_epoch``),
  ``distscaler/scale`` and, when clipping ran, ``distscaler/grad_norm`` (device tensors, no host
  read); at the steps Lightning writes its logs (``log_every_n_steps``), the other entries of
  [`GradScaler.metrics()`][distscaler.GradScaler.metrics] (``distscaler/skipped_total``, the last
  overflow, the replica check's counts: the keys every integration logs; one host read).
* **Checkpoints.** The scaler's ``state_dict`` goes into the checkpoint under
  ``"DistScalerPrecision"`` (Lightning's precision-plugin key), so a resume continues with the same
  scale, tracker and skip counts, on every strategy (``ModelParallelStrategy`` keeps it in the
  metadata file of its distributed checkpoint).
* **Layout.** At the first optimizer step the plugin registers the strategy's wrapped model with the
  scaler ([`GradScaler.register_model()`][distscaler.GradScaler.register_model]: DDP's and FSDP1's
  process groups; FSDP2 / TP gradients are DTensors), so the norm counts each gradient value once.

Strategies: ``SingleDeviceStrategy``, the ``ddp`` family, ``FSDPStrategy`` (FSDP1, which accepts
only an ``FSDPPrecision``: this class is one, and keeps its fp16 ``MixedPrecision`` config for
FSDP1; not yet exercised by the tests, which run on CPU processes) and ``ModelParallelStrategy``.
``distscaler/skipped`` is logged without ``sync_dist`` on purpose: the value is already the same on
every rank (Lightning's epoch-level warning about it can be ignored). DeepSpeed and XLA bring their own precision (Lightning refuses
this plugin there). Fabric: scaling, agreed skips, ``unscale_gradients`` for
``fabric.clip_gradients`` (fused optimizers too; pass ``error_if_nonfinite=False``, as with
Lightning's own plugin, since an overflow reaches torch's norm), checkpoint state, floating-point
inputs cast to float16 as Fabric's ``MixedPrecision`` does (the Trainer's leaves them as they are,
so does the plugin there); the folded clip and the scheduler guard are Trainer-only. The plugin
pickles (``strategy="ddp_spawn"``): a copy keeps the settings and the scaler's state. Only the unified ``lightning`` package is supported
(``pytorch_lightning`` has its own class hierarchy).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.optim import LBFGS, Optimizer

from ._common import SKIPPED, LRHold, requires

with requires("lightning", "Lightning >= 2.4", "lightning"):
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as _FabricFSDPPrecision
    from lightning.fabric.plugins.precision.precision import Precision as _FabricPrecision
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
    from lightning.pytorch.plugins.precision.precision import Precision as _TrainerPrecision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning_utilities.core.apply_func import apply_to_collection

from .._scaler import GradScaler
from ._scaler_arg import scaler_from_argument

__all__ = ["PRECISIONS", "DistScalerPrecision"]

#: The ``precision`` values the plugin accepts (fp16 autocast with a loss scaler).
PRECISIONS = ("16-mixed",)

#: Step-interval schedulers guarded by a plugin: scheduler -> the plugin (see ``_SkipAwareScheduler``).
_SCHEDULER_OWNERS: weakref.WeakKeyDictionary[Any, DistScalerPrecision] = weakref.WeakKeyDictionary()
_SKIP_AWARE_CLASSES: dict[type, type] = {}


class DistScalerPrecision(FSDPPrecision, _FabricFSDPPrecision):  # type: ignore[misc]
    """fp16 autocast + ``distscaler.GradScaler`` for ``lightning.pytorch.Trainer`` and ``Fabric``.

    Constructed like Lightning's ``MixedPrecision(precision, device, scaler)`` and passed in
    ``plugins=[...]`` (not together with ``precision=``). See the module docstring for what it
    changes against Lightning 2.6.6. It subclasses both ``FSDPPrecision`` classes (Trainer's and
    Fabric's) only because Lightning's ``FSDPStrategy`` accepts nothing else; every behaviour those
    classes define that matters here is overridden, except ``mixed_precision_config`` (FSDP1's
    fp16 ``MixedPrecision``, as Lightning's ``FSDPPrecision("16-mixed")``).

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, fp32 parameters, dynamic loss scale).
        device: the autocast device type, ``"cuda"`` (default, as Lightning) or ``"cpu"`` or any
            type ``torch.amp.is_autocast_available`` accepts; it must be the Trainer's device type.
        scaler: ``None``: a new ``GradScaler(device)``. A ``distscaler.GradScaler`` (its
            ``device_type`` must be ``device``). A ``distscaler.ScalerConfig``. A DeepSpeed config
            (a dict, its ``"fp16"`` section, or a JSON path), read by
            ``ScalerConfig.from_deepspeed`` (DeepSpeed's loss-scale semantics).
        log_metrics: log ``distscaler/*`` metrics through ``LightningModule.log`` (Trainer only).

    Raises:
        ValueError: ``precision`` is not one of
            [`PRECISIONS`][distscaler.integrations.lightning.PRECISIONS]; ``device`` has no
            autocast; the scaler's device type is not ``device``.
        TypeError: ``device`` is not a string; ``scaler`` is none of the above (a
            ``torch.amp.GradScaler`` included: it decides per rank); ``log_metrics`` not a bool.

    Cost per optimizer step: the scaler's (one ``all_reduce`` of 2 float32 on every rank of the
    scaler's group, which every rank must join; no host read with a fused optimizer, one with
    others); one host read of the agreed flags per guarded scheduler step; one host read at each
    step Lightning writes its logs (``log_metrics``).
    """

    precision = "16-mixed"

    def __init__(
        self,
        precision: str = "16-mixed",
        device: str = "cuda",
        scaler: Any = None,
        *,
        log_metrics: bool = True,
    ) -> None:
        # Every check before anything is set.
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {PRECISIONS}, got: {precision!r} (bf16 and fp32 need no "
                "loss scaler: use Lightning's own precision flags)"
            )
        if not isinstance(device, str):
            raise TypeError(f"device must be a device type string such as 'cuda', got: {device!r}")
        try:
            autocast = torch.amp.is_autocast_available(device)
        except RuntimeError:  # not a device type at all
            autocast = False
        if not autocast:
            raise ValueError(
                f"device must be a device type with autocast, such as 'cuda' or 'cpu', got: {device!r}"
            )
        if not isinstance(log_metrics, bool):
            raise TypeError(f"log_metrics must be a bool, got: {log_metrics!r}")
        # FSDPPrecision types these as ShardedGradScaler and its literals; this class narrows them.
        self.scaler: GradScaler = _resolve_scaler(scaler, device)  # type: ignore[assignment]
        self.precision = "16-mixed"
        self.device = device
        self.log_metrics = log_metrics
        # FSDPPrecision's attribute (FSDPPrecision("16-mixed")'s float32; convert_input decides).
        self._desired_input_dtype = torch.float32
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What one process learns while training: none of it is copied (see ``__getstate__``)."""
        # Per optimizer: the agreed found_inf of its last step, and its last clipping norm.
        self._found_inf: weakref.WeakKeyDictionary[Optimizer, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        self._norms: weakref.WeakKeyDictionary[Optimizer, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        self._registered: weakref.ref[torch.nn.Module] | None = None
        self._guarded: list[tuple[Any, type]] = []
        # Per guarded scheduler: its optimizer's steps since its last step (the hold rule).
        self._lr_holds: weakref.WeakKeyDictionary[Any, LRHold] = weakref.WeakKeyDictionary()
        self._backward_skipped = False
        # Set by connect(), which only the Trainer calls: Fabric casts inputs, the Trainer does not.
        self._trainer_connected = False

    def __getstate__(self) -> dict[str, Any]:
        """Settings and scaler, without the run's weak references (they do not pickle).

        ``strategy="ddp_spawn"`` pickles the plugin into each new process before training, as it
        pickles Lightning's ``MixedPrecision``; a copy starts like a new plugin with this scaler.
        """
        state = self.__dict__.copy()
        for key in (
            "_found_inf",
            "_norms",
            "_registered",
            "_guarded",
            "_lr_holds",
            "_backward_skipped",
            "_trainer_connected",
        ):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_run_state()

    # ------------------------------------------------------------------ what the strategy asks

    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        """Trainer hook (``Strategy.setup_precision_plugin``): guard the step-interval schedulers.

        Each ``LRSchedulerConfig`` with ``interval="step"`` gets its scheduler's class swapped for a
        subclass whose ``step`` does nothing when every optimizer step of its optimizer since its
        last ``step`` was skipped (same object, state and ``state_dict``; undone by
        [`teardown()`][distscaler.integrations.lightning.DistScalerPrecision.teardown]). Epoch
        schedulers are left alone.

        Raises:
            ValueError: the Trainer's device type is not the plugin's ``device``.
        """
        self._trainer_connected = True
        module = next((m for m in model.modules() if isinstance(m, pl.LightningModule)), None)
        trainer = None if module is None else module._trainer
        if trainer is not None and trainer.strategy.root_device.type != self.device:
            raise ValueError(
                f"DistScalerPrecision(device={self.device!r}) must match the Trainer's device "
                f"type, got: {trainer.strategy.root_device.type!r}; autocast would do nothing"
            )
        for config in lr_schedulers:
            if getattr(config, "interval", None) == "step":
                self._guard(config.scheduler)
        return model, optimizers, lr_schedulers

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Parameters stay fp32 (mixed precision); FSDP1 casts per its ``mixed_precision_config``."""
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        """No dtype context: tensors are created in fp32 (mixed precision)."""
        return nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        """No dtype context: modules are created in fp32 (mixed precision)."""
        return nullcontext()

    def forward_context(self) -> AbstractContextManager:
        """fp16 autocast on ``device``, as ``MixedPrecision.autocast_context_manager`` (no cache)."""
        return torch.autocast(self.device, dtype=torch.float16, cache_enabled=False)

    def convert_input(self, data: Any) -> Any:
        """As Lightning's ``MixedPrecision("16-mixed")``: under the Trainer, inputs unchanged
        (autocast casts where it matters); under Fabric, floating-point tensors cast to float16
        (integer and bool tensors, and anything else, unchanged)."""
        if self._trainer_connected:
            return data
        return apply_to_collection(data, torch.Tensor, _to_float16)

    # ------------------------------------------------------------------ backward

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """Trainer: scale the loss, then Lightning's ``on_before_backward`` hooks. Fabric: as is
        (it scales in
        [`backward()`][distscaler.integrations.lightning.DistScalerPrecision.backward])."""
        if _trainer_of(module) is None:
            return _FabricPrecision.pre_backward(self, tensor, module)
        return _TrainerPrecision.pre_backward(self, self.scaler.scale(tensor), module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """Trainer: ``model.backward`` (the loss is scaled already). Fabric: scale, then backward."""
        if _trainer_of(model) is None:
            return _FabricPrecision.backward(
                self, self.scaler.scale(tensor), model, *args, **kwargs
            )
        return _TrainerPrecision.backward(self, tensor, model, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """Lightning's own ``post_backward`` of the Trainer's or Fabric's precision, unchanged."""
        if _trainer_of(module) is None:
            return _FabricPrecision.post_backward(self, tensor, module)
        return _TrainerPrecision.post_backward(self, tensor, module)

    # ------------------------------------------------------------------ step and clipping

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure, the hooks and clipping (Trainer), then ``scaler.step`` + ``update``.

        Trainer signature ``(optimizer, model, closure)`` (``MixedPrecision.optimizer_step``:
        closure, ``on_before_optimizer_step`` hooks, ``configure_gradient_clipping``, step), Fabric
        signature ``(optimizer)``. Every rank skips, or none does. When the closure skipped the
        backward (``training_step`` returned None), nothing is clipped or stepped, as Lightning.

        Raises:
            TypeError: ``optimizer`` is an ``LBFGS`` (Lightning's refusal too).
        """
        if isinstance(optimizer, LBFGS):
            raise TypeError("AMP and the LBFGS optimizer are not compatible.")
        trainer = _trainer_of(model)
        if trainer is not None:
            assert closure is not None
            closure_result = closure()
            self._backward_skipped = closure_result is None and model.automatic_optimization
            self._register(trainer.strategy.model)
            try:
                self._after_closure(model, optimizer)  # hooks, then clip_gradients
            finally:
                skipped_backward, self._backward_skipped = self._backward_skipped, False
            if skipped_backward:
                return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        found_inf = self.scaler.found_inf
        if found_inf is not None:
            self._found_inf[optimizer] = found_inf
            for scheduler, lr_hold in self._lr_holds.items():
                if _unwrap(getattr(scheduler, "optimizer", optimizer)) is _unwrap(optimizer):
                    lr_hold.record(found_inf)  # no host read: read when the scheduler steps
        if trainer is not None and self.log_metrics and found_inf is not None:
            self._log(model, optimizer, found_inf, _logs_this_step(trainer))
        return out

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Trainer clipping (``gradient_clip_val`` or ``LightningModule.clip_gradients``).

        ``"norm"``: [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] (the
        global norm of the unscaled gradients, in the step's one collective; fused optimizers
        included). ``"value"``: ``scaler.unscale_`` (which runs the inf check first, so an inf still
        skips) and ``clip_grad_value_``. Every rank must call. No-op for ``clip_val <= 0``.
        """
        if clip_val <= 0 or self._backward_skipped:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_value_(self.main_params(optimizer), clip_value=clip_val)
            return
        self._norms[optimizer] = self.scaler.clip_grad_norm_(optimizer, float(clip_val))

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Fabric's clipping entry (``Strategy.clip_gradients_norm`` / ``_value``): the scaler's
        ``unscale_`` (agreed ``found_inf``, one ``all_reduce``), fused optimizers included."""
        self.scaler.unscale_(optimizer)

    def step_was_skipped(self, optimizer: Optimizer | None = None) -> bool:
        """Whether the last step of ``optimizer`` (None: of any optimizer) was skipped, the same on
        every rank. One host read. False before the first step. ``optimizer`` may be Fabric's or
        the Trainer's wrapper."""
        if optimizer is not None:
            flag = self._found_inf.get(_unwrap(optimizer))
            return flag is not None and bool(flag.item())
        return self.scaler.step_was_skipped

    def grad_norm(self, optimizer: Optimizer) -> torch.Tensor | None:
        """The global unscaled norm of ``optimizer``'s last clipped step (0-dim float32 on the
        scale's device, non-finite when the step was skipped), or None if it was not clipped."""
        return self._norms.get(_unwrap(optimizer))

    # ------------------------------------------------------------------ checkpoints, teardown

    def state_dict(self) -> dict[str, Any]:
        """The scaler's ``state_dict`` (one host read); Lightning stores it under the class name."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scaler state (this plugin's, or ``MixedPrecision``'s torch scaler state)."""
        self.scaler.load_state_dict(state_dict)
        self._found_inf.clear()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of stock ``MixedPrecision`` keeps torch's scaler state under its own
        name: load it, so that a run moving to this plugin keeps its scale."""
        if type(self).__qualname__ not in checkpoint:
            for key in ("MixedPrecision", "FSDPPrecision", "native_amp_scaling_state"):
                if checkpoint.get(key):
                    self.load_state_dict(checkpoint[key])
                    return

    def teardown(self) -> None:
        """Give the guarded schedulers their class back; the next run may be Fabric's."""
        for scheduler, cls in self._guarded:
            scheduler.__class__ = cls
            _SCHEDULER_OWNERS.pop(scheduler, None)
        self._guarded.clear()
        self._lr_holds.clear()
        self._trainer_connected = False

    # ------------------------------------------------------------------ helpers

    def _register(self, model: torch.nn.Module | None) -> None:
        """Tell the scaler the wrapped model's layout (DDP / FSDP1 wrappers; DTensors need none)."""
        if model is None or (self._registered is not None and self._registered() is model):
            return
        self.scaler.register_model(model)
        self._registered = weakref.ref(model)

    def _guard(self, scheduler: Any) -> None:
        cls = type(scheduler)
        self._lr_holds[scheduler] = LRHold()
        if issubclass(cls, _SkipAwareScheduler):
            _SCHEDULER_OWNERS[scheduler] = self
            return
        guarded = _SKIP_AWARE_CLASSES.get(cls)
        if guarded is None:
            guarded = type(cls.__name__, (_SkipAwareScheduler, cls), {"__module__": cls.__module__})
            guarded.__qualname__ = cls.__qualname__
            _SKIP_AWARE_CLASSES[cls] = guarded
        scheduler.__class__ = guarded
        _SCHEDULER_OWNERS[scheduler] = self
        self._guarded.append((scheduler, cls))

    def _holds(self, scheduler: Any) -> bool:
        """Whether ``scheduler`` holds: every step of its optimizer since its last step skipped."""
        lr_hold = self._lr_holds.get(scheduler)
        return lr_hold is not None and lr_hold.hold()

    def _log(
        self, model: Any, optimizer: Optimizer, found_inf: torch.Tensor, logs_now: bool
    ) -> None:
        log = {"batch_size": 1, "sync_dist": False, "add_dataloader_idx": False}
        model.log(SKIPPED, found_inf, on_step=True, on_epoch=True, reduce_fx="sum", **log)
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        model.log("distscaler/scale", self.scaler.scale(one), on_step=True, on_epoch=False, **log)
        norm = self._norms.get(optimizer)
        if norm is not None:
            model.log("distscaler/grad_norm", norm, on_step=True, on_epoch=False, **log)
        if logs_now:  # the rest of GradScaler.metrics(), when Lightning writes (one host read)
            for key, value in self.scaler.metrics().items():
                if key != "distscaler/scale":  # logged above from the device, at every step
                    model.log(key, float(value), on_step=True, on_epoch=False, **log)


class _SkipAwareScheduler:
    """Put in front of a step-interval scheduler's class: no step when every optimizer step since
    its last one was skipped.

    The steps are the owning plugin's agreed flags for the scheduler's ``optimizer`` (torch's
    ``LRScheduler`` attribute; for a scheduler without one, every optimizer's), kept in a
    `distscaler.integrations._common.LRHold`. One host read.
    """

    def step(self, *args: Any, **kwargs: Any) -> Any:
        owner = _SCHEDULER_OWNERS.get(self)
        if owner is not None and owner._holds(self):
            return None
        return super().step(*args, **kwargs)  # type: ignore[misc]


def _to_float16(tensor: torch.Tensor) -> torch.Tensor:
    """Fabric's input cast for ``"16-mixed"`` (its ``_convert_fp_tensor``): floating point only."""
    return tensor.to(torch.float16) if torch.is_floating_point(tensor) else tensor


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Fabric's or the Trainer's optimizer wrapper."""
    if isinstance(optimizer, _FabricOptimizer):
        return optimizer.optimizer
    if isinstance(optimizer, LightningOptimizer):
        return optimizer._optimizer
    return optimizer


def _logs_this_step(trainer: Any) -> bool:
    """Whether Lightning writes its logs at this optimizer step (``log_every_n_steps``: its logger
    connector's ``should_update_logs``; True where a Lightning release lacks it)."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def _trainer_of(module: Any) -> Any:
    """The Trainer driving ``module`` (a LightningModule attached to one), else None (Fabric)."""
    if isinstance(module, pl.LightningModule):
        return module._trainer
    return None


def _resolve_scaler(scaler: Any, device: str) -> GradScaler:
    resolved = scaler_from_argument(scaler, device, "the plugin's device")
    return GradScaler(device) if resolved is None else resolved
