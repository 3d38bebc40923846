"""The contenders: distscaler, torch's two scalers and DeepSpeed's overflow check, as users run them.

Each contender offers two callables over the same gradients:

* ``phase()``: the scaler (+ clip) phase alone. It runs the contender's whole sequence (unscale /
  check, clip, ``scaler.step``, ``update``) against a twin of the optimizer whose ``step`` does
  nothing, so the optimizer's own time is left out and everything the scaler does is in.
* ``step()``: the whole optimizer step with the real optimizer: the same sequence, and the update.

What each one runs (``clip`` = a max norm, or None for no clipping):

* ``distscaler``: ``scaler.clip_grad_norm_`` (if clipping) + ``scaler.step`` + ``scaler.update``.
* ``torch``: ``torch.amp.GradScaler``: ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` (if
  clipping; DTensor-aware for FSDP2) + ``step`` + ``update``.
* ``torch-sharded``: the same with ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
  (it all-reduces ``found_inf`` itself; it needs a process group, even of one rank).
* ``deepspeed``: DeepSpeed's fp16 recipe with DeepSpeed's own code (``FP16_Optimizer.step``):
  ``CheckOverflow.has_overflow`` over the gradients, ``DynamicLossScaler.update_scale``, then (no
  overflow) ``get_global_norm_of_tensors`` (if clipping) and one multiply by
  ``1 / combined_scale`` (``unscale_and_clip_grads``), then ``optimizer.step()``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import distscaler
from common.tensors import local_tensor

__all__ = [
    "CONTENDERS",
    "ON_REQUEST",
    "VARIANTS",
    "Contender",
    "build_contender",
    "floors",
    "noop_step",
    "optimizer_like",
]

#: Every contender, in the order the reports list them. ``distscaler-graph`` (CUDA only): the same
#: sequence as ``distscaler``, captured once in a CUDA graph and replayed.
#: ``distscaler-compiled`` (asked for by name only: compiling costs seconds per case): the same
#: sequence compiled as one graph (``fullgraph=True``; on CUDA ``mode="reduce-overhead"``).
CONTENDERS = (
    "distscaler",
    "torch",
    "torch-sharded",
    "deepspeed",
    "distscaler-graph",
    "distscaler-compiled",
)
#: The most gradient tensors ``distscaler-compiled`` compiles (one case's compile time).
MAX_COMPILED_TENSORS = 1000
#: Contenders a run takes only when named (``--contenders``).
ON_REQUEST = ("distscaler-compiled",)
#: distscaler with other settings (the launch sweep runs them beside ``distscaler``): the DeepSpeed
#: rule as ``ScalerConfig.from_deepspeed`` gives it to a DeepSpeed user (hysteresis 2, window 1000,
#: minimum 1, raise at the minimum: one host read per update), Megatron's rule (hysteresis 2,
#: minimum 1), the torch rule without the overflow report (``skip_log_interval=0``), and without the
#: replica check (``replica_check=False``; distscaler.replica_check).
VARIANTS: dict[str, dict[str, Any]] = {
    "distscaler-deepspeed": {"deepspeed": {"fp16": {"enabled": True}}},
    "distscaler-megatron": {
        "policy": "megatron",
        "hysteresis": 2,
        "min_scale": 1.0,
        "growth_interval": 1000,
    },
    "distscaler-noreport": {"skip_log_interval": 0},
    # The replica check off (it is on by default, and runs where gradients are replicated: DDP),
    # and at every update (by default every `distscaler.replica_check.INTERVAL`-th with torch's
    # kernels: a run of fewer rounds times its default without a check).
    "distscaler-nocheck": {"replica_check": False},
    "distscaler-everycheck": {"replica_check_interval": 1},
    # torch's multi-tensor kernels for the pass where kernels="auto" takes the Triton kernel (CUDA).
    "distscaler-torch-kernels": {"kernels": "torch"},
}

INIT_SCALE = 2.0**16


@dataclass
class Contender:
    """One way of running the scaler phase. ``error`` is set (and nothing runs) where it cannot."""

    name: str
    phase: Callable[[], Any] | None = None
    step: Callable[[], Any] | None = None
    error: str | None = None
    #: Whether a dispatch-mode counter can count its ops (a compiled graph cannot run under one:
    #: its kernels are counted from inductor's code by tests/test_compile.py).
    countable: bool = True


def noop_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step`` do nothing (keeping what scalers look at: ``_step_supports_amp_scaling``
    and a signature without ``grad_scaler``), so a phase can be timed without the optimizer."""

    def step(*args: Any, **kwargs: Any) -> None:
        return None

    optimizer.step = step  # type: ignore[method-assign]
    return optimizer


def build_contender(
    name: str,
    *,
    params: Sequence[nn.Parameter],
    make_optimizer: Callable[[], torch.optim.Optimizer],
    optimizer: torch.optim.Optimizer,
    clip: float | None,
    device: torch.device,
    layout: str = "single",
    model: nn.Module | None = None,
    init_scale: float = INIT_SCALE,
    setup_scaler: Callable[[distscaler.GradScaler], Any] | None = None,
    torch_clip: Callable[[float], Any] | None = None,
) -> Contender:
    """Build contender ``name`` over ``params`` (their ``.grad`` hold loss-scaled gradients).

    Args:
        make_optimizer: builds a fresh optimizer over ``params`` like ``optimizer``; the phase uses
            one with a no-op step.
        optimizer: the real optimizer, shared by every contender's ``step()``.
        clip: max norm, or None for no clipping.
        layout: "single" (one process, plain tensors), "ddp" or "fsdp2" (DTensor gradients).
        model: the DDP module (distscaler registers it).
        init_scale: the scale the gradients carry (every scaler starts at it).
        setup_scaler: tells a distscaler scaler the gradients' layout (``register_model``...)
            instead of ``layout``'s default (the DDP ``model`` under "ddp").
        torch_clip: the clip of torch's recipe for this layout, given the max norm, instead of
            ``torch.nn.utils.clip_grad_norm_(params, clip)`` (FSDP1's own, a pipeline's...).
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(
            f"contender must be one of {CONTENDERS + tuple(VARIANTS)}, got: {name!r}"
        ) from None
    try:
        return builder(
            params=list(params),
            make_optimizer=make_optimizer,
            optimizer=optimizer,
            clip=clip,
            device=device,
            layout=layout,
            model=model,
            init_scale=init_scale,
            setup_scaler=setup_scaler,
            torch_clip=torch_clip,
        )
    except _NotApplicable as exc:
        return Contender(name, error=str(exc))


class _NotApplicable(Exception):
    """This contender has no way to run in this configuration (said in the report)."""


def _settings(variant: str | None) -> dict[str, Any]:
    settings = dict(VARIANTS[variant]) if variant is not None else {}
    if "deepspeed" in settings:
        from distscaler.config import ScalerConfig

        settings = ScalerConfig.from_deepspeed(settings["deepspeed"]).scaler_kwargs()
        settings.pop("init_scale")
        settings.pop("enabled", None)
    return settings


def _distscaler(
    *,
    params,
    make_optimizer,
    optimizer,
    clip,
    device,
    layout,
    model,
    init_scale,
    setup_scaler,
    variant=None,
    **_,
) -> Contender:
    settings = _settings(variant)

    def make() -> distscaler.GradScaler:
        scaler = distscaler.GradScaler(device.type, init_scale=init_scale, **settings)
        if setup_scaler is not None:
            setup_scaler(scaler)
        elif layout == "ddp":
            scaler.register_model(model)
        scaler.materialize(device)
        return scaler

    def sequence(scaler: distscaler.GradScaler, opt: torch.optim.Optimizer) -> Callable[[], Any]:
        def run() -> None:
            if clip is not None:
                scaler.clip_grad_norm_(opt, clip)
            scaler.step(opt)
            scaler.update()

        return run

    return Contender(
        variant or "distscaler",
        phase=sequence(make(), noop_step(make_optimizer())),
        step=sequence(make(), optimizer),
    )


def _torch_scaler(sharded: bool):
    def build(
        *, params, make_optimizer, optimizer, clip, device, layout, init_scale, torch_clip, **_
    ) -> Contender:
        name = "torch-sharded" if sharded else "torch"
        if sharded:
            import torch.distributed as dist
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            if not dist.is_initialized():
                raise _NotApplicable("needs a process group")
            cls: Any = ShardedGradScaler
        else:
            if layout == "fsdp2":
                raise _NotApplicable("FSDP2 needs ShardedGradScaler")
            cls = torch.amp.GradScaler
        if not sharded and clip is not None and any(p.dtype == torch.float16 for p in params):
            raise _NotApplicable("unscale_ refuses fp16 gradients")

        def make() -> Any:
            scaler = cls(device.type, init_scale=init_scale)
            scaler.scale(torch.ones((), device=device))  # creates its scale tensor
            return scaler

        def sequence(scaler: Any, opt: torch.optim.Optimizer) -> Callable[[], Any]:
            def run() -> None:
                if clip is not None:
                    scaler.unscale_(opt)
                    if torch_clip is not None:
                        torch_clip(clip)
                    else:
                        torch.nn.utils.clip_grad_norm_(params, clip)
                scaler.step(opt)
                scaler.update()

            return run

        return Contender(
            name,
            phase=sequence(make(), noop_step(make_optimizer())),
            step=sequence(make(), optimizer),
        )

    return build


def _deepspeed(
    *, params, make_optimizer, optimizer, clip, device, layout, init_scale, **_
) -> Contender:
    if layout == "fsdp2":
        raise _NotApplicable("DeepSpeed has no FSDP2 (DTensor) path")
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
        from deepspeed.runtime.utils import CheckOverflow, get_global_norm_of_tensors
    except ImportError as exc:  # an optional contender
        raise _NotApplicable(f"deepspeed is not installed ({exc})") from None

    def sequence(opt: torch.optim.Optimizer) -> Callable[[], Any]:
        checker = CheckOverflow()  # data parallel: the gradients are already all-reduced
        # DeepSpeed's fp16 defaults: loss_scale_window 1000, min_loss_scale 1, hysteresis 2.
        loss_scaler = DynamicLossScaler(
            init_scale=init_scale,
            scale_window=1000,
            min_scale=1.0,
            delayed_shift=2,
            consecutive_hysteresis=False,
        )

        def run() -> None:
            overflow = checker.has_overflow(params)
            scale = loss_scaler.cur_scale
            loss_scaler.update_scale(overflow)
            if overflow:
                return
            grads = [p.grad for p in params if p.grad is not None]
            combined_scale = scale
            if clip is not None:
                norm = get_global_norm_of_tensors(grads)
                coef = ((norm / scale) + 1e-6) / clip
                if coef > 1:  # FP16_Optimizer.unscale_and_clip_grads: a host read
                    combined_scale = coef * scale
            torch._foreach_mul_(grads, 1.0 / combined_scale)
            opt.step()

        return run

    return Contender(
        "deepspeed", phase=sequence(noop_step(make_optimizer())), step=sequence(optimizer)
    )


def optimizer_like(
    optimizer: torch.optim.Optimizer, params: Any, **overrides: Any
) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over ``params`` (a list of parameters
    or of param-group dicts), with ``overrides``. ``optimizer.defaults`` also holds keys its
    constructor does not take (AdamW's ``decoupled_weight_decay``): those are left out."""
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(params, **{**settings, **overrides})


def _distscaler_graph(*, params, optimizer, device, **kwargs) -> Contender:
    """distscaler's sequence replayed from a CUDA graph (torch's recipe: warm-up on a side stream,
    static gradients, a capturable fused optimizer for the whole step)."""
    if device.type != "cuda":
        raise _NotApplicable("CUDA graphs need a CUDA device")
    if not optimizer.defaults.get("fused"):
        raise _NotApplicable("needs a fused optimizer (the only kind a graph can replay sync-free)")
    capturable = optimizer_like(optimizer, params, capturable=True)
    base = _distscaler(params=params, optimizer=capturable, device=device, **kwargs)
    try:
        assert base.phase is not None and base.step is not None
        return Contender("distscaler-graph", phase=_captured(base.phase), step=_captured(base.step))
    except Exception as exc:  # reported in the tables, as a contender that cannot run here
        return Contender("distscaler-graph", error=f"{type(exc).__name__}: {exc}"[:200])


def _distscaler_compiled(*, params, optimizer, device, **kwargs) -> Contender:
    """distscaler's sequence without the overflow report (``skip_log_interval=0``: the report reads
    the host) compiled whole: ``torch.compile(fullgraph=True)``, on CUDA with
    ``mode="reduce-overhead"`` (inductor's CUDA graphs). Compiled at build time (two calls each)."""
    from distscaler._traced_step import TRACES_WHOLE_PHASE

    if not TRACES_WHOLE_PHASE:
        raise _NotApplicable(f"torch {torch.__version__}: dynamo traces the phase whole from 2.12")
    if not optimizer.defaults.get("fused"):
        raise _NotApplicable("needs a fused optimizer (the only kind a graph can skip sync-free)")
    if len(params) > MAX_COMPILED_TENSORS:
        raise _NotApplicable(
            f"{len(params)} tensors: dynamo's trace grows with the tensor count (10,000 took 14 "
            f"minutes on a 2-core CPU); compiled up to {MAX_COMPILED_TENSORS}"
        )
    base = _distscaler(
        params=params, optimizer=optimizer, device=device, variant="distscaler-noreport", **kwargs
    )
    assert base.phase is not None and base.step is not None
    torch._dynamo.reset()  # one case's compiles at a time, far from dynamo's recompile limit
    mode = "reduce-overhead" if device.type == "cuda" else None
    compiled = []
    for fn in (base.phase, base.step):
        fn = torch.compile(fn, fullgraph=True, mode=mode)
        for _ in range(2):  # traced, then again once the scaler's caches are warm
            fn()
        compiled.append(fn)
    return Contender("distscaler-compiled", phase=compiled[0], step=compiled[1], countable=False)


def _captured(fn: Callable[[], Any], warmup: int = 3) -> Callable[[], Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


_BUILDERS: dict[str, Callable[..., Contender]] = {
    "distscaler": _distscaler,
    **{name: functools.partial(_distscaler, variant=name) for name in VARIANTS},
    "distscaler-graph": _distscaler_graph,
    "distscaler-compiled": _distscaler_compiled,
    "torch": _torch_scaler(sharded=False),
    "torch-sharded": _torch_scaler(sharded=True),
    "deepspeed": _deepspeed,
}


def floors(grads: Sequence[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The memory-traffic floors on the same tensors: one read pass and one read+write pass."""
    local = [local_tensor(g) for g in grads]

    def read() -> None:
        torch._foreach_norm(local, 2.0)

    def read_write() -> None:
        torch._foreach_mul_(local, 1.0)

    out = {"floor: one read": read, "floor: one read+write": read_write}
    if all(
        g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous() for g in local
    ):
        flat = [g.view(-1) for g in local]

        def read_dot() -> None:  # the same read with BLAS sdot, which runs at memory speed on CPU
            for g in flat:
                torch.dot(g, g)

        out["floor: one read (BLAS dot)"] = read_dot
    return out
