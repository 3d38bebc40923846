"""One read of every gradient: a multi-tensor Triton kernel for the scaler's phase.

What it replaces (the torch path of the inf check): torch's check kernel or ``_foreach_norm`` for
the non-finite flag and the norm, ``_foreach_norm`` again for the per-tensor flags, the replica
check's own sums (one reduction per tensor), each a pass or a launch group of its own.

**What is read once.** `grad_pass()` reads every element of every gradient exactly once, in one
launch over all tensors (all dtypes: a block looks up its tensor's dtype and takes one of three
compiled branches), and from that read writes per-block partials of

* the largest magnitude (as the int32 bits of ``|x|`` in float32: ordered like the values, and
  NaN's bits sort above inf's, so one integer max gives the max, the inf flag and the NaN flag),
* ``sum |x|**p`` in float32 (p = 2 or 1; nothing for p = inf, which is the max),
* the replica checksum's two exact integer moments of the tensor's 16-bit words and, given the
  keyed weights, its two keyed sums (`kernels`' Keyed sums).

A second launch reduces the partials **in a fixed order** (each tensor's blocks by tiles, each tile
by ``tl.sum``'s fixed tree; no atomics, so the same bits on every run) into the step's collective
buffer ``stat = [found, norm_stat]``, the per-tensor statistics and the checksum moments.

**Cost.** One read of the bytes (no write), about ten integer ops per element for the
checksum, and the partials: 20 bytes per block (``chunk`` elements, at least 32,768), re-read
once by the reduction. On the host: per call, the tensors' addresses, sizes and dtypes gathered
in C (``map`` over ``Tensor``'s methods: the tables' cache key) and two or three Triton launches
(about 25 us each on the H100's host), which bound small cases in eager mode (a captured CUDA
graph replays without them). The scaler's own call skips the argument checks (``validate=False``).

Measured (``python launch/kernel_bench.py --iters 10``, NVIDIA H100 80GB HBM3, torch
2.11.0+cu130, Triton 3.6.0, 2026-11-27; ten calls queued back to back, CUDA events): one
1.536e9-element bfloat16 gradient, ``grad_pass`` + ``finish`` 1.16 ms (2.66 TB/s; one
``torch.sum`` read of the same bytes 1.01 ms, torch's unscale + clip recipe 10.2 ms), 2.35 ms with
the checksum; 500 mixed-dtype matrices of 225M elements 0.70 ms (0.73 ms with the
checksum); 2 GB of float32 0.75 ms (1.07x the read). These figures are of the kernels before
``tl.multiple_of`` (scalar loads) and before the checksum's row sums (124 registers per thread
then, 16 warps per SM); the kernels as they are now are not yet timed on a GPU.

The package, one module per role (each holds its part of the design in its docstring):

* `kernels`: the kernels, plain functions in Triton's language (int64 addressing, the
  checksum's exactness, the alignment);
* `runtime`: where they run, compiled for CUDA or in Triton's interpreter on the CPU
  (`available()`);
* `tables`: the address tables the kernels read, their blocks, their cache and `CONFIG`;
* `checks`: the entry points' checks of their arguments;
* `reference`: the same outputs with torch's ops (float64 gradients, the tests' reference) and the
  bound of the float32 norm (`norm_bound()`);
* `launch`: from the tensors to their tables to the kernels (`LAUNCHES`);
* `ops`: the entry points and their custom ops;
* `diagnostics`: for tests and ``launch/`` only: the kernels compiled for a GPU and inspected,
  the tables and launches one by one, the seam that counts or stubs the launches.

`distscaler._inf_check` is the library's one caller: it runs `phase()` where `available()`
says the kernels run. The rest of ``__all__`` is for tests and ``launch/``: the phase's steps
one by one, their launch counts and their references; what they inspect beyond it is
`distscaler._triton.diagnostics`'.
"""

from __future__ import annotations

from .launch import LAUNCHES
from .ops import FinishResult, PassResult, div_, finish, grad_pass, phase, scale_
from .reference import norm_bound, slot_sums
from .runtime import available

__all__ = [
    # the library's (`distscaler._inf_check`)
    "FinishResult",
    "PassResult",
    "available",
    "phase",
    # for tests and launch/: the phase's steps, their launch counts, their references
    "LAUNCHES",
    "div_",
    "finish",
    "grad_pass",
    "norm_bound",
    "scale_",
    "slot_sums",
]
