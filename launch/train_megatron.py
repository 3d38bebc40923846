"""Megatron-core's GPTModel in fp16 with distscaler: one loss scale for the dense and expert optimizers.

A tiny mixture-of-experts GPT (megatron-core's ``GPTModel``, its local layer spec, 2 layers,
2 experts, expert-parallel over the ranks) under ``Float16Module`` and Megatron's
``DistributedDataParallel``, trained on bytes of the Python standard library sources with
``get_megatron_optimizer(fp16=True)``, which builds a dense and an expert optimizer, and
``distscaler.integrations.megatron.install`` on it. Two CPU processes (gloo)::

    torchrun --nproc-per-node 2 launch/train_megatron.py --inject-inf 3

On GPUs the same script runs on NCCL (``--nproc-per-node gpu``). Options::

    --steps N          optimizer steps (default 20)
    --inject-inf S     write an inf into rank 0's expert gradients at step S (1-based,
                       repeatable): every rank skips it and the one scale backs off
    --stock            leave Megatron's per-sub-optimizer scalers in place (to compare)
    --distributed-optimizer   Megatron's distributed optimizer (default: not)
    --out DIR          rank 0 writes summary.json there (default runs/megatron)

At the end every rank reports its skipped steps, its sub-optimizers' scales and a digest of its
parameters; the job exits non-zero if the ranks disagree or, with distscaler, if the
sub-optimizers' scales differ. On CPU processes it runs with the stand-ins of
``launch/common/megatron_cpu.py`` (megatron-core is written for CUDA; each says why).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.requirements import require

VOCAB, SEQ, BATCH, HIDDEN = 256, 64, 8, 128


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--inject-inf", type=int, action="append", default=[])
    p.add_argument("--stock", action="store_true")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="runs/megatron")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got: {args.steps}")
    if any(not 1 <= s <= args.steps for s in args.inject_inf):
        p.error(f"--inject-inf takes steps in [1, --steps={args.steps}], got: {args.inject_inf}")
    return args


def build(args: argparse.Namespace, world_size: int) -> tuple[Any, Any]:
    """(model, optimizer): GPTModel with 2 experts under Float16Module and Megatron's DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    torch.manual_seed(0)  # CPU initialization draws from here: the same on every replica
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=world_size,
        expert_model_parallel_size=world_size,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        fp16=True,
        params_dtype=torch.float16,
        bias_dropout_fusion=False,
        add_bias_linear=False,  # experts with biases add them in place, which autograd refuses at TP=1
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=world_size),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.distributed_optimizer
    )
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            fp16=True,
            initial_loss_scale=2.0**12,
            min_loss_scale=1.0,
            loss_scale_window=10,
            hysteresis=1,
            clip_grad=1.0,
            use_distributed_optimizer=args.distributed_optimizer,
        ),
        [model],
    )
    return model, optimizer


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Byte windows of the standard library sources, the same on every rank (data parallel
    replicas would each read their own; the same batch keeps the check simple)."""
    from lm.data import stdlib_files

    blob = b"".join(f.read_bytes() for f in stdlib_files()[:40])
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        window = data[starts[:, None] + torch.arange(SEQ + 1)].long()  # (B, T + 1)
        out.append((window[:, :-1], window[:, 1:]))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from common.megatron_cpu import stub_gpu_only_imports

    stub_gpu_only_imports()  # without triton, megatron-core's import stops at one GPU kernel
    require("megatron", "launch/train_megatron.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from common.distributed import destroy_process_group
    from common.megatron_cpu import cpu_megatron
    from common.tensors import params_digest
    from lm.agreement import RankView, ranks_agree

    context = cpu_megatron() if not cuda else _nothing()
    with context:
        model, optimizer = build(args, world_size)
        if not args.stock:
            from distscaler.integrations import megatron as ds_megatron

            ds_megatron.install(optimizer)
        device = torch.device("cuda") if cuda else torch.device("cpu")
        position_ids = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
        losses, skipped, norms = [], [], []
        start = time.perf_counter()
        for step, (x, y) in enumerate(batches(rank, args.steps), start=1):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            x, y = x.to(device), y.to(device)
            per_token = model(x, position_ids, None, labels=y)  # (B, T) fp32
            loss = per_token.float().mean()
            optimizer.scale_loss(loss).backward()
            model.finish_grad_sync()
            if step in args.inject_inf and rank == 0:
                experts = [p for n, p in model.named_parameters() if "experts" in n]
                experts[0].main_grad.view(-1)[0] = math.inf
            success, grad_norm, _ = optimizer.step()
            losses.append(loss.item())
            norms.append(grad_norm)
            if not success:
                skipped.append(step)
        seconds = time.perf_counter() - start
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        scales = [float(s.get_loss_scale().reshape(-1)[0]) for s in subs]
        view = RankView(
            rank=rank,
            skipped_steps=tuple(skipped),
            scale=scales[0],
            params_digest=params_digest(
                p for n, p in model.named_parameters() if "experts" not in n
            ),
        )
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, view)
    problems = ranks_agree(views)
    if not args.stock and len(set(scales)) > 1:
        problems.append(f"rank {rank}: sub-optimizer scales differ: {scales}")
    summary = {
        "steps": args.steps,
        "losses": losses,
        "final_loss": losses[-1],
        "grad_norms": norms,
        "skipped_steps": skipped,
        "scales": scales,
        "sub_optimizers": [type(s).__name__ for s in subs],
        "ranks_agree": not problems,
        "problems": problems,
        "distscaler": not args.stock,
        "seconds": round(seconds, 2),
        "world_size": world_size,
        "torch": torch.__version__,
    }
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
        print(
            f"train_megatron: {args.steps} steps in {seconds:.1f} s on {world_size} ranks, loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}, skipped steps {skipped}, sub-optimizer scales "
            f"{scales}, ranks {'agree' if not problems else 'DISAGREE'}",
            flush=True,
        )
        for problem in problems:
            print(f"train_megatron: {problem}", file=sys.stderr, flush=True)
    destroy_process_group()  # after a barrier: gloo's teardown can hang on torch < 2.8
    if problems:
        raise SystemExit(1)
    return summary


def _nothing():
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
