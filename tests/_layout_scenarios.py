"""Layout scenarios run inside spawned gloo ranks (tests/test_layouts.py checks their results).

Each layout of issue 3 (FSDP1 strategies, FSDP2 / HSDP / FSDP2 + TP, pipeline parallel alone and
with DP, DDP with ``no_sync()``) is built by a small builder and trained for a few steps twice, with
the same data and the same steps skipped:

* **ours**: ``distscaler.GradScaler`` + ``clip_grad_norm_`` + ``step`` + ``update``; a fault (inf,
  -inf or NaN) is written into one local gradient element on the targeted ranks only (first rank,
  last rank, every rank). Per step it records the collectives of ``clip_grad_norm_ + step +
  update`` (CommDebugMode), host reads (HostReadSpy), whether the local gradients held a
  non-finite value (the guard), the returned norm, a reference norm computed on the full gathered
  gradients (replicated copies compared and counted once), the scale, whether the step was
  skipped, and whether parameters and optimizer state were left bit-for-bit unchanged.
* **torch**: torch's own scaler where torch is correct: ``ShardedGradScaler`` (FSDP layouts) or
  ``torch.amp.GradScaler`` (DDP, pipeline stages), ``unscale_`` + torch's clipping
  (``FSDP.clip_grad_norm_``, ``torch.nn.utils.clip_grad_norm_`` on DTensors; for a pipeline, whose
  stages torch cannot clip globally, ``torch.nn.utils.clip_grads_with_norm_`` with the gathered
  global norm). Every fault of the ours-run is written on *every* rank here, so that each torch
  rank skips locally the steps our ranks skipped by agreement: a single process group.

Nothing here asserts across ranks; every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    FAULTS,
    OPTIMIZERS,
    TARGETS,
    digest,
    gpu_path,
    make_optimizer,
    mlp,
    optim_digest,
    target_ranks,
)
from _torch_gaps import CRASH, run_case, torch_gaps
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from common.probes import HostReadSpy
from common.tensors import local_tensor
from common.wrapping import fully_shard_blocks
from distscaler import GradScaler
from distscaler.layouts import UnknownLayoutError

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2
#: Below every gradient norm of these models, so the clip really scales the gradients.
MAX_NORM = 1e-3
DEVICE = "cpu"
#: Widths of the layouts' model: three Linear layers (indices 0, 2, 4 of the Sequential).
DIMS = (8, 16, 16, 4)

Fault = tuple[str, str]  # (fault name, target)


def full_schedule() -> list[Fault | None]:
    """Every (fault, target) pair once, with clean steps between the groups (13 steps)."""
    pairs = [(f, t) for t in TARGETS for f in FAULTS]
    return [None, *pairs[0:3], None, *pairs[3:6], None, *pairs[6:9], None]


def diagonal_schedule(opt_index: int) -> list[Fault | None]:
    """A Latin square over (fault, target) for optimizer ``opt_index`` (6 steps).

    Over the three optimizers every (fault, target), (optimizer, fault) and (optimizer, target)
    pair occurs once: 9 of the 27 cells of the cross product.
    """
    faults = list(FAULTS)
    pairs = [(faults[(opt_index + i) % 3], TARGETS[i]) for i in range(3)]
    return [None, pairs[0], None, pairs[1], pairs[2], None]


def first_rank_schedule() -> list[Fault | None]:
    """Faults on the first rank only (for a layout whose other ranks hold no gradients)."""
    return [None, ("inf", "first"), None, ("-inf", "first"), ("nan", "first"), None]


def state_digest(opt: torch.optim.Optimizer) -> tuple[str, str]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return digest(params), optim_digest(opt)


def local_values(opt: torch.optim.Optimizer) -> list[float]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return [v for p in params for v in local_tensor(p).detach().double().reshape(-1).tolist()]


def inject(opt: torch.optim.Optimizer, value: float) -> None:
    """Write ``value`` into the first element of the first non-empty local gradient."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and local_tensor(p.grad).numel() > 0:
                local_tensor(p.grad).view(-1)[0] = value
                return
    raise AssertionError("no local gradient to inject a fault into")


def locally_nonfinite(opt: torch.optim.Optimizer) -> bool:
    grads = [
        local_tensor(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None
    ]
    return any(not bool(g.isfinite().all()) for g in grads)


# ---------------------------------------------------------------------- builders


@dataclass
class Built:
    """One rank's part of a layout: what it trains and how to gather its gradients."""

    opt: torch.optim.Optimizer
    #: Forward + scaled backward of one optimizer step (``scale`` is the scaler's ``scale``).
    backward: Callable[[Callable[[torch.Tensor], torch.Tensor], int], None]
    #: {key: local piece of the gradients}; pieces with equal keys on several ranks are copies.
    pieces: Callable[[], dict[str, torch.Tensor]]
    #: torch's clipping of the unscaled gradients (returns the norm it computed).
    torch_clip: Callable[[float], torch.Tensor]
    #: Modules to register with the scaler, with their grad_layout.
    register: list[tuple[nn.Module, str | None]] = field(default_factory=list)
    #: "sharded": ShardedGradScaler (all-reduces found_inf in unscale_), except with a fused
    #: optimizer: torch 2.13's ShardedGradScaler keeps found_inf of shape (1,), which the fused
    #: AdamW kernel rejects after unscale_ ("output with shape [] doesn't match the broadcast
    #: shape [1]"); torch.amp.GradScaler there. "amp": torch.amp.GradScaler.
    torch_scaler: str = "sharded"
    #: Ranks whose stage has no trainable parameters (no gradients to fault).
    no_grads: bool = False
    hooks: list[Any] = field(default_factory=list)
    #: The model as the user holds it after wrapping (DDP/FSDP1 root, fully_shard-ed module, the
    #: pipeline stage); for naming parameters.
    model: nn.Module | None = None


def _data(seed: int, step: int, rows: int = 8, dim: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(rows, dim, generator=gen)


def _mse_backward(model: nn.Module, dp_seed: int) -> Callable[..., None]:
    def backward(scale: Callable[[torch.Tensor], torch.Tensor], step: int) -> None:
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = model(_data(dp_seed, step)).float().pow(2).mean()
        scale(loss).backward()

    return backward


def _dtensor_pieces(model: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def pieces() -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad
                out[name] = g.full_tensor() if isinstance(g, DTensor) else g
        return out

    return pieces


def _dtensor_clip(model: nn.Module) -> Callable[[float], torch.Tensor]:
    # torch's clip on DTensor gradients as torchtitan calls it: get_total_norm per device mesh
    # (torch cannot stack norms of different meshes, e.g. TP layers on a 2-D mesh next to plain
    # FSDP layers on its dp sub-mesh), full_tensor() to reduce each, then clip_grads_with_norm_.
    def clip(max_norm: float) -> torch.Tensor:
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in model.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh, []).append(p)
        norms = []
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    return clip


def build_fsdp1(rank: int, world_size: int, opt_kind: str, *, strategy: str, orig: bool) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = {}
    if strategy == "HYBRID_SHARD":  # 2 x 2: shard within a "node" of 2 ranks, replicate across
        kwargs["device_mesh"] = init_device_mesh(
            DEVICE, (world_size // 2, 2), mesh_dim_names=("replicate", "shard")
        )
    model = FSDP(
        mlp(0, DIMS),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=orig,
        device_id=torch.device(DEVICE),
        **kwargs,
    )
    opt = make_optimizer(opt_kind, model.parameters())

    def pieces() -> dict[str, torch.Tensor]:
        out = {}
        for i, module in enumerate(FSDP.fsdp_modules(model)):
            handle = module._handle
            if handle is None or handle.sharded_grad is None:
                continue
            shard = dist.get_rank(handle.process_group) if handle.uses_sharded_strategy else 0
            # The local flat shard (padding is zero): equal keys are replicas.
            out[f"fsdp{i}-shard{shard}"] = handle.sharded_grad
        return out

    return Built(
        opt=opt,
        backward=_mse_backward(model, rank),
        pieces=pieces,
        torch_clip=lambda max_norm: model.clip_grad_norm_(max_norm),
        register=[(model, None)],
        model=model,
    )


def _linears(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in model.children() if isinstance(layer, nn.Linear)]


def build_fsdp2(rank: int, world_size: int, opt_kind: str, *, variant: str) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = mlp(0, DIMS)
    if variant == "fp16":  # 1-D mesh, fp16 compute, fp32 gradient reduction and sharded grads
        mesh = init_device_mesh(DEVICE, (world_size,))
        mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        fully_shard_blocks(_linears(model), model, mesh, mp_policy=mp)
        dp_seed = rank
    elif variant == "mixed":  # fp32 + bf16 parameters in one optimizer (two dtype groups)
        mesh = init_device_mesh(DEVICE, (world_size,))
        model[2].to(torch.bfloat16)
        fully_shard_blocks(_linears(model), model, mesh)
        dp_seed = rank
    elif variant == "hsdp":  # 2-D mesh: replicate x shard
        mesh = init_device_mesh(DEVICE, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard_blocks(_linears(model), model, mesh)
        dp_seed = rank
    elif variant in ("tp", "tp-partial"):  # 2-D mesh: shard (FSDP) x tp
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(DEVICE, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        if variant == "tp":  # every layer tensor-parallel: every gradient lives on the 2-D mesh
            plan["4"] = ColwiseParallel(output_layouts=Replicate())
        # "tp-partial": the last Linear is left out of the plan, so FSDP shards it on the 1-D dp
        # sub-mesh and its gradient does not say that the tp ranks hold copies of it: the test
        # registers it as replicated (without that, clip_grad_norm_ raises; see unknown_layouts).
        parallelize_module(model, mesh["tp"], plan)
        fully_shard_blocks(_linears(model), model, mesh["dp"])
        dp_seed = mesh.get_coordinate()[0]  # the TP ranks of one replica see the same batch
    else:
        raise ValueError(variant)
    opt = make_optimizer(opt_kind, model.parameters())
    return Built(
        opt=opt,
        backward=_mse_backward(model, dp_seed),
        pieces=_dtensor_pieces(model),
        torch_clip=_dtensor_clip(model),
        register=[(model[4], "replicated")] if variant == "tp-partial" else [],
        model=model,
    )


def build_ddp_no_sync(rank: int, world_size: int, opt_kind: str) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(mlp(0, DIMS))
    opt = make_optimizer(opt_kind, model.parameters())

    def backward(scale: Callable[[torch.Tensor], torch.Tensor], step: int) -> None:
        # Two micro-batches: the first accumulates locally (no_sync), the second all-reduces.
        for micro in range(2):
            ctx = model.no_sync() if micro == 0 else contextlib.nullcontext()
            with ctx:
                with torch.autocast(DEVICE, dtype=torch.float16):
                    x = _data(rank, 10 * step + micro)
                    loss = model(x).float().pow(2).mean() / 2
                scale(loss).backward()

    def pieces() -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in model.module.named_parameters() if p.grad is not None}

    return Built(
        opt=opt,
        backward=backward,
        pieces=pieces,
        torch_clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm),
        register=[(model, None)],
        torch_scaler="amp",
        model=model,
    )


class _Stage(nn.Module):
    """A pipeline stage computing under fp16 autocast and sending float32 activations."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=torch.float16):
            return self.body(x).float()


def build_pipeline(
    rank: int, world_size: int, opt_kind: str, *, dp: int, frozen_last: bool = False
) -> Built:
    """2 stages; with ``dp == 2`` a 2 x 2 mesh (pp x dp) and each stage wrapped in DDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel as DDP

    num_stages = 2
    full = mlp(0, (8, 16, 16, 16, 4))  # the same initial weights on every rank
    stage_index = rank // dp
    dp_index = rank % dp
    bodies = [full[:3], full[3:]]
    body = bodies[stage_index]
    if frozen_last and stage_index == num_stages - 1:
        body.requires_grad_(False)  # a stage with no trainable parameters
    mesh = init_device_mesh(DEVICE, (num_stages, dp), mesh_dim_names=("pp", "dp"))
    module: nn.Module = _Stage(body)
    if dp > 1:
        module = DDP(module, process_group=mesh["dp"].get_group())
    scaler_box: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaler_box["scale"]((out - target).pow(2).mean())

    stage = PipelineStage(
        module, stage_index, num_stages, torch.device(DEVICE), group=mesh["pp"].get_group()
    )
    # One micro-batch under DDP: torch 2.13's pipeline runs every micro-batch's forward before the
    # backwards, and DDP then fails to rebuild its buckets ("rebuilt params size of 8").
    schedule = ScheduleGPipe(stage, n_microbatches=2 if dp == 1 else 1, loss_fn=loss_fn)
    params = list(body.parameters())
    opt = make_optimizer(opt_kind, params)

    def backward(scale: Callable[[torch.Tensor], torch.Tensor], step: int) -> None:
        scaler_box["scale"] = scale
        if stage_index == 0:
            schedule.step(_data(dp_index, step))
        else:
            schedule.step(target=_data(dp_index + 100, step, dim=4), losses=[])

    def pieces() -> dict[str, torch.Tensor]:
        return {
            f"stage{stage_index}-{n}": p.grad
            for n, p in body.named_parameters()
            if p.grad is not None
        }

    def torch_clip(max_norm: float) -> torch.Tensor:
        # torch cannot clip a pipeline globally: give its clip the gathered global norm.
        total = reference_norm(pieces(), 1.0)[0]
        grads_params = [p for p in params if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(grads_params, max_norm, torch.tensor(total))
        return torch.tensor(total)

    no_grads = frozen_last and stage_index == num_stages - 1
    return Built(
        opt=opt,
        backward=backward,
        pieces=pieces,
        torch_clip=torch_clip,
        register=[(module, "sharded")],
        torch_scaler="amp",
        no_grads=no_grads,
        model=module,
    )


#: name -> (world size, builder, full fault matrix?)
LAYOUTS: dict[str, tuple[int, Callable[..., Built], bool]] = {
    "fsdp1-full_shard": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="FULL_SHARD", orig=False), True),
    "fsdp1-full_shard-orig": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="FULL_SHARD", orig=True), False),
    "fsdp1-shard_grad_op": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="SHARD_GRAD_OP", orig=False), False),
    "fsdp1-shard_grad_op-orig": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="SHARD_GRAD_OP", orig=True), False),
    "fsdp1-no_shard": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="NO_SHARD", orig=False), False),
    "fsdp1-no_shard-orig": (2, lambda r, w, o: build_fsdp1(r, w, o, strategy="NO_SHARD", orig=True), False),
    "fsdp2-fp16": (2, lambda r, w, o: build_fsdp2(r, w, o, variant="fp16"), True),
    "fsdp2-mixed-dtypes": (2, lambda r, w, o: build_fsdp2(r, w, o, variant="mixed"), False),
    "pp": (2, lambda r, w, o: build_pipeline(r, w, o, dp=1), False),
    "pp-frozen-stage": (2, lambda r, w, o: build_pipeline(r, w, o, dp=1, frozen_last=True), False),
    "ddp-no_sync": (2, build_ddp_no_sync, False),
    "fsdp1-hybrid_shard": (4, lambda r, w, o: build_fsdp1(r, w, o, strategy="HYBRID_SHARD", orig=False), False),
    "fsdp1-hybrid_shard-orig": (4, lambda r, w, o: build_fsdp1(r, w, o, strategy="HYBRID_SHARD", orig=True), False),
    "hsdp": (4, lambda r, w, o: build_fsdp2(r, w, o, variant="hsdp"), True),
    "fsdp2-tp": (4, lambda r, w, o: build_fsdp2(r, w, o, variant="tp"), False),
    "fsdp2-tp-partial": (4, lambda r, w, o: build_fsdp2(r, w, o, variant="tp-partial"), False),
    "pp-dp": (4, lambda r, w, o: build_pipeline(r, w, o, dp=2), False),
}  # fmt: skip


def schedule_for(layout: str, opt_index: int) -> list[Fault | None]:
    if layout == "pp-frozen-stage":
        return first_rank_schedule()
    if LAYOUTS[layout][2]:
        return full_schedule()
    return diagonal_schedule(opt_index)


# ---------------------------------------------------------------------- the runs


def reference_norm(pieces: dict[str, torch.Tensor], scale: float) -> tuple[float, bool]:
    """The 2-norm of the full unscaled gradients, each distinct piece counted once, on every rank.

    Gathers every rank's pieces (all_gather_object); pieces with the same key on several ranks
    are replicas and must be bit-identical (returned as the second value). fp64 throughout.
    """
    local = {k: v.detach().to("cpu", torch.float64) for k, v in pieces.items()}
    gathered: list[dict[str, torch.Tensor]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    unique: dict[str, torch.Tensor] = {}
    replicas_equal = True
    for rank_pieces in gathered:
        for key, value in rank_pieces.items():
            if key in unique:
                replicas_equal &= bool(torch.equal(unique[key], value))
            else:
                unique[key] = value
    total = sum(float((v / scale).pow(2).sum()) for v in unique.values())
    return math.sqrt(total), replicas_equal


def run_ours(layout: str, rank: int, world_size: int, opt_kind: str, schedule: list) -> dict:
    return _run_ours(layout, rank, world_size, opt_kind, schedule)


def _run_ours(layout: str, rank: int, world_size: int, opt_kind: str, schedule: list) -> dict:
    built = LAYOUTS[layout][1](rank, world_size, opt_kind)
    # The path a GPU runs: host reads are counted below.
    scaler = gpu_path(GradScaler(DEVICE, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL))
    for module, grad_layout in built.register:
        scaler.register_model(module, grad_layout=grad_layout)
    scaler.materialize(DEVICE)  # first pipeline stages never call scale()
    spy = HostReadSpy()
    spy.exclude_optimizer(built.opt)
    out: dict[str, list] = {
        k: []
        for k in (
            "skipped",
            "scales",
            "norms",
            "ref_norms",
            "replicas_equal",
            "local_nonfinite",
            "unchanged",
            "comms",
            "host_reads",
        )
    }
    for step, fault in enumerate(schedule):
        built.opt.zero_grad(set_to_none=True)
        built.backward(scaler.scale, step)
        if fault is not None and rank in target_ranks(fault[1], world_size):
            inject(built.opt, FAULTS[fault[0]])
        out["local_nonfinite"].append(locally_nonfinite(built.opt))
        scale = scaler.get_scale()
        ref, equal = reference_norm(built.pieces(), scale)
        out["ref_norms"].append(ref)
        out["replicas_equal"].append(equal)
        before = state_digest(built.opt)
        spy.reads.clear()
        with CommDebugMode() as comm, spy:
            norm = scaler.clip_grad_norm_(built.opt, MAX_NORM)
            scaler.step(built.opt)
            scaler.update()
        out["host_reads"].append(len(spy.reads))
        out["comms"].append({str(k): v for k, v in comm.get_comm_counts().items()})
        out["norms"].append(float(norm))
        out["skipped"].append(scaler.step_was_skipped)
        out["scales"].append(scaler.get_scale())
        out["unchanged"].append(state_digest(built.opt) == before)
    out["params"] = local_values(built.opt)
    out["no_grads"] = built.no_grads
    return out


def run_torch(layout: str, rank: int, world_size: int, opt_kind: str, schedule: list) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    built = LAYOUTS[layout][1](rank, world_size, opt_kind)
    kwargs = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler: torch.amp.GradScaler
    if built.torch_scaler == "sharded" and opt_kind != "fused":
        scaler = ShardedGradScaler(DEVICE, **kwargs)
    else:
        scaler = torch.amp.GradScaler(DEVICE, **kwargs)
    out: dict[str, list] = {"skipped": [], "scales": [], "norms": [], "comms": []}
    for step, fault in enumerate(schedule):
        built.opt.zero_grad(set_to_none=True)
        built.backward(scaler.scale, step)
        if scaler._scale is None:  # a first pipeline stage: torch's scale appears lazily
            scaler._lazy_init_scale_growth_tracker(torch.device(DEVICE))
        if fault is not None and not built.no_grads:
            inject(built.opt, FAULTS[fault[0]])  # on every rank: torch decides per rank
        scale_before = scaler.get_scale()
        with CommDebugMode() as comm:
            if built.no_grads:
                # torch raises "No inf checks were recorded for this optimizer." for a rank without
                # gradients: this rank only joins the reference norm's gather; not compared.
                norm = built.torch_clip(MAX_NORM)
            else:
                scaler.unscale_(built.opt)
                norm = built.torch_clip(MAX_NORM)
                scaler.step(built.opt)
                scaler.update()
        out["comms"].append({str(k): v for k, v in comm.get_comm_counts().items()})
        out["norms"].append(float(norm))
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(scaler.get_scale() < scale_before)
    out["params"] = local_values(built.opt)
    return out


def layout_matrix(rank: int, world_size: int, only: set[str] | None = None) -> dict[str, Any]:
    """Every layout of this world size x every optimizer: ours and torch's run."""
    results: dict[str, Any] = {}
    for name, (size, _, _) in LAYOUTS.items():
        if size != world_size or (only is not None and name not in only):
            continue
        for i, opt_kind in enumerate(OPTIMIZERS):
            # A crash (torch's own, on an old torch) fails this layout only, not its neighbours.
            result = run_case(functools.partial(_layout_case, name, rank, world_size, opt_kind, i))
            results[f"{name}-{opt_kind}"] = result
            if CRASH in result:  # the same crash for its other optimizers: not run again
                for other in OPTIMIZERS[i + 1 :]:
                    results[f"{name}-{other}"] = result
                break
    return results


def _layout_case(name: str, rank: int, world_size: int, opt_kind: str, i: int) -> dict[str, Any]:
    schedule = schedule_for(name, i)
    start = time.perf_counter()
    ours = run_ours(name, rank, world_size, opt_kind, schedule)
    middle = time.perf_counter()
    ref = run_torch(name, rank, world_size, opt_kind, schedule)
    return {
        "schedule": schedule,
        "ours": ours,
        "torch": ref,
        "seconds": [middle - start, time.perf_counter() - middle],
    }


# ---------------------------------------------------------------------- unknown layouts


@contextlib.contextmanager
def _expect_unknown(record: dict[str, Any]) -> Iterator[None]:
    try:
        yield
    except UnknownLayoutError as e:
        record["error"] = str(e)
        record["error_type"] = type(e).__name__
    else:
        record["error"] = None


UNKNOWN_CASES = ("fsdp1-unregistered", "plain-no-grad-layout", "fsdp2-sub-mesh")


def unknown_layouts(rank: int, world_size: int) -> dict[str, Any]:
    """clip_grad_norm_ without a known layout raises on every rank, changes nothing, hangs nothing."""
    results: dict[str, Any] = {}
    for case in UNKNOWN_CASES:
        results[case] = run_case(functools.partial(_unknown_case, case, rank, world_size))
    return results


def _unknown_case(case: str, rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    if case == "fsdp1-unregistered":
        model: nn.Module = FSDP(mlp(0, DIMS), device_id=torch.device(DEVICE))
    elif case == "fsdp2-sub-mesh":  # sharded over a 1-rank dp sub-mesh: copies on the tp ranks
        model = mlp(0, DIMS)
        mesh = init_device_mesh(DEVICE, (1, world_size), mesh_dim_names=("dp", "tp"))
        fully_shard(model, mesh=mesh["dp"])
    else:
        model = mlp(0, DIMS)
    opt = make_optimizer("fused", model.parameters())
    scaler = GradScaler(DEVICE, init_scale=INIT_SCALE)
    copies = case == "fsdp2-sub-mesh"  # the tp ranks of one replica see the same batch
    with torch.autocast(DEVICE, dtype=torch.float16):
        loss = model(_data(0 if copies else rank, 0)).float().pow(2).mean()
    scaler.scale(loss).backward()
    grads_before = digest([p.grad for p in model.parameters()])
    record: dict[str, Any] = {}
    if copies:  # every rank holds the whole gradient: the global norm is the local one
        local = [local_tensor(p.grad).double() / INIT_SCALE for p in model.parameters()]
        record["local_norm"] = math.sqrt(sum(float(g.pow(2).sum()) for g in local))
    with CommDebugMode() as comm, _expect_unknown(record):
        scaler.clip_grad_norm_(opt, MAX_NORM)
    record["collectives"] = comm.get_total_counts()
    record["grads_unchanged"] = digest([p.grad for p in model.parameters()]) == grads_before
    record["stage"] = scaler._per_optimizer_states[id(opt)]["stage"].name
    # The ranks are still in step: a later collective completes (no rank waits in a collective).
    probe = torch.ones(1)
    dist.all_reduce(probe)
    record["probe"] = float(probe)
    # After registering (or naming the layout), the same scaler works.
    if case == "fsdp1-unregistered":
        scaler.register_model(model)
    elif case == "fsdp2-sub-mesh":
        scaler.register_model(model, grad_layout="replicated")
    else:
        scaler.register_model(model, grad_layout="sharded")
    record["norm_after_fix"] = float(scaler.clip_grad_norm_(opt, MAX_NORM))
    scaler.step(opt)
    scaler.update()
    return record


EMPTY_SHARD_CASES = {"pinf": math.inf, "p2": 2.0, "noclip": None}
#: The step whose gradient holds an inf on rank 0 (in the shard rank 1 has none of).
EMPTY_SHARD_INF_STEP = 1


def empty_shard(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 over 2 ranks of a model whose first layer has one output row: rank 1 holds an empty
    shard (0 elements) of its weight and bias. For a clip at p = inf, at p = 2 and no clip, with the
    overflow report read every update: three steps, an inf on rank 0 at `EMPTY_SHARD_INF_STEP`;
    each step's norm beside the norm of the gathered gradients (``full_tensor()``, float64)."""
    return {case: run_case(functools.partial(_empty_shard_case, norm_type, rank))
            for case, norm_type in EMPTY_SHARD_CASES.items()}  # fmt: skip


def _empty_shard_case(norm_type: float | None, rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(DEVICE, init_scale=INIT_SCALE, skip_log_interval=1)
    scaler.register_model(model)
    record: dict[str, Any] = {
        "local_numels": [local_tensor(p).numel() for p in model.parameters()],
        "norms": [], "reference": [], "skipped": [], "scales": [],
    }  # fmt: skip
    for step in range(3):
        data = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        scaler.scale(model(data).sum()).backward()
        if step == EMPTY_SHARD_INF_STEP and rank == 0:
            local_tensor(model[0].weight.grad).view(-1)[0] = math.inf
        if norm_type is not None:
            full = [p.grad.full_tensor().double().flatten() / scaler.get_scale()
                    for p in model.parameters()]  # fmt: skip
            record["reference"].append(float(torch.linalg.vector_norm(torch.cat(full), norm_type)))
            record["norms"].append(float(scaler.clip_grad_norm_(opt, 1.0, norm_type)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        record["skipped"].append(scaler.step_was_skipped)
        record["scales"].append(scaler.get_scale())
    report = scaler.report_overflow()
    record["report"] = None if report is None else [[e.rank, e.param, e.kind] for e in report.entries]
    return record


def everything(rank: int, world_size: int) -> dict[str, Any]:
    out = {"torch_gaps": torch_gaps(world_size), "matrix": layout_matrix(rank, world_size)}
    if world_size == 2:
        out["unknown"] = unknown_layouts(rank, world_size)
        out["empty_shard"] = empty_shard(rank, world_size)  # last: a crash there stalls no other
    return out


def fsdp2_model_moves_after_a_step(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 + ``register_model`` + a clipped step, then ``model.to()`` both ways (what a framework
    does to offload its model between training and rollout: a swap of each DTensor parameter,
    which torch refuses for a tensor with a weak reference); then a second step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", init_scale=256.0).register_model(model)
    named = len(scaler._overflows._names._entries)  # the names registered
    out: dict[str, Any] = {"named": named, "moved": [], "scales": []}

    def step() -> None:
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["scales"].append(scaler.get_scale())

    step()
    for dtype in (torch.float64, torch.float32):  # away and back, as an offload does
        try:
            model.to(dtype)
            out["moved"].append(str(next(model.parameters()).dtype))
        except RuntimeError as e:
            out["moved"].append(f"failed: {e}")
    step()
    return out
