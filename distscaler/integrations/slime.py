"""slime's Megatron backend in fp16 with distscaler: one agreed scale, one unscale per step.

slime (tested at commit `TESTED_COMMIT`; not on PyPI) trains through Megatron-core's optimizer.
In fp16 with a dynamic loss scale Megatron sets ``check_for_nan_in_loss_and_grad=False``, and
slime's ``train_one_step`` (``slime/backends/megatron_utils/model.py``, lines 659-687 at the tested
commit) then calls ``optimizer.prepare_grads()``, ``optimizer.get_grad_norm()`` and
``optimizer.step()``; Megatron's ``MixedPrecisionOptimizer.step()`` runs ``prepare_grads()``
again. ``prepare_grads`` copies the model gradients to the main gradients, unscales them and
updates the loss scale, so each clean step:

* updates the loss scale **twice** (the growth interval counts two per step);
* unscales the main gradients **twice** when they share storage with the fp32 gradient buffer
  (``--accumulate-allreduce-grads-in-fp32``: ``main_grad.float()`` is the buffer itself): the
  step sees the gradients divided by the scale a second time (slime PR #1842).

The one line, in slime's arguments (a hook slime calls at the start of every training step, on
every rank, with the optimizer):

```bash
--custom-megatron-before-train-step-hook-path distscaler.integrations.slime.before_train_step
```

At the first step of each optimizer (the actor's, the critic's) in fp16,
[`before_train_step()`][distscaler.integrations.slime.before_train_step] puts
[`distscaler.integrations.megatron.install()`][distscaler.integrations.megatron.install] on it, with
Megatron's rule and the state the stock scaler holds then (a checkpoint slime loaded before: scale,
growth and hysteresis trackers; the smallest of a chain's). Then, in slime's own ``train_one_step``:

* ``prepare_grads()`` copies, checks, unscales (and clips) every main gradient, agrees on the
  overflow flag and updates the scale once, in **one** ``all_reduce`` of 2 float32; the
  ``prepare_grads()`` inside ``optimizer.step()`` returns the same flag and does nothing: one
  unscale and one scale update per step. A second unscale of the step's main gradients (Megatron's
  own ``MixedPrecisionOptimizer.prepare_grads``, called past the installed one, or ``prepare_grads``
  on one sub-optimizer of a chain) raises [`CallOrderError`][distscaler.CallOrderError] before it
  changes them.
* ``get_grad_norm()`` returns that step's norm (no second collective); on a skipped step slime
  keeps its ``grad_norm = nan`` and, as stock, neither steps the optimizer nor the LR scheduler.
* the scale is saved in slime's Megatron checkpoints under Megatron's keys, as stock, and
  resumed.

Checkpoints carry Megatron's keys only (the scale and its trackers): after a resume distscaler's
own counters (``skip_totals``, the replica ledger, the overflow flags) start again.

Install: ``pip install 'distscaler[slime]'`` on Python >= 3.12 (megatron-core 0.19.2 declares it);
on 3.11 also ``pip install --ignore-requires-python --no-deps megatron-core==0.19.2``. Without
megatron-core this module refuses to import, saying so.

Settings: Megatron's (``--initial-loss-scale``, ``--min-loss-scale``, ``--loss-scale-window``,
``--hysteresis``, ``--loss-scale`` for a static scale), or ``DISTSCALER_SLIME_SCALER`` in the
workers' environment: a DeepSpeed fp16 config JSON path (DeepSpeed's semantics). In bf16 the hook
does nothing.

Not covered: what [`distscaler.integrations.megatron`][distscaler.integrations.megatron] refuses
(the precision-aware optimizer, Megatron-FSDP, CPU offloading, separate grad-norm groups: MTP),
each with a ``NotImplementedError`` at the first step; slime's FSDP backend. Relied on in slime at
`TESTED_COMMIT`: ``slime/utils/arguments.py`` (``--custom-megatron-before-train-step-hook-path``),
``slime/backends/megatron_utils/model.py`` (``train_one_step``: the hook called with ``(args,
rollout_id, step_id, model, optimizer, opt_param_scheduler)`` after ``optimizer.zero_grad()``;
``prepare_grads``/``get_grad_norm``/``step``), ``slime/utils/misc.py`` (``load_function``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from .. import GradScaler
from ..errors import CallOrderError
from ._common import TESTED_VERSIONS
from ._scaler_arg import scaler_from_argument


def _has_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all
        return False


# The hook runs the Megatron integration at slime's first step; refuse here, where slime imports the
# hook by its path, rather than there. `distscaler[slime]` installs megatron-core only on Python
# >= 3.12 (what megatron-core 0.19.2 declares); its 3.11 wheel runs, installed without the check.
if not _has_megatron_core():
    _PIN = f"megatron-core=={TESTED_VERSIONS['megatron-core']}"
    if sys.version_info < (3, 12):
        _FIX = (
            f"{_PIN} declares Python >= 3.12, so on Python {sys.version_info[0]}."
            f"{sys.version_info[1]} the `slime` extra leaves it out; install its wheel without "
            f"the check: pip install --ignore-requires-python --no-deps {_PIN}"
        )
    else:
        _FIX = "pip install 'distscaler[slime]'"
    raise ImportError(
        f"distscaler.integrations.slime needs megatron-core {TESTED_VERSIONS['megatron-core']}: "
        f"{_FIX}",
        name="megatron",
    )

__all__ = ["HOOK", "TESTED_COMMIT", "before_train_step", "install"]

#: The slime commit this module is tested at (github.com/THUDM/slime; slime is not on PyPI).
TESTED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
#: The value of slime's ``--custom-megatron-before-train-step-hook-path``.
HOOK = f"{__name__}.before_train_step"
_ENV = "DISTSCALER_SLIME_SCALER"


def _subs(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _one_unscale_per_step(binding: Any) -> Any:
    """A sub-optimizer's ``grad_scaler``: the Megatron integration's view of the one scale, whose
    ``inv_scale`` (what Megatron's own unscale reads) is refused once the step is prepared."""
    from .megatron import SharedGradScaler

    class OneUnscalePerStep(SharedGradScaler):
        @property
        def inv_scale(self) -> Any:
            if self._binding._prepared is not None:
                raise CallOrderError(
                    "this step's main gradients are unscaled already (prepare_grads ran): "
                    "distscaler refuses to unscale them a second time; the optimizer's "
                    "prepare_grads() and step() return this step's result"
                )
            return super().inv_scale

    return OneUnscalePerStep(binding)


def install(optimizer: Any, scaler: Any = None) -> GradScaler:
    """[`distscaler.integrations.megatron.install()`][distscaler.integrations.megatron.install]
    on slime's optimizer, keeping the state its stock scalers hold now.

    Args:
        optimizer: what slime's ``setup_model_and_optimizer`` built (``get_megatron_optimizer``).
        scaler: None (default): Megatron's rule from ``optimizer.config``, then the stock scalers'
            state (scale, growth and hysteresis trackers; the smallest scale of a chain's, with
            its trackers); or a ``GradScaler``, ``ScalerConfig`` or DeepSpeed fp16 config (dict or
            JSON path), which start from their own initial scale.

    Returns:
        The scaler.

    Raises:
        TypeError, ValueError, NotImplementedError, RuntimeError: those of
            [`distscaler.integrations.megatron.install()`][distscaler.integrations.megatron.install],
            before anything is changed.

    Cost: no collective; one host read of each stock scaler's state.
    """
    from . import megatron as ds_megatron

    states = [
        sub.grad_scaler.state_dict()
        for sub in _subs(optimizer)
        if getattr(sub, "grad_scaler", None) is not None
    ]
    built = ds_megatron.install(optimizer, scaler=scaler)
    binding = optimizer._distscaler
    for sub in _subs(optimizer):
        sub.grad_scaler = _one_unscale_per_step(binding)
    if scaler is None:
        dynamic = [s for s in states if s]  # {}: a constant scale, nothing to carry
        if dynamic:
            smallest = min(dynamic, key=lambda s: float(s["scale"].reshape(-1)[0]))
            built.load_state_dict(dict(smallest))
    return built


def before_train_step(
    args: Any,
    rollout_id: int,
    step_id: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
) -> None:
    """slime's ``--custom-megatron-before-train-step-hook-path``: distscaler on the optimizer at
    its first fp16 step (every rank), nothing after, nothing in bf16 or without an optimizer.

    The scaler: ``DISTSCALER_SLIME_SCALER`` (a DeepSpeed fp16 config JSON path) when set, else
    [`install()`][distscaler.integrations.slime.install]'s default (Megatron's rule, the stock
    state).

    Raises:
        ValueError: ``DISTSCALER_SLIME_SCALER`` is not a readable DeepSpeed config file.
        NotImplementedError: a path the Megatron integration does not cover.
    """
    from . import megatron as ds_megatron

    if optimizer is None or not getattr(args, "fp16", False):
        return
    if ds_megatron.installed_scaler(optimizer) is not None:
        return
    path = os.environ.get(_ENV) or None
    if path is not None:
        scaler_from_argument(path, "cpu", f"{_ENV}'s")  # validates before anything is changed
    install(optimizer, scaler=path)
