"""Scenarios of tests/test_replica_check.py, run on every rank of a gloo group (one spawn each).

A bit of one gradient element is flipped on one rank after the reduce (DDP's all_reduce, HSDP's
replicate reduce), and the scaler must catch it at that step, skip it on every rank and name the
rank; a clean run must never see a mismatch.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.distributed as dist
from _common import gpu_path
from _torch_gaps import GAPS, run_case, torch_gaps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.probes import DispatchCounter, HostReadSpy
from distscaler import GradScaler, ReplicaMismatchError

#: Bits flipped per dtype: the sign, every exponent bit, the highest and lowest mantissa bits.
BITS = {
    "float32": [31, *range(23, 31), 22, 0],
    "float16": [15, *range(10, 15), 9, 0],
}
#: The step (0-based) whose gradients are corrupted.
FLIP_STEP = 1
STEPS = 3
_INT = {torch.float32: torch.int32, torch.float16: torch.int16}


def flip_bit_(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` (flat) of ``tensor`` in place, through its bit pattern."""
    ints = tensor.detach().view(-1).view(_INT[tensor.dtype])
    width = ints.element_size() * 8
    mask = -(1 << (width - 1)) if bit == width - 1 else 1 << bit  # the sign bit as a signed int
    ints[index] ^= mask


def digest(tensors: Any) -> list[str]:
    """Each tensor's bytes, as hex (bit-for-bit comparisons across ranks and steps)."""
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()
            for t in tensors]  # fmt: skip


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _ddp_case(
    rank: int,
    flip_rank: int,
    *,
    dtype: torch.dtype,
    opt_kind: str,
    clip: bool,
    path: str,
    bit: int,
    index: int,
) -> dict[str, Any]:
    model = _mlp(dtype)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=opt_kind == "fused",
                            foreach=opt_kind == "foreach")  # fmt: skip
    scaler = GradScaler("cpu", init_scale=2.0**4, replica_check_interval=1).register_model(ddp)
    if path == "gpu":
        gpu_path(scaler)
    out: dict[str, Any] = {"skipped": [], "mismatch_steps": [], "named": None}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + 10 * step + rank)  # each rank its own batch: DDP averages
        x = torch.randn(4, 8, dtype=dtype)
        loss = ddp(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == FLIP_STEP and rank == flip_rank:
            flip_bit_(model[0].weight.grad, index, bit)
        before = digest(model.parameters())
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        out["skipped"].append(digest(model.parameters()) == before)
        last = scaler.last_replica_mismatch
        if last is not None and last.step == step + 1:
            out["mismatch_steps"].append(step)
            out["named"] = list(last.ranks)
            out["what"] = last.what
    out["params"] = digest(model.parameters())
    out["ledger"] = scaler.replica_ledger.as_dict()
    return out


def ddp_flips(rank: int, world_size: int) -> dict[str, Any]:
    """Every bit of the list, fp32 and fp16 gradients, fused and foreach AdamW, clipping on and
    off, the CPU's path and the path a GPU runs; the flip on the last rank."""
    results: dict[str, Any] = {}
    flip_rank = world_size - 1
    cases = []
    for dtype_name, bits in BITS.items():
        opts = ["fused", "foreach"] if dtype_name == "float32" else ["fused"]  # fp16: no unscale_
        for opt_kind, clip, path, bit in itertools.product(opts, (False, True), ("cpu", "gpu"),
                                                           bits):  # fmt: skip
            cases.append((dtype_name, opt_kind, clip, path, bit))
    for i, (dtype_name, opt_kind, clip, path, bit) in enumerate(cases):
        key = f"{dtype_name}-{opt_kind}-{'clip' if clip else 'noclip'}-{path}-bit{bit}"
        results[key] = _ddp_case(rank, flip_rank, dtype=getattr(torch, dtype_name),
                                 opt_kind=opt_kind, clip=clip, path=path, bit=bit,
                                 index=(7 * i) % 128)  # fmt: skip
    return results


def hsdp_flips(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 HSDP (replicate 2 x shard world/2): a flip in one rank's local shard of a gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    flip_rank = world_size - 1
    for bit, clip in itertools.product([31, 30, 26, 23, 22, 0], (False, True)):
        model = _mlp(torch.float32)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = GradScaler("cpu", init_scale=2.0**4, replica_check_interval=1)
        out: dict[str, Any] = {"mismatch_steps": [], "named": None, "skipped": []}
        for step in range(STEPS):
            opt.zero_grad()
            torch.manual_seed(100 + 10 * step + rank)
            loss = model(torch.randn(4, 8)).square().mean()
            scaler.scale(loss).backward()
            if step == FLIP_STEP and rank == flip_rank:
                flip_bit_(model[0].weight.grad._local_tensor, 5, bit)
            before = digest(p._local_tensor for p in model.parameters())
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            out["skipped"].append(digest(p._local_tensor for p in model.parameters()) == before)
            last = scaler.last_replica_mismatch
            if last is not None and last.step == step + 1:
                out["mismatch_steps"].append(step)
                out["named"] = list(last.ranks)
                out["sets"] = [list(s) for s, _ in last.sets]
        out["params"] = digest(p._local_tensor for p in model.parameters())
        out["coordinate"] = list(mesh.get_coordinate())
        results[f"bit{bit}-{'clip' if clip else 'noclip'}"] = out
    return results


def _ddp_setup(rank: int, **settings: Any) -> tuple[nn.Module, DDP, torch.optim.Optimizer, GradScaler]:
    model = _mlp(torch.float32)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**4, **settings).register_model(ddp)
    return model, ddp, opt, scaler


def _step(rank: int, step: int, ddp: DDP, opt: Any, scaler: GradScaler, clip: bool = False) -> None:
    opt.zero_grad()
    torch.manual_seed(100 + 10 * step + rank)
    scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)


def actions(rank: int, world_size: int) -> dict[str, Any]:
    """A parameter flip caught at the next parameter check; ``"raise"`` and a callable."""
    out: dict[str, Any] = {}
    # A parameter bit flipped on the last rank after update 3: the parameter check every 2 updates
    # catches it at update 4 (the 4th iteration's pass, before its step).
    model, ddp, opt, scaler = _ddp_setup(rank, replica_check_interval=1, param_check_interval=2)
    seen = []
    for step in range(6):
        _step(rank, step, ddp, opt, scaler)
        scaler.step(opt)
        scaler.update()
        if step == 2 and rank == world_size - 1:
            with torch.no_grad():
                flip_bit_(model[2].weight, 3, 20)
        last = scaler.last_replica_mismatch
        if last is not None and last.step == step + 1:
            seen.append({"step": step, "what": last.what, "ranks": list(last.ranks)})
    out["param_flip"] = {"seen": seen, "ledger": scaler.replica_ledger.as_dict()}

    # "raise": every rank raises before the optimizer steps; nothing changed.
    model, ddp, opt, scaler = _ddp_setup(rank, replica_check_interval=1, on_replica_mismatch="raise")
    _step(rank, 0, ddp, opt, scaler)
    if rank == world_size - 1:
        flip_bit_(model[0].weight.grad, 0, 30)
    before = digest([*model.parameters(), *(t for s in opt.state.values() for t in s.values())])
    try:
        scaler.step(opt)
        out["raise"] = {"raised": None}
    except ReplicaMismatchError as e:
        after = digest([*model.parameters(), *(t for s in opt.state.values() for t in s.values())])
        out["raise"] = {"raised": str(e), "ranks": list(e.mismatch.ranks),
                        "unchanged": before == after, "scale": scaler.get_scale()}  # fmt: skip

    # A callable: called on every rank with the mismatch, then the step is skipped.
    calls: list[Any] = []
    model, ddp, opt, scaler = _ddp_setup(
        rank, replica_check_interval=1, on_replica_mismatch=lambda m: calls.append(list(m.ranks))
    )
    _step(rank, 0, ddp, opt, scaler)
    if rank == 0:  # after the reduce, before the check (clip_grad_norm_ runs it)
        flip_bit_(model[2].bias.grad, 1, 0)
    before = digest(model.parameters())
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    out["callable"] = {"calls": calls, "skipped": digest(model.parameters()) == before,
                       "step_was_skipped": scaler.step_was_skipped}  # fmt: skip
    return out


def clean_run(rank: int, world_size: int) -> dict[str, Any]:
    """2,000 clean steps in all: fused and foreach AdamW, clipping on and off, 2 micro-batches
    (DDP's no_sync on the first), a checkpoint saved at step 250 and resumed into new objects, the
    parameter check every 7 updates. No mismatch may be seen."""
    out: dict[str, Any] = {}
    for opt_kind, clip in itertools.product(("fused", "foreach"), (False, True)):
        model = _mlp(torch.float32)
        ddp = DDP(model)

        def build(
            model: nn.Module, ddp: DDP, opt_kind: str = opt_kind
        ) -> tuple[Any, GradScaler]:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=opt_kind == "fused",
                                    foreach=opt_kind == "foreach")  # fmt: skip
            scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=50,
                                replica_check_interval=1,
                                param_check_interval=7).register_model(ddp)  # fmt: skip
            return opt, scaler

        opt, scaler = build(model, ddp)
        checks = param_checks = skipped = 0
        for step in range(500):
            if step == 250:  # resume from a checkpoint into new objects
                saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
                ledger = scaler.replica_ledger.as_dict()
                checks += ledger["replica_checks"]
                param_checks += ledger["replica_param_checks"]
                model = _mlp(torch.float32)
                model.load_state_dict(saved[0])
                ddp = DDP(model)
                opt, scaler = build(model, ddp)
                opt.load_state_dict(saved[1])
                scaler.load_state_dict(saved[2])
            opt.zero_grad()
            for micro in range(2):
                torch.manual_seed(1000 * step + 10 * micro + rank)
                x = torch.randn(4, 8) * (1.0 + step % 5)
                if micro == 0:
                    with ddp.no_sync():
                        scaler.scale(ddp(x).square().mean()).backward()
                else:
                    scaler.scale(ddp(x).square().mean()).backward()
            if clip:
                scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
            skipped += scaler.step_was_skipped
        ledger = scaler.replica_ledger.as_dict()
        out[f"{opt_kind}-{'clip' if clip else 'noclip'}"] = {
            "checks": checks + ledger["replica_checks"],
            "param_checks": param_checks + ledger["replica_param_checks"],
            "mismatches": ledger["replica_mismatches"],
            "skipped": skipped,
            "params": digest(model.parameters()),
        }
    return out


def step_ops(rank: int, world_size: int) -> dict[str, Any]:
    """Device ops and host reads of a clean fused step + update with the check and without, on
    the CPU's path and on the path a GPU runs (both every 32nd update by default with torch's
    kernels): updates 2 and 63 (not checked) and 64 (the run's second check: its key drawn at
    the first)."""
    out: dict[str, Any] = {}
    for path, clip, check in itertools.product(("cpu", "gpu"), (False, True), (False, True)):
        model = _mlp(torch.float32)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = GradScaler("cpu", init_scale=2.0**8, replica_check=check).register_model(ddp)
        if path == "gpu":
            gpu_path(scaler)
        per_step = []
        for step in range(64):
            opt.zero_grad()
            scaler.scale(ddp(torch.randn(2, 8)).sum()).backward()
            spy = HostReadSpy()
            spy.exclude_optimizer(opt)
            with DispatchCounter() as counter, spy:
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
            if step in (1, 62, 63):
                per_step.append({"ops": dict(counter.ops), "reads": len(spy.reads)})
        out[f"{path}-{'clip' if clip else 'noclip'}-{'on' if check else 'off'}"] = per_step
    out["tensors"] = sum(1 for _ in model.parameters())
    return out


#: What the last rank writes into one reduced gradient: finite, past float32's range once
#: unscaled at a loss scale of 0.5 (times 2: inf).
PAST_FLOAT32 = 3e38


def unscaled_past_float32(rank: int, world_size: int) -> dict[str, Any]:
    """A finite corruption of the last rank's reduced gradient that the unscale takes past
    float32's range (a loss scale of 0.5): the replica check sees the mismatch and, where the
    gradients are unscaled in place, that rank's inf; the overflow check (torch's kernel checks
    before it multiplies) sees no inf. Then two clean
    steps. Per optimizer kind (the fused step on the GPU's path, a foreach one reading
    ``found_inf``)."""
    out: dict[str, Any] = {}
    for kind in ("fused", "foreach"):
        model = _mlp(torch.float32)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=kind == "fused",
                                foreach=kind == "foreach")  # fmt: skip
        scaler = GradScaler("cpu", init_scale=0.5, growth_interval=2, replica_check_interval=1)
        scaler.register_model(ddp)
        if kind == "fused":
            gpu_path(scaler)
        run: dict[str, list] = {"skipped": [], "scales": [], "trackers": [], "params": []}
        for step in range(3):
            _step(rank, step, ddp, opt, scaler)
            if step == 0 and rank == world_size - 1:
                model[0].weight.grad.view(-1)[3] = PAST_FLOAT32
            scaler.step(opt)
            scaler.update()
            run["skipped"].append(scaler.step_was_skipped)
            run["scales"].append(scaler.get_scale())
            run["trackers"].append(int(scaler.state_dict()["_growth_tracker"]))
            run["params"].append(digest(model.parameters()))
        totals = scaler.skip_totals
        run["causes"] = [totals.num_skipped, totals.replica_mismatches]
        last = scaler.replica_ledger.last_mismatch
        run["mismatch"] = None if last is None else [last.step, list(last.ranks),
                                                     list(last.nonfinite)]  # fmt: skip
        out[kind] = run
    return out


def everything_2(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "flips": ddp_flips(rank, world_size),
        "actions": actions(rank, world_size),
        "past_float32": unscaled_past_float32(rank, world_size),
        "clean": clean_run(rank, world_size),
        "ops": step_ops(rank, world_size),
    }


def everything_4(rank: int, world_size: int) -> dict[str, Any]:
    flips = {}
    for bit in (31, 30, 23, 0):  # DDP at 4 ranks: exactly the flipped rank is named
        flips[f"bit{bit}"] = _ddp_case(rank, 2, dtype=torch.float32, opt_kind="fused", clip=bit == 0,
                                       path="cpu", bit=bit, index=9)  # fmt: skip
    return {
        GAPS: torch_gaps(world_size),  # torch 2.6's own fully_shard fails on CPUs
        "ddp": flips,
        "hsdp": run_case(lambda: hsdp_flips(rank, world_size)),
        "odd": _three_replicas(rank),
    }


def _three_replicas(rank: int) -> dict[str, Any]:
    """DDP over 3 of the 4 ranks (coefficients 1, 1, -2), the scaler over the same 3."""
    sub = dist.new_group([0, 1, 2])
    if rank == 3:
        return {"named": None}
    model = _mlp(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**4, replica_check_interval=1, process_group=sub)
    ddp = DDP(model, process_group=sub)
    scaler.register_model(ddp)
    named = []
    for step in range(3):
        opt.zero_grad()
        torch.manual_seed(100 + 10 * step + rank)
        scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
        if step == 1 and rank == 1:
            flip_bit_(model[2].weight.grad, 4, 27)
        scaler.step(opt)
        scaler.update()
        last = scaler.last_replica_mismatch
        named.append(None if last is None or last.step != step + 1 else list(last.ranks))
    return {"named": named}
