"""Probes of a step: its wall time, its device ops, its host reads of tensor values, its c10d
collectives (with bytes).

``PhaseTimer`` times a region (CUDA events on GPUs). The counters are modes: whatever runs inside
``with DispatchCounter() as ops`` / ``with HostReadSpy() as spy`` / ``with CollectiveLog() as log``
is counted, whichever library issued it (distscaler, torch's scalers, DeepSpeed's checks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveLog", "DispatchCounter", "HostReadSpy", "PhaseTimer", "count_per_step"]

# Python-level ways of reading a tensor value on the host. On CUDA each of these is a sync.
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}

#: What CommDebugMode counts as a collective (not wait_tensor and other bookkeeping ops).
_COLLECTIVES = {
    *c10d_collective_ops,
    *(op._overloadpacket if hasattr(op, "_overloadpacket") else op for op in NATIVE_TO_PY_MAPPING),
}


class HostReadSpy(TorchFunctionMode):
    """Counts host reads of tensor values (``.item()``, ``bool(t)``, ``.tolist()``...) inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and not self._paused:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    def exclude_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Do not count reads made inside ``optimizer.step`` (torch's for-loop Adam reads its step)."""
        step = optimizer.step

        def paused_step(*args, **kwargs):
            self._paused += 1
            try:
                return step(*args, **kwargs)
            finally:
                self._paused -= 1

        optimizer.step = paused_step  # type: ignore[method-assign]


#: Ops that make no device work: views, aliases autograd and tensor creation leave behind, and the
#: profiler's record-function markers.
_NO_WORK = {torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten.lift_fresh}
_NO_WORK_NAMESPACES = {"profiler"}


class DispatchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it that do work on a device (views left out).

    On a GPU each is (at least) one kernel launch, so the count is what sets the time of a step
    while it is launch-bound; it is the same on every machine, and countable on a CPU. ``ops`` maps
    each op's name (``aten._foreach_norm.Scalar``...) to its count; ``total`` is their sum.
    Collectives (``c10d.allreduce_``...) are ops too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return (
                NotImplemented  # count the plain-tensor ops and collectives DTensor turns it into
            )
        if not (
            func.is_view or func.overloadpacket in _NO_WORK or func.namespace in _NO_WORK_NAMESPACES
        ):
            name = str(func)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class CollectiveLog(TorchDispatchMode):
    """Records every c10d collective dispatched inside it with the bytes of its input tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor desugar its op into plain-tensor ops and collectives first (as
            # CommDebugMode does); they come back here.
            return NotImplemented
        if func._overloadpacket in _COLLECTIVES:
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            nbytes = sum(
                t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
            )
            self.calls.append((str(func.overloadpacket), nbytes))
        return func(*args, **(kwargs or {}))


def count_per_step(
    step: Callable[[], Any], *, untimed: Callable[[], Any] | None = None, steps: int = 3
) -> dict:
    """Run ``step()`` ``steps`` times under the counters; per key, the median step's count.

    Returns ``{"collectives": int, "collective_bytes": int, "host_reads": int, "ops": int}``
    (``ops``: device ops, :class:`DispatchCounter`). The median leaves out a step that does the
    work of many, as distscaler's periodic skip report does once every ``skip_log_interval``
    updates (a host read and a few ops). ``untimed`` (run before each step, outside the counters)
    restores the gradients. Reads made inside an optimizer's own ``step`` are the optimizer's, not
    the scaler's: pause the spy there with :meth:`HostReadSpy.exclude_optimizer` before calling
    this.
    """
    counts: list[dict[str, int]] = []
    for _ in range(steps):
        if untimed is not None:
            untimed()
        with HostReadSpy() as spy, CollectiveLog() as log, DispatchCounter() as ops:
            step()
        counts.append(
            {
                "collectives": len(log.calls),
                "collective_bytes": sum(n for _, n in log.calls),
                "host_reads": len(spy.reads),
                "ops": ops.total,
            }
        )
    return {key: statistics.median_low(c[key] for c in counts) for key in counts[0]}


class PhaseTimer:
    """Wall time of a region (the job's scaler phase, a benchmark call) between ``start()`` and
    ``stop()``, in seconds. CUDA events on GPUs: no host sync until :meth:`seconds`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: tuple[Any, Any] | None = None
        self._t0 = 0.0
        self._dt = 0.0

    def start(self) -> None:
        if self.cuda:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._dt = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """Read after the step's own host reads (on CUDA it waits for the end event)."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._dt
