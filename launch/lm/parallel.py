"""How the job lays the model out over the ranks: one builder per ``--parallelism``.

Every builder starts from the same ``ByteGPT`` (same seed, so the same initial function on every
rank and in every layout) and returns a :class:`Parallel`: the module the step calls, what the
optimizer and the checkpoint get, the data-parallel coordinates that pick each rank's batches, and
how the scaler learns the gradients' layout (docs/layouts.md, "Sharded and model-parallel layouts"):

==========  ==========================================================  ========================
layout      wrapping                                                    scaler learns it from
==========  ==========================================================  ========================
ddp         ``DistributedDataParallel``                                 ``register_model(ddp)``
fsdp1       ``FullyShardedDataParallel`` per block + root, FULL_SHARD,  ``register_model(fsdp)``
            ``use_orig_params=True`` (fused AdamW over the originals)
fsdp2       ``fully_shard`` per block + root, 1-D mesh                  DTensor placements
hsdp        ``fully_shard`` on a 2-D (replicate, shard) mesh            DTensor placements
tp          Colwise/RowwiseParallel over qkv/proj and the MLP, every    DTensor placements
            other parameter a replicated DTensor; FSDP2 over ``dp``
            when the world has more ranks than ``tp_size``
pp          ``lm.pipeline``: stages of torch.distributed.pipelining,    ``register_model`` (DDP,
            DDP over each stage's replicas when world > ``pp_stages``   or ``"sharded"`` alone)
==========  ==========================================================  ========================

Mixed precision is fp16 autocast in every layout (fp32 parameters, fp32 gradient reduction), so
the layouts compute the same function; FSDP2's ``MixedPrecisionPolicy`` is not used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from common.distributed import Dist
from common.wrapping import ddp_device_ids, fully_shard_blocks
from lm.config import TrainConfig
from lm.layout import Parallel
from lm.model import ByteGPT
from lm.pipeline import build_pipeline

__all__ = ["build_parallel", "check_parallelism"]


def check_parallelism(cfg: TrainConfig, world_size: int, *, launched: bool) -> list[str]:
    """Every reason ``cfg.parallelism`` cannot run on ``world_size`` ranks (empty: it can).

    Checked from the launcher's environment before any process group exists, so that a bad
    combination exits with a message instead of hanging in the first collective.
    """
    name = cfg.parallelism
    problems = []
    if cfg.inject_inf is not None and cfg.inject_inf.rank >= world_size:
        problems.append(
            f"inject_inf.rank must be in [0, {world_size}) for this world size, "
            f"got: {cfg.inject_inf.rank}"
        )
    if name != "ddp" and not launched:
        problems.append(
            f"parallelism {name!r} needs a process group: launch with torchrun "
            "(a single process without torchrun runs parallelism 'ddp' only)"
        )
        return problems
    if name == "hsdp":
        shard = cfg.hsdp_shard_size
        if world_size % shard or world_size // shard < 2:
            problems.append(
                f"parallelism 'hsdp' needs a world size that is a multiple of hsdp_shard_size="
                f"{shard} with at least 2 replicas (>= {2 * shard} ranks), got: world size "
                f"{world_size}; set hsdp_shard_size (1 gives {world_size} replicas of 1 shard) "
                "or use --parallelism fsdp2"
            )
    elif name == "tp":
        if world_size % cfg.tp_size:
            problems.append(
                f"parallelism 'tp' needs a world size that is a multiple of tp_size="
                f"{cfg.tp_size}, got: {world_size}"
            )
        if cfg.n_head % cfg.tp_size:
            problems.append(
                f"parallelism 'tp' splits the heads: n_head must be a multiple of tp_size, got: "
                f"n_head={cfg.n_head}, tp_size={cfg.tp_size}"
            )
    elif name == "pp" and world_size % cfg.pp_stages:
        problems.append(
            f"parallelism 'pp' needs a world size that is a multiple of pp_stages="
            f"{cfg.pp_stages} (one rank per stage and replica), got: {world_size}"
        )
    return problems


def _ddp(model: ByteGPT, cfg: TrainConfig, d: Dist) -> Parallel:
    if not d.enabled:
        return Parallel(
            name="ddp",
            model=model,
            state_module=model,
            sharded_checkpoint=False,
            describe="single process",
        )
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model, device_ids=ddp_device_ids(d.device))
    return Parallel(
        name="ddp",
        model=wrapped,
        state_module=model,
        dp_rank=d.rank,
        dp_size=d.world_size,
        register=[(wrapped, None)],
        sharded_checkpoint=False,
        describe=f"DDP over {d.world_size} ranks",
    )


def _fsdp1(model: ByteGPT, cfg: TrainConfig, d: Dist) -> Parallel:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lm.model import Block

    wrapped = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,  # the optimizer (fused AdamW) sees the original parameters
        device_id=d.device,  # the CPU too: without it FSDP1 looks for an accelerator
    )
    return Parallel(
        name="fsdp1",
        model=wrapped,
        state_module=wrapped,
        dp_rank=d.rank,
        dp_size=d.world_size,
        register=[(wrapped, None)],
        full_params=lambda: FSDP.summon_full_params(wrapped, writeback=False),
        describe=f"FSDP1 FULL_SHARD over {d.world_size} ranks, use_orig_params",
    )


def _fsdp2(model: ByteGPT, cfg: TrainConfig, d: Dist) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    fully_shard_blocks(model.blocks, model, mesh)
    return Parallel(
        name="fsdp2",
        model=model,
        state_module=model,
        dp_rank=d.rank,
        dp_size=d.world_size,
        describe=f"fully_shard on a 1-D mesh of {d.world_size}",
    )


def _hsdp(model: ByteGPT, cfg: TrainConfig, d: Dist) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh

    replicas = d.world_size // cfg.hsdp_shard_size
    mesh = init_device_mesh(
        d.device.type, (replicas, cfg.hsdp_shard_size), mesh_dim_names=("replicate", "shard")
    )
    fully_shard_blocks(
        model.blocks, model, mesh
    )  # a 2-D mesh makes fully_shard hybrid: (Replicate, Shard(0))
    return Parallel(
        name="hsdp",
        model=model,
        state_module=model,
        dp_rank=d.rank,
        dp_size=d.world_size,
        # The rows are the shard groups (consecutive ranks: one node's under torchrun), the
        # columns the replicas of each shard, across nodes.
        describe=f"HSDP, mesh (replicate={replicas}, shard={cfg.hsdp_shard_size}), "
        f"shard groups {mesh.mesh.tolist()}",
    )


def _replicate_on(module: nn.Module, mesh: Any) -> None:
    """Make ``module``'s parameters Replicate DTensors on ``mesh``, plain tensors in and out.

    So that the scaler reads from the placements that every TP rank holds the same values.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_mod: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
            else t
            for t in inputs
        )

    def to_local(_mod: nn.Module, output: Any, _mesh: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _tp(model: ByteGPT, cfg: TrainConfig, d: Dist) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp, dp = cfg.tp_size, d.world_size // cfg.tp_size
    mesh = init_device_mesh(d.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]
    C = cfg.d_model
    for block in model.blocks:
        # Column-sharding qkv (3C rows: q, k, v) hands each rank contiguous rows; reorder them to
        # (rank, q/k/v, its heads) so every rank gets the q, k and v of its own heads. Done after
        # init: the model computes the same function as under DDP.
        with torch.no_grad():
            w, b = block.attn.qkv.weight, block.attn.qkv.bias
            w.copy_(w.view(3, tp, C // tp, C).transpose(0, 1).reshape(3 * C, C))
            b.copy_(b.view(3, tp, C // tp).transpose(0, 1).reshape(3 * C))
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
        _replicate_on(block.ln1, tp_mesh)
        _replicate_on(block.ln2, tp_mesh)
    for module in (model.head, model.tok_emb, model.pos_emb, model.ln_f):
        _replicate_on(module, tp_mesh)
    model.head.weight = model.tok_emb.weight  # distribute_module replaced both: tie them again
    describe = f"tensor parallel over {tp} ranks"
    if dp > 1:
        fully_shard_blocks(model.blocks, model, mesh["dp"])
        describe = f"FSDP2 x tensor parallel, mesh (dp={dp}, tp={tp})"
    return Parallel(
        name="tp",
        model=model,
        state_module=model,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=dp,
        describe=describe,
    )


def build_parallel(cfg: TrainConfig, d: Dist) -> Parallel:
    """The model, initialised from ``cfg.seed`` on every rank, laid out as ``cfg.parallelism``."""
    torch.manual_seed(cfg.seed)
    model = ByteGPT(cfg).to(d.device)
    num_params = sum(p.numel() for p in model.parameters())  # before sharding hides them
    if cfg.parallelism == "pp":
        par: Parallel = build_pipeline(model, cfg, d)
    else:
        builders = {"ddp": _ddp, "fsdp1": _fsdp1, "fsdp2": _fsdp2, "hsdp": _hsdp, "tp": _tp}
        par = builders[cfg.parallelism](model, cfg, d)
    par.num_params = num_params
    return par
