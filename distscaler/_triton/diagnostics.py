"""For tests and ``launch/`` only (the library imports none of it): the kernels compiled for a GPU
on any machine and inspected (`ptx_accesses()`, `registers()`); the configuration the kernels
and their tables are cut by (`CONFIG`, changed in place to shrink or sweep it); the tables and the
two launches one by one (a fake table runs the kernels past 2**31 elements); the seam that counts
or stubs the launches (`use_kernels()`); whether Triton's interpreter runs the kernels here
(`interpreter_runs()`) and whether the custom ops are registered (`OPS`)."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

from . import runtime
from .kernels import RAW
from .launch import launch_pass, launch_scale
from .ops import OPS
from .runtime import get_kernels, interpreter_runs, triton_importable
from .tables import CONFIG, DTYPE_KIND, Tables, build_tables, tables_for

__all__ = [
    "CONFIG",
    "DTYPE_KIND",
    "OPS",
    "RAW",
    "Tables",
    "build_tables",
    "can_compile_for_a_gpu",
    "compile_for_a_gpu",
    "get_kernels",
    "interpreter_runs",
    "launch_pass",
    "launch_scale",
    "ptx_accesses",
    "registers",
    "tables_for",
    "use_kernels",
]


def use_kernels(make: Callable[[bool], Any]) -> Callable[[bool], Any]:
    """From now on every launch takes its kernels from ``make(interpret)`` (`get_kernels()`'s
    signature: a namespace of the kernels by `RAW`'s names), to count or stub the launches.
    Returns the function in use before, to put back by another call."""
    previous = runtime.get_kernels
    runtime.get_kernels = make  # type: ignore[assignment]  # (a cached function there)
    return previous


def can_compile_for_a_gpu() -> bool:
    """Whether `compile_for_a_gpu()` can run here: Triton importable, with its CUDA backend and
    an ``ASTSource`` that takes ``constexprs`` (Triton >= 3.3)."""
    if not triton_importable():
        return False
    import importlib.util
    import inspect

    from triton.compiler import ASTSource

    return (importlib.util.find_spec("triton.backends.nvidia") is not None
            and "constexprs" in inspect.signature(ASTSource).parameters)  # fmt: skip


def compile_for_a_gpu(name: str, consts: dict[str, Any], arch: int = 90) -> Any:
    """Kernel ``name`` (``"_read_kernel"``, ``"_reduce_kernel"``, ``"_scale_kernel"``) compiled
    with the constexprs ``consts`` for an NVIDIA GPU of compute capability ``arch`` (90: H100), on
    any machine (Triton's compiler and its bundled ``ptxas``; no GPU): Triton's compiled kernel,
    whose ``asm`` holds the PTX and the cubin. Pointer arguments are declared 16-byte aligned (as
    Triton's launcher specializes torch's allocations), integers int32 (the primes int64);
    ``num_warps`` is `CONFIG`'s. A diagnostic (`ptx_accesses()`, `registers()`)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(runtime.get_kernels(False), name)
    sig: dict[str, str] = {}
    for arg in inspect.signature(RAW[name]).parameters:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in ("num_blocks", "num_tensors", "chunk"):
            sig[arg] = "i32"
        elif arg in ("p1", "p2"):
            sig[arg] = "i64"
        elif arg in ("part_s", "factor", "stat", "per_tensor", "scale", "max_norm", "out"):
            sig[arg] = "*fp32"
        elif arg == "keys":
            sig[arg] = "*i32"
        else:
            sig[arg] = "*i64"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    source = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": CONFIG["num_warps"]})  # fmt: skip


def ptx_accesses(compiled: Any) -> collections.Counter:
    """The global loads, stores, atomics and reductions of a `compile_for_a_gpu()` kernel,
    counted by PTX instruction (``ld.global.v4.b32``: 16 bytes in one load)."""
    import re

    found = re.findall(r"\b(?:ld|st|red|atom)\.global[\w.]*", compiled.asm["ptx"])
    return collections.Counter(found)


def registers(compiled: Any) -> dict[str, int]:
    """A `compile_for_a_gpu()` kernel's resources per thread from its cubin (``REG``: registers,
    ``STACK``: bytes spilled), as the ``cuobjdump`` bundled with Triton reports them; empty where
    it cannot run."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        try:
            shown = subprocess.run([tool, "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return {}
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", shown)}
