"""Where the kernels run and how: compiled for a CUDA device (Triton's ``JITFunction``) or run
by Triton's interpreter on the CPU (``InterpretedFunction``), each set of kernels wrapped in a
namespace of its own, so that the package imports without Triton.

Where it runs: `available()` (a CUDA tensor and Triton importable, or the CPU under
``TRITON_INTERPRET=1``, Triton's interpreter: the tests).
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch

from .kernels import RAW

__all__ = ["available", "get_kernels", "interpreter_runs", "triton_importable"]


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (a missing libcuda stub, say)
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the kernels run on ``device``: a CUDA device with Triton importable, or the CPU
    with ``TRITON_INTERPRET=1`` set and an interpreter that runs them (Triton's, for tests: slow;
    `interpreter_runs()`: 3.9's does, 3.6's does not). Imports Triton on its first call; never
    raises."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and triton_importable()
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1" and interpreter_runs()
    return False


@functools.cache
def interpreter_runs() -> bool:
    """Whether Triton's interpreter, here, runs the kernels: it must take a loop's bound loaded
    from memory, as every kernel here does (Triton 3.9's does; 3.6's stops there with "only
    0-dimensional arrays can be converted to Python scalars"). One tiny interpreted launch, once.
    Tests use it to skip the CPU's runs."""
    if not triton_importable():
        return False
    try:
        out = torch.zeros(1, dtype=torch.int64)
        get_kernels(True)._probe_kernel[(1,)](torch.tensor([4], dtype=torch.int64), out)
        return int(out[0]) == 6
    except Exception:  # the interpreter's error, whatever its type
        return False


@functools.cache
def get_kernels(interpret: bool) -> types.SimpleNamespace:
    """The kernels, compiled (``interpret=False``: CUDA tensors) or run by Triton's interpreter
    (CPU tensors), whatever ``TRITON_INTERPRET`` said when Triton was imported: each set is
    wrapped explicitly (``JITFunction``/``InterpretedFunction``) in a namespace of its own, and
    neither calls a jit function of ``triton.language`` (which that variable decides for). The
    interpreted reductions name Triton's own combine functions, which its interpreter runs as one
    numpy call (it matches them by identity); the compiled ones use ``_add``/``_maximum``, the same
    arithmetic. Imports Triton. The launches look it up on this module at each call
    (``runtime.get_kernels``), so that `distscaler._triton.diagnostics.use_kernels()` can count or
    stub them."""
    import triton
    import triton.language as tl

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    namespace: dict[str, Any] = {"tl": tl, "triton": triton, "__name__": __name__}
    for name, raw in RAW.items():
        clone = types.FunctionType(raw.__code__, namespace, name, raw.__defaults__)
        clone.__doc__ = raw.__doc__
        clone.__annotations__ = dict(raw.__annotations__)
        clone.__qualname__ = raw.__qualname__
        namespace[name] = wrap(clone)
    if interpret:
        standard = tl.standard  # (a Triton without them: the same arithmetic, slower)
        namespace["_SUM"] = getattr(standard, "_sum_combine", None) or namespace["_add"]
        namespace["_MAX"] = getattr(standard, "_elementwise_max", None) or namespace["_maximum"]
    else:
        namespace["_SUM"] = namespace["_add"]
        namespace["_MAX"] = namespace["_maximum"]
    return types.SimpleNamespace(**{name: namespace[name] for name in RAW})
