"""verl's training engines in fp16 with distscaler's scaler: one collective per step, every rank.

verl (tested with 0.9.1) trains its actor and critic through engines looked up in its
``EngineRegistry``. In fp16 its FSDP engines (``verl/workers/engine/fsdp/transformer_impl.py``)
build ``ShardedGradScaler(growth_interval=400)`` and, each step, ``unscale_`` (one ``all_reduce`` of
the flag), FSDP's ``clip_grad_norm_`` (its own collective), ``step`` and ``update``. Stock, that
crashes with a fused AdamW (torch issue 140514), advances the LR scheduler on skipped steps, leaves
the scale out of verl's checkpoints (a resumed run restarts from 65536) and, on a device type other
than ``"cuda"``, is disabled by torch with a warning (fp16 with no loss scale, no inf check).

Importing this module puts distscaler's engines in verl's registry in place of the stock FSDP
engines (``language_model`` and ``value_model``, backends ``fsdp`` and ``fsdp2``, every device they
are registered for), and in place of the Megatron engines when verl's Megatron engine imports. The
one line, in the verl config (verl imports ``external_lib`` in each worker before it builds the
engine):

```text
actor_rollout_ref.model.external_lib=distscaler.integrations.verl
critic.model.external_lib=distscaler.integrations.verl        # when a critic trains too
```

(or ``VERL_USE_EXTERNAL_MODULES=distscaler.integrations.verl`` in the workers' environment). In bf16
and fp32 the engines are verl's, unchanged: nothing is scaled there.

What an FSDP engine then does in fp16, on verl's device (``get_device_name()``), FSDP1 and FSDP2:

* **Step** (``optimizer_step``, every rank):
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] with verl's
  ``optim.clip_grad`` (one read pass, **one** ``all_reduce`` of 2 float32 for the flag and the
  global norm, FSDP1's flat shards and FSDP2's DTensors counted once each), ``step`` (skipped on
  every rank or none; fused and foreach AdamW take ``grad_scale``/``found_inf`` and never wait for
  the host), ``update``. It returns ``grad_norm`` as verl does (a Python float: the norm before
  clipping; non-finite on a skipped step). One host read (the norm, which verl reads anyway).
* **Metrics**, in the step's ``metrics``: ``grad_norm`` (verl's),
  [`GradScaler.metrics()`][distscaler.GradScaler.metrics] (the keys every integration logs:
  ``distscaler/scale``, the scale for the next step, ``distscaler/updates``,
  ``distscaler/skipped_total``, the replica check's counts once it compared replicas) and
  ``distscaler/skipped`` (0 or 1) and, after a skip, ``distscaler/overflow_step`` and
  ``distscaler/overflow_tensors`` (in that step's metrics only) with a warning that names the
  ranks and parameters (by module path, FSDP1 and FSDP2)
  ([`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow], one ``all_gather``, only
  after a skip). One more host read per step.
* **LR scheduler held** on skipped steps (default, ``lr_on_skip="hold"``): verl's worker calls
  ``lr_scheduler_step()`` once per training call, after its mini-batches; it is held (the current
  LR returned) when every optimizer step since the last scheduler step was skipped, so the schedule
  counts updates that happened, as Accelerate's scheduler does. ``lr_on_skip="step"`` keeps verl's
  stock behaviour.
* **Checkpoints**: ``save_checkpoint``/``load_checkpoint`` (verl's ``FSDPCheckpointManager``, as
  stock) also write/read the scaler's state (scale, growth tracker, skip counts) to
  ``distscaler_world_size_{W}_rank_{R}.pt`` beside verl's ``extra_state_*`` files, when the
  checkpoint contents include ``extra``; ``save_checkpoint`` returns once every rank's file exists
  (one ``barrier`` after verl's, every rank). A checkpoint without it (a stock one) loads with a warning
  and the scale starts from the initial value.

The Megatron engine (``backend="megatron"``, fp16): its optimizer goes through
[`distscaler.integrations.megatron.install()`][distscaler.integrations.megatron.install] (one scale
for the dense and expert sub-optimizers, one collective), a skipped step returns a non-finite
``grad_norm`` (stock verl raises ``NotImplementedError("Megatron optimizer step failed...")`` on any
skipped fp16 step) and the LR scheduler is held as above. Needs megatron-core 0.19.2 and Megatron's
standard fp16 optimizer: verl turns the precision-aware optimizer on in fp16, so the config also
needs
``actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=False``
(building the engine without it raises ``NotImplementedError`` saying so, before anything is built).

Settings: [`configure()`][distscaler.integrations.verl.configure] in the process that builds the
engine (``scaler=``: a ``GradScaler``, ``ScalerConfig`` or DeepSpeed fp16 config; default
``ScalerConfig(growth_interval=400)``, verl's stock settings), or the environment:
``DISTSCALER_VERL_SCALER`` (a DeepSpeed config JSON path) and ``DISTSCALER_VERL_LR_ON_SKIP``
(``hold`` or ``step``), read when the engine is built.

Not covered: the ``fsdp_turbo`` engine (it builds no scaler in any dtype and needs the
``fsdp_turbo`` package), verl's legacy ``dp_actor``/``fsdp_workers`` path, the VeOmni, TorchTitan
and Automodel engines. Relied on in verl 0.9.1: ``workers/engine/base.py``
(``EngineRegistry._engines``, ``BaseEngine.train_batch``), ``workers/engine/fsdp/transformer_impl.py``
(``FSDPEngine._build_fsdp_module`` sets ``self.scaler`` in fp16, ``optimizer_step``,
``lr_scheduler_step``, ``save_checkpoint``/``load_checkpoint``, ``checkpoint_manager.should_save_extra``
/``should_load_extra``), ``workers/engine/megatron/transformer_impl.py`` (``_build_optimizer``,
``optimizer_step``, ``lr_scheduler_step``), ``utils/device.py`` (``get_device_name``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Literal

import torch

from .._scaler import GradScaler
from ..config import ScalerConfig
from ._common import (
    SKIPPED,
    TESTED_VERSIONS,
    LRHold,
    check_lr_on_skip,
    requires,
)
from ._scaler_arg import scaler_from_argument

__all__ = [
    "TESTED_VERSION",
    "VerlScalerOptions",
    "configure",
    "install",
    "installed",
    "options",
    "uninstall",
]

#: The verl release this module is tested with (CI: ``tests/test_verl.py``).
TESTED_VERSION = TESTED_VERSIONS["verl"]

#: verl's own fp16 scaler settings (``ShardedGradScaler(growth_interval=400)``), our default.
VERL_SCALER = ScalerConfig(growth_interval=400)

_DEVICE = "verl's device (get_device_name())"

logger = logging.getLogger("distscaler")


@dataclasses.dataclass(frozen=True)
class VerlScalerOptions:
    """What the engines use (see [`configure()`][distscaler.integrations.verl.configure]).

    Attributes:
        scaler: a ``GradScaler`` (its device type must be verl's device), a ``ScalerConfig``, a
            DeepSpeed fp16 config (dict or JSON path; DeepSpeed's semantics), or None for
            `VERL_SCALER`.
        lr_on_skip: ``"hold"`` (default): the LR scheduler does not advance when every optimizer
            step since its last step was skipped; ``"step"``: verl's stock behaviour.
    """

    scaler: Any = None
    lr_on_skip: Literal["hold", "step"] = "hold"


_options: VerlScalerOptions | None = None


def configure(scaler: Any = None, *, lr_on_skip: Literal["hold", "step"] = "hold") -> VerlScalerOptions:
    """Set what the engines built after this call in this process use; returns the options.

    Args:
        scaler: see [`VerlScalerOptions`][distscaler.integrations.verl.VerlScalerOptions]. A
            ``GradScaler`` instance serves one engine.
        lr_on_skip: ``"hold"`` or ``"step"``.

    Cost: validation only (a ``ScalerConfig`` or DeepSpeed config is built once on the CPU and
    dropped; a DeepSpeed JSON path is read): no collective, no host sync. Per process: call it in
    every worker that builds an engine, before it builds it.

    Raises:
        ValueError: ``lr_on_skip`` is not one of them; a ``GradScaler`` whose device type is not
            verl's (``verl.utils.device.get_device_name()``: ``GradScaler("cuda")`` in a CPU-only
            process); a DeepSpeed config that does not parse, or a path that is not a readable
            file.
        TypeError: ``scaler`` is none of the accepted kinds.
    """
    global _options
    check_lr_on_skip(lr_on_skip)
    if isinstance(scaler, GradScaler):
        _check_scaler_device(scaler)
    else:
        scaler_from_argument(scaler, "cpu", _DEVICE)  # validates; nothing kept
    _options = VerlScalerOptions(scaler=scaler, lr_on_skip=lr_on_skip)
    return _options


def options() -> VerlScalerOptions:
    """The options in force: [`configure()`][distscaler.integrations.verl.configure]'s, else the
    environment's (``DISTSCALER_VERL_SCALER``, ``DISTSCALER_VERL_LR_ON_SKIP``), else the defaults.

    Raises:
        ValueError: ``DISTSCALER_VERL_LR_ON_SKIP`` is not ``hold`` or ``step``.
    """
    if _options is not None:
        return _options
    lr_on_skip = check_lr_on_skip(
        os.environ.get("DISTSCALER_VERL_LR_ON_SKIP", "hold"), "DISTSCALER_VERL_LR_ON_SKIP"
    )
    return VerlScalerOptions(
        scaler=os.environ.get("DISTSCALER_VERL_SCALER") or None, lr_on_skip=lr_on_skip
    )


def _check_scaler_device(scaler: GradScaler) -> None:
    """A given scaler's device type must be verl's and exist in this process; torch disables
    ``GradScaler("cuda")`` without CUDA (fp16 with no scale), and verl names ``"cuda"`` there."""
    from verl.utils.device import get_device_name

    device_type = scaler.device_type
    scaler_from_argument(scaler, get_device_name(), _DEVICE)
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    if device_type != "cpu" and is_available is not None and not is_available():
        raise ValueError(
            f"scaler's device type must be available in this process, got: {device_type!r} "
            f"(torch.{device_type}.is_available() is False: a GradScaler({device_type!r}) here is "
            "disabled, fp16 with no loss scale)"
        )


def _new_scaler(device_type: str) -> GradScaler:
    chosen = options().scaler
    scaler = scaler_from_argument(chosen, device_type, _DEVICE)
    return scaler if scaler is not None else GradScaler.from_config(VERL_SCALER, device_type)


# ----------------------------------------------------------------------------- the step's metrics

#: The overflow report's keys of ``GradScaler.metrics()``: in the metrics of the skipped step only.
_OVERFLOW_KEYS = ("distscaler/overflow_step", "distscaler/overflow_tensors")


def _scaler_metrics(scaler: GradScaler, skipped: bool) -> dict[str, float | int]:
    """``distscaler/*`` of one step: ``GradScaler.metrics()`` and the step's skip; after a skip
    every rank must call it (``report_overflow``)."""
    if skipped:
        scaler.report_overflow()
    metrics = scaler.metrics()
    if not skipped:  # verl averages each key over a step's metrics: the report is that step's
        for key in _OVERFLOW_KEYS:
            metrics.pop(key, None)
    metrics[SKIPPED] = float(skipped)
    return metrics


def _checkpoint_file(local_path: str) -> str:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    return os.path.join(local_path, f"distscaler_world_size_{world}_rank_{rank}.pt")


# ----------------------------------------------------------------------------- the engines


class _DistScalerEngine:
    """What every distscaler engine adds to verl's whatever its backend: the step's metrics and
    the LR held on skipped steps. A subclass says where its scaler is and what the current LR is."""

    _distscaler_lr_hold: LRHold

    def _distscaler(self) -> GradScaler | None:
        """The engine's distscaler scaler; None in bf16/fp32 (verl's behaviour, unchanged)."""
        raise NotImplementedError

    def _current_lr(self) -> Any:
        """What verl's ``lr_scheduler_step`` returns, without stepping the scheduler."""
        raise NotImplementedError

    def train_batch(self, data: Any, loss_function: Any) -> Any:
        outputs = super().train_batch(data, loss_function)  # type: ignore[misc]
        scaler = self._distscaler()
        if scaler is not None:
            metrics = _scaler_metrics(scaler, self._distscaler_lr_hold.last_skipped)
            if self.is_mp_src_rank_with_outputs():  # type: ignore[attr-defined]
                outputs["metrics"].update(metrics)
        return outputs

    def lr_scheduler_step(self) -> Any:
        if self._distscaler() is not None:
            held = self._distscaler_lr_hold.hold()  # counts from here on either way
            if held and options().lr_on_skip == "hold":
                return self._current_lr()
        return super().lr_scheduler_step()  # type: ignore[misc]


class DistScalerFSDPEngine(_DistScalerEngine):
    """What distscaler's FSDP engines add to verl's (a mixin placed before verl's class)."""

    scaler: Any
    optimizer: Any
    optimizer_config: Any
    engine_config: Any
    lr_scheduler: Any
    checkpoint_manager: Any
    module: Any

    def _build_fsdp_module(self, module: Any) -> Any:
        module = super()._build_fsdp_module(module)  # type: ignore[misc]
        # verl decides fp16 there: it leaves a ShardedGradScaler in self.scaler, else None.
        if self.scaler is not None and not self.engine_config.forward_only:
            from verl.utils.device import get_device_name

            scaler = _new_scaler(get_device_name())
            # FSDP1: the flat shards' layout. Both: the parameters' module paths, which the
            # overflow report names (FSDP2's DTensors give their layout themselves).
            scaler.register_model(module)
            self.scaler = scaler
        self._distscaler_lr_hold = LRHold()
        return module

    def _distscaler(self) -> GradScaler | None:
        scaler = getattr(self, "scaler", None)
        return scaler if isinstance(scaler, GradScaler) and scaler.is_enabled() else None

    def optimizer_step(self) -> float:
        scaler = self._distscaler()
        if scaler is None:
            return super().optimizer_step()  # type: ignore[misc, no-any-return]
        norm = scaler.clip_grad_norm_(self.optimizer, self.optimizer_config.clip_grad)
        scaler.step(self.optimizer)
        scaler.update()
        if getattr(self, "_qat_enabled", False):  # as verl's optimizer_step
            from verl.utils.qat.core import invalidate_all_scales

            invalidate_all_scales(self.module)
        grad_norm = float(norm.item())
        # The norm is non-finite exactly when the agreed flag is set: no second host read.
        self._distscaler_lr_hold.record(skipped=not math.isfinite(grad_norm))
        return grad_norm

    def _current_lr(self) -> Any:
        return self.lr_scheduler.get_last_lr()[0]  # verl's FSDP engine returns the first group's

    def save_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        super().save_checkpoint(local_path, *args, **kwargs)  # type: ignore[misc]
        scaler = self._distscaler()
        if scaler is None or local_path is None or not self.checkpoint_manager.should_save_extra:
            return
        import torch.distributed as dist

        torch.save({"grad_scaler": scaler.state_dict()}, _checkpoint_file(local_path))
        # verl's own files are complete when its save returns (its closing barrier); the scaler's
        # file is written after that barrier, so one more: on return every rank's file exists.
        dist.barrier()

    def load_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        super().load_checkpoint(local_path, *args, **kwargs)  # type: ignore[misc]
        scaler = self._distscaler()
        if scaler is None or local_path is None or not self.checkpoint_manager.should_load_extra:
            return
        path = _checkpoint_file(local_path)
        if not os.path.exists(path):
            logger.warning(
                "%s: no distscaler state (a checkpoint saved without distscaler); the loss "
                "scale starts from %g",
                path,
                scaler.get_scale(),
            )
            return
        scaler.load_state_dict(torch.load(path, weights_only=True)["grad_scaler"])


# ----------------------------------------------------------------------------- Megatron engines


#: The verl setting that turns Megatron's precision-aware optimizer off (verl turns it on in fp16).
PRECISION_AWARE_OFF = (
    "actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer=False"
)


def _check_standard_fp16_optimizer(optimizer_config: Any) -> None:
    """verl's ``init_megatron_optim_config`` turns Megatron's precision-aware optimizer on in fp16
    unless ``override_optimizer_config`` says otherwise; its gradients live in ``decoupled_grad``,
    which [`distscaler.integrations.megatron.install()`][distscaler.integrations.megatron.install]
    refuses. Say so before anything is built.
    """
    override = getattr(optimizer_config, "override_optimizer_config", None) or {}
    if override.get("use_precision_aware_optimizer", True) is not False:
        raise NotImplementedError(
            "distscaler's Megatron engine needs Megatron's standard fp16 optimizer (fp32 main "
            "gradients); verl turns the precision-aware optimizer on in fp16 by default "
            "(verl/utils/megatron/optimizer.py: init_megatron_optim_config), which "
            "distscaler.integrations.megatron does not support. Add to the verl config: "
            f"{PRECISION_AWARE_OFF} (critic.optim... for a critic)"
        )


class DistScalerMegatronEngine(_DistScalerEngine):
    """What distscaler's Megatron engines add to verl's (a mixin placed before verl's class)."""

    optimizer: Any
    optimizer_config: Any
    param_dtype: Any

    def _build_optimizer(self) -> Any:
        fp16 = self.param_dtype == torch.float16
        if fp16:
            _check_standard_fp16_optimizer(self.optimizer_config)
        optimizer = super()._build_optimizer()  # type: ignore[misc]
        self._distscaler_lr_hold = LRHold()
        self._distscaler_scaler: GradScaler | None = None
        if fp16:
            from . import megatron as ds_megatron

            self._distscaler_scaler = ds_megatron.install(optimizer, scaler=options().scaler)
        return optimizer

    def _distscaler(self) -> GradScaler | None:
        return getattr(self, "_distscaler_scaler", None)

    def _current_lr(self) -> Any:
        from verl.utils.megatron.optimizer import get_megatron_last_lr

        return get_megatron_last_lr(self.optimizer)

    def optimizer_step(self) -> float:
        if self._distscaler() is None:
            return super().optimizer_step()  # type: ignore[misc, no-any-return]
        update_successful, grad_norm, _ = self.optimizer.step()
        self._distscaler_lr_hold.record(skipped=not update_successful)
        return float(grad_norm) if update_successful else math.nan


# ----------------------------------------------------------------------------- the registry

#: stock engine class -> distscaler's, filled by
#: [`install()`][distscaler.integrations.verl.install].
_REPLACEMENTS: dict[type, type] = {}


def _replacements() -> dict[type, type]:
    if _REPLACEMENTS:
        return _REPLACEMENTS
    from verl.workers import engine as engines

    pairs: list[tuple[type, type]] = [
        (engines.FSDPEngineWithLMHead, DistScalerFSDPEngine),
        (engines.fsdp.transformer_impl.FSDPEngineWithValueHead, DistScalerFSDPEngine),
    ]
    # verl's Megatron engines exist when megatron-core imports (verl warns otherwise).
    for name in ("MegatronEngineWithLMHead", "MegatronEngineWithValueHead"):
        stock = getattr(engines, name, None)
        if stock is not None:
            pairs.append((stock, DistScalerMegatronEngine))
    for stock, mixin in pairs:
        ours = type(
            stock.__name__,
            (mixin, stock),
            {
                "__module__": __name__,
                "__doc__": (
                    f"verl's ``{stock.__name__}`` with distscaler's scaler in fp16 (module docstring)."
                ),
            },
        )
        _REPLACEMENTS[stock] = ours
    return _REPLACEMENTS


def _swap(mapping: dict[type, type]) -> int:
    from verl.workers.engine.base import EngineRegistry

    swapped = 0
    for backends in EngineRegistry._engines.values():
        for by_device in backends.values():
            for key, cls in list(by_device.items()):
                if cls in mapping:
                    by_device[key] = mapping[cls]
                    swapped += 1
    return swapped


def install() -> int:
    """Put distscaler's engines in verl's ``EngineRegistry`` in place of the stock FSDP (and
    Megatron) engines, wherever those are registered; idempotent. Runs on import. Returns the
    number of registry entries replaced by this call.

    Cost: a walk over verl's registry in this process (no collective, no device work); engines
    built before the call stay what they are. Relies on verl 0.9.1's ``EngineRegistry._engines``.

    Raises:
        ImportError: verl is not installed.
    """
    return _swap(_replacements())


def uninstall() -> int:
    """Put verl's stock engines back (this process's registry; engines already built stay ours);
    returns the number of entries restored. No collective, no device work."""
    return _swap({ours: stock for stock, ours in _replacements().items()})


def installed(model_type: str = "language_model", backend: str = "fsdp2") -> bool:
    """Whether the engine verl's registry would build for ``model_type``/``backend`` on this
    process's device is distscaler's (verl's lookup: ``get_device_name()``, or
    ``VERL_ENGINE_DEVICE``).

    Raises:
        AssertionError: verl's own, for an unknown ``model_type`` or ``backend``.
        ValueError: verl's, when no engine is registered for this device.
    """
    from verl.workers.engine.base import EngineRegistry

    cls = EngineRegistry.get_engine_cls(model_type, backend)
    return issubclass(cls, _DistScalerEngine)


with requires("verl", f"verl {TESTED_VERSIONS['verl']}", "verl"):
    install()
