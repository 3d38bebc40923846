"""Scenarios of tests/test_disabled_scaler.py on gloo ranks: a disabled scaler's
``clip_grad_norm_`` beside torch's ``clip_grad_norm_`` on a copy of the same gradients, under DDP
(``GradScaler("cuda")`` on a machine without CUDA, as a newcomer's first script builds it) and
under FSDP2; each call's collectives counted with torch's ``CommDebugMode``."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

#: (max_norm, norm_type) pairs: clipping, measuring only, the inf-norm.
CLIPS = ((0.05, 2.0), (math.inf, 2.0), (0.05, math.inf), (0.05, 1.0))


def _bits(tensors: list[torch.Tensor]) -> list[str]:
    out = []
    for t in tensors:
        t = getattr(t, "_local_tensor", t).detach().contiguous().view(-1)
        out.append(bytes(t.view(torch.uint8).tolist()).hex())
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _compare(rank: int, wrap: Any, scaler: GradScaler) -> list[dict[str, Any]]:
    """Each clip of `CLIPS` by the scaler and by torch on a twin holding the same gradients."""
    out = []
    for max_norm, norm_type in CLIPS:
        ours_model, twin_model = wrap(_model()), wrap(_model())
        opt = torch.optim.SGD(ours_model.parameters(), lr=0.1)
        for m in (ours_model, twin_model):
            torch.manual_seed(100 + rank)
            m(torch.randn(4, 8)).square().mean().backward()
        ours, twin = list(ours_model.parameters()), list(twin_model.parameters())
        assert _bits([p.grad for p in ours]) == _bits([p.grad for p in twin])  # the same start
        with CommDebugMode() as theirs_comm:
            expected = torch.nn.utils.clip_grad_norm_(twin, max_norm, norm_type)
        with CommDebugMode() as ours_comm:
            norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
        scaler.step(opt)  # a disabled scaler: the optimizer's step
        scaler.update()
        full, full_expected = _full(norm), _full(expected)
        out.append({
            "clip": [max_norm, norm_type],
            "norm": float(full),
            "norm_bits": _bits([full]) == _bits([full_expected]),
            "type": type(norm).__name__ == type(expected).__name__,
            "grads_bits": _bits([p.grad for p in ours]) == _bits([p.grad for p in twin]),
            "collectives": ours_comm.get_total_counts(),
            "torch_collectives": theirs_comm.get_total_counts(),
        })  # fmt: skip
    return out


def disabled_clip(rank: int, world_size: int) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available. Disabling."
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()
    out: dict[str, Any] = {"ddp": _compare(rank, DDP, scaler)}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def shard(model: nn.Module) -> nn.Module:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    out["fsdp2"] = _compare(rank, shard, scaler)
    return out
