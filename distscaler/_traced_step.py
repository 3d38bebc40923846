"""A fused optimizer step that ``torch.compile`` can trace whole, so a compiled scaler phase has no
graph break.

torch keeps every optimizer step out of a compiled graph: ``Optimizer.step``'s ``_use_grad`` wrapper
calls ``torch._dynamo.graph_break()`` before and after the step, dynamo refuses to trace torch's
fused optimizer functions (``torch.optim.adam._fused_adam`` is wrapped in ``torch.compiler.disable``:
"don't trace into fused optimizer"), and the in-place kernel ``aten::_fused_adam(w)_`` fails
functionalization without amsgrad (an empty mutable tensor list; torch 2.6 to 2.15). So
``clip_grad_norm_`` + ``step`` + ``update`` through torch's step is at least three graphs, and
``fullgraph=True`` raises.

While dynamo traces (``torch.compiler.is_compiling()``), `traced_step()` runs a fused torch
``Adam``/``AdamW`` step as torch's own wrappers and ``Adam.step`` would, minus the graph breaks:

1. the global and the optimizer's step pre-hooks (torch's ``profile_hook_step``);
2. per parameter group, the optimizer's own ``_init_group`` (dynamo runs it eagerly, so state is
   made exactly as torch makes it), then per (device, dtype) group what ``_fused_adam`` does: the
   step counts + 1, torch's fused kernel, the step counts - ``found_inf``. The kernel runs in place
   through ``torch.ops.distscaler.fused_adam_step_``, a custom op around torch's own
   ``torch._fused_adam(w)_`` (the same kernel: the same bits as the eager step) that declares what
   it mutates: the graph holds one node per call whatever the number of tensors, and inductor calls
   it in place on the parameters, gradients and moments, with no copy back. Calls take at most
   `CHUNK` tensors (see there why);
3. the step post-hooks, and the mark an LR scheduler reads (``optimizer._opt_called``).

Anything else returns `NOT_TRACED` before touching anything, and the caller runs
``optimizer.step()`` (torch's path: correct, with graph breaks): other optimizer classes or an
overridden ``step``, an instance ``step`` patched by anything but an LR scheduler, fused SGD and
Adagrad (``aten::_fused_sgd_`` has no fake kernel: it cannot be traced), tensor betas,
``differentiable=True``, step arguments. Eager calls never come here.

Cost, compiled: the fused kernel in calls of at most `CHUNK` tensors per (device, dtype) group, and
the step counts' + 1 and - ``found_inf`` (inductor fuses them with the phase's other small writes);
no host read, no collective. Compile time grows linearly with the tensors (torch 2.13, CPU:
``launch/compile_cost.py``, figures in docs/benchmarks.md).

Sources: ``torch/optim/optimizer.py`` (``_use_grad_for_differentiable``, ``profile_hook_step``),
``torch/optim/adam.py`` and, before torch 2.7, ``torch/optim/adamw.py`` (``step``,
``_fused_adam(w)``), ``torch/optim/lr_scheduler.py`` (``patch_track_step_called``).
"""

from __future__ import annotations

import inspect
from itertools import chain
from typing import Any, Final

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as _torch_optimizer

from ._torch_compat import torch_at_least

__all__ = ["NOT_TRACED", "TRACES_WHOLE_PHASE", "traced_step"]

#: What `traced_step()` returns when it did nothing: run ``optimizer.step()`` instead.
NOT_TRACED: Final = object()


#: The optimizer classes whose fused step this module mirrors (exactly these: a subclass may
#: change the step) -> whether their ``_init_group`` takes ``amsgrad`` (``AdamW`` before torch
#: 2.7, a class of its own there).
_MIRRORED: Final[dict[type, bool]] = {
    cls: "amsgrad" in inspect.signature(cls._init_group).parameters
    for cls in (torch.optim.Adam, torch.optim.AdamW)
}

#: Whether this torch traces the scaler's phase whole (``fullgraph=True`` with a fused Adam/AdamW).
#: dynamo before torch 2.12 cannot trace the scaler's phase whole (``id()`` of a process group or
#: of None in the scaler's caches; an optimizer passed to a constant-result function); there
#: torch's step runs, between graph breaks. Tried: 2.6.0, 2.10.0, 2.11.0 (no); 2.12.1, 2.13.0,
#: 2.15.0 (whole).
TRACES_WHOLE_PHASE: Final = torch_at_least(2, 12)


def _mirrored(optimizer: Optimizer) -> bool | None:
    """Whether ``optimizer``'s ``_init_group`` takes ``amsgrad``, if its step is one this module
    mirrors; else None. Traced by dynamo: attribute reads only (it cannot unwrap torch's step)."""
    takes_amsgrad = _MIRRORED.get(type(optimizer))
    instance_step = optimizer.__dict__.get("step")
    if instance_step is not None and not (
        # An LR scheduler's wrapper (torch/optim/lr_scheduler.py) around the class's step: it
        # only sets the mark that _lr_mark.mark_stepped sets.
        getattr(instance_step, "_wrapped_by_lr_sched", False)
        and instance_step.__wrapped__ is type(optimizer).step
    ):
        return None  # patched by something whose effect we cannot reproduce
    return takes_amsgrad


def _traceable(optimizer: Optimizer) -> bool:
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("differentiable"):
            return False
        if any(isinstance(v, torch.Tensor) for v in group["betas"]):
            return False  # torch reads tensor betas on the host
    return True


def traced_step(
    optimizer: Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run a fused ``Adam``/``AdamW`` step inside the graph dynamo is tracing, or do nothing.

    Args:
        optimizer: the optimizer to step.
        grad_scale: 0-dim float32 the kernel divides the gradients by, or None.
        found_inf: 0-dim float32; exactly 1.0 makes the kernel skip the update and the step count
            stay, as torch's fused step does.
        args, kwargs: ``step``'s own arguments; any makes this return `NOT_TRACED`.

    Returns:
        None (what ``Adam.step`` returns without a closure) after stepping, or `NOT_TRACED` when not
        tracing or the step is not one this module mirrors (nothing was run or changed).
    """
    if args or kwargs or not (TRACES_WHOLE_PHASE and torch.compiler.is_compiling()):
        return NOT_TRACED
    init_takes_amsgrad = _mirrored(optimizer)
    if init_takes_amsgrad is None or not _traceable(optimizer):
        return NOT_TRACED
    for pre_hook in chain(
        _torch_optimizer._global_optimizer_pre_hooks.values(),
        optimizer._optimizer_step_pre_hooks.values(),
    ):
        if pre_hook(optimizer, (), {}) is not None:
            raise RuntimeError(
                "an optimizer step pre-hook returned new step arguments, which a compiled "
                "distscaler step cannot pass on (GradScaler takes no step arguments)"
            )
    with torch.no_grad():  # what _use_grad sets for a non-differentiable optimizer
        for group in optimizer.param_groups:
            _step_group(optimizer, group, grad_scale, found_inf, init_takes_amsgrad)
    for post_hook in chain(
        optimizer._optimizer_step_post_hooks.values(),
        _torch_optimizer._global_optimizer_post_hooks.values(),
    ):
        post_hook(optimizer, (), {})
    if "step" in optimizer.__dict__ and not getattr(optimizer, "_opt_called", False):
        # Imported here, while dynamo traces (it runs an import for real): the module marks a
        # function with torch.compiler.assume_constant_result, which imports dynamo (0.35 s), a
        # cost `import distscaler` should not pay.
        from ._lr_mark import mark_stepped

        mark_stepped(optimizer)
    return None


#: Tensors per call of the step op. Each call is one node of the traced graph; inductor's pass
#: that turns the op's functional form back into the in-place call
#: (``decompose_auto_functionalized``) costs time quadratic in one call's tensors (torch 2.13, CPU,
#: a prototype: 7.9 s for one call over 144 parameters' lists, 2.1 s as five calls of at most 32).
#: A CUDA ``multi_tensor_apply`` launch of Adam's kernel takes at most 36 tensors (30 with
#: amsgrad), so a call of 32 adds at most one launch to those the whole group would take.
CHUNK: Final = 32

_OP_NAME: Final = "distscaler::fused_adam_step_"


def _define_step_op() -> None:
    """Define ``torch.ops.distscaler.fused_adam_step_`` (once per process): torch's fused
    Adam/AdamW kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``) over one call's tensors,
    as one opaque in-place op. The caller adds 1 to the step counts before and subtracts
    ``found_inf`` after, as torch's ``_fused_adam`` does.

    Traced, it is one node whatever the number of tensors: dynamo and AOTAutograd see its schema
    (the lists it mutates) and inductor calls it in place on the parameters, gradients and moments
    (no copy back). The out-of-place overload this replaces (``aten::_fused_adamw``) made inductor
    copy every output back: the phase compiled in 66.0 s at 144 tensors with ``fullgraph=True``,
    now 20.8 s (torch 2.13, CPU; docs/benchmarks.md). Eagerly it is the kernel call itself.
    """
    if hasattr(torch.ops.distscaler, "fused_adam_step_"):
        return

    @torch.library.custom_op(
        _OP_NAME,
        mutates_args=(
            "params",
            "grads",
            "exp_avgs",
            "exp_avg_sqs",
            "max_exp_avg_sqs",
        ),
        schema=(
            "(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
            "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, "
            "float lr, Tensor? lr_tensor, bool decoupled, float beta1, float beta2, "
            "float weight_decay, float eps, bool amsgrad, bool maximize, Tensor? grad_scale, "
            "Tensor found_inf) -> ()"
        ),
    )
    def fused_adam_step_(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
        lr: float,
        lr_tensor: torch.Tensor | None,
        decoupled: bool,
        beta1: float,
        beta2: float,
        weight_decay: float,
        eps: float,
        amsgrad: bool,
        maximize: bool,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
    ) -> None:
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            lr=lr if lr_tensor is None else lr_tensor,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=maximize,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )

    @fused_adam_step_.register_fake
    def _(*args: Any, **kwargs: Any) -> None:
        return None


_define_step_op()


def _step_group(
    optimizer: Any,
    group: dict[str, Any],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    init_takes_amsgrad: bool,
) -> None:
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    amsgrad = group["amsgrad"]
    if init_takes_amsgrad:
        optimizer._init_group(
            group, params, grads, amsgrad, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
    else:
        optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    if not params:
        return
    decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
    lr = group["lr"]
    beta1, beta2 = group["betas"]
    # _fused_adam's grouping by (device, dtype): one kernel per group, in calls of CHUNK tensors.
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        by_kind.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), index in by_kind.items():
        dev_found_inf = found_inf.to(device, non_blocking=True)
        dev_grad_scale = None if grad_scale is None else grad_scale.to(device, non_blocking=True)
        # A tensor lr (torch's advice for compiled steps under an LR scheduler: no recompile when
        # it changes) goes to the kernel as a tensor, on the parameters' device unless on the CPU.
        lr_tensor = None
        if isinstance(lr, torch.Tensor):
            lr_tensor = lr if lr.device.type == "cpu" else lr.to(device, non_blocking=True)
        dev_steps = [steps[i] for i in index]
        torch._foreach_add_(dev_steps, 1)
        for start in range(0, len(index), CHUNK):
            part = index[start : start + CHUNK]
            torch.ops.distscaler.fused_adam_step_(
                [params[i] for i in part],
                [grads[i] for i in part],
                [exp_avgs[i] for i in part],
                [exp_avg_sqs[i] for i in part],
                [max_exp_avg_sqs[i] for i in part] if amsgrad else [],
                [steps[i] for i in part],
                0.0 if lr_tensor is not None else float(lr),
                lr_tensor,
                decoupled,
                beta1,
                beta2,
                group["weight_decay"],
                group["eps"],
                amsgrad,
                group["maximize"],
                dev_grad_scale,
                dev_found_inf,
            )
        torch._foreach_sub_(dev_steps, [dev_found_inf] * len(dev_steps))
