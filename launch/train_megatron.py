"""Megatron-core's GPTModel in fp16 with distscaler: one loss scale for the dense and expert optimizers.

A tiny mixture-of-experts GPT (megatron-core's ``GPTModel``, its local layer spec, 2 layers,
2 experts, expert-parallel over the ranks) under ``Float16Module`` and Megatron's
``DistributedDataParallel``, trained on bytes of the Python standard library sources with
``get_megatron_optimizer(fp16=True)``, which builds a dense and an expert optimizer, and
``distscaler.integrations.megatron.install`` on it. The script has the shape of Megatron-LM's
``pretrain``: :func:`setup_model_and_optimizer` builds the model chunks and the optimizer and
calls ``install`` right after ``get_megatron_optimizer`` (before a checkpoint would be loaded into
the optimizer); the loop sets ``config.grad_scale_func = optimizer.scale_loss`` and
``config.finalize_model_grads_func``, and :func:`train_step` zeroes the grad buffers, runs
Megatron's ``get_forward_backward_func()`` schedule over the microbatches and calls
``optimizer.step()``, stepping the LR scheduler only when the update succeeded. Two CPU processes
(gloo)::

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.requirements import require

VOCAB, SEQ, BATCH, HIDDEN = 256, 64, 4, 128
MICROBATCHES = 2  # per optimizer step, per rank


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


def setup_model_and_optimizer(args: argparse.Namespace, world_size: int) -> tuple[list[Any], Any]:
    """(model chunks, optimizer): GPTModel with 2 experts under Float16Module and Megatron's DDP,
    and ``get_megatron_optimizer``'s chained optimizer with distscaler installed (unless
    ``--stock``). Megatron-LM's function of the same name loads the checkpoint after building the
    optimizer: ``install`` goes between the two, so that the checkpoint's scale and trackers load
    into the one scaler."""
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
    model = [DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))]
    # --8<-- [start:optimizer]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.lr / 10,  # the LR scheduler's floor (its param groups carry it)
            fp16=True,
            initial_loss_scale=2.0**12,
            min_loss_scale=1.0,
            loss_scale_window=10,
            hysteresis=1,
            clip_grad=1.0,
            use_distributed_optimizer=args.distributed_optimizer,
        ),
        model,
    )
    if not args.stock:
        from distscaler.integrations import megatron as ds_megatron

        ds_megatron.install(optimizer)  # every rank, before loading a checkpoint, before step 1
    # (a checkpoint would load here: load_checkpoint(model, optimizer, opt_param_scheduler))
    # --8<-- [end:optimizer]
    return model, optimizer


def batches(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, MICROBATCHES byte windows of the standard library sources, each (B, T), the same
    on every rank (data-parallel replicas would each read their own; the same batch keeps the check
    simple)."""
    from lm.data import stdlib_files

    blob = b"".join(f.read_bytes() for f in stdlib_files()[:40])
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(MICROBATCHES):
            starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
            window = data[starts[:, None] + torch.arange(SEQ + 1)].long()  # (B, T + 1)
            step.append((window[:, :-1], window[:, 1:]))
        out.append(step)
    return out


def forward_step(data_iterator: Iterator[Any], model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's forward step: the output tensor and the function that makes the loss from it."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ, device=tokens.device).expand_as(tokens)
    per_token = model(tokens, position_ids, None, labels=labels)  # (B, T) fp32

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

    return per_token, loss_func


# --8<-- [start:train_step]
def train_step(
    forward_step_func: Any,
    data_iterator: Iterator[Any],
    model: list[Any],
    optimizer: Any,
    opt_param_scheduler: Any,
    inject_inf: bool = False,
) -> tuple[float, bool, float | None]:
    """One optimizer step, as Megatron-LM's ``train_step``: (loss, skipped, grad_norm).

    The schedule scales each microbatch's loss with ``config.grad_scale_func``
    (``optimizer.scale_loss``: with distscaler installed, the one scale) before its backward, and
    ends with ``config.finalize_model_grads_func`` (the data-parallel gradient reduction).
    ``optimizer.step()`` then checks, unscales and clips every sub-optimizer's main gradients with
    one collective, updates the one scale and steps unless a rank saw inf/NaN, and returns
    Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=False,
    )
    if inject_inf:  # an overflow in one rank's expert gradients, after the gradient reduction
        experts = [p for n, p in model[0].named_parameters() if "experts" in n]
        experts[0].main_grad.view(-1)[0] = math.inf
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=MICROBATCHES * BATCH)
    loss = sum(float(x["lm loss"]) for x in losses_reduced) / len(losses_reduced)
    return loss, not update_successful, grad_norm


# --8<-- [end:train_step]


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
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config

        model, optimizer = setup_model_and_optimizer(args, world_size)
        opt_param_scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
            lr_warmup_steps=2 * MICROBATCHES * BATCH,
            lr_decay_steps=args.steps * MICROBATCHES * BATCH, lr_decay_style="cosine",
            start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        )  # fmt: skip
        # --8<-- [start:loop]
        # What Megatron-LM's train() sets before its loop: the loss scaling the schedule applies
        # before each backward (one scale for all sub-optimizers once distscaler is installed) and
        # the gradient reduction at the end of the schedule.
        config = get_model_config(model[0])
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        device = torch.device("cuda") if cuda else torch.device("cpu")
        losses, skipped, norms = [], [], []
        start = time.perf_counter()
        for step, micro in enumerate(batches(args.steps), start=1):
            data_iterator = iter([(x.to(device), y.to(device)) for x, y in micro])
            loss, was_skipped, grad_norm = train_step(
                forward_step, data_iterator, model, optimizer, opt_param_scheduler,
                inject_inf=step in args.inject_inf and rank == 0,
            )  # fmt: skip
            losses.append(loss)
            norms.append(grad_norm)
            if was_skipped:
                skipped.append(step)
        # --8<-- [end:loop]
        seconds = time.perf_counter() - start
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        scales = [float(s.get_loss_scale().reshape(-1)[0]) for s in subs]
        view = RankView(
            rank=rank,
            skipped_steps=tuple(skipped),
            scale=scales[0],
            params_digest=params_digest(
                p for n, p in model[0].named_parameters() if "experts" not in n
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
        # LR scheduler steps: train_step advances it only when the update succeeded.
        "scheduler_steps": opt_param_scheduler.num_steps // (MICROBATCHES * BATCH),
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
