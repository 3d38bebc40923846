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
* ``torch.distributed.all_to_all_single`` takes its split sizes as tensors too (the MoE
  dispatcher turns them into host arrays only when they are on CUDA).
* ``torch.cuda.current_device``/``current_stream``/``Stream``/``stream``/``synchronize``: the grad
  buffers wait on streams (``param_and_grad_buffer.py``); on a CPU every op has run when it
  returns, so a stream that does nothing is exact.
* ``torch.cuda`` RNG calls (``tensor_parallel/random.py``'s CUDA RNG tracker): the CPU generator.
* ``torch.cuda.Event``: an event that is always complete (the MoE dispatcher waits on one).
* Without triton, a stub for ``transformer/moe/ops/paged_stash.py``, which imports triton at
  module level for kernels that only a GPU runs.
* Python 3.11: megatron-core >= 0.17 declares Python >= 3.12; its cp311 wheel installs with
  ``pip install --ignore-requires-python --no-deps megatron-core==0.19.2`` and runs the paths used here.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
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
        return event if event is not None else _Event()


class _Event:
    """A CUDA event stand-in: already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def _split_sizes_as_lists(all_to_all_single: Any) -> Any:
    """Megatron's MoE dispatcher moves its split sizes to the host as numpy arrays only when
    they are on CUDA (``moe_utils.maybe_move_tensor_to_cpu``); on the CPU they stay tensors,
    which c10d does not take. (Patched on ``torch.distributed``, not in the mode: autograd runs
    the dispatcher's backward outside it.)"""

    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):  # noqa: ANN001
        if torch.is_tensor(output_split_sizes):
            output_split_sizes = output_split_sizes.tolist()
        if torch.is_tensor(input_split_sizes):
            input_split_sizes = input_split_sizes.tolist()
        return all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, *args, **kwargs
        )

    wrapper._split_sizes_as_lists = True  # type: ignore[attr-defined]
    return wrapper


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
    # The CPU itself rather than an index: autograd's backward runs Megatron's functions (the MoE
    # all-to-all's) outside the TorchFunctionMode, and they make tensors on this device.
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    cuda.current_stream = lambda device=None: _STREAM
    cuda.default_stream = lambda device=None: _STREAM
    cuda.Stream = _Stream  # type: ignore[misc]
    cuda.Event = _Event  # type: ignore[misc]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed seeds the CPU generator and then calls these.
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    if not getattr(dist.all_to_all_single, "_split_sizes_as_lists", False):
        dist.all_to_all_single = _split_sizes_as_lists(dist.all_to_all_single)
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Megatron's CUDA calls go to the CPU inside this block (see the module docstring)."""
    install_stubs()
    with CudaToCpu():
        yield
