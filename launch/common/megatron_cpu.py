"""Run megatron-core's fp16 optimizer path on CPU processes (gloo), for the tests and the job.

megatron-core is written for CUDA: it names ``"cuda"`` where it makes tensors, asks for the current
CUDA stream and RNG state, checks ``Tensor.type()`` against ``'torch.cuda.HalfTensor'`` and imports
triton unguarded. None of that is what distscaler's integration is about, so each gets a stand-in
here, in the test and launch code only; ``distscaler.integrations.megatron`` patches nothing.
Every stand-in, and why (megatron-core 0.19.2):

* :class:`CudaToCpu`, a ``TorchFunctionMode`` active while Megatron runs: a factory function or
  ``Tensor.to``/``Tensor.cuda`` asked for a CUDA device (``device='cuda'``, an index from
  ``torch.cuda.current_device()``) gets the CPU (``optimizer/grad_scaler.py``,
  ``optimizer/optimizer.py``, ``optimizer/clip_grads.py``, ``utils.py``,
  ``distributed/param_and_grad_buffer.py`` make their tensors on ``'cuda'``); ``Tensor.type()``
  answers with the CUDA type name its CPU twin would have on a GPU (``optimizer.py`` and
  ``distrib_optimizer.py`` accept only ``'torch.cuda.HalfTensor'``/``'torch.cuda.FloatTensor'``...).
* ``torch.cuda.current_device``/``current_stream``/``Stream``/``stream``/``synchronize``: the grad
  buffers wait on streams (``param_and_grad_buffer.py``); on a CPU every op has run when it
  returns, so a stream that does nothing is exact.
* ``torch.cuda`` RNG calls (``tensor_parallel/random.py``'s CUDA RNG tracker): the CPU generator.
* Without triton, a stub for ``transformer/moe/ops/paged_stash.py``, which imports triton at
  module level for kernels that only a GPU runs.
* Python 3.11: megatron-core >= 0.17 declares Python >= 3.12; its cp311 wheel installs with
  ``pip install --ignore-requires-python megatron-core==0.19.2`` and runs the paths used here.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "cpu_megatron", "install_stubs", "stub_gpu_only_imports"]

#: The module that imports triton unguarded; its kernels run only on GPUs.
_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"

#: The CUDA type names Megatron compares ``Tensor.type()`` against, by dtype.
_CUDA_TYPE_NAMES = {
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float32: "torch.cuda.FloatTensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an index from torch.cuda.current_device()
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpu(TorchFunctionMode):
    """Tensors Megatron asks to make on CUDA are made on the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream stand-in: on a CPU every op has run when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event


_STREAM = _Stream()


def stub_gpu_only_imports() -> None:
    """Let ``import megatron.core`` run without triton (idempotent; changes nothing else)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        # Not a stub triton: torch's dynamo inspects triton when it is importable, and megatron
        # compiles its fusions at import. The one module that needs triton unguarded gets a stub.
        stub = types.ModuleType(_PAGED_STASH)
        stub.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
        stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = None  # type: ignore[attr-defined]
        sys.modules.setdefault(_PAGED_STASH, stub)


def install_stubs() -> None:
    """Every process-wide stand-in of the module docstring (idempotent), for a Megatron rank."""
    stub_gpu_only_imports()
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.current_stream = lambda device=None: _STREAM
    cuda.default_stream = lambda device=None: _STREAM
    cuda.Stream = _Stream  # type: ignore[misc]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed seeds the CPU generator and then calls these.
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Megatron's CUDA calls go to the CPU inside this block (see the module docstring)."""
    install_stubs()
    with CudaToCpu():
        yield
