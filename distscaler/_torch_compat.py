"""Where torch behaves differently across the versions distscaler supports (``pyproject.toml``).

The one place in the library that knows, and the only one that compares torch versions; everything
else calls these helpers. Each entry names the versions it was checked on and why it exists. (The
jobs under ``launch/`` have their own: ``launch/common/torch_compat.py``.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["amp_check_and_unscale_", "fused_handoff", "torch_at_least", "wide_dtype"]

_F = TypeVar("_F", bound=Callable)


@functools.cache
def _release() -> tuple[int, int]:
    # "2.13.0+cpu", "2.6.0+cu124", "2.16.0a0+git..." -> (2, 13)
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is release ``major.minor`` or newer (pre-releases count as it)."""
    return _release() >= (major, minor)


#: torch 2.6.0 (run) and 2.7.1 (read in its source) cannot trace
#: ``_amp_foreach_non_finite_check_and_unscale_``:
#: functionalization turns it into its out-of-place form, which returns ``(list, Tensor)``, and
#: FakeTensor's handler for every op whose name contains "foreach" treats each output as a tensor
#: (``BackendCompilerFailed: AttributeError: 'list' object has no attribute 'device'``), also for a
#: function that calls nothing but that op. torch's own scaler never meets it because dynamo does
#: not trace ``torch.amp`` (it runs there eagerly, outside the graph). torch 2.8.0 (read in its
#: source: the handler matches ``aten::_foreach_*`` only) and later trace it (pytorch/pytorch PR
#: 154930, for issue 138412); 2.10.0 to 2.15.0 run.
_CHECK_KERNEL_TRACES = torch_at_least(2, 8)


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype a clip's statistics are accumulated and all-reduced in on ``device``: float64
    (no sum of squares of float32 gradients overflows it; docs/pass-semantics.md), float32 on
    Apple's MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def amp_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: multiply
    ``grads`` (one device and dtype) in place by the 0-dim float32 ``inv_scale`` and set the 0-dim
    float32 ``found_inf`` to 1.0 if an element was inf/NaN (left as it was otherwise).

    torch's kernel, except while ``torch.compile`` traces on a torch that cannot trace it (2.6,
    2.7): there the same arithmetic in ops it traces (``isfinite``/``all`` per gradient,
    ``masked_fill_``, ``_foreach_mul_``). The values are the same bit for bit: the kernel, too,
    multiplies in float32 (float64 for float64 gradients) and rounds once to the gradient's dtype,
    and a product with an inv_scale of exactly 1.0 is the value itself.
    """
    if _CHECK_KERNEL_TRACES or not torch.compiler.is_compiling():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    if not grads:
        return
    finite = torch.stack([g.isfinite().all() for g in grads]).all()
    found_inf.masked_fill_(finite.logical_not(), 1.0)
    torch._foreach_mul_(grads, inv_scale)


#: torch 2.10.0 and 2.11.0 (run) crash while torch.compile traces an attribute set on an optimizer
#: (``AssertionError: Attempted setattr on a user-defined object that does not have an
#: AttributeMutation mutation_type``), which is how a fused optimizer gets ``grad_scale`` and
#: ``found_inf`` (torch's contract; torch's own scaler is not traced: dynamo skips ``torch.amp``).
#: torch 2.6.0, 2.12.1 to 2.15.0 (run) trace it; 2.7 to 2.9 not run.
_OPTIMIZER_SETATTR_TRACES = torch_at_least(2, 12)


def fused_handoff(fn: _F) -> _F:
    """Decorate the function that hands ``grad_scale``/``found_inf`` to a fused optimizer and
    steps it: below torch 2.12 it runs outside torch.compile's graph (``torch._dynamo.disable``),
    which costs nothing but the place of a graph break (torch's optimizer step breaks the graph
    there anyway); ``fn`` itself from 2.12 on, where the hand-off traces."""
    if _OPTIMIZER_SETATTR_TRACES:
        return fn
    return torch._dynamo.disable(fn)  # type: ignore[return-value]
