"""Transformers' ``Trainer`` and TRL: one call puts ``distscaler.GradScaler`` into a Trainer.

```python
from transformers import Trainer, TrainingArguments
from distscaler.integrations.transformers import install

args = TrainingArguments(..., fp16=True, optim="adamw_torch_fused", max_grad_norm=1.0)
trainer = Trainer(model=model, args=args, train_dataset=data)   # or SFTTrainer, DPOTrainer...
install(trainer)                  # after the Trainer is built, before train(); every rank
trainer.train(resume_from_checkpoint=...)
```

Every Trainer subclass works the same way (TRL's ``SFTTrainer``, ``DPOTrainer``,
``GRPOTrainer``...): the Trainer trains through its ``accelerate.Accelerator``, and
[`install()`][distscaler.integrations.transformers.install] installs distscaler there with
[`distscaler.integrations.accelerate.install()`][distscaler.integrations.accelerate.install]. What
Transformers 5.x (``trainer.py``: ``_inner_training_loop``, ``_clip_grad_norm``, ``_get_grad_norm``,
``_save_scaler``, ``_load_scaler``, ``log``) does with fp16 and what changes:

* **Agreement.** Accelerate's ``torch.amp.GradScaler`` decides per rank; here every rank skips, or
  none does, and the scales agree (one ``all_reduce`` of 2 float32 per optimizer step).
* **Skips and the scheduler.** The Trainer steps the LR scheduler unless
  ``accelerator.optimizer_step_was_skipped``, which misses the skips of fused optimizers
  (``optim="adamw_torch_fused"``; accelerate issue 4242), so their scheduler moves on a skipped
  step. Here the flag is the agreed ``found_inf`` for every optimizer: the scheduler holds.
* **Clipping.** ``max_grad_norm > 0`` clips through
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] (the global norm folded
  into the step's collective, no extra pass with a fused optimizer); ``max_grad_norm=0`` measures
  the logged ``grad_norm`` with ``max_norm=inf`` (measure only).
* **Logs.** Each Trainer log (``on_log``: the console, TensorBoard, W&B... get them like any metric,
  and ``trainer.state.log_history``) carries
  [`GradScaler.metrics()`][distscaler.GradScaler.metrics] (the keys every integration logs:
  ``distscaler/scale``, ``distscaler/updates``, ``distscaler/skipped_total`` and, once a step was
  skipped, ``distscaler/overflow_step`` (the scaler's update number of the last skipped step) and
  ``distscaler/overflow_tensors`` (how many gradient tensors held inf/NaN, all ranks), and once
  replicated gradients were compared ([`distscaler.replica_check`][distscaler.replica_check]),
  ``distscaler/replica_checks``, ``distscaler/replica_mismatches``,
  ``distscaler/replica_skipped`` and ``distscaler/suspects``) and ``distscaler/skipped`` (skipped
  optimizer steps since the previous log). The names,
  ranks and kinds are logged as a warning on rank 0 (logger ``"distscaler"``) right after the
  skipped step: [`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow].
* **Checkpoints.** Unchanged code path: the Trainer saves ``accelerator.scaler.state_dict()`` as
  ``scaler.pt`` in each checkpoint and loads it on ``resume_from_checkpoint`` (after the optimizer,
  so FSDP2's dummy optimizer step cannot move the restored scale): the same scale, tracker and
  skip counts continue.
* **CPU.** Stock Accelerate on the CPU ignores ``fp16=True`` and trains in fp32 without a word;
  here fp16 autocast and the scaler run on the CPU too, and
  [`install()`][distscaler.integrations.transformers.install] says so once (a warning on rank 0;
  fp16 matmuls are slow on CPUs without fp16 units). Under ``torchrun`` on a machine without GPUs
  the Trainer needs ``use_cpu=True``: without it, Accelerate runs ``DistributedType.NO`` and every
  rank trains its own copy of the model; [`install()`][distscaler.integrations.transformers.install]
  refuses that setup. Stock Accelerate also drops FSDP on the CPU (FSDP needs an accelerator device
  there).

Not supported (refused by the Accelerate integration): DeepSpeed, Megatron-LM, XLA, MS-AMP. Tested
with transformers 5.23.0, trl 1.16.0, accelerate 1.15.0, torch 2.13, on CPU processes (gloo; the
FSDP2 test sets Accelerate's FSDP state by hand there).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import _common
from ._common import INSTALLED, LogMetrics, requires

with requires("transformers", "HuggingFace Transformers", "transformers"):
    from transformers import Trainer, TrainerCallback

from .._scaler import GradScaler
from . import accelerate as _accelerate

__all__ = ["DistScalerCallback", "install", "installed_scaler", "uninstall"]

logger = logging.getLogger(__name__)

_said_cpu_fp16 = False


class DistScalerCallback(TrainerCallback):  # type: ignore[misc]
    """Reports the scaler through a Trainer's logs;
    [`install()`][distscaler.integrations.transformers.install] adds it (first in the list, so that
    the reporting callbacks after it see its metrics).

    ``on_step_end`` (every rank, after each optimizer step): one host read of the agreed skip flag;
    after a skipped step, [`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow]
    (every rank at the same step: at world size > 1 one ``all_gather``, only then). ``on_log``: adds
    the metrics of the module docstring to the log (one host read).
    """

    def __init__(self, scaler: GradScaler, *, log_metrics: bool = True) -> None:
        self.scaler = scaler
        self.log_metrics = log_metrics
        self._log = LogMetrics()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After a skipped step, fill ``scaler.last_overflow`` (every rank together)."""
        if self.scaler.is_enabled() and self.scaler.step_was_skipped:
            self.scaler.report_overflow()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add the scale, the skip counts and the last overflow report to the Trainer's log."""
        if not self.log_metrics or logs is None or not self.scaler.is_enabled():
            return
        # Reported after each skipped step already (on_step_end): no report here.
        metrics = self._log.metrics(self.scaler)
        if not metrics.get("distscaler/updates"):  # before the first step (or only evaluating)
            return
        logs.update(metrics)
        # Trainer.log stored a copy of ``logs`` in the history before calling the callbacks.
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(metrics)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Count skips from the checkpoint's totals on a resumed run."""
        # A resumed run continues the skip counts of its checkpoint: count from there.
        if self.scaler.is_enabled():
            self._log.resume(self.scaler)


def install(trainer: Trainer, scaler: Any = None, *, log_metrics: bool = True) -> GradScaler:
    """Make ``trainer`` scale, skip, clip, log and checkpoint with a ``distscaler.GradScaler``.

    Call it on every rank after building the Trainer (any subclass: TRL's included) and before
    ``train()``; a resumed run calls it the same way. It installs the scaler in
    ``trainer.accelerator``
    ([`distscaler.integrations.accelerate.install()`][distscaler.integrations.accelerate.install])
    and adds a [`DistScalerCallback`][distscaler.integrations.transformers.DistScalerCallback] first
    in the Trainer's callbacks. On the CPU with ``fp16=True`` it warns once (rank 0) that fp16 is
    now real there. Undo with [`uninstall()`][distscaler.integrations.transformers.uninstall].

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) trained with DDP, FSDP2 or one process
            (FSDP1 takes the same Accelerate path; the tests do not exercise it).
        scaler: ``None`` (default): a new ``GradScaler`` on the Trainer's device type (needs
            ``TrainingArguments(fp16=True)``). A ``distscaler.GradScaler``, a
            ``distscaler.ScalerConfig`` or a DeepSpeed config (dict, its ``"fp16"`` section or a
            JSON path): as
            [`distscaler.integrations.accelerate.install()`][distscaler.integrations.accelerate.install]
            takes it (needed without ``fp16=True``, for example to agree on non-finite steps in
            bf16).
        log_metrics: add the ``distscaler/*`` metrics to the Trainer's logs (default True).

    Returns:
        The installed scaler (also ``trainer.accelerator.scaler``).

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``; ``log_metrics`` is not a bool;
            ``scaler`` is of another type.
        ValueError: ``scaler`` is None without ``fp16=True``; torch.distributed runs several ranks
            but the Trainer's accelerator runs one process (``torchrun`` on the CPU without
            ``use_cpu=True``); the Trainer uses DeepSpeed (and the other refusals of the
            Accelerate integration).
        RuntimeError: distscaler is already installed on ``trainer``.

    Cost: no collective and no host read here; per optimizer step, the scaler's one ``all_reduce``
    plus the callback's
    ([`DistScalerCallback`][distscaler.integrations.transformers.DistScalerCallback]).
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"trainer must be a transformers.Trainer (or subclass), got: {type(trainer).__name__}"
        )
    if not isinstance(log_metrics, bool):
        raise TypeError(f"log_metrics must be a bool, got: {log_metrics!r}")
    if getattr(trainer, INSTALLED, None) is not None:
        raise RuntimeError(
            "distscaler is already installed on this Trainer; call uninstall(trainer) first"
        )
    accelerator = trainer.accelerator
    if scaler is None and accelerator.mixed_precision != "fp16":
        raise ValueError(
            "install(trainer) without a scaler needs TrainingArguments(fp16=True), got: "
            f"mixed_precision={accelerator.mixed_precision!r}; pass a GradScaler or ScalerConfig "
            "to agree on non-finite steps without fp16"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise ValueError(
            f"WORLD_SIZE is {world} but the Trainer's accelerator runs one process "
            f"({accelerator.distributed_type}): every rank would train its own copy of the model. "
            "On a machine without GPUs pass TrainingArguments(use_cpu=True)"
        )
    installed = _accelerate.install(accelerator, scaler)
    callback = DistScalerCallback(installed, log_metrics=log_metrics)
    trainer.callback_handler.callbacks.insert(0, callback)
    setattr(trainer, INSTALLED, callback)
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16":
        _say_cpu_fp16(accelerator.is_main_process)
    return installed


def installed_scaler(trainer: Trainer) -> GradScaler | None:
    """The scaler [`install()`][distscaler.integrations.transformers.install] put into ``trainer``,
    or None."""
    return _common.installed_scaler(trainer)


def uninstall(trainer: Trainer) -> GradScaler:
    """Undo [`install()`][distscaler.integrations.transformers.install]: Accelerate's scaler and
    optimizers come back, the callback goes.

    Raises:
        RuntimeError: distscaler is not installed on ``trainer``.
    """
    callback = getattr(trainer, INSTALLED, None)
    if callback is None:
        raise RuntimeError("distscaler is not installed on this Trainer")
    trainer.callback_handler.callbacks.remove(callback)
    delattr(trainer, INSTALLED)
    return _accelerate.uninstall(trainer.accelerator)


def _say_cpu_fp16(main_process: bool) -> None:
    global _said_cpu_fp16
    if _said_cpu_fp16 or not main_process:
        return
    _said_cpu_fp16 = True
    logger.warning(
        "distscaler: fp16=True on the CPU now trains with fp16 autocast and distscaler's loss "
        "scaler (stock Accelerate silently trains in fp32 there); fp16 matmuls are slow on CPUs "
        "without fp16 units"
    )
