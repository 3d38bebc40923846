"""Accelerate scenarios run inside spawned gloo ranks (tests/test_accelerate.py checks the results).

Each scenario builds an ``accelerate.Accelerator`` twice: "stock" (Accelerate with a
``torch.amp.GradScaler`` in ``accelerator.scaler``, which is what Accelerate creates itself for fp16
on GPUs; on the CPU it creates none, so the scenario puts it there before ``prepare``) and "ours"
(``install(accelerator)``). Nothing here asserts: every rank runs the same collectives whatever it
sees, and the parent process compares the ranks.

FSDP2 on the CPU: Accelerate only enables FSDP for accelerator device types, so the scenario sets
``distributed_type = FSDP`` and an FSDP2 plugin on the (shared) accelerator state after construction;
from there Accelerate's real FSDP2 code runs on gloo (``fully_shard`` in ``prepare``, DCP
``save_state``, ``load_state`` with ``set_optimizer_state_dict`` and its dummy optimizer step).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import mlp, set_rank_env
from _torch_gaps import GAPS, run_case, torch_gaps

from common.tensors import params_digest

NUM_STEPS = 4
INJECT_STEP = 2  # an inf on the last rank only, after DDP's all-reduce
GROWTH_INTERVAL = 4


def _accelerator(fsdp2: bool = False) -> Any:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    if fsdp2:
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        assert accelerator.is_fsdp2
    return accelerator


def _setup(kind: str, fused: bool, fsdp2: bool = False, **scaler_kwargs: Any) -> tuple:
    from distscaler import GradScaler
    from distscaler.integrations.accelerate import install

    accelerator = _accelerator(fsdp2)
    if kind == "stock":
        accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
        accelerator.native_amp = True
        scaler = accelerator.scaler
    model = mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    if kind == "ours":  # after prepare(): the harder case (the optimizer is already wrapped)
        scaler = install(accelerator, GradScaler("cpu", **scaler_kwargs))
    return accelerator, model, optimizer, scaler


def _train(accelerator: Any, model: Any, optimizer: Any, scaler: Any, steps: range) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, list] = {
        "skipped": [], "scales": [], "norms": [], "ref_norms": [], "unchanged": [], "seen": []
    }  # fmt: skip
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=gen)
        before = params_digest(model.parameters())
        loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        if step == INJECT_STEP and rank == world - 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out["seen"].append(any(not bool(g.isfinite().all()) for g in grads))
        # Reference: torch's 2-norm of the full (gathered), unscaled gradients, in float64.
        full = [(g.full_tensor() if hasattr(g, "full_tensor") else g).double() for g in grads]
        out["ref_norms"].append(
            float(torch.linalg.vector_norm(torch.stack([f.norm() for f in full])))
            / scaler.get_scale()
        )
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["skipped"].append(accelerator.optimizer_step_was_skipped)
        out["scales"].append(scaler.get_scale())
        out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        out["unchanged"].append(params_digest(model.parameters()) == before)
    out["params"] = params_digest(model.parameters())
    return out


def ddp_skip_and_clip() -> dict[str, Any]:
    """MULTI_CPU (DDP): an inf on the last rank only, fused and foreach AdamW, stock vs ours."""
    results = {}
    for fused in (True, False):
        for kind in ("stock", "ours"):
            accelerator, model, optimizer, scaler = _setup(kind, fused)
            res = _train(accelerator, model, optimizer, scaler, range(NUM_STEPS))
            res["distributed_type"] = str(accelerator.distributed_type)
            res["optimizer_class"] = type(optimizer).__name__
            results[f"{kind}-{'fused' if fused else 'foreach'}"] = res
    return results


def fsdp2_load_state(tmp: str) -> dict[str, Any]:
    """FSDP2: save after GROWTH_INTERVAL - 1 clean steps, load into a fresh model and optimizer.

    ``load_state`` runs a dummy optimizer step. With torch's scaler in Accelerate it is one more
    clean step: the tracker reaches the interval and the scale doubles.
    """
    results = {}
    for kind in ("stock", "ours"):
        kwargs = {"init_scale": 256.0, "growth_interval": GROWTH_INTERVAL}
        accelerator, model, optimizer, scaler = _setup(kind, fused=False, fsdp2=True, **kwargs)
        # Clean steps only: the inf step is beyond the range.
        trained = _train(
            accelerator, model, optimizer, scaler, range(100, 100 + GROWTH_INTERVAL - 1)
        )
        saved = scaler.state_dict()
        ckpt = os.path.join(tmp, kind)
        accelerator.save_state(ckpt)
        accelerator.free_memory()

        # A resumed run: a new accelerator, scaler, model and optimizer (empty optimizer state, so
        # set_optimizer_state_dict runs its dummy step).
        accelerator, model, opt, scaler = _setup(kind, fused=False, fsdp2=True, **kwargs)
        fresh = scaler.state_dict()
        calls = []
        step = opt.step  # test-only spy on the AcceleratedOptimizer: proves the dummy step ran

        def counting_step(*args: Any, _calls: list = calls, _step: Any = step, **kw: Any) -> Any:
            _calls.append(1)
            return _step(*args, **kw)

        opt.step = counting_step
        accelerator.load_state(ckpt)
        loaded = scaler.state_dict()
        results[kind] = {
            "trained": trained,
            "saved": saved,
            "loaded": loaded,
            "fresh": fresh,
            "dummy_steps": len(calls),
            "files": sorted(p.name for p in Path(ckpt).iterdir()),
            "is_fsdp2": bool(accelerator.is_fsdp2),
            "grad_type": type(next(iter(model.parameters()))).__name__,
            "skipped_after_load": accelerator.optimizer_step_was_skipped,
        }
        del opt.step
    return results


def everything(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    set_rank_env(rank, world_size)
    # A crash (torch's own, on an old torch) fails its scenario only (tests/_torch_gaps.py).
    return {
        GAPS: torch_gaps(world_size),
        "ddp": run_case(ddp_skip_and_clip),
        "fsdp2": run_case(lambda: fsdp2_load_state(tmp)),
    }
