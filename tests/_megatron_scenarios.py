"""Megatron-core scenarios run inside spawned gloo ranks (tests/test_megatron.py checks the results).

Nothing here asserts: every rank runs the same collectives whatever it sees.

The model is megatron-core's own machinery around a tiny module: a ``MegatronModule`` with a dense
``Linear`` and an expert ``Linear`` (its parameters marked ``allreduce = False``, which is how
Megatron's MoE layers mark expert parameters), fp16 parameters, wrapped in Megatron's
``DistributedDataParallel`` (fp32 grad buffers), expert-parallel over both ranks, and
``get_megatron_optimizer(OptimizerConfig(fp16=True, ...))``: a ``ChainedOptimizer`` of a dense and
an expert optimizer, ``Float16OptimizerWithFloat16Params`` or ``DistributedOptimizer``. "stock" is
that optimizer as Megatron builds it; "ours" is the same after
``distscaler.integrations.megatron.install``. The CPU stand-ins are in
launch/common/megatron_cpu.py, each with its reason.

An inf is written into one gradient (after Megatron's DDP has reduced it, so only that rank sees
it) on one rank at chosen steps.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from common.megatron_cpu import cpu_megatron
from common.probes import HostReadSpy

HIDDEN = 128  # the distributed optimizer wants every rank's shard to hold optimizer state


def _megatron():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    return (
        parallel_state,
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        get_megatron_optimizer,
        TransformerConfig,
        MegatronModule,
    )


def build(rank: int, *, dist_opt: bool, experts: bool = True, **config: Any):
    """(model, optimizer) as Megatron builds them: dense + expert sub-optimizers when ``experts``."""
    _, MDDP, DDPConfig, OptimizerConfig, get_megatron_optimizer, TConfig, MegatronModule = (
        _megatron()
    )
    tconfig = TConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        use_cpu_initialization=True,
        fp16=True,
        params_dtype=torch.float16,
    )

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(tconfig)
            torch.manual_seed(0)
            self.dense = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float16)
            torch.manual_seed(1 + rank if experts else 1)  # experts: each rank its own
            self.expert = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float16)
            for p in self.expert.parameters():
                p.allreduce = not experts  # False: an expert parameter, as Megatron's MoE marks it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.expert(torch.relu(self.dense(x))).float().pow(2).mean()

    ddp_config = DDPConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    model = MDDP(tconfig, ddp_config, Tiny())
    settings = dict(
        optimizer="adam",
        lr=1e-3,
        fp16=True,
        initial_loss_scale=8.0,
        hysteresis=1,
        loss_scale_window=1000,
        min_loss_scale=1.0,
        clip_grad=0.0,
        use_distributed_optimizer=dist_opt,
    )
    settings.update(config)
    optimizer = get_megatron_optimizer(OptimizerConfig(**settings), [model])
    return model, optimizer


def init_parallel(world_size: int) -> None:
    parallel_state = _megatron()[0]
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)


def backward(model, optimizer, step: int, rank: int) -> None:
    """One micro-batch: the same data on every rank (the dense gradients agree), scaled loss."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, HIDDEN, generator=gen).half()
    optimizer.scale_loss(model(x)).backward()
    model.finish_grad_sync()


def inject(model, where: str) -> None:
    """Write an inf into one main gradient (Megatron's DDP buffer) of this rank."""
    module = model.module
    grad = (module.expert if where == "expert" else module.dense).weight.main_grad
    grad.view(-1)[3] = math.inf


def sub_scales(optimizer) -> list[float]:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [float(s.get_loss_scale().reshape(-1)[0]) for s in subs]


def _install(optimizer, scaler=None):
    from distscaler.integrations import megatron as ds_megatron

    return ds_megatron.install(optimizer, scaler)


def _expert_grad_sum(model) -> float:
    """Sum of |g| over this rank's expert gradients in Megatron's buffer (scaled by the loss)."""
    return sum(m.main_grad.abs().sum().item() for m in model.module.expert.parameters())


def _expert_main_grad_sum(optimizer) -> float:
    """Sum of |g| over the expert optimizer's main gradients (after prepare_grads: unscaled).

    With expert parallelism over both ranks the expert data-parallel group is one rank, so the
    distributed optimizer's shard on this rank is this rank's whole expert too.
    """
    expert = optimizer.chained_optimizers[1]
    return sum(p.grad.abs().sum().item() for p in expert.get_parameters() if p.grad is not None)


def split(rank: int, world_size: int) -> dict[str, Any]:
    """(a, b) Dense + expert optimizers, an inf only in rank 0's expert gradients at step 1."""
    init_parallel(world_size)
    out: dict[str, Any] = {}
    for dist_opt in (False, True):
        for mode in ("stock", "ours"):
            model, optimizer = build(rank, dist_opt=dist_opt)
            if mode == "ours":
                _install(optimizer)
            steps = []
            for step in range(4):
                backward(model, optimizer, step, rank)
                loss_scale = float(optimizer.get_loss_scale().reshape(-1)[0])
                if step == 1 and rank == 0:
                    inject(model, "expert")
                scaled = _expert_grad_sum(model)  # before: the unscale may write the buffer
                with CommDebugMode() as comm:
                    spy = HostReadSpy()
                    for sub in optimizer.chained_optimizers:
                        spy.exclude_optimizer(sub.optimizer)
                    with spy:
                        found_inf = optimizer.prepare_grads()
                        grad_norm = None if found_inf else optimizer.get_grad_norm()
                # Expert gradients as the optimizer will use them / their true value.
                ratio = (
                    None if found_inf else _expert_main_grad_sum(optimizer) * loss_scale / scaled
                )
                if not found_inf:
                    optimizer.step_with_ready_grads()
                steps.append(
                    {
                        "found_inf": bool(found_inf),
                        "loss_scale": loss_scale,
                        "scales": sub_scales(optimizer),
                        "ratio": ratio,
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "all_reduces": int(comm.get_total_counts()),
                        "host_reads": len(spy.reads),
                        "params": _digest(model),
                    }
                )
            out[f"{mode}-{'dist' if dist_opt else 'plain'}"] = steps
    return out


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


#: (c) Steps with an inf on every rank for the trajectory: hysteresis 2 absorbs the first, the second
#: backs off, then a run of overflows reaches the minimum, then clean steps grow (window 3).
TRAJECTORY_INF = {1, 3, 4, 6, 7, 8, 9, 10, 11}
TRAJECTORY_STEPS = 20


def trajectory(rank: int, world_size: int) -> dict[str, Any]:
    """(c) One dense optimizer (nothing to split): stock and ours step for step."""
    init_parallel(world_size)
    out: dict[str, Any] = {}
    for dist_opt in (False, True):
        for mode in ("stock", "ours"):
            model, optimizer = build(
                rank,
                dist_opt=dist_opt,
                experts=False,
                initial_loss_scale=2.0**6,
                hysteresis=2,
                loss_scale_window=3,
                min_loss_scale=4.0,
                clip_grad=1.0,
            )
            if mode == "ours":
                _install(optimizer)
            steps = []
            for step in range(TRAJECTORY_STEPS):
                backward(model, optimizer, step, rank)
                if step in TRAJECTORY_INF:
                    inject(model, "dense")  # every rank: stock's non-distributed check is per rank
                success, grad_norm, zeros = optimizer.step()
                steps.append(
                    {
                        "success": bool(success),
                        "grad_norm": grad_norm,
                        "zeros": zeros,
                        "scale": sub_scales(optimizer)[0],
                        "params": [p.float().sum().item() for p in model.module.parameters()],
                    }
                )
            out[f"{mode}-{'dist' if dist_opt else 'plain'}"] = steps
    # Stock's non-distributed optimizer reduces its flag over the model-parallel group only, so an
    # inf on one data-parallel rank is that rank's alone; ours agrees over the world.
    for mode in ("stock", "ours"):
        model, chain = build(rank, dist_opt=False, experts=False)
        optimizer = chain.chained_optimizers[0]  # a single Float16OptimizerWithFloat16Params
        if mode == "ours":
            _install(optimizer)
        steps = []
        for step in range(3):
            backward(model, optimizer, step, rank)
            if step == 1 and rank == 1:
                inject(model, "dense")
            success, _, _ = optimizer.step()
            steps.append({"success": bool(success), "scale": sub_scales(optimizer)[0],
                          "params": _digest(model)})  # fmt: skip
        out[f"{mode}-one-rank"] = steps
    return out


def contracts(rank: int, world_size: int) -> dict[str, Any]:
    """prepare_grads twice; state dicts both ways; unsupported configs refused at install."""
    init_parallel(world_size)
    out: dict[str, Any] = {}

    # prepare_grads twice in one step: the second does nothing.
    model, optimizer = build(rank, dist_opt=False)
    _install(optimizer)
    backward(model, optimizer, 0, rank)
    first = optimizer.prepare_grads()
    grads = [p.grad.clone() for s in optimizer.chained_optimizers for p in s.get_parameters()]
    with CommDebugMode() as comm:
        second = optimizer.prepare_grads()
    again = [p.grad for s in optimizer.chained_optimizers for p in s.get_parameters()]
    out["prepare_twice"] = {
        "first": first,
        "second": second,
        "same_grads": all(torch.equal(a, b) for a, b in zip(grads, again)),
        "second_all_reduces": int(comm.get_total_counts()),
    }
    try:
        optimizer.chained_optimizers[0].step()
        out["sub_step"] = None
    except RuntimeError as e:
        out["sub_step"] = str(e)
    optimizer.step_with_ready_grads()

    # (d) A stock chained checkpoint whose scales split, into ours; ours out to stock.
    model, stock = build(rank, dist_opt=False)
    for step in range(2):
        backward(model, stock, step, rank)
        if step == 1:
            inject(model, "expert")  # every rank: both ranks' expert scalers back off
        stock.step()
    stock_state = stock.state_dict()
    out["stock_saved_scales"] = sub_scales(stock)
    model2, ours = build(rank, dist_opt=False)
    scaler = _install(ours)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.load_state_dict(stock_state)
    out["loaded_scales"] = sub_scales(ours)
    out["load_warnings"] = [str(w.message) for w in caught if "loss scales" in str(w.message)]
    backward(model2, ours, 2, rank)
    ours.step()
    backward(model2, ours, 3, rank)
    inject(model2, "dense")
    ours.step()  # hysteresis 1: back off once more, to a scale stock never had
    ours_state = ours.state_dict()
    out["ours_saved"] = [
        {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s["grad_scaler"].items()}
        for s in ours_state
    ]
    out["ours_scale"] = scaler.get_scale()
    _, stock2 = build(rank, dist_opt=False)
    stock2.load_state_dict(ours_state)
    out["stock_loaded_scales"] = sub_scales(stock2)
    out["stock_loaded_trackers"] = [
        [s.grad_scaler._growth_tracker, s.grad_scaler._hysteresis_tracker]
        for s in stock2.chained_optimizers
    ]

    # scaler= as every integration takes it, and its checks.
    from distscaler import GradScaler, ScalerConfig

    args = {}
    _, optimizer = build(rank, dist_opt=False)
    for name, scaler in (
        ("disabled", GradScaler("cpu", enabled=False)),
        ("cuda", GradScaler("cuda", init_scale=8.0, enabled=True)),
        ("int", 3),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "cuda" without CUDA: torch's warning
                _install(optimizer, scaler)
            args[name] = None
        except (ValueError, TypeError) as e:
            args[name] = [type(e).__name__, str(e)]
    args["stock_kept"] = type(optimizer.chained_optimizers[0].grad_scaler).__name__
    config_scaler = _install(optimizer, ScalerConfig(init_scale=32.0, policy="torch"))
    args["config"] = [config_scaler.get_scale(), config_scaler.config.policy, sub_scales(optimizer)]
    try:
        _install(optimizer)
        args["twice"] = None
    except RuntimeError as e:
        args["twice"] = str(e)
    out["arguments"] = args

    # sharded_state_dict (distributed checkpointing's view): the same grad_scaler entries.
    model, optimizer = build(rank, dist_opt=False)
    _install(optimizer)
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict())
    out["sharded_grad_scalers"] = [
        {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in sharded[i]["grad_scaler"].items()}
        for i in sorted(sharded)
    ]

    # Unsupported paths: refused at install, nothing changed.
    refused = {}
    model, optimizer = build(rank, dist_opt=True)  # its sub-optimizers know their model chunks
    ddp_config = model.ddp_config
    model.ddp_config = copy.copy(ddp_config)
    model.ddp_config.use_megatron_fsdp = True
    try:
        _install(optimizer)
        refused["use_megatron_fsdp"] = None
    except NotImplementedError as e:
        refused["use_megatron_fsdp"] = [str(e), "DynamicGradScaler" in repr(
            [type(s.grad_scaler).__name__ for s in optimizer.chained_optimizers])]  # fmt: skip
    model.ddp_config = ddp_config
    from megatron.core.models.mimo.optimizer import MimoOptimizer

    try:
        _install(MimoOptimizer.__new__(MimoOptimizer))
        refused["mimo"] = None
    except NotImplementedError as e:
        refused["mimo"] = [str(e), True]
    for field in ("use_precision_aware_optimizer", "optimizer_cpu_offload", "fp16"):
        _, optimizer = build(rank, dist_opt=False)
        value = field != "fp16"
        bad = copy.copy(optimizer.config)  # no __post_init__: it refuses some on the CPU
        setattr(bad, field, value)
        optimizer.config = bad
        for sub in optimizer.chained_optimizers:
            sub.config = bad
        try:
            _install(optimizer)
            refused[field] = None
        except NotImplementedError as e:
            stock_kept = all(
                type(s.grad_scaler).__name__ == "DynamicGradScaler"
                for s in optimizer.chained_optimizers
            )
            refused[field] = [str(e), stock_kept]
    out["refused"] = refused
    return out


def everything(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with cpu_megatron(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"split": split(rank, world_size), "trajectory": trajectory(rank, world_size)}
        out["contracts"] = contracts(rank, world_size)
    dist.barrier()
    return out
