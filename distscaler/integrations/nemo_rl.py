"""NeMo-RL's DTensor workers (v2) in fp16 with distscaler's scaler: one agreed scale, every rank.

NeMo-RL (tested at commit `TESTED_COMMIT`, version 0.6.0) trains its policy and value models
through DTensor workers (``DTensorPolicyWorkerV2``, ``DTensorValueWorkerV2``: FSDP2 through
NeMo-Automodel). With ``policy.precision: "float16"`` they compute in fp16
(``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``) with **no loss scale**: small
gradients underflow to zero in the fp16 backward, and a step whose gradient norm is inf is taken
anyway (``utils/grad_norm.py`` prints a warning, then ``optimizer.step()`` writes inf/NaN into the
weights on every rank).

The one line, in the script that calls NeMo-RL's GRPO ``setup`` (``examples/run_grpo.py``):

```python
from distscaler.integrations.nemo_rl import policy_factory

policy, ... = setup(master_config, tokenizer, dataset, val_dataset, policy_factory=policy_factory)
```

[`policy_factory()`][distscaler.integrations.nemo_rl.policy_factory] builds NeMo-RL's ``Policy``
with ``worker_extension_cls_fqn=`` `WORKER` (NeMo-RL's own hook for a subclass of its worker)
when the policy trains in fp16 on the DTensor v2 backend, and NeMo-RL's stock ``Policy`` otherwise
(bf16 and fp32 are NeMo-RL's, unchanged). Where a script builds ``Policy(...)`` itself, the same
is ``Policy(..., worker_extension_cls_fqn=WORKER)`` after importing this module; a PPO critic takes
`VALUE_WORKER`. The workers run in NeMo-RL's ``automodel`` environment, which must hold distscaler
too (``uv add distscaler`` in NeMo-RL's checkout; docs/integrations/nemo_rl.md).

What a worker then does in fp16, in its own ``train()`` (NeMo-RL's code, run as written), for each
global batch:

* **Backward**: the loss's gradient is multiplied by the scale (the loss function is wrapped: its
  value, and so every loss metric, is NeMo-RL's unchanged; only the backward is scaled).
* **Clip** (NeMo-RL's call to Automodel's ``scale_grads_and_clip_grad_norm``):
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] with
  ``policy.max_grad_norm`` (``None``: measured, not clipped): one read pass over the fp32 DTensor
  gradient shards and **one** ``all_reduce`` of 2 float32 for the overflow flag and the global
  norm, then the unscale (times the clip coefficient) in place. ``grad_norm`` is that norm on every
  step: the unscaled norm, non-finite exactly when the step is skipped (stock reports ``0.0`` when
  ``max_grad_norm`` is ``None``).
* **Step** (NeMo-RL's ``self.optimizer.step()``): [`GradScaler.step()`][distscaler.GradScaler.step]
  (skipped on every rank or none) and [`update()`][distscaler.GradScaler.update]. A step without
  the clip before it (a second ``optimizer.step()`` in one global batch) raises
  [`CallOrderError`][distscaler.CallOrderError]: it would unscale the gradients a second time. So
  does a second clip or ``unscale_``.
* **LR scheduler held** (default ``lr_on_skip="hold"``): NeMo-RL steps its scheduler once per
  ``train()`` call, after the global batches; it does not step when every optimizer step of the
  call was skipped, so the schedule counts updates that happened. ``"step"``: NeMo-RL's schedule.
* **Metrics**, in ``train()``'s result: ``distscaler/scale`` (the scale for the next step),
  ``distscaler/skipped`` (skipped optimizer steps in the call) and, after a skip,
  ``distscaler/overflow_step`` and ``distscaler/overflow_tensors``, with a warning naming the ranks
  and parameters (one ``all_gather``, only after a skip).
* **Checkpoints**: ``save_checkpoint(..., optimizer_path=..., checkpointing_cfg=...)`` (NeMo-RL's
  save raises without its ``checkpointing_cfg``) also writes the scaler's state
  (scale, growth tracker, skip counts) to ``distscaler_world_size_{W}_rank_{R}.pt`` in
  ``optimizer_path`` and returns once every rank's file exists (one ``barrier``);
  ``load_checkpoint`` and a worker built with ``optimizer_path`` (NeMo-RL's resume) read it. A
  checkpoint without it loads with a warning, the scaler's state left as it is (in a new worker:
  the initial scale).

Settings, in the policy config (``policy.distscaler``, every key optional) or as
``policy_factory``'s keywords (``functools.partial(policy_factory, scaler=...)``):

```yaml
policy:
  distscaler:
    scaler: {fp16: {initial_scale_power: 16, loss_scale_window: 2000}}  # DeepSpeed's fp16 section
    lr_on_skip: hold                                                    # or: step
```

``scaler`` is a ``ScalerConfig``, a DeepSpeed fp16 config (dict or JSON path) or None (default
``ScalerConfig()``: torch's ``GradScaler`` settings); each worker builds its own scaler from it.

Not covered, each refused with a ``NotImplementedError`` naming it when the worker is built:
expert parallelism (``moe_mesh``: Automodel rescales expert gradients), ``cpu_offload``, the
Megatron backend (``policy.megatron_cfg``) and the DTensor v1 worker (``dtensor_cfg._v2: false``)
in fp16 (refused by ``policy_factory``), the data-plane (``TQPolicy``) workers. Relied on at
`TESTED_COMMIT`: ``nemo_rl/models/policy/workers/dtensor_policy_worker_v2.py`` and
``nemo_rl/models/value/workers/dtensor_value_worker_v2.py`` (``__init__``'s ``config`` and
``optimizer_path``, ``train`` calling the module's ``scale_grads_and_clip_grad_norm`` then
``self.optimizer.step()`` per global batch and ``self.scheduler.step()`` once, ``save_checkpoint``
/``load_checkpoint``, the attributes ``dtype``, ``model``, ``optimizer``, ``scheduler``,
``device_mesh``, ``moe_mesh``, ``cpu_offload``), ``models/policy/lm_policy.py``
(``Policy(worker_extension_cls_fqn=...)``) and ``distributed/ray_actor_environment_registry.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import types
from collections.abc import Mapping
from typing import Any

import torch

from .. import GradScaler, ScalerConfig
from ..errors import CallOrderError
from ._common import subclass
from ._scaler_arg import scaler_from_argument

__all__ = [
    "TESTED_COMMIT",
    "TESTED_VERSION",
    "VALUE_WORKER",
    "WORKER",
    "DistScalerWorker",
    "NemoRLScalerOptions",
    "options_from_config",
    "policy_factory",
    "worker_class",
]

#: The NeMo-RL commit this module is tested at (github.com/NVIDIA-NeMo/RL; NeMo-RL is not on PyPI).
TESTED_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
#: ``nemo_rl.__version__`` at `TESTED_COMMIT` (its ``package_info.py``).
TESTED_VERSION = "0.6.0"

#: NeMo-RL's stock DTensor v2 workers, and distscaler's (the names ``worker_extension_cls_fqn``
#: takes; the classes are built on first access, from NeMo-RL's).
STOCK_WORKER = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2"
STOCK_VALUE_WORKER = "nemo_rl.models.value.workers.dtensor_value_worker_v2.DTensorValueWorkerV2"
#: distscaler's policy worker: ``Policy(..., worker_extension_cls_fqn=WORKER)``.
WORKER = f"{__name__}.DTensorPolicyWorkerV2"
#: distscaler's value (critic) worker, for PPO.
VALUE_WORKER = f"{__name__}.DTensorValueWorkerV2"

#: Our default: torch's ``GradScaler`` settings (NeMo-RL has none of its own).
NEMO_RL_SCALER = ScalerConfig()

_LR_ON_SKIP = ("hold", "step")
_CONFIG_KEY = "distscaler"
_OWNER = "the worker's device mesh"
#: The name NeMo-RL's ``train`` calls for the clip, and its inf-norm warning.
_CLIP = "scale_grads_and_clip_grad_norm"
_WARN = "warn_if_inf_grad_norm"

logger = logging.getLogger("distscaler")


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class NemoRLScalerOptions:
    """What a worker uses (``policy.distscaler`` in the config, see the module doc).

    Attributes:
        scaler: a ``ScalerConfig``, a DeepSpeed fp16 config (dict or JSON path; DeepSpeed's
            semantics), or None for `NEMO_RL_SCALER`.
        lr_on_skip: ``"hold"`` (default): the LR scheduler does not step when every optimizer step
            of a ``train()`` call was skipped; ``"step"``: NeMo-RL's stock behaviour.
    """

    scaler: Any = None
    lr_on_skip: str = "hold"


def options_from_config(config: Mapping[str, Any]) -> NemoRLScalerOptions:
    """The options of a NeMo-RL policy (or value) config: its ``distscaler`` entry, if any.

    Args:
        config: the ``policy`` section as NeMo-RL's ``Policy`` gets it (a mapping).

    Cost: validation only (a ``ScalerConfig`` or DeepSpeed config is built once on the CPU and
    dropped; a DeepSpeed JSON path is read). No collective.

    Raises:
        ValueError: ``distscaler`` has a key other than ``scaler`` and ``lr_on_skip``;
            ``lr_on_skip`` is not ``"hold"`` or ``"step"``; a DeepSpeed config that does not
            parse, or a path that is not a file.
        TypeError: ``distscaler`` is not a mapping; ``scaler`` is a ``GradScaler`` (each worker
            process builds its own: pass its ``config``) or none of the accepted kinds.
    """
    entry = config.get(_CONFIG_KEY) if isinstance(config, Mapping) else None
    if entry is None:
        return NemoRLScalerOptions()
    if not isinstance(entry, Mapping):
        raise TypeError(
            f"policy.{_CONFIG_KEY} must be a mapping with the keys 'scaler' and 'lr_on_skip', "
            f"got: {type(entry).__name__}"
        )
    unknown = sorted(set(entry) - {"scaler", "lr_on_skip"})
    if unknown:
        raise ValueError(
            f"policy.{_CONFIG_KEY} has unknown keys {unknown}; valid keys: ['lr_on_skip', 'scaler']"
        )
    options = NemoRLScalerOptions(
        scaler=entry.get("scaler"), lr_on_skip=entry.get("lr_on_skip", "hold")
    )
    _check_options(options, f"policy.{_CONFIG_KEY}")
    return options


def _check_options(options: NemoRLScalerOptions, where: str) -> None:
    if options.lr_on_skip not in _LR_ON_SKIP:
        raise ValueError(
            f"{where}.lr_on_skip must be one of {_LR_ON_SKIP}, got: {options.lr_on_skip!r}"
        )
    if isinstance(options.scaler, GradScaler):
        raise TypeError(
            f"{where}.scaler must be a ScalerConfig, a DeepSpeed fp16 config or None, not a "
            "GradScaler instance: NeMo-RL's workers are separate processes and each builds its "
            "own scaler (pass scaler.config)"
        )
    scaler_from_argument(options.scaler, "cpu", _OWNER)  # validates; nothing kept


# ----------------------------------------------------------------------------- the step's parts


class _StepCounts:
    """Optimizer steps and skips of one ``train()`` call, for the LR hold rule and the metrics."""

    def __init__(self) -> None:
        self.steps = 0
        self.skipped = 0

    def record(self, skipped: bool) -> None:
        self.steps += 1
        self.skipped += skipped

    def hold_lr(self, lr_on_skip: str) -> bool:
        return lr_on_skip == "hold" and self.steps > 0 and self.skipped == self.steps


class _ScaleBackward(torch.autograd.Function):
    """Identity in the forward (the loss and its metrics stay NeMo-RL's); the gradient flowing
    back is multiplied by the scale (a 0-dim float32 tensor on the scaler's device)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.device, grad.dtype), None


class _ScaledLoss:
    """NeMo-RL's loss function with a scaled backward; every attribute is the wrapped one's
    (``input_type``, ``loss_type``... which NeMo-RL reads)."""

    def __init__(self, loss_fn: Any, scaler: GradScaler) -> None:
        self._loss_fn = loss_fn
        self._scaler = scaler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loss_fn, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss, metrics = self._loss_fn(*args, **kwargs)
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return loss, metrics
        # The scale now: a train() call steps once per global batch, and the scale may change.
        scale = self._scaler.scale(torch.ones((), dtype=torch.float32, device=loss.device))
        return _ScaleBackward.apply(loss, scale), metrics


class _ScaledStep:
    """The worker's optimizer during ``train()``: ``step()`` goes through the scaler, everything
    else (``zero_grad``, ``param_groups``...) is the optimizer's."""

    def __init__(self, optimizer: Any, scaler: GradScaler, counts: _StepCounts) -> None:
        self._optimizer = optimizer
        self._scaler = scaler
        self._counts = counts
        self._clipped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def clip(self, max_norm: float, norm_type: float) -> float:
        norm = self._scaler.clip_grad_norm_(self._optimizer, max_norm, norm_type)
        self._clipped = True
        return float(norm.item())

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._clipped:
            raise CallOrderError(
                "optimizer.step() without the gradient clip before it in this global batch "
                f"(NeMo-RL's {_CLIP}): the gradients are already unscaled (a second step) or "
                "were never unscaled; distscaler refuses to unscale them a second time"
            )
        self._clipped = False
        retval = self._scaler.step(self._optimizer, *args, **kwargs)
        self._scaler.update()
        self._counts.record(self._scaler.step_was_skipped)
        return retval


class _HeldScheduler:
    """The worker's LR scheduler during ``train()``: ``step()`` is held when every optimizer step
    of the call was skipped (``lr_on_skip="hold"``)."""

    def __init__(self, scheduler: Any, counts: _StepCounts, lr_on_skip: str) -> None:
        self._scheduler = scheduler
        self._counts = counts
        self._lr_on_skip = lr_on_skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self._counts.hold_lr(self._lr_on_skip):
            return None  # held
        return self._scheduler.step(*args, **kwargs)


def _rebound(fn: Any, replacements: Mapping[str, Any]) -> tuple[Any, Any]:
    """``fn`` with the global names of ``replacements`` bound to them instead of its module's,
    through the decorators NeMo-RL puts around it (``wrap_with_nvtx_name`` keeps the function in
    its closure); the module is not changed. Returns the new function and the original function
    that calls those names (None when none does: then ``fn`` itself is returned)."""
    if not isinstance(fn, types.FunctionType):
        return fn, None
    core = None
    cells = fn.__closure__
    if cells:
        new_cells = []
        for cell in cells:
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                new_cells.append(cell)
                continue
            rebound, inner_core = _rebound(inner, replacements)
            core = core or inner_core
            new_cells.append(types.CellType(rebound) if inner_core is not None else cell)
        cells = tuple(new_cells)
    names = set(fn.__code__.co_names) & set(replacements)
    if names:
        core = fn
    if core is None:
        return fn, None
    globals_ = fn.__globals__
    if names:
        globals_ = dict(globals_)
        globals_.update({name: replacements[name] for name in names})
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new, core


def _checkpoint_file(directory: str) -> str:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    return os.path.join(directory, f"distscaler_world_size_{world}_rank_{rank}.pt")


# ----------------------------------------------------------------------------- the worker


class DistScalerWorker:
    """What distscaler's workers add to NeMo-RL's DTensor v2 workers (a mixin placed before
    NeMo-RL's class; [`worker_class()`][distscaler.integrations.nemo_rl.worker_class] builds the
    pair). In fp16 it owns a [`GradScaler`][distscaler.GradScaler]; in bf16 and fp32 the worker is
    NeMo-RL's, unchanged."""

    dtype: Any
    model: Any
    optimizer: Any
    scheduler: Any
    device_mesh: Any
    moe_mesh: Any
    cpu_offload: Any

    _distscaler_scaler: GradScaler | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)  # type: ignore[misc]
        config = bound.arguments.get("config")
        options = options_from_config(config if config is not None else {})  # before the build
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._distscaler_setup(options, optimizer_path=bound.arguments.get("optimizer_path"))

    def _distscaler_setup(
        self, options: NemoRLScalerOptions, *, optimizer_path: str | None = None
    ) -> None:
        """After NeMo-RL's ``__init__``: the scaler in fp16, the scaled ``train``, a resumed scale.

        Raises:
            NotImplementedError: a path this integration does not cover (module doc).
        """
        self._distscaler_options = options
        self._distscaler_scaler = None
        if self.dtype != torch.float16 or getattr(self, "optimizer", None) is None:
            return  # bf16/fp32, or no optimizer (a reference or inference-only worker)
        if getattr(self, "moe_mesh", None) is not None:
            raise NotImplementedError(
                "distscaler.integrations.nemo_rl does not cover expert parallelism (moe_mesh): "
                f"Automodel's {_CLIP} rescales expert gradients on its own mesh"
            )
        if getattr(self, "cpu_offload", False):
            raise NotImplementedError(
                "distscaler.integrations.nemo_rl does not cover dtensor_cfg.cpu_offload: the "
                "gradients live on the CPU, the scale on the device"
            )
        stock_train = super().train.__func__  # type: ignore[misc]
        # Looked up at each call, so that a subclass's (or a test's) override is the one called.
        train, core = _rebound(
            stock_train,
            {
                _CLIP: lambda *args, **kwargs: self._distscaler_clip(*args, **kwargs),
                _WARN: lambda *args, **kwargs: self._distscaler_warn_if_inf(*args, **kwargs),
            },
        )
        if core is None or _CLIP not in core.__code__.co_names:
            raise NotImplementedError(
                f"{stock_train.__qualname__} does not call {_CLIP}: this integration is written "
                f"against NeMo-RL {TESTED_COMMIT[:12]} (module doc)"
            )
        device_type = self.device_mesh.device_type
        scaler = scaler_from_argument(options.scaler, device_type, _OWNER)
        if scaler is None:
            scaler = GradScaler.from_config(NEMO_RL_SCALER, device_type)
        # The parameters' module paths, which the overflow report names (FSDP2's DTensors give
        # their layout themselves).
        scaler.register_model(self.model)
        self._distscaler_scaler = scaler
        self._distscaler_train = train  # a function: called with the worker first
        self._distscaler_signature = inspect.signature(core)
        self._distscaler_step: _ScaledStep | None = None
        if optimizer_path:
            self._distscaler_load(optimizer_path)

    # -- the parts NeMo-RL's train calls, by the names it calls them

    def _distscaler_clip(
        self,
        max_grad_norm: float | None,
        model_parts: Any,
        *,
        norm_type: float = 2.0,
        pp_enabled: bool = False,
        moe_mesh: Any = None,
        **_: Any,
    ) -> float:
        step = self._distscaler_step
        if step is None:
            raise CallOrderError(f"{_CLIP} called outside distscaler's train()")
        if pp_enabled or moe_mesh is not None:
            raise NotImplementedError(
                "distscaler.integrations.nemo_rl covers neither pipeline nor expert parallelism"
            )
        max_norm = math.inf if max_grad_norm is None else float(max_grad_norm)
        return step.clip(max_norm, norm_type)

    def _distscaler_warn_if_inf(self, grad_norm: Any) -> None:
        """NeMo-RL's ``warn_if_inf_grad_norm`` warns of a step taken on an inf norm; here that
        step is skipped, and distscaler's overflow report names the ranks and parameters."""

    # -- NeMo-RL's methods

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's ``train`` (its arguments), run as NeMo-RL writes it, scaled in fp16.

        In fp16 and not ``eval_mode``: the loss's backward scaled, the clip and the inf check
        distscaler's (one collective), the optimizer step skipped on every rank or none, the LR
        scheduler held when every step of the call was skipped (module doc). Returns NeMo-RL's
        metrics plus ``distscaler/scale``, ``distscaler/skipped`` and, after a skip,
        ``distscaler/overflow_step`` and ``distscaler/overflow_tensors``. Otherwise NeMo-RL's.

        Raises:
            CallOrderError: a second ``optimizer.step()`` or ``unscale_`` in one global batch.
        """
        scaler = self._distscaler_scaler
        if scaler is None:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        bound = self._distscaler_signature.bind(self, *args, **kwargs)
        if bound.arguments.get("eval_mode", False):
            return super().train(*args, **kwargs)  # type: ignore[misc]
        bound.arguments["loss_fn"] = _ScaledLoss(bound.arguments["loss_fn"], scaler)
        counts = _StepCounts()
        optimizer, scheduler = self.optimizer, self.scheduler
        step = _ScaledStep(optimizer, scaler, counts)
        self._distscaler_step = step
        self.optimizer = step
        self.scheduler = _HeldScheduler(scheduler, counts, self._distscaler_options.lr_on_skip)
        try:
            metrics = self._distscaler_train(*bound.args, **bound.kwargs)
        finally:
            self.optimizer, self.scheduler = optimizer, scheduler
            self._distscaler_step = None
        metrics.update(self._distscaler_metrics(scaler, counts))
        return metrics

    def _distscaler_metrics(self, scaler: GradScaler, counts: _StepCounts) -> dict[str, float]:
        metrics = {
            "distscaler/scale": scaler.get_scale(),
            "distscaler/skipped": float(counts.skipped),
        }
        if counts.skipped:
            report = scaler.report_overflow()  # every rank: the skip is agreed
            if report is not None:
                metrics["distscaler/overflow_step"] = float(report.step)
                metrics["distscaler/overflow_tensors"] = float(
                    len(report.entries) + report.unlisted
                )
                logger.warning("%s", report.describe())
        return metrics

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's ``save_checkpoint``; in fp16 with an ``optimizer_path``, also the scaler's
        state in ``distscaler_world_size_{W}_rank_{R}.pt`` there, every rank's file written when it
        returns (one ``barrier``)."""
        out = super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        scaler = self._distscaler_scaler
        bound = inspect.signature(super().save_checkpoint).bind(*args, **kwargs)  # type: ignore[misc]
        optimizer_path = bound.arguments.get("optimizer_path")
        if scaler is None or not optimizer_path:
            return out
        import torch.distributed as dist

        os.makedirs(optimizer_path, exist_ok=True)
        torch.save({"grad_scaler": scaler.state_dict()}, _checkpoint_file(optimizer_path))
        dist.barrier()  # on return every rank's file exists
        return out

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's ``load_checkpoint``; in fp16 with an ``optimizer_path``, also the scaler's
        state (a warning, and the scaler left as it is, when the checkpoint has none)."""
        out = super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]
        bound = inspect.signature(super().load_checkpoint).bind(*args, **kwargs)  # type: ignore[misc]
        optimizer_path = bound.arguments.get("optimizer_path")
        if self._distscaler_scaler is not None and optimizer_path:
            self._distscaler_load(optimizer_path)
        return out

    def _distscaler_load(self, optimizer_path: str) -> None:
        scaler = self._distscaler_scaler
        assert scaler is not None
        path = _checkpoint_file(optimizer_path)
        if not os.path.exists(path):
            logger.warning(
                "%s: no distscaler state (a checkpoint saved without distscaler); the loss "
                "scale starts from %g",
                path,
                scaler.get_scale(),
            )
            return
        scaler.load_state_dict(torch.load(path, weights_only=True)["grad_scaler"])


# ----------------------------------------------------------------------------- the classes


@functools.cache
def worker_class(base: type) -> type:
    """distscaler's worker for NeMo-RL's worker implementation ``base``: the subclass
    ``(DistScalerWorker, base)``, named as ``base``, built once per ``base``.

    ``base`` is NeMo-RL's ``DTensorPolicyWorkerV2Impl`` or ``DTensorValueWorkerV2Impl`` (the
    ``@ray.remote`` classes cannot be subclassed), or a subclass of either. The module's
    ``DTensorPolicyWorkerV2Impl``/``DTensorValueWorkerV2Impl`` are these, and its
    ``DTensorPolicyWorkerV2``/``DTensorValueWorkerV2`` (`WORKER`, `VALUE_WORKER`) the same under
    NeMo-RL's ``ray.remote``.

    Raises:
        TypeError: ``base`` is not a class or has no ``train``.
    """
    if not isinstance(base, type) or not callable(getattr(base, "train", None)):
        raise TypeError(f"base must be a NeMo-RL worker class with train(), got: {base!r}")
    return subclass(DistScalerWorker, base, module=__name__,
                    doc=f"NeMo-RL's ``{base.__name__}`` with distscaler's scaler in fp16 (module doc).")


_STOCK_IMPLS = {
    "DTensorPolicyWorkerV2": (STOCK_WORKER.rsplit(".", 1)[0], "DTensorPolicyWorkerV2Impl"),
    "DTensorValueWorkerV2": (STOCK_VALUE_WORKER.rsplit(".", 1)[0], "DTensorValueWorkerV2Impl"),
}
_BUILT: dict[str, Any] = {}


def _impl(name: str) -> type:
    import importlib

    module_name, impl_name = _STOCK_IMPLS[name]
    return worker_class(getattr(importlib.import_module(module_name), impl_name))


def _remote(name: str) -> Any:
    import ray
    from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker

    # NeMo-RL's own decoration of its workers (both use the policy worker's runtime env).
    return ray.remote(runtime_env=get_runtime_env_for_policy_worker("dtensor_policy_worker_v2"))(
        _impl(name)
    )


def __getattr__(name: str) -> Any:
    """The worker classes, built from NeMo-RL's on first access (NeMo-RL is imported then)."""
    if name in _BUILT:
        return _BUILT[name]
    if name in _STOCK_IMPLS:
        _BUILT[name] = _remote(name)
    elif name.endswith("Impl") and name[: -len("Impl")] in _STOCK_IMPLS:
        _BUILT[name] = _impl(name[: -len("Impl")])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _BUILT[name]


def _register_actor_environments() -> None:
    """NeMo-RL looks the Python environment of an actor up by its class name: ours run where
    NeMo-RL's run (its ``automodel`` environment)."""
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY

    for ours, stock in ((WORKER, STOCK_WORKER), (VALUE_WORKER, STOCK_VALUE_WORKER)):
        if stock in ACTOR_ENVIRONMENT_REGISTRY:
            ACTOR_ENVIRONMENT_REGISTRY.setdefault(ours, ACTOR_ENVIRONMENT_REGISTRY[stock])


def policy_factory(*args: Any, scaler: Any = None, lr_on_skip: str = "hold", **kwargs: Any) -> Any:
    """NeMo-RL's ``Policy(*args, **kwargs)``, its DTensor v2 workers distscaler's in fp16.

    GRPO's ``setup(..., policy_factory=policy_factory)``; the arguments are ``Policy``'s. With
    ``policy.precision: "float16"`` and ``dtensor_cfg._v2: true`` the policy is built with
    ``worker_extension_cls_fqn=WORKER`` and the options in ``config["distscaler"]`` (a copy of the
    config; keywords given here fill what the config leaves out); in any other precision it is
    NeMo-RL's stock ``Policy``.

    Args:
        scaler: a ``ScalerConfig``, a DeepSpeed fp16 config (dict or JSON path) or None
            (`NEMO_RL_SCALER`); ``policy.distscaler.scaler`` in the config wins.
        lr_on_skip: ``"hold"`` or ``"step"``; ``policy.distscaler.lr_on_skip`` wins.

    Raises:
        NotImplementedError: fp16 on the Megatron backend or the DTensor v1 worker.
        ValueError / TypeError: an invalid option (see
            [`options_from_config()`][distscaler.integrations.nemo_rl.options_from_config]), or
            ``worker_extension_cls_fqn`` given too. Raised before anything is built.
    """
    from nemo_rl.models.policy.lm_policy import Policy

    bound = inspect.signature(Policy).bind(*args, **kwargs)
    config = bound.arguments["config"]
    if config.get("precision") != "float16":
        return Policy(*args, **kwargs)
    if bool(config.get("megatron_cfg", {}).get("enabled", False)):
        raise NotImplementedError(
            "distscaler.integrations.nemo_rl covers NeMo-RL's DTensor v2 workers; fp16 on the "
            "Megatron backend (policy.megatron_cfg.enabled) is not covered"
        )
    if not config.get("dtensor_cfg", {}).get("_v2", False):
        raise NotImplementedError(
            "distscaler.integrations.nemo_rl covers NeMo-RL's DTensor v2 workers: set "
            "policy.dtensor_cfg._v2=true (the v1 worker is not covered)"
        )
    if bound.arguments.get("worker_extension_cls_fqn") is not None:
        raise ValueError(
            "worker_extension_cls_fqn must be left out: policy_factory sets it to "
            f"{WORKER!r}, got: {bound.arguments['worker_extension_cls_fqn']!r}"
        )
    entry = dict(config.get(_CONFIG_KEY) or {})
    entry.setdefault("scaler", scaler)
    entry.setdefault("lr_on_skip", lr_on_skip)
    config = {**config, _CONFIG_KEY: entry}
    options_from_config(config)  # validated here, before any worker starts
    _register_actor_environments()
    bound.arguments["config"] = config
    bound.arguments["worker_extension_cls_fqn"] = WORKER
    return Policy(*bound.args, **bound.kwargs)


def _import_hook() -> None:
    try:
        _register_actor_environments()
    except ImportError:  # NeMo-RL is not installed here
        pass


_import_hook()
