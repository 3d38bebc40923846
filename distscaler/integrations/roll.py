"""ROLL's FSDP2 training strategy in fp16 with one agreed dynamic loss scale.

ROLL (alibaba/ROLL; not on PyPI, where ``roll`` is an unrelated HTTP framework; tested with its
source at version `TESTED_VERSION`, ``roll/distributed/strategy/fsdp2_strategy.py`` of sha256
`TESTED_SOURCE_SHA256`) trains ``strategy_name: fsdp2_train`` in fp16 when
``strategy_config.param_dtype`` is ``fp16``: ``FSDP2TrainStrategy.initialize`` then builds torch's
``ShardedGradScaler(growth_interval=400)``, and ``train_step`` runs, at each gradient-sync
boundary, ``scaler.unscale_(optimizer)`` (its own ``all_reduce`` of the inf flag on the default,
WORLD, group), ``_clip_grad_norm`` (``torch.nn.utils.clip_grad_norm_`` over the DTensor
gradients: a second collective), ``scaler.step(optimizer)`` and ``scaler.update()``, and nothing
else: ROLL's fp16 branch neither steps the LR scheduler nor zeroes the gradients (its bf16/fp32
branch does both), so in fp16 the learning rate stays at its first value and each step's
gradients are added to the previous step's, which were already unscaled and are divided by the
scale again. The scale is not in ROLL's checkpoint: a resumed run starts again from 65536.

The one line, where ROLL builds its strategies (its ``create_strategy`` factory has no registry:
the worker modules import it; in a worker of your own, the ``worker_cls`` ROLL's config names):

```python
from distscaler.integrations.roll import create_strategy  # was: from roll.distributed.strategy.factory import create_strategy
```

[`create_strategy()`][distscaler.integrations.roll.create_strategy] is ROLL's, plus
[`install()`][distscaler.integrations.roll.install] on an ``fsdp2_train`` strategy whose
``strategy_config.param_dtype`` is fp16 (any other strategy is returned as ROLL built it).
``install(strategy)`` itself, before or after ``strategy.initialize(...)``, does the same on one
strategy. The strategy becomes distscaler's subclass of its own class (``isinstance`` checks still
hold), with one [`distscaler.GradScaler`][distscaler.GradScaler] on ROLL's device
(``current_platform.device_type``) in place of the ``ShardedGradScaler``. In ROLL's own
``train_step``, on every rank:

* **Backward**: ``scaler.scale(loss).backward()`` as stock.
* **Step** (the sync boundary): ``scaler.unscale_`` marks the step; ``_clip_grad_norm`` is
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] with ROLL's
  ``max_grad_norm`` (one read pass over the FSDP2 gradient shards, **one** ``all_reduce`` of 2
  float32 for the overflow flag and the global norm; nothing replicated: no replica check);
  ``scaler.step`` is skipped on every rank or none; ``scaler.update`` updates the scale, then
  steps ROLL's LR scheduler (**held** on a skipped step) and zeroes the gradients, as ROLL's bf16
  branch does. ``grad_norm`` in ROLL's metrics is the norm before clipping on every step, a number
  on a clean one and non-finite (inf or NaN) on a skipped one; ``train_step`` adds the scaler's
  [`metrics()`][distscaler.GradScaler.metrics] (``distscaler/scale``...) and
  ``distscaler/skipped``. After a skip, one ``all_gather`` attributes it and a warning names the
  rank and the parameter by its name in ROLL's model.
* **No double unscale**: a second ``scaler.unscale_`` since the last ``update()``, or one without a
  scaled backward since then, raises [`CallOrderError`][distscaler.CallOrderError] before any
  gradient changes.
* **Checkpoints**: ``save_checkpoint`` (unless ``save_only_model``) writes the scaler's state
  (scale, growth tracker, skip counts) to ``distscaler_world_size_{W}_rank_{R}.pt`` in the
  checkpoint directory, before ROLL's own files (ROLL may upload and remove the directory once they
  are written); ``load_checkpoint`` reads it back. A checkpoint without it (a stock one) loads with
  a warning and the scale starts from the initial value.

The scaler (``scaler=``): a ``GradScaler`` (on ROLL's device type), a
[`ScalerConfig`][distscaler.ScalerConfig], or a DeepSpeed fp16 config (dict or JSON path;
DeepSpeed's semantics); default `ROLL_SCALER`, ROLL's own settings.

Not covered, refused with ``NotImplementedError``: expert parallelism (``ep_size > 1``: ROLL's own
clip divides the expert gradients first) and ``offload_policy`` (the gradients on the CPU, the
scale on the device); ``ValueError`` for a strategy that does not train in fp16. ROLL's Megatron
strategy (``megatron_train``) is not covered here. Relied on in ROLL `TESTED_VERSION`:
``FSDP2TrainStrategy.initialize``, ``train_step`` (its calls of ``self.scaler``: ``scale``,
``unscale_``, ``step``, ``update``, and of ``self._clip_grad_norm(max_norm=...)``),
``_clip_grad_norm``, ``save_checkpoint``, ``load_checkpoint``, the attributes ``worker``,
``worker_config``, ``param_dtype``, ``scaler``, ``optimizer``, ``scheduler``, ``model``,
``ep_enabled``, ``cpu_offload_enabled``, ``save_only_model``,
``roll.distributed.strategy.factory.create_strategy`` and ``roll.platforms.current_platform``.
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC
from typing import Any

import torch

from .. import GradScaler
from ..config import ScalerConfig
from ..errors import CallOrderError
from ._common import subclass
from ._scaler_arg import scaler_from_argument

__all__ = [
    "ROLL_SCALER",
    "TESTED_SOURCE_SHA256",
    "TESTED_VERSION",
    "create_strategy",
    "install",
    "scaler_of",
]

#: The ROLL version this module is tested with (``setup.py`` of its source; CI: tests/test_roll.py).
TESTED_VERSION = "0.3.0"
#: sha256 of the tested ``roll/distributed/strategy/fsdp2_strategy.py`` (the source carried no git
#: metadata; docs/integrations/roll.md).
TESTED_SOURCE_SHA256 = "1958d26dac29e2c79a1e9c46d7054682ee1a5d170bad88580c4cee99859e76ae"

#: ROLL's own scaler settings (``ShardedGradScaler(growth_interval=400)``: initial scale 65536,
#: growth 2 every 400 clean steps, backoff 0.5).
ROLL_SCALER = ScalerConfig(growth_interval=400)

#: ROLL's name of the strategy this module covers (its factory's key and the class's
#: ``strategy_name``).
STRATEGY_NAME = "fsdp2_train"

_DEVICE = "ROLL's device (current_platform.device_type)"
_FP16 = ("fp16", "float16", "half")

logger = logging.getLogger("distscaler")


def _device_type() -> str:
    try:
        from roll.platforms import current_platform
    except ImportError:  # ROLL's platform detection, for a strategy that is not ROLL's own
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(current_platform.device_type)


def _checkpoint_file(path: str) -> str:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    return os.path.join(path, f"distscaler_world_size_{world}_rank_{rank}.pt")


class _StepScaler:
    """What ROLL's ``train_step`` calls as ``self.scaler`` (``scale``, ``unscale_``, ``step``,
    ``update``), on distscaler's scaler; ``update`` ends the step as ROLL's bf16 branch does."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.scaler: GradScaler = strategy.distscaler
        self.backward = False  # a scaled backward since the last update()
        self.unscaled = False  # unscale_ called since the last update()
        self.norm: torch.Tensor | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.backward = True
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: Any) -> None:
        if self.unscaled:
            raise CallOrderError(
                "unscale_() has already been called on this optimizer since the last update(): "
                "its gradients would be unscaled twice"
            )
        if not self.backward:
            raise CallOrderError(
                "unscale_() needs a scaled backward since the last update(): these gradients "
                "were already unscaled and stepped, or come from a backward distscaler did not scale"
            )
        self.unscaled = True  # the unscale itself is in _clip_grad_norm's one pass

    def clip(self, optimizer: Any, max_norm: Any) -> torch.Tensor:
        if not self.unscaled:
            self.unscale_(optimizer)
        clip = math.inf if max_norm is None or max_norm <= 0 else float(max_norm)
        self.norm = self.scaler.clip_grad_norm_(optimizer, clip)
        return self.norm

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.norm is None:  # train_step always clips first; a step without: check now
            self.clip(optimizer, None)
        return self.scaler.step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        strategy, scaler = self.strategy, self.scaler
        scaler.update(new_scale)
        norm, self.norm = self.norm, None
        self.backward = self.unscaled = False
        # The norm is non-finite exactly when the agreed flag is set (ROLL already read it).
        skipped = norm is not None and not math.isfinite(float(norm.item()))
        strategy._distscaler_skips += skipped
        if skipped:
            scaler.report_overflow()  # every rank: one all_gather; the scaler warns, naming them
        else:
            strategy.scheduler.step()  # held on a skipped step
        strategy.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.scaler.load_state_dict(state_dict)

    def get_scale(self) -> float:
        return self.scaler.get_scale()


class _DistScalerStrategy(ABC):  # noqa: B024 - a mixin; ABC: ROLL's strategies' base
    """What distscaler adds to ROLL's ``FSDP2TrainStrategy`` (a mixin placed before ROLL's class
    by ``install()``; see the module docstring)."""

    distscaler: GradScaler
    _distscaler_skips: int
    _distscaler_logged: int

    # ROLL's attributes this mixin reads.
    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    param_dtype: Any
    save_only_model: bool

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        out = super().initialize(*args, **kwargs)  # type: ignore[misc]
        _attach(self)
        return out

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        scaler = self.scaler
        if not isinstance(scaler, _StepScaler):  # not initialized through install's path
            return super()._clip_grad_norm(max_norm)  # type: ignore[misc,no-any-return]
        return scaler.clip(self.optimizer, max_norm)

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        metrics = super().train_step(*args, **kwargs)  # type: ignore[misc]
        if isinstance(metrics, dict):
            skips, self._distscaler_logged = (
                self._distscaler_skips - self._distscaler_logged,
                self._distscaler_skips,
            )
            metrics.update({k: float(v) for k, v in self.distscaler.metrics().items()})
            metrics["distscaler/skipped"] = float(skips)
        return metrics

    def save_checkpoint(self, save_dir: str, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "save_only_model", False):
            os.makedirs(save_dir, exist_ok=True)
            torch.save({"grad_scaler": self.distscaler.state_dict()}, _checkpoint_file(save_dir))
        return super().save_checkpoint(save_dir, *args, **kwargs)  # type: ignore[misc]

    def load_checkpoint(self, load_dir: str, *args: Any, **kwargs: Any) -> Any:
        out = super().load_checkpoint(load_dir, *args, **kwargs)  # type: ignore[misc]
        path = _checkpoint_file(load_dir)
        if not os.path.exists(path):
            logger.warning(
                "%s: no distscaler state (a checkpoint saved without distscaler); the loss scale "
                "starts from %g",
                path,
                self.distscaler.get_scale(),
            )
        else:
            self.distscaler.load_state_dict(torch.load(path, weights_only=True)["grad_scaler"])
            self._distscaler_skips = self._distscaler_logged = 0
        return out


def _attach(strategy: Any) -> None:
    """After ROLL's ``initialize``: check what it built, put the step scaler in place."""
    if strategy.param_dtype != torch.float16:
        raise ValueError(
            "strategy must train in fp16 (strategy_config.param_dtype: fp16) for a loss scale, "
            f"got param_dtype {strategy.param_dtype} (bf16 and fp32 train without one)"
        )
    if getattr(strategy, "ep_enabled", False):
        raise NotImplementedError(
            "expert parallelism (strategy_config.ep_size > 1) is not covered: ROLL's clip of the "
            "expert gradients divides them by ep_size before the norm"
        )
    if getattr(strategy, "cpu_offload_enabled", False):
        raise NotImplementedError(
            "strategy_config.offload_policy is not covered: the gradients live on the CPU and the "
            "scale on the device"
        )
    if getattr(strategy, "optimizer", None) is None:
        raise ValueError("strategy has no optimizer: nothing to scale")
    strategy.scaler = _StepScaler(strategy)
    # The overflow report's names (DTensor gradients need no registered layout). ROLL's
    # load_states/offload_states move the model with model.to() (a swap of each DTensor
    # parameter), which the scaler's tables allow: they hold no weak reference to a parameter.
    strategy.distscaler.register_model(strategy.model)


def _strategy_config(strategy: Any) -> dict[str, Any]:
    return dict(strategy.worker_config.strategy_args.strategy_config or {})


def _configured_fp16(strategy: Any) -> bool:
    dtype = _strategy_config(strategy).get("param_dtype")
    if isinstance(dtype, torch.dtype):
        return dtype == torch.float16
    return isinstance(dtype, str) and dtype.lower() in _FP16


def _check_strategy(strategy: Any) -> None:
    """Refuse what this module does not cover, before any change."""
    kind = type(strategy)
    if getattr(kind, "strategy_name", None) != STRATEGY_NAME or not all(
        callable(getattr(strategy, m, None))
        for m in (
            "initialize",
            "train_step",
            "_clip_grad_norm",
            "save_checkpoint",
            "load_checkpoint",
        )
    ):
        raise TypeError(
            "strategy must be ROLL's FSDP2 training strategy "
            "(roll.distributed.strategy.fsdp2_strategy.FSDP2TrainStrategy, strategy_name "
            f"'fsdp2_train'), got: {kind.__module__}.{kind.__qualname__}"
        )
    initialized = getattr(strategy, "optimizer", None) is not None
    if not initialized and not _configured_fp16(strategy):
        raise ValueError(
            "strategy must train in fp16 (strategy_config.param_dtype: fp16) for a loss scale, "
            f"got param_dtype {_strategy_config(strategy).get('param_dtype')!r} (bf16 and fp32 "
            "train without one)"
        )
    config = _strategy_config(strategy)
    if int(config.get("ep_size", 1) or 1) > 1:
        raise NotImplementedError(
            "expert parallelism (strategy_config.ep_size > 1) is not covered: ROLL's clip of the "
            "expert gradients divides them by ep_size before the norm"
        )
    if config.get("offload_policy", False):
        raise NotImplementedError(
            "strategy_config.offload_policy is not covered: the gradients live on the CPU and the "
            "scale on the device"
        )


def _subclass(stock: type) -> type:
    """``stock`` with distscaler's scaler: its subclass made once (`_common.subclass()`)."""
    return subclass(_DistScalerStrategy, stock, module=__name__,
                    doc=f"ROLL's ``{stock.__name__}`` with distscaler's scaler (module docstring).")


def install(strategy: Any, scaler: Any = None) -> GradScaler:
    """Train ``strategy`` (ROLL's ``FSDP2TrainStrategy``, fp16) with one agreed dynamic loss scale;
    returns its scaler (also ``strategy.distscaler``).

    Before or after ``strategy.initialize(...)``, on every rank that holds the strategy. Idempotent
    with ``scaler=None`` (the strategy's scaler is returned).

    Args:
        strategy: ROLL's ``FSDP2TrainStrategy`` (``strategy_name`` ``"fsdp2_train"``) or a subclass.
        scaler: a ``GradScaler`` (its device type must be ROLL's,
            ``current_platform.device_type``), a ``ScalerConfig``, a DeepSpeed fp16 config (a dict,
            its ``"fp16"`` section, or a JSON path), or None for `ROLL_SCALER`.

    Cost: no collective, no device work.

    Raises:
        TypeError: ``strategy`` is not ROLL's FSDP2 training strategy; ``scaler`` is none of the
            accepted kinds.
        ValueError: the strategy does not train in fp16 (``strategy_config.param_dtype``; after
            ``initialize``, the ``param_dtype`` it set up); it has no optimizer; ``scaler`` on
            another device type, a DeepSpeed config that does not parse or a path that is not a
            file; a second ``install`` with a ``scaler``.
        NotImplementedError: ``ep_size > 1`` or ``offload_policy``.
    """
    _check_strategy(strategy)
    if isinstance(strategy, _DistScalerStrategy):
        if scaler is not None:
            raise ValueError(
                "strategy already has distscaler's scaler (install() was called on it): pass "
                "scaler= to the first install() only"
            )
        return strategy.distscaler
    device_type = _device_type()
    built = scaler_from_argument(scaler, device_type, _DEVICE)
    if built is None:
        built = GradScaler.from_config(ROLL_SCALER, device_type)
    initialized = getattr(strategy, "optimizer", None) is not None
    if initialized:  # what _attach checks, before any change
        if strategy.param_dtype != torch.float16:
            raise ValueError(
                "strategy must train in fp16 (strategy_config.param_dtype: fp16) for a loss "
                f"scale, got param_dtype {strategy.param_dtype} (bf16 and fp32 train without one)"
            )
        if getattr(strategy, "ep_enabled", False) or getattr(
            strategy, "cpu_offload_enabled", False
        ):
            raise NotImplementedError(
                "expert parallelism and offload_policy are not covered (module docstring)"
            )
    # Nothing is changed above this line.
    strategy.__class__ = _subclass(type(strategy))
    strategy.distscaler = built
    strategy._distscaler_skips = strategy._distscaler_logged = 0
    if initialized:
        _attach(strategy)
    return built


def create_strategy(worker: Any, sync_wrapper: bool = False) -> Any:
    """ROLL's ``roll.distributed.strategy.factory.create_strategy``, with
    [`install()`][distscaler.integrations.roll.install] on an ``fsdp2_train`` strategy whose
    ``strategy_config.param_dtype`` is fp16; any other strategy is returned as ROLL built it.

    Args:
        worker: the ROLL worker building its strategy (``worker.worker_config.strategy_args``).
        sync_wrapper: ROLL's argument (its async inference strategies), passed on.

    Raises:
        ImportError: ROLL is not importable.
        NotImplementedError: what ``install`` refuses (``ep_size > 1``, ``offload_policy``).
    """
    try:
        from roll.distributed.strategy.factory import create_strategy as rolls
    except ImportError as e:
        raise ImportError(
            f"distscaler.integrations.roll.create_strategy needs ROLL {TESTED_VERSION} importable "
            "(its source on the path: docs/integrations/roll.md)"
        ) from e
    strategy = rolls(worker, sync_wrapper=sync_wrapper)
    if (
        getattr(type(strategy), "strategy_name", None) == STRATEGY_NAME
        and not sync_wrapper
        and _configured_fp16(strategy)
    ):
        install(strategy)
    return strategy


def scaler_of(strategy: Any) -> GradScaler | None:
    """The scaler [`install()`][distscaler.integrations.roll.install] gave ``strategy``, or None
    (a stock strategy). No collective, no host read."""
    return strategy.distscaler if isinstance(strategy, _DistScalerStrategy) else None
