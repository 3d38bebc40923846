"""The reference job's byte-level data on a small GPT-2, trained by Transformers' ``Trainer``.

The Trainer as a user runs it (``TrainingArguments(fp16=True, optim="adamw_torch_fused")``, its
scheduler, clipping, logging and checkpoints), with distscaler put in by one call,
``distscaler.integrations.transformers.install(trainer)``. Data: the Python standard library
sources of this interpreter as bytes (``launch/train.py``'s corpus, ``lm.data``), or ``--data``;
the model: ``GPT2LMHeadModel`` from a config with a 256-byte vocabulary (no download).

Two CPU processes (gloo; sized for a CPU without fp16 units: about 20 s, most of it imports and
reading the corpus)::

    torchrun --nproc-per-node 2 launch/train_transformers.py --inject-inf 5

GPUs (NCCL; DDP, or FSDP2 through the Trainer's FSDP settings)::

    torchrun --nproc-per-node 8 launch/train_transformers.py --steps 2000 --n-layer 6 \\
        --n-embd 384 --block-size 256 --batch-size 32 [--fsdp]

Options::

    --steps N            optimizer steps (default 20)
    --out DIR            output folder: Trainer checkpoints, summary.json (default:
                         runs/transformers)
    --data PATH          text file or folder instead of the stdlib sources
    --inject-inf S       write an inf into one gradient on the last rank only, at step S (1-based,
                         repeatable): every rank skips it, the scheduler holds
    --max-grad-norm X    the Trainer's clipping (default 1.0; 0 measures the norm only)
    --optim NAME         the Trainer's optim (default adamw_torch_fused)
    --accumulation N     gradient_accumulation_steps (default 1)
    --save-steps N       checkpoint every N steps (default 0: none); --resume continues from the
                         latest checkpoint in --out
    --fsdp               FSDP2 (GPUs only: Accelerate drops FSDP on the CPU)
    --n-layer, --n-embd, --n-head, --block-size, --batch-size (per rank), --lr

At the end every rank reports its skipped steps, final scale and parameter digest; rank 0 writes
them to ``summary.json`` (with the Trainer's ``log_history``, which carries ``distscaler/*``) and the
job exits non-zero if the ranks disagree (``lm.agreement.ranks_agree``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.requirements import require

logger = logging.getLogger("train_transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/transformers")
    p.add_argument("--data", help="text file or folder (default: the stdlib *.py sources)")
    p.add_argument("--inject-inf", type=int, action="append", default=[], metavar="STEP")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--optim", default="adamw_torch_fused")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 via the Trainer (GPUs only)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    for name in (
        "steps",
        "accumulation",
        "n_layer",
        "n_embd",
        "n_head",
        "block_size",
        "batch_size",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got: {getattr(args, name)}")
    if any(s < 1 or s > args.steps for s in args.inject_inf):
        p.error(f"--inject-inf steps must be in [1, {args.steps}], got: {args.inject_inf}")
    return args


class ByteWindows:
    """``block_size + 1``-byte windows of a byte corpus, one per ``block_size`` stride, as causal
    LM examples (the model shifts the labels itself)."""

    def __init__(self, data: Any, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.data[i * self.block_size : (i + 1) * self.block_size].long()  # (T,)
        return {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    require("transformers", "launch/train_transformers.py")
    import torch
    from accelerate.utils import gather_object
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from common.tensors import params_digest
    from distscaler.integrations.transformers import install
    from lm.agreement import RankView, ranks_agree
    from lm.data import load_corpus

    use_cpu = not torch.cuda.is_available()
    if args.fsdp and use_cpu:
        raise SystemExit("--fsdp needs GPUs: Accelerate drops FSDP on the CPU")
    inject = {s - 1 for s in args.inject_inf}  # as the Trainer's global_step before the step

    class InjectingTrainer(Trainer):
        """Writes an inf into one gradient on the last rank after the backward of the last
        micro-batch of the chosen steps (after DDP's all-reduce: only that rank sees it)."""

        def training_step(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            loss = super().training_step(model, inputs, *a, **kw)
            acc = self.accelerator
            if (
                acc.sync_gradients
                and self.state.global_step in inject
                and acc.process_index == acc.num_processes - 1
            ):
                for p in model.parameters():
                    g = p.grad
                    g = g.to_local() if hasattr(g, "to_local") else g
                    if g is not None and g.numel():
                        g.view(-1)[0] = math.inf
                        break
            return loss

    class SkipRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None
            self.skipped: list[int] = []

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.trainer.accelerator.optimizer_step_was_skipped:
                self.skipped.append(state.global_step)

    fsdp: dict[str, Any] = {}
    if args.fsdp:
        fsdp = dict(
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        )
    targs = TrainingArguments(
        output_dir=args.out, fp16=True, use_cpu=use_cpu, optim=args.optim,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, max_grad_norm=args.max_grad_norm,
        logging_steps=max(1, args.steps // 10), report_to=[], seed=1337,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False, **fsdp,
    )  # fmt: skip
    logging.basicConfig(
        level=logging.INFO if targs.process_index == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{targs.process_index}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if use_cpu:
        torch.set_num_threads(1)
    corpus = SimpleNamespace(data=args.data, eval_fraction=0.1, block_size=args.block_size)
    train_bytes, _, num_files = load_corpus(corpus)  # type: ignore[arg-type]
    config = GPT2Config(
        vocab_size=256, n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1337)
    trainer = InjectingTrainer(
        model=GPT2LMHeadModel(config),
        args=targs,
        train_dataset=ByteWindows(train_bytes, args.block_size),
    )
    recorder = SkipRecorder()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    # The one line: distscaler scales, skips, clips, logs and checkpoints for this Trainer.
    scaler = install(trainer)
    accelerator = trainer.accelerator
    logger.info(
        "%s, %d process(es), device %s, %d files (%d bytes), scaler %r",
        accelerator.distributed_type,
        accelerator.num_processes,
        accelerator.device,
        num_files,
        len(train_bytes),
        scaler,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    view = RankView(
        rank=accelerator.process_index,
        skipped_steps=tuple(recorder.skipped),
        scale=scaler.get_scale(),
        params_digest=params_digest(full(p) for p in trainer.model.parameters()),
    )
    views = gather_object([view])
    problems = ranks_agree(views)
    for problem in problems:
        logger.error("ranks disagree: %s", problem)
    summary = {
        "steps": trainer.state.global_step,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "inject_steps": sorted(args.inject_inf),
        "ranks": [dataclasses.asdict(v) for v in views],
        "ranks_consistent": not problems,
        "final_scale": view.scale,
        "wall_s": time.perf_counter() - t_start,
        "log_history": trainer.state.log_history,
    }
    if accelerator.is_main_process:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1))
        logger.info(
            "done: %d steps, skipped %s, final scale %g, %.1f s; ranks consistent: %s",
            summary["steps"],
            list(view.skipped_steps),
            view.scale,
            summary["wall_s"],
            not problems,
        )
    accelerator.wait_for_everyone()
    # Release the DDP model (it holds the process group) while the interpreter is alive (see
    # launch/train_accelerate.py).
    accelerator.free_memory()
    del trainer
    gc.collect()
    if problems:
        raise SystemExit(
            "ranks disagree on skipped steps, scale or parameters: " + "; ".join(problems)
        )
    return summary


if __name__ == "__main__":
    main()
