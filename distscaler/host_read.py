"""Where a verdict may read its flag on the host: the devices on which a host read costs no sync.

A fused optimizer step on a GPU never reads a device value on the host: the agreed flag goes to the
kernel as a tensor, and the step can be captured in a CUDA graph (the design's core promise). On
the CPU a kernel has run when it returns, so reading its result costs no sync: there the verdict
reads the flag and spends ops on the overflow report (tensor codes) only for a skipped step
(:mod:`distscaler.verdict`). A traced step (``make_fx``, ``torch.compile``) must record what a GPU
runs, so it reads nothing on any device.

Tests that prove the GPU's verdict on the CPU empty :data:`HOST_READ_FREE`.
"""

from __future__ import annotations

import torch

__all__ = ["HOST_READ_FREE", "host_read_is_free"]

#: Device types where reading a value on the host costs no device sync (their kernels already ran
#: when they returned): there a verdict reads its flag and codes the gradients only on a skip.
HOST_READ_FREE = frozenset({"cpu"})


def host_read_is_free(device: torch.device) -> bool:
    """Whether a verdict on ``device`` may read its flag on the host: a device of
    :data:`HOST_READ_FREE` (the CPU) and no graph being traced (``make_fx``, ``torch.compile``),
    which must record the same device ops as a GPU step. Never on CUDA: fused steps there keep
    their promise of no host sync."""
    if device.type not in HOST_READ_FREE or torch.compiler.is_compiling():
        return False
    # make_fx's proxy mode, or fake tensors (AOT tracing): two C++ lookups, no Python walk.
    return _dispatch_mode(_PROXY) is None and _dispatch_mode(_FAKE) is None


_dispatch_mode = torch._C._get_dispatch_mode
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE
