"""torchtitan in fp16: a Trainer that scales the loss and skips an overflowing step on every rank.

Command line (any torchtitan model config: ``<model>.<config function>``, or a module path):

```bash
torchrun --nproc-per-node 8 -m torchtitan.train \\
    --module distscaler.integrations.torchtitan --config llama3.llama3_8b \\
    --grad_scaler.init_scale 65536 --grad_scaler.growth_interval 2000
```

Or from a config function of your own (``--module my_configs --config llama3_8b_fp16``):

```python
from distscaler.integrations.torchtitan import fp16
from torchtitan.models.llama3.config_registry import llama3_8b

def llama3_8b_fp16():
    return fp16(llama3_8b())            # a DistScalerTrainer.Config
```

What torchtitan 0.3.0 (``trainer.py``) does in fp16 and what
[`DistScalerTrainer`][distscaler.integrations.torchtitan.DistScalerTrainer] changes:

* **fp16.** Its command line takes ``bfloat16``/``float32`` parameters only;
  [`fp16()`][distscaler.integrations.torchtitan.fp16] (and the command line here) sets ``float16``:
  FSDP2's ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``, which torchtitan
  applies through ``fully_shard`` even at shard degree 1.
* **Loss scaling.** No scaler. Its default LLM loss, ``ChunkedLossWrapper``, runs the output layer's
  backward inside the loss call and ignores the gradient reaching its result: with
  ``scaler.scale(loss).backward()`` the gradients would be divided by the scale. Here the loss
  object (a ``ChunkedLossWrapper``'s inner loss) returns
  [`scaled_for_backward()`][distscaler.integrations.torchtitan.scaled_for_backward] of its value:
  the same value, its gradient times the scale; pipeline schedules call that same object.
* **The inf check.** ``train_step`` clips the (scaled) gradients and steps; an inf gradient becomes NaN
  weights and the next step stops the job ("Loss is not finite"). Here
  [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] (the global norm of the
  unscaled gradients, any layout, in the step's one ``all_reduce``), ``step`` and ``update``: every
  rank skips, or none does, and backs off; logged, not raised.
* **Fused optimizers.** ``OptimizersContainer`` holds one optimizer per model part and optimizer
  name. When all take ``grad_scale``/``found_inf`` (``Adam``/``AdamW``/``SGD``/``Adagrad`` with
  ``implementation="fused"``, the default), one inf check covers all their parameters and the
  container's ``step()`` runs with both handed to each: its and their step hooks run as in stock
  (on skipped steps too, as a fused optimizer's do under torch's scaler); no host read. Otherwise
  (``foreach``, ``for-loop``, ``DistMuon``...) the container is the scaler's optimizer: an in-place
  unscale pass and one host read of the agreed flag per step; a skipped step runs no hook.
* **Logs.** torchtitan's metrics logger (console, TensorBoard, W&B) gets
  [`GradScaler.metrics()`][distscaler.GradScaler.metrics] (the keys every integration logs:
  ``distscaler/scale``, ``distscaler/updates``, ``distscaler/skipped_total`` and, after a skip,
  ``distscaler/overflow_step`` and ``distscaler/overflow_tensors``, and once replicated gradients
  were compared the replica check's counts, ``distscaler/replica_checks``,
  ``distscaler/replica_mismatches``, ``distscaler/replica_skipped``, ``distscaler/suspects``:
  [`distscaler.replica_check`][distscaler.replica_check]) and ``distscaler/skipped`` (since the
  last log); a warning names the parameters and ranks
  ([`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow]). The LR
  scheduler steps on skipped steps too (torch's recipe; holding it would cost a host read per step).
* **Checkpoints.** ``Trainer.state_dict`` (torchtitan's ``train_state``) carries the scaler: a
  resume continues with the same scale, tracker and skip counts.

What it relies on in torchtitan 0.3.0 (upstream changes there break it): ``Trainer.train_step``
(overridden whole: batching, token count, loss metrics, optimizer block), ``forward_backward_step``
(called), ``state_dict``/``load_state_dict`` (extended), the loss object reaching the pipeline
schedule and ``ChunkedLossWrapper.loss_fn`` (scaled in place), ``OptimizersContainer.optimizers``/
``step``, ``MetricsProcessor.should_log``/``log(extra_metrics=)``, ``dist_utils.dist_sum``/
``dist_max``/``dist_sum_tensor``, the mesh names ``batch``/``loss``. Tested with torchtitan 0.3.0
and torch 2.13 on CPU processes (gloo, with the shims of ``launch/common/torchtitan_cpu.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._common import TESTED_VERSIONS, LogMetrics, requires, warn_if_untested

with requires(
    "torchtitan",
    "torchtitan (Python >= 3.11)",
    "torchtitan",
    hints={
        "triton": f"torchtitan {TESTED_VERSIONS['torchtitan']} imports triton when it loads "
        "(torchtitan.distributed.minimal_async_ep); install triton (CUDA builds of torch bring it)"
    },
):
    import torchtitan
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.config import TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools import utils as tt_utils
    from torchtitan.tools.logging import logger as tt_logger
    from torchtitan.trainer import Trainer

from .._contract import uses_fused_scaling
from .._scaler import GradScaler
from ..config import ScalerConfig
from ..layouts import GradLayout
from ..policies import get_policy
from ._scaler_arg import scaler_from_argument
from ._torchtitan_loss import scale_loss_fn, scaled_for_backward

__all__ = [
    "TESTED_VERSION",
    "DistScalerTrainer",
    "Fp16TrainingConfig",
    "fp16",
    "scale_loss_fn",
    "scaled_for_backward",
]

#: The torchtitan release this module is written against and tested with.
TESTED_VERSION = TESTED_VERSIONS["torchtitan"]

logger = logging.getLogger(__name__)

warn_if_untested(
    logger,
    "torchtitan",
    torchtitan.__version__,
    "it overrides Trainer.train_step (see its docstring for what an upstream change can break)",
)

# Optimizers whose fused kernels read ``grad_scale``/``found_inf`` per param group whatever the
# constructor's ``fused`` (torchtitan puts ``fused`` into each group, so torch leaves their
# ``_step_supports_amp_scaling`` unset). Source: torch/optim/{adam,sgd,adagrad}.py.
_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


# ----------------------------------------------------------------------------- the optimizer step


class _ContainerStep:
    """The scaler's view of an ``OptimizersContainer`` whose optimizers all take ``grad_scale``:
    one optimizer over all their param groups, so one inf check and one global norm; its ``step``
    runs the container's ``step()`` with the scaler's ``grad_scale``/``found_inf`` on each."""

    _step_supports_amp_scaling = True

    def __init__(self, container: Any) -> None:
        self.container = container

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.container.optimizers for g in opt.param_groups]

    def step(self) -> None:
        handed = {k: v for k, v in vars(self).items() if k in ("grad_scale", "found_inf")}
        inner = self.container.optimizers
        prior = [{k: opt.__dict__[k] for k in handed if k in vars(opt)} for opt in inner]
        for opt in inner:
            for key, value in handed.items():
                setattr(opt, key, value)
        try:
            self.container.step()
        finally:
            for opt, saved in zip(inner, prior):
                for key in handed:
                    if key in saved:
                        setattr(opt, key, saved[key])
                    else:
                        delattr(opt, key)


def _takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    if isinstance(optimizer, _FUSED_CLASSES):
        return all(group.get("fused") for group in optimizer.param_groups)
    return uses_fused_scaling(optimizer)


# ----------------------------------------------------------------------------- the trainer


@dataclass(kw_only=True, slots=True)
class Fp16TrainingConfig(TrainingConfig):
    """torchtitan's ``training`` section with ``float16`` among the parameter dtypes (its default
    here); ``--training.mixed_precision_param`` takes it on the command line."""

    mixed_precision_param: Literal["float16", "bfloat16", "float32"] = "float16"
    """Parameter dtype of FSDP2's ``MixedPrecisionPolicy`` (gradients are reduced in
    ``mixed_precision_reduce``, float32)."""


class DistScalerTrainer(Trainer):
    """torchtitan's ``Trainer`` with a ``distscaler.GradScaler``: fp16 training whose overflowing
    steps every rank skips together (see the module docstring).

    Args:
        config: a
            [`DistScalerTrainer.Config`][distscaler.integrations.torchtitan.DistScalerTrainer.Config]
            ([`fp16()`][distscaler.integrations.torchtitan.fp16] makes one from a
            ``Trainer.Config``).
        scaler: ``None`` (default): a scaler from ``config.grad_scaler``. Or a
            ``distscaler.GradScaler`` (on torchtitan's device type), a ``ScalerConfig``, a DeepSpeed
            config (dict, its ``"fp16"`` section or a JSON path).

    Raises:
        TypeError: ``config`` is not a ``DistScalerTrainer.Config``; ``scaler`` of another type.
        ValueError: ``scaler`` on another device type; ``training.max_norm`` not > 0. Both before
            torchtitan builds anything.

    Attributes:
        grad_scaler: the ``distscaler.GradScaler`` (its process group: the world).
        fused_step: whether every optimizer of ``optimizers`` takes ``grad_scale``/``found_inf``
            (the fused path of the module docstring).

    Cost per step on top of stock torchtitan: the one ``all_reduce`` of 2 float32 over
    the world (in place of the clip's norm reductions) and a few device ops; no host read on the
    fused path. Per logging step: one host read, and after new skips one ``all_gather`` and one
    more read (every rank). Every rank must run the same steps, as in stock torchtitan.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        training: Fp16TrainingConfig = field(default_factory=Fp16TrainingConfig)
        grad_scaler: ScalerConfig = field(default_factory=ScalerConfig)
        """The loss scaler's settings, one flag each (``--grad_scaler.init_scale 65536``...)."""

    config: Config
    grad_scaler: GradScaler

    def __init__(self, config: Config, *, scaler: Any = None) -> None:
        if not isinstance(config, DistScalerTrainer.Config):
            raise TypeError(
                "config must be a DistScalerTrainer.Config (fp16(config) makes one), got: "
                f"{type(config).__qualname__}"
            )
        if not config.training.max_norm > 0:
            raise ValueError(
                "training.max_norm must be > 0 (math.inf: measure only), got: "
                f"{config.training.max_norm!r}"
            )
        # Checked now, before torchtitan builds a model; a new scaler finds WORLD when it first
        # needs it, after init_distributed.
        grad_scaler = scaler_from_argument(
            config.grad_scaler if scaler is None else scaler,
            tt_utils.device_type,
            "torchtitan's device type",
        )
        if grad_scaler is None:
            raise TypeError(
                "config.grad_scaler must be a ScalerConfig when scaler is None, got: None"
            )
        super().__init__(config)
        self.grad_scaler = grad_scaler
        grad_scaler.materialize(self.device)  # pipeline stages without a loss never call scale()
        # A pipeline stage's DTensors live on a mesh without the pp axis: the other stages hold
        # other parameters.
        layout: GradLayout | None = "sharded" if self.parallel_dims.pp_enabled else None
        for part in self.model_parts:
            grad_scaler.register_model(part, grad_layout=layout)
        scale_loss_fn(self.loss_fn, grad_scaler)
        inner = list(self.optimizers.optimizers)
        self.fused_step = bool(inner) and all(_takes_grad_scale(opt) for opt in inner)
        self._scaler_optimizer: Any = (
            _ContainerStep(self.optimizers) if self.fused_step else self.optimizers
        )
        self._log = LogMetrics()
        modules = (m for part in self.model_parts for m in part.modules())
        if not any(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in modules):
            tt_logger.warning(
                "distscaler: no fully_shard module: mixed_precision_param has no effect "
                "(torchtitan applies it through FSDP2's MixedPrecisionPolicy)"
            )
        dtype = config.training.mixed_precision_param
        if dtype != "float16" and get_policy(grad_scaler.config.policy).reacts_to_overflow:
            tt_logger.warning(
                "distscaler: %s parameters need no loss scale; --grad_scaler.policy static "
                "--grad_scaler.init_scale 1 keeps only the agreement on non-finite steps",
                dtype,
            )
        tt_logger.info(
            "distscaler: %r, %s path (%s)",
            grad_scaler,
            "fused" if self.fused_step else "non-fused",
            ", ".join(sorted({type(opt).__name__ for opt in inner})),
        )

    # ------------------------------------------------------------------ the step

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> None:
        """One optimizer step: torchtitan's ``train_step`` with the scaler's clip, step, update
        and inf check in place of its clip, step and abort (module docstring)."""
        training = self.config.training
        self.optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        groups, local_tokens = self._next_batches(data_iterator)
        sl.log_trace_scalar({"local_valid_tokens": int(local_tokens)})  # a host tensor
        if self.parallel_dims.dp_enabled:
            global_tokens = dist_utils.dist_sum_tensor(
                local_tokens.to(self.device), self.parallel_dims.get_mesh("batch")
            )
        else:
            global_tokens = local_tokens.to(self.device)
        loss_sum: torch.Tensor | None = None
        for group in groups:
            inputs = [
                ({k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in x.items()},
                 y.to(self.device))
                for x, y in group
            ]  # fmt: skip
            if self.parallel_dims.pp_enabled:
                kwargs: dict[str, Any] = {
                    "input_dict": [x for x, _ in inputs],
                    "labels": [y for _, y in inputs],
                }
            else:
                kwargs = {"input_dict": inputs[0][0], "labels": inputs[0][1]}
            loss = self.forward_backward_step(global_valid_tokens=global_tokens, **kwargs)
            if should_log:
                loss_sum = (
                    loss.detach().clone() if loss_sum is None else loss_sum.add_(loss.detach())
                )
        scaler = self.grad_scaler
        with sl.log_trace_span("optim"):
            grad_norm = scaler.clip_grad_norm_(self._scaler_optimizer, training.max_norm)
            self.checkpointer.maybe_wait_for_staging()
            scaler.step(self._scaler_optimizer)
            scaler.update()
            self.lr_schedulers.step()
        if should_log:
            assert loss_sum is not None
            self._log_step(loss_sum, local_tokens, global_tokens, grad_norm, lr_metrics)

    def _next_batches(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> tuple[list[list[tuple[dict[str, torch.Tensor], torch.Tensor]]], torch.Tensor]:
        """The step's micro-batches (one group per accumulation step, one per pipeline micro-batch
        in it) and the number of labels that count, on the host."""
        tokens = torch.zeros((), dtype=torch.int64)
        groups = []
        for _ in range(self.gradient_accumulation_steps):
            group = [next(data_iterator) for _ in range(self.num_pipeline_parallel_microbatches)]
            for _, labels in group:
                tokens += (labels != IGNORE_INDEX).sum()
            groups.append(group)
        return groups, tokens

    def _log_step(
        self,
        loss_sum: torch.Tensor,
        local_tokens: torch.Tensor,
        global_tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        lr_metrics: dict[str, Any],
    ) -> None:
        sl.log_trace_scalar({"global_valid_tokens": int(global_tokens)})
        dims = self.parallel_dims
        ntokens_seen: Any = self.ntokens_seen
        if dims.dp_cp_enabled:
            mesh = dims.get_optional_mesh("loss")
            # loss_sum is this rank's summed loss over the global token count: the global mean is
            # the sum over ranks, the largest rank mean is loss_sum * global / local tokens.
            avg_loss = dist_utils.dist_sum(loss_sum, mesh)
            max_loss = dist_utils.dist_max(loss_sum * global_tokens / local_tokens, mesh)
            ntokens_seen = dist_utils.dist_sum(
                torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), mesh
            )
        else:
            avg_loss = max_loss = float(loss_sum.item())
        extra = {"n_tokens_seen": ntokens_seen, **lr_metrics, **self.scaler_metrics()}
        if not math.isfinite(float(avg_loss)):
            if not self.grad_scaler.is_enabled():  # nothing skipped the step: stock's stop
                raise RuntimeError(
                    f"Loss is not finite (global_avg_loss={float(avg_loss)}) at step {self.step}. "
                    "Stopping training."
                )
            # Its gradients were not finite either: every rank skipped the step and backed off.
            tt_logger.warning(
                "step %d: loss is not finite (%s); the optimizer step was skipped on every rank",
                self.step,
                float(avg_loss),
            )
        self.metrics_processor.log(
            self.step, avg_loss, max_loss, float(grad_norm.item()), extra_metrics=extra
        )

    def scaler_metrics(self) -> dict[str, float | int]:
        """The ``distscaler/*`` metrics of this logging step (module docstring):
        [`GradScaler.metrics()`][distscaler.GradScaler.metrics] and ``distscaler/skipped``. After
        new skips it runs [`GradScaler.report_overflow()`][distscaler.GradScaler.report_overflow]
        first, which logs the report (a warning on rank 0, logger ``"distscaler"``): every rank
        must call it at the same step (one ``all_gather`` at world size > 1, only then). One host
        read; after new skips the report's and one more."""
        return self._log.metrics(self.grad_scaler, report=True)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's ``train_state`` plus ``"grad_scaler"``: the scaler's state as plain numbers
        (one host read; absent when the scaler is disabled)."""
        state = super().state_dict()
        if self.grad_scaler.is_enabled():
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore torchtitan's ``train_state`` and the scaler (same scale, tracker, skip counts)."""
        super().load_state_dict(state_dict)
        if "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            self._log.resume(self.grad_scaler)


# ----------------------------------------------------------------------------- configs


def fp16(config: Any, scaler: ScalerConfig | None = None) -> DistScalerTrainer.Config:
    """A [`DistScalerTrainer.Config`][distscaler.integrations.torchtitan.DistScalerTrainer.Config]
    with every section of ``config`` (a torchtitan ``Trainer.Config``; the sections are shared, not
    copied, except ``training``, copied into an
    [`Fp16TrainingConfig`][distscaler.integrations.torchtitan.Fp16TrainingConfig] with
    ``mixed_precision_param="float16"``) and the ``grad_scaler`` section ``scaler`` (default:
    ``config``'s own if it has one, else ``ScalerConfig()``, torch's defaults: initial scale 2**16,
    growth every 2000 clean steps).

    Raises:
        TypeError: ``config`` is not a ``Trainer.Config`` (a config of another trainer class, such
            as ``FluxTrainer.Config``, is refused: its trainer is not this one's base); ``scaler``
            is not a ScalerConfig.
    """
    if not isinstance(config, Trainer.Config) or (
        type(config) is not Trainer.Config and not isinstance(config, DistScalerTrainer.Config)
    ):
        raise TypeError(
            f"config must be a torchtitan Trainer.Config, got: {type(config).__qualname__}"
        )
    if scaler is not None and not isinstance(scaler, ScalerConfig):
        raise TypeError(f"scaler must be a ScalerConfig or None, got: {type(scaler).__name__}")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    training = {
        f.name: getattr(config.training, f.name) for f in dataclasses.fields(TrainingConfig)
    }
    values["training"] = Fp16TrainingConfig(**{**training, "mixed_precision_param": "float16"})
    if scaler is None:
        scaler = getattr(config, "grad_scaler", None) or ScalerConfig()
    return DistScalerTrainer.Config(**values, grad_scaler=scaler)


def _config_function(name: str) -> Callable[[], DistScalerTrainer.Config]:
    """``<model>.<function>`` (a torchtitan model or experiment's config registry) or
    ``<module path>.<function>`` as a config function returning its config in fp16."""
    module_name, _, function = name.rpartition(".")
    candidates = [
        f"torchtitan.models.{module_name}.config_registry",
        f"torchtitan.experiments.{module_name}.config_registry",
        module_name,
    ]
    for candidate in candidates:
        try:
            module = importlib.import_module(candidate)
        except ImportError:
            continue
        base = getattr(module, function, None)
        if callable(base):
            return lambda: fp16(base())
    raise AttributeError(f"--config {name}: no config function {function!r} in any of {candidates}")


def __getattr__(name: str) -> Any:
    # torchtitan's ConfigManager looks the --config name up on this module: a dotted name is a
    # config function of torchtitan (or of a module) turned fp16.
    if "." in name and not name.startswith("_"):
        return _config_function(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
