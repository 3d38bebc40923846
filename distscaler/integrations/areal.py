"""AReaL's FSDP training engine in fp16 with one agreed dynamic loss scale.

AReaL (tested with 1.0.4) accepts ``dtype: float16`` for its FSDP engine
(``areal/engine/fsdp_engine.py``: FSDP2's ``MixedPrecisionPolicy(param_dtype=float16)``, fp32 master
weights) and trains it with no loss scale: the fp16 backward flushes gradients below 2**-24 to zero,
and ``optimizer_step`` skips a step whose global gradient norm is non-finite (zeroing the
gradients) while AReaL's trainer still steps the LR scheduler after it.

One line, on the engine, in the process that trains (AReaL's SPMD mode, or a script that builds
its engines itself), before or after ``engine.initialize(...)``:

```python
from distscaler.integrations.areal import install

scaler = install(trainer.actor)             # PPOTrainer's actor; install(trainer.critic) too
```

``install`` turns that engine into distscaler's subclass of its own class (``FSDPPPOActor``,
``FSDPPPOCritic``, ``FSDPLMEngine``..., ``isinstance`` checks still hold) with one
[`distscaler.GradScaler`][distscaler.GradScaler] on AReaL's device
(``current_platform.device_type``). On a machine without flash-attn (a CPU), the engine's
config needs ``attn_impl="sdpa"``: AReaL's default, ``"flash_attention_2"``, makes transformers
refuse to build the model. What the engine then does, on every rank:

* **Backward** (``forward_backward_batch``, which ``train_batch`` calls): the loss AReaL
  back-propagates is multiplied by the scale (``scaler.scale(loss)``); forward-only passes
  (``forward_batch``, ``eval_batch``) are unchanged.
* **Step** (``optimizer_step``):
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] with AReaL's
  ``optimizer.gradient_clipping`` (one read pass over the FSDP2 gradient shards, **one**
  ``all_reduce`` of 2 float32 for the overflow flag and the global norm), ``step`` (skipped on every
  rank or none; fused AdamW, AReaL's default, takes ``grad_scale``/``found_inf``), ``update``. On a
  skipped step the gradients are zeroed, as AReaL does. It returns AReaL's dict
  (``update_successful``, ``grad_norm``: the norm before clipping, a float on every step, non-finite
  on a skipped one; ``lr``) plus the scaler's [`metrics()`][distscaler.GradScaler.metrics]
  (``distscaler/scale``...) and ``distscaler/skipped``; AReaL's ``ppo_update`` puts them in its
  stats (``stats_tracker.scalar``). After a skip, one ``all_gather`` attributes it and a warning
  names the rank and parameter. ``optimizer_step`` without a scaled backward since the last step
  (a second call in one iteration, or gradients from a backward outside
  ``forward_backward_batch``) raises [`CallOrderError`][distscaler.CallOrderError] on every rank
  before anything changes: those gradients would be unscaled twice, or unscaled without being
  scaled.
* **LR scheduler held**: ``lr_scheduler_step`` (AReaL's trainer calls it once per RL step, after
  the ``ppo_update`` minibatches) does not step the scheduler when every optimizer step since its
  last step was skipped, so the schedule counts updates that happened.
* **Checkpoints**: ``save``/``load`` with ``with_optim`` (AReaL's recover checkpoints, ``dcp``, and
  ``hf`` with the optimizer) also write/read the scaler's state (scale, growth tracker, skip counts)
  to ``distscaler_world_size_{W}_rank_{R}.pt`` in the checkpoint directory; ``save`` returns once
  every rank's file exists. A checkpoint without it (a stock one) loads with a warning and the scale
  starts from the initial value.

The scaler (``scaler=``): a ``GradScaler`` (on AReaL's device type), a
[`ScalerConfig`][distscaler.ScalerConfig], or a DeepSpeed fp16 config (dict or JSON path; DeepSpeed's
semantics); default ``ScalerConfig()``: initial scale 65536, growth 2 every 2000 clean steps, backoff
0.5. AReaL's ``optimizer.initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window`` and
``hysteresis`` are not read (AReaL 1.0.4's FSDP engine does not read them either).

Not covered, refused by ``install`` before it changes anything: an engine that is not AReaL's FSDP
engine in this process (the Megatron and Archon engines; AReaL's single-controller mode, whose
``trainer.actor`` is a controller and whose engines live in worker processes), ``dtype`` other than
``float16`` (bf16 and fp32 need no loss scale), an engine without an optimizer (a reference model),
``fsdp.per_layer_optim_step`` (AReaL's per-layer optimizer wrapper steps outside the optimizer) and
``fsdp.offload_params`` (gradients on the CPU, the scale on the device). Relied on in AReaL 1.0.4:
``FSDPEngine.forward_backward_batch``, ``optimizer_step``, ``lr_scheduler_step``, ``save``, ``load``,
``initialize``, the attributes ``config``, ``optimizer``, ``optimizer_config``, ``lr_scheduler``,
``model``, ``cpu_group``, ``initialized``, and ``areal.infra.platforms.current_platform``.
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC
from collections.abc import Callable
from typing import Any

import torch

from .. import GradScaler
from ..config import ScalerConfig
from ..errors import CallOrderError
from ._common import subclass
from ._scaler_arg import scaler_from_argument

__all__ = ["AREAL_SCALER", "TESTED_VERSION", "install", "scaler_of"]

#: The AReaL release this module is tested with (CI: ``tests/test_areal.py``).
TESTED_VERSION = "1.0.4"

#: The default scaler settings: torch's (initial scale 65536, growth 2 every 2000 clean steps,
#: backoff 0.5). AReaL's FSDP engine builds no scaler of its own.
AREAL_SCALER = ScalerConfig()

_DEVICE = "AReaL's device (current_platform.device_type)"

logger = logging.getLogger("distscaler")


def _checkpoint_file(path: str) -> str:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    return os.path.join(path, f"distscaler_world_size_{world}_rank_{rank}.pt")


class _DistScalerEngine(ABC):  # noqa: B024 - a mixin; ABC: AReaL's engines' object layout
    """What distscaler adds to AReaL's FSDP engine (a mixin placed before AReaL's class by
    ``install()``; see the module docstring). Derived from ``ABC`` as AReaL's engines are: a
    mixin that is not gives the subclass another object layout, and ``__class__`` cannot be
    assigned."""

    distscaler: GradScaler  # the engine's scaler

    # AReaL's attributes this mixin reads.
    config: Any
    model: Any
    optimizer: Any
    optimizer_config: Any
    lr_scheduler: Any
    cpu_group: Any
    initialized: bool

    _distscaler_backward: bool
    _distscaler_steps: int
    _distscaler_applied: int

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        out = super().initialize(*args, **kwargs)  # type: ignore[misc]
        _check_built(self)
        self.distscaler.register_model(self.model)  # names parameters in the overflow report
        return out

    def forward_backward_batch(
        self, mb_list: Any, process_output_fn: Callable[..., Any], forward_only: bool = False
    ) -> Any:
        if forward_only:
            return super().forward_backward_batch(  # type: ignore[misc]
                mb_list, process_output_fn, forward_only=True
            )
        scaler = self.distscaler

        def scaled(logits: torch.Tensor, ctx: dict[str, Any]) -> Any:
            loss = process_output_fn(logits, ctx)
            return None if loss is None else scaler.scale(loss)

        out = super().forward_backward_batch(mb_list, scaled, forward_only=False)  # type: ignore[misc]
        self._distscaler_backward = True
        return out

    def optimizer_step(self) -> dict[str, float]:
        if not self._distscaler_backward:
            raise CallOrderError(
                "optimizer_step() needs a scaled backward since the last optimizer_step(): "
                "call train_batch() or forward_backward_batch() first (the gradients of this "
                "iteration were already unscaled and stepped, or come from a backward "
                "distscaler did not scale)"
            )
        scaler = self.distscaler
        norm = scaler.clip_grad_norm_(self.optimizer, self.optimizer_config.gradient_clipping)
        scaler.step(self.optimizer)
        scaler.update()
        self._distscaler_backward = False
        grad_norm = float(norm.item())
        # The norm is non-finite exactly when the agreed flag is set: no second host read.
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad()  # AReaL drops the gradients of a skipped step
            scaler.report_overflow()  # every rank: one all_gather; the scaler warns, naming them
        self._distscaler_steps += 1
        self._distscaler_applied += not skipped
        stats: dict[str, float] = {
            "update_successful": float(not skipped),
            "grad_norm": grad_norm,
            "lr": self.lr_scheduler.get_last_lr()[0],
        }
        stats.update({k: float(v) for k, v in scaler.metrics().items()})
        stats["distscaler/skipped"] = float(skipped)
        return stats

    def lr_scheduler_step(self) -> Any:
        held = self._distscaler_steps > 0 and self._distscaler_applied == 0
        self._distscaler_steps = self._distscaler_applied = 0
        if held:
            return None  # AReaL's lr_scheduler_step returns None too
        return super().lr_scheduler_step()  # type: ignore[misc]

    def save(self, meta: Any) -> Any:
        out = super().save(meta)  # type: ignore[misc]
        if meta.with_optim:
            import torch.distributed as dist

            torch.save({"grad_scaler": self.distscaler.state_dict()}, _checkpoint_file(meta.path))
            # AReaL's files are complete when its save returns; the scaler's file is written
            # after that: on return every rank's file exists.
            dist.barrier(group=self.cpu_group)
        return out

    def load(self, meta: Any) -> Any:
        out = super().load(meta)  # type: ignore[misc]
        if meta.with_optim:
            path = _checkpoint_file(meta.path)
            if not os.path.exists(path):
                logger.warning(
                    "%s: no distscaler state (a checkpoint saved without distscaler); the loss "
                    "scale starts from %g",
                    path,
                    self.distscaler.get_scale(),
                )
            else:
                state = torch.load(path, weights_only=True)["grad_scaler"]
                self.distscaler.load_state_dict(state)
        return out


def _check_built(engine: Any) -> None:
    """What ``install`` checks on the config, checked again on what ``initialize`` built."""
    if getattr(engine, "optimizer", None) is None:
        raise ValueError(
            "engine has no optimizer (config.optimizer is None: an inference-only engine, such as "
            "a reference model): nothing to scale"
        )


def _subclass(stock: type) -> type:
    """``stock`` with distscaler's scaler: its subclass made once (`_common.subclass()`)."""
    return subclass(_DistScalerEngine, stock, module=__name__,
                    doc=f"AReaL's ``{stock.__name__}`` with distscaler's scaler (module docstring).")


def _is_controller(engine: Any) -> bool:
    """Whether ``engine`` is one of AReaL's single-controller stand-ins for an engine."""
    from areal.experimental.training_service.controller.controller import (
        GatewayTrainController,
    )
    from areal.infra import TrainController

    return isinstance(engine, (TrainController, GatewayTrainController))


def _check_engine(engine: Any) -> None:
    """Refuse the paths this module does not cover (the module docstring), before any change."""
    try:
        from areal.engine.fsdp_engine import FSDPEngine
    except ImportError as e:
        raise ImportError(
            f"distscaler.integrations.areal needs AReaL {TESTED_VERSION}: pip install "
            "'distscaler[areal]' (in an environment of its own: docs/integrations/areal.md)"
        ) from e

    if not isinstance(engine, FSDPEngine):
        kind = type(engine)
        name = f"{kind.__module__}.{kind.__qualname__}"
        hint = ""
        if _is_controller(engine):
            hint = (
                " (AReaL's single-controller mode: the engines live in worker processes; run in "
                "SPMD mode, AREAL_SPMD_MODE=1, to install on the engine itself)"
            )
        raise TypeError(
            "engine must be AReaL's FSDP engine in this process "
            f"(areal.engine.fsdp_engine.FSDPEngine or a subclass), got: {name}{hint}"
        )
    config = engine.config
    if config.dtype != "float16":
        raise ValueError(
            f"engine.config.dtype must be 'float16' for a loss scale, got: {config.dtype!r} "
            "(bfloat16 and float32 train without one)"
        )
    if engine.optimizer_config is None:
        raise ValueError(
            "engine has no optimizer (config.optimizer is None: an inference-only engine, such as "
            "a reference model): nothing to scale"
        )
    clip = engine.optimizer_config.gradient_clipping
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        raise ValueError(
            "engine.config.optimizer.gradient_clipping must be a number > 0 (math.inf: no "
            f"clipping), got: {clip!r}"
        )
    if config.fsdp.per_layer_optim_step:
        raise NotImplementedError(
            "engine.config.fsdp.per_layer_optim_step=True is not covered: AReaL's per-layer "
            "optimizer wrapper steps outside the optimizer the scaler steps"
        )
    if config.fsdp.offload_params:
        raise NotImplementedError(
            "engine.config.fsdp.offload_params=True is not covered: the gradients live on the "
            "CPU and the scale on the device"
        )


def install(engine: Any, scaler: Any = None) -> GradScaler:
    """Train ``engine`` (AReaL's FSDP engine, ``dtype: float16``) with one agreed dynamic loss
    scale; returns the engine's scaler (also ``engine.distscaler``).

    Before or after ``engine.initialize(...)``; on every rank that holds the engine. Idempotent
    with ``scaler=None`` (the engine's scaler is returned).

    Args:
        engine: an ``areal.engine.fsdp_engine.FSDPEngine`` (``FSDPPPOActor``, ``FSDPPPOCritic``,
            ``FSDPLMEngine``, ``FSDPRWEngine``, ``FSDPDPOEngine`` or a subclass) in this process.
        scaler: a ``GradScaler`` (its device type must be AReaL's,
            ``current_platform.device_type``), a ``ScalerConfig``, a DeepSpeed fp16 config (a
            dict, its ``"fp16"`` section, or a JSON path), or None for `AREAL_SCALER`.

    Cost: no collective, no device work; after ``initialize``, the scaler learns the model's
    parameter names (``register_model``).

    Raises:
        TypeError: ``engine`` is not AReaL's FSDP engine in this process (the Megatron or
            Archon engine, a single-controller ``TrainController``...); ``scaler`` is none of
            the accepted kinds.
        ValueError: ``engine.config.dtype`` is not ``"float16"``; the engine has no optimizer;
            ``scaler`` on another device type, a DeepSpeed config that does not parse or a path
            that is not a file; a second ``install`` with a ``scaler``.
        NotImplementedError: ``fsdp.per_layer_optim_step`` or ``fsdp.offload_params``.
        ImportError: AReaL is not installed.
    """
    _check_engine(engine)
    if isinstance(engine, _DistScalerEngine):
        if scaler is not None:
            raise ValueError(
                "engine already has distscaler's scaler (install() was called on it): pass "
                "scaler= to the first install() only"
            )
        return engine.distscaler
    from areal.infra.platforms import current_platform

    device_type = current_platform.device_type
    built = scaler_from_argument(scaler, device_type, _DEVICE)
    if built is None:
        built = GradScaler.from_config(AREAL_SCALER, device_type)
    if engine.initialized:
        _check_built(engine)
    # Nothing is changed above this line.
    engine.__class__ = _subclass(type(engine))
    engine.distscaler = built
    engine._distscaler_backward = False
    engine._distscaler_steps = engine._distscaler_applied = 0
    if engine.initialized:
        built.register_model(engine.model)
    return built


def scaler_of(engine: Any) -> GradScaler | None:
    """The scaler [`install()`][distscaler.integrations.areal.install] gave ``engine``, or None
    (a stock engine). No collective, no host read."""
    return engine.distscaler if isinstance(engine, _DistScalerEngine) else None
