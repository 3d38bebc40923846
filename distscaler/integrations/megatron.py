"""Megatron-core in fp16 with one loss scale for every sub-optimizer, agreed in one collective.

Megatron-core's fp16 path builds one ``DynamicGradScaler`` per sub-optimizer: what
``get_megatron_optimizer`` returns for a mixture-of-experts model is a ``ChainedOptimizer`` of a
dense and an expert optimizer, each unscaling, checking and updating its own scale. The chain ORs
their flags, so every rank skips together, but each scaler backs off on its own flag: after an
overflow in the expert gradients only, the scales split ([8, 4]), the loss is scaled by the first
one's (``ChainedOptimizer.get_loss_scale``) and the expert gradients are unscaled by the other's,
2x too large from then on. It also costs one ``all_reduce`` and one host read per sub-optimizer per
step, plus the norm's own ``all_reduce``.

[`install()`][distscaler.integrations.megatron.install] puts one
[`distscaler.GradScaler`][distscaler.GradScaler] behind the whole chain, on every rank, before the
first step:

```python
from megatron.core.optimizer import get_megatron_optimizer
from distscaler.integrations import megatron as ds_megatron

optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
ds_megatron.install(optimizer)          # scaler=None: policy="megatron" from the config
```

and nothing else changes: the training loop still calls ``optimizer.scale_loss(loss)`` (or
``config.grad_scale_func``), ``optimizer.step()`` and ``optimizer.zero_grad()``.

What a step does then (``optimizer.step()``, every rank must call it, as stock):

1. every sub-optimizer copies its model gradients to its main gradients (Megatron's own
   ``_copy_model_grads_to_main_grads``);
2. [`GradScaler.clip_grad_norm_()`][distscaler.GradScaler.clip_grad_norm_] over the main gradients
   of **all** sub-optimizers at once: one read pass, **one** ``all_reduce`` of two float32 over the
   world for the overflow flag and the global norm, then the unscale (times the clip coefficient
   when ``clip_grad > 0``) in place; ``clip_grad == 0`` measures the norm only;
3. one host read of the agreed flag (Megatron's ``step()`` returns a Python bool), and one of the
   norm (it returns a Python float);
4. the scale is updated once, by the policy, for every sub-optimizer;
5. unless skipped: Megatron's ``step_with_ready_grads`` (the inner optimizers' steps, main to
   model parameter copies); ``count_zeros`` when ``log_num_zeros_in_grad`` (its own collective,
   as stock).

Every sub-optimizer's ``grad_scaler`` becomes a view of the one scale
([`SharedGradScaler`][distscaler.integrations.megatron.SharedGradScaler]): ``get_loss_scale()``,
``scale_loss()`` and the checkpoints read it, so a checkpoint keeps Megatron's keys (``{"scale",
"growth_tracker", "hysteresis_tracker"}`` per sub-optimizer, one value for all) and loads into stock
Megatron; a stock checkpoint loads here, and a chained one whose scales differ loads the smallest
scale with its trackers, with a warning (the largest would overflow the sub-optimizer whose scale
had backed off).

The norm weights each rank's ``sum |g|**2`` by ``|G| / world_size``, ``G`` being the sub-optimizer's
grad-stats group (``get_grad_stats_parallel_group()``: the model-parallel group for the
non-distributed optimizer, the data-parallel ranks sharing a shard's optimizer for the distributed
one): Megatron's norm over ``G`` counts each value once, and the world holds
``world_size / |G|`` copies of ``G``. Parameters Megatron leaves out of its norm (shared copies,
tensor-parallel and GTP duplicates: ``MegatronOptimizer._filter_grads_for_norm``) weigh 0 and
still count for the overflow flag.

Not supported, each refused by [`install()`][distscaler.integrations.megatron.install] with a
``NotImplementedError`` that names it (never a silent split): the precision-aware optimizer
(``use_precision_aware_optimizer``: gradients in ``decoupled_grad``), Megatron-FSDP
(``use_megatron_fsdp``), MIMO's per-module optimizer (``MimoOptimizer``), the layer-wise distributed
optimizer, CPU offloading (``optimizer_cpu_offload``), separate grad-norm groups (MTP),
sub-optimizers without a grad scaler (bf16, fp32).

Relied on in megatron-core (tested with 0.19.2): ``optimizer/optimizer.py``:
``ChainedOptimizer.chained_optimizers``, ``MixedPrecisionOptimizer.grad_scaler``/``step``/
``step_with_ready_grads``, ``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``
(``DistributedOptimizer``'s in ``optimizer/distrib_optimizer.py``), ``MegatronOptimizer.
get_parameters``/``get_grad_stats_parallel_group``/``count_zeros``, ``state_dict``'s
``"grad_scaler"`` entry; ``optimizer/grad_scaler.py``: ``MegatronGradScaler``;
``transformer/module.py``: ``param_is_not_shared``, ``tensor_parallel.param_is_not_tensor_parallel_duplicate``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from . import _common
from ._common import INSTALLED, TESTED_VERSIONS, requires

with requires("megatron", f"megatron-core {TESTED_VERSIONS['megatron-core']}", "megatron"):
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.grad_scaler import MegatronGradScaler
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        MegatronOptimizer,
        MixedPrecisionOptimizer,
    )
    from megatron.core.transformer.module import param_is_not_shared

from .._scaler import GradScaler
from ..config import ScalerConfig
from ..policies import get_policy
from ._scaler_arg import scaler_from_argument

__all__ = ["MegatronBinding", "SharedGradScaler", "install", "installed_scaler", "scaler_config"]

#: The megatron-core version the tests ran (``pip install distscaler[megatron]``).
TESTED_VERSION = TESTED_VERSIONS["megatron-core"]


def scaler_config(config: Any) -> ScalerConfig:
    """The [`ScalerConfig`][distscaler.config.ScalerConfig] of Megatron's own grad scaler for
    ``config``.

    Megatron's ``get_megatron_optimizer`` rule: ``loss_scale`` set: a constant scale
    (``policy="static"``); otherwise ``DynamicGradScaler(initial_loss_scale, min_loss_scale,
    growth_factor=2.0, backoff_factor=0.5, growth_interval=loss_scale_window, hysteresis)``, which
    is ``policy="megatron"``.

    Args:
        config: a ``megatron.core.optimizer.OptimizerConfig`` (its fp16 fields are read).

    Raises:
        ValueError: a field out of the scaler's range (all problems in one message).
    """
    if config.loss_scale:
        return ScalerConfig(init_scale=float(config.loss_scale), policy="static")
    return ScalerConfig(
        init_scale=float(config.initial_loss_scale),
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=int(config.loss_scale_window),
        min_scale=float(config.min_loss_scale),
        policy="megatron",
        hysteresis=int(config.hysteresis),
    )


class SharedGradScaler(MegatronGradScaler):
    """A sub-optimizer's ``grad_scaler``: a view of the one
    [`distscaler.GradScaler`][distscaler.GradScaler].

    Megatron reads ``scale`` (``get_loss_scale``, ``scale_loss``; float32, shape ``(1,)``, on the
    scaler's device, a view that follows every update, no copy) and ``inv_scale``, and saves
    ``state_dict()``. ``update`` is never what moves the scale: the binding updates the one scaler
    once per step.
    """

    def __init__(self, binding: MegatronBinding) -> None:  # no super(): it makes a CUDA tensor
        self._binding = binding

    @property
    def scale(self) -> torch.Tensor:
        """The one scale
        ([`MegatronBinding.scale_tensor()`][distscaler.integrations.megatron.MegatronBinding.scale_tensor])."""
        return self._binding.scale_tensor()

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` computed in float64, as Megatron's (a new float32 tensor of shape ``(1,)``)."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """No-op: the one scale is updated by the binding's ``prepare_grads``."""

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (one host read); ``{}`` for a constant scale, as ``ConstantGradScaler``."""
        return self._binding.megatron_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load Megatron's (or distscaler's) scaler state into the one scaler."""
        self._binding.load_sub_state(state_dict)


class _MainGrads:
    """The scaler's view of every sub-optimizer's main parameters: one "optimizer" whose
    ``step`` only records that the agreed ``found_inf`` let the step run (Megatron's ``step_with_ready_grads``
    runs after, so that ``prepare_grads`` and ``step`` keep their contracts)."""

    _step_supports_amp_scaling = False  # the flag is read on the host anyway (step() returns it)

    def __init__(self, subs: list[MixedPrecisionOptimizer]) -> None:
        self.subs = subs
        self.stepped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            g for sub in self.subs if sub.optimizer is not None for g in sub.optimizer.param_groups
        ]

    def step(self) -> None:
        self.stepped = True


class MegatronBinding:
    """What [`install()`][distscaler.integrations.megatron.install] attaches to a Megatron optimizer
    (an attribute of the optimizer).

    Attributes:
        scaler: the one [`distscaler.GradScaler`][distscaler.GradScaler] (its process group: the
            world).
        optimizer: the optimizer given to [`install()`][distscaler.integrations.megatron.install].
        subs: its sub-optimizers (the optimizer itself when it is not chained).
        last_grad_norm: the last prepared step's global norm (Python float; None before one or
            after a skipped step).
    """

    def __init__(self, optimizer: MegatronOptimizer, scaler: GradScaler) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self.subs: list[MixedPrecisionOptimizer] = list(
            optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
        )
        self.view = _MainGrads(self.subs)
        self.last_grad_norm: float | None = None
        self._prepared: bool | None = None  # this step's found_inf once prepare_grads ran
        self._loading = False
        self._stock = {
            name: getattr(optimizer, name)
            for name in ("step_with_ready_grads", "zero_grad", "load_state_dict", "count_zeros")
        }

    # ------------------------------------------------------------------ the scale

    def scale_tensor(self) -> torch.Tensor:
        """The one scale: float32, shape ``(1,)``, on the scaler's device; a view (no copy, no
        host read) that follows every update."""
        return self.scaler._scale.view(1)  # type: ignore[union-attr]  # materialized by install

    def megatron_state(self) -> dict[str, Any]:
        """The scale in Megatron's ``DynamicGradScaler.state_dict()`` keys (one host read);
        ``{}`` for a static scale, as ``ConstantGradScaler``."""
        if not get_policy(self.scaler.config.policy).reacts_to_overflow:  # a static scale
            return {}
        state = self.scaler.state_dict()
        return {
            "scale": torch.tensor(
                [state["scale"]], dtype=torch.float32, device=self.scale_tensor().device
            ),
            "growth_tracker": int(state["_growth_tracker"]),
            "hysteresis_tracker": int(
                state.get("hysteresis_tracker", state.get("cur_hysteresis", 1))
            ),
        }

    def load_sub_state(self, state: Mapping[str, Any]) -> None:
        """One sub-optimizer's ``"grad_scaler"`` entry into the one scaler (skipped while the
        optimizer's own ``load_state_dict`` loads the chain, which chose an entry already)."""
        if self._loading or not state:
            return  # the chain's load_state_dict loaded it once already; {}: a constant scale
        self.scaler.load_state_dict(dict(state))

    def load_state_dict(self, state_dict: Any) -> None:
        """The optimizer's ``load_state_dict`` with one rule for the chain's scaler entries."""
        entries = _grad_scaler_entries(state_dict)
        if entries:
            chosen = min(entries, key=lambda e: float(torch.as_tensor(e["scale"]).reshape(-1)[0]))
            scales = sorted({float(torch.as_tensor(e["scale"]).reshape(-1)[0]) for e in entries})
            if len(scales) > 1:
                warnings.warn(
                    f"the checkpoint's sub-optimizers hold different loss scales {scales} (stock "
                    "Megatron lets them split); distscaler keeps one: the smallest, "
                    f"{scales[0]}, with its trackers",
                    stacklevel=3,
                )
            self.scaler.load_state_dict(dict(chosen))
        self._loading = True
        try:
            self._stock["load_state_dict"](state_dict)
        finally:
            self._loading = False

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy, check, unscale (and clip) every main gradient, agree, update the scale.

        Returns whether any rank found inf/NaN (the same bool on every rank). Once per step: a
        second call before ``step_with_ready_grads``/``zero_grad``/``step`` returns the same
        found_inf and does nothing (no second unscale, no collective).

        Cost: one ``all_reduce`` of 2 float32 over the world, one host read of the flag and
        one of the norm; every rank must call.
        """
        if self._prepared is not None:
            return self._prepared
        for sub in self.subs:
            if not getattr(sub, "is_stub_optimizer", False):
                sub._copy_model_grads_to_main_grads()
        clip = float(self.optimizer.config.clip_grad)
        scaler, view = self.scaler, self.view
        norm = scaler.clip_grad_norm_(view, clip if clip > 0.0 else math.inf)  # type: ignore[arg-type]
        view.stepped = False
        scaler.step(view)  # type: ignore[arg-type]  # the one host read of the agreed flag
        found_inf = not view.stepped
        self.last_grad_norm = None if found_inf else float(norm)
        scaler.update()
        self._prepared = found_inf
        return found_inf

    def step_with_ready_grads(self) -> bool:
        """Megatron's ``step_with_ready_grads`` (inner steps, main to model copies); ends the step."""
        self._prepared = None
        return self._stock["step_with_ready_grads"]()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Megatron's ``zero_grad``; a ``prepare_grads`` after it prepares a new step."""
        self._prepared = None
        self._stock["zero_grad"](set_to_none)

    def grad_norm(self) -> float | None:
        """The prepared step's norm (no collective), or Megatron's own outside a step."""
        if self._prepared is not None:
            return self.last_grad_norm
        return _stock_grad_norm(self.optimizer)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """Megatron's ``step()``: ``(update_successful, grad_norm, num_zeros_in_grad)``.

        ``(False, None, None)`` on a skipped step, as stock; ``update_successful`` is False too
        when the norm exceeds ``grad_norm_skip_threshold`` (the scale counts the step as clean,
        as stock).
        """
        try:
            if self.prepare_grads():
                return False, None, None
            grad_norm = self.last_grad_norm
            assert grad_norm is not None
            config = self.optimizer.config
            threshold = getattr(config, "grad_norm_skip_threshold", math.inf)
            too_large = math.isfinite(threshold) and grad_norm > threshold
            num_zeros = self._stock["count_zeros"]() if config.log_num_zeros_in_grad else None
            if num_zeros is None and not isinstance(self.optimizer, ChainedOptimizer):
                num_zeros = 0  # MixedPrecisionOptimizer.step's value
            success = False if too_large else self._stock["step_with_ready_grads"]()
            return success, grad_norm, num_zeros
        finally:
            self._prepared = None


def _stock_grad_norm(optimizer: MegatronOptimizer) -> Any:
    return type(optimizer).get_grad_norm(optimizer)


def _grad_scaler_entries(state_dict: Any) -> list[Mapping[str, Any]]:
    """The non-empty ``"grad_scaler"`` entries of a Megatron optimizer state (chained or not)."""
    if isinstance(state_dict, Mapping):
        if "grad_scaler" in state_dict:
            entry = state_dict["grad_scaler"]
            return [entry] if entry else []
        parts: list[Any] = [state_dict[k] for k in sorted(state_dict) if isinstance(k, int)]
    elif isinstance(state_dict, (list, tuple)):
        parts = list(state_dict)
    else:
        return []
    return [e for part in parts for e in _grad_scaler_entries(part)]


def _unsupported(optimizer: MegatronOptimizer, subs: list[Any]) -> list[str]:
    """What of ``optimizer`` the integration does not cover, each said by name."""
    problems = []
    kind = type(optimizer).__name__
    if kind == "MimoOptimizer":  # per-module optimizers, each with its own scaler
        return ["MIMO's per-module optimizer (MimoOptimizer)"]
    if kind == "LayerWiseDistributedOptimizer":
        return ["the layer-wise distributed optimizer (LayerWiseDistributedOptimizer)"]
    config = getattr(optimizer, "config", None) or getattr(subs[0], "config", None)
    if config is not None:
        if not config.fp16:
            problems.append("a config without fp16 (bf16 and fp32 run without a loss scale)")
        if config.use_precision_aware_optimizer:
            problems.append(
                "the precision-aware optimizer (use_precision_aware_optimizer: gradients in "
                "decoupled_grad)"
            )
        if config.optimizer_cpu_offload:
            problems.append("CPU offloading (optimizer_cpu_offload)")
    for i, sub in enumerate(subs):
        if not isinstance(sub, MixedPrecisionOptimizer):
            problems.append(f"sub-optimizer {i}: {type(sub).__name__} (not a mixed-precision one)")
            continue
        if sub.grad_scaler is None:
            problems.append(f"sub-optimizer {i} has no grad scaler")
        fsdp = any(
            getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False)
            for chunk in getattr(sub, "model_chunks", None) or []
        ) or any(getattr(p, "__fsdp_param__", False) for p in sub.get_parameters())
        if fsdp:
            problems.append(f"sub-optimizer {i}: Megatron-FSDP (use_megatron_fsdp)")
        for param in sub.get_parameters():
            if getattr(param, "grad_norm_group", None) is not None:
                problems.append(
                    f"sub-optimizer {i}: a separate grad-norm group "
                    f"({param.grad_norm_group!r}, clipped apart from the main norm)"
                )
                break
    return problems


def _replicas(sub: MixedPrecisionOptimizer, world_size: int) -> float:
    group = sub.get_grad_stats_parallel_group()
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    return world_size / size


def _counted(sub: MixedPrecisionOptimizer, param: torch.Tensor) -> bool:
    """Whether Megatron's norm counts ``param`` on this rank (``_filter_grads_for_norm``)."""
    if not param_is_not_shared(param):
        return False
    if not tensor_parallel.param_is_not_tensor_parallel_duplicate(
        param,
        tp_group=getattr(sub, "tp_group", None),
        expert_tp_group=getattr(sub, "expert_tp_group", None),
    ):
        return False
    gtp = getattr(tensor_parallel, "param_is_not_gtp_duplicate", None)
    return gtp is None or bool(gtp(param))


def _device_type(subs: list[MixedPrecisionOptimizer]) -> str:
    for sub in subs:
        for param in sub.get_parameters():
            return param.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def install(optimizer: MegatronOptimizer, scaler: Any = None) -> GradScaler:
    """Put one [`distscaler.GradScaler`][distscaler.GradScaler] behind every sub-optimizer of
    ``optimizer``.

    Call on every rank, after ``get_megatron_optimizer`` and before the first step (and before
    loading a checkpoint into ``optimizer``). See the module docstring for what a step does.

    Args:
        optimizer: what ``megatron.core.optimizer.get_megatron_optimizer`` returns with
            ``fp16=True``: a ``ChainedOptimizer``, a ``Float16OptimizerWithFloat16Params`` or a
            ``DistributedOptimizer``.
        scaler: None (default): Megatron's own rule from ``optimizer.config``
            ([`scaler_config()`][distscaler.integrations.megatron.scaler_config]:
            ``policy="megatron"``, or ``"static"`` when ``loss_scale`` is set), its scale taken from
            the first sub-optimizer's current scale. Or a ``distscaler.GradScaler`` (on the
            parameters' device type, process group the world), a ``ScalerConfig``, or a DeepSpeed
            config (dict, its ``"fp16"`` section or JSON path).

    Returns:
        The scaler.

    Raises:
        TypeError: ``optimizer`` is not a Megatron optimizer; ``scaler`` of another type.
        NotImplementedError: a path this integration does not cover (named; module docstring).
        RuntimeError: ``optimizer`` already has distscaler installed.
        ValueError: ``scaler`` on another device type, disabled, or with a process group other
            than the world; config values out of range.

    Nothing is changed when it raises. Cost: no collective, one host read (the scale).
    """
    if not isinstance(optimizer, MegatronOptimizer):
        raise TypeError(
            "optimizer must be what megatron.core.optimizer.get_megatron_optimizer returns, got: "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    if getattr(optimizer, INSTALLED, None) is not None:
        raise RuntimeError("distscaler is already installed on this optimizer")
    subs = list(
        optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    )
    if not subs:
        raise NotImplementedError("a ChainedOptimizer without sub-optimizers (no parameters)")
    problems = _unsupported(optimizer, subs)
    if problems:
        raise NotImplementedError(
            "distscaler.integrations.megatron does not support "
            + "; ".join(problems)
            + " (one shared loss scale cannot be guaranteed there)"
        )
    device_type = _device_type(subs)
    built = scaler_from_argument(scaler, device_type, "the parameters'")
    if built is None:
        config = scaler_config(optimizer.config)
        stock = subs[0].grad_scaler.scale  # every stock scaler starts from the same value
        config = _with_init_scale(config, float(stock.reshape(-1)[0]))
        built = GradScaler.from_config(config, device_type)
    if not built.is_enabled():
        raise ValueError(
            "scaler must be enabled: a disabled GradScaler would train fp16 with no loss scale "
            "and no inf/NaN check"
        )
    if built.process_group is not None and built.process_group is not dist.group.WORLD:
        raise ValueError("scaler's process_group must be the world (None): the chain spans it")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    for sub in subs:
        replicas = _replicas(sub, world_size)
        params = sub.get_parameters()
        built.register_params([p for p in params if _counted(sub, p)], replicas=replicas)
        built.register_params([p for p in params if not _counted(sub, p)], replicas=math.inf)
    device = next((p.device for s in subs for p in s.get_parameters()), torch.device(device_type))
    built.materialize(device)
    binding = MegatronBinding(optimizer, built)
    for sub in subs:
        sub.grad_scaler = SharedGradScaler(binding)
    setattr(optimizer, INSTALLED, binding)
    optimizer.prepare_grads = binding.prepare_grads  # type: ignore[method-assign]
    optimizer.step = binding.step  # type: ignore[method-assign]
    optimizer.step_with_ready_grads = binding.step_with_ready_grads  # type: ignore[method-assign]
    optimizer.zero_grad = binding.zero_grad  # type: ignore[method-assign]
    optimizer.load_state_dict = binding.load_state_dict  # type: ignore[method-assign]
    optimizer.get_grad_norm = binding.grad_norm  # type: ignore[method-assign]
    if isinstance(optimizer, ChainedOptimizer):
        for sub in subs:
            sub.prepare_grads = _chained_only  # type: ignore[method-assign]
            sub.step = _chained_only  # type: ignore[method-assign]
    return built


def _chained_only(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "with distscaler installed, the sub-optimizers share one found_inf: call prepare_grads() "
        "and step() on the ChainedOptimizer given to install(), not on a sub-optimizer"
    )


def _with_init_scale(config: ScalerConfig, scale: float) -> ScalerConfig:
    import dataclasses

    return dataclasses.replace(config, init_scale=scale)


def installed_scaler(optimizer: MegatronOptimizer) -> GradScaler | None:
    """The scaler [`install()`][distscaler.integrations.megatron.install] put on ``optimizer``, or
    None."""
    return _common.installed_scaler(optimizer)
