"""Which step contract an optimizer follows with a gradient scaler, read from the optimizer.

torch's ``GradScaler.step`` knows three: optimizers with ``_step_supports_amp_scaling`` whose
``step`` takes no ``grad_scaler`` keyword read ``grad_scale``/``found_inf`` attributes inside their
step (``Adam``/``AdamW``/``SGD(fused=True)``: `distscaler._fused` hands them over); those whose
``step`` takes the deprecated ``grad_scaler=`` keyword drive the scaler themselves; every other
optimizer steps unless the agreed flag, read on the host, says overflow. Source:
``torch/amp/grad_scaler.py`` (``GradScaler.step``).
"""

from __future__ import annotations

import enum
import inspect
from typing import Any

import torch

__all__ = ["StepContract", "step_contract", "takes_grad_scaler", "uses_fused_scaling"]

#: ``step`` function -> whether it takes torch's deprecated ``grad_scaler`` keyword. Reading a
#: signature costs tens of microseconds, once per step otherwise. A plain dict, not a
#: ``WeakKeyDictionary``: torch.compile traces this lookup, and dynamo fails on a weak mapping
#: ("weak object has gone away"). Step functions live as long as their classes.
_TAKES_GRAD_SCALER: dict[Any, bool] = {}


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes torch's deprecated ``grad_scaler=`` keyword."""
    # Keyed by the class's step: the deprecated keyword is a class's contract (an instance patch
    # such as an LR scheduler's keeps the signature), and dynamo traces a class attribute where
    # torch 2.6 cannot trace a bound method's __func__.
    func = type(optimizer).step
    try:
        return _TAKES_GRAD_SCALER[func]
    except (KeyError, TypeError):
        pass
    takes = "grad_scaler" in inspect.signature(optimizer.step).parameters
    if torch.compiler.is_compiling():  # not cached while traced: dynamo would compile again
        return takes
    try:
        _TAKES_GRAD_SCALER[func] = takes
    except TypeError:  # not hashable: not cached
        pass
    return takes


def uses_fused_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes ``grad_scale``/``found_inf`` attributes (not the old keyword)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        not takes_grad_scaler(optimizer)
    )


class StepContract(enum.Enum):
    """How an optimizer's step takes the scaler's agreed ``found_inf``."""

    #: ``_step_supports_amp_scaling`` and no ``grad_scaler`` keyword: ``grad_scale``/``found_inf``
    #: attributes read inside the step (`distscaler._fused`); no host read.
    FUSED = "fused"
    #: torch's deprecated contract: ``step(grad_scaler=scaler)`` drives the scaler itself.
    DRIVES_THE_SCALER = "drives the scaler"
    #: Any other optimizer: the gradients are unscaled in place, and the step runs unless the
    #: agreed flag, read on the host, says overflow.
    HOST = "host"


def step_contract(optimizer: torch.optim.Optimizer) -> StepContract:
    """The contract ``optimizer``'s step follows (its class's signature is read once)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return StepContract.HOST
    if takes_grad_scaler(optimizer):
        return StepContract.DRIVES_THE_SCALER
    return StepContract.FUSED
