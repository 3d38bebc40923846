"""verl's FSDP training engine in fp16 with distscaler: GRPO-style RL on a tiny Qwen2, no ray.

verl's own actor engine (``FSDPEngineWithLMHead``, built by verl's ``EngineRegistry`` as a verl
worker builds it), a 2-layer Qwen2 saved locally, fp16 (``mixed_precision.param_dtype: fp16``),
verl's PPO loss. Each step every rank samples responses to its prompts from the current policy
(a plain sampling loop over the engine's module: no rollout server), rewards each response by the
share of its tokens below 64, turns the rewards into GRPO advantages (normalized within the group of
responses to one prompt) and runs verl's ``train_batch`` and ``lr_scheduler_step``, as verl's
``TrainingWorker`` does. Two CPU processes (gloo)::

    torchrun --nproc-per-node 2 launch/train_verl.py --inject-inf 3

On GPUs the same script runs on NCCL (``--nproc-per-node gpu``). Options::

    --steps N          RL steps, one optimizer step each (default 30)
    --strategy S       fsdp (FSDP1) or fsdp2 (default)
    --fused            fused AdamW (stock verl crashes at the first step with it)
    --inject-inf S     write an inf into rank 1's gradient shard at step S (1-based, repeatable):
                       every rank skips it, the scale backs off, the LR is held
    --stock            verl's own engine and ShardedGradScaler (to compare)
    --lr LR            AdamW's learning rate (default 1e-2)
    --out DIR          rank 0 writes summary.json there (default runs/verl)

At the end every rank reports its skipped steps and its scale; the job exits non-zero if the ranks
disagree. On CPU processes it runs with the stand-ins of ``launch/common/verl_cpu.py`` (verl is
written for accelerators; each says why), stock's scaler rebuilt for the CPU.
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

#: Prompts per rank per step; each gets GROUP sampled responses.
PROMPTS = 4
#: A response token below this earns reward (a quarter of the vocabulary at random).
REWARDED_BELOW = 64


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--strategy", choices=["fsdp", "fsdp2"], default="fsdp2")
    p.add_argument("--fused", action="store_true")
    p.add_argument("--inject-inf", type=int, action="append", default=[])
    p.add_argument("--stock", action="store_true")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="runs/verl")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got: {args.steps}")
    if any(not 1 <= s <= args.steps for s in args.inject_inf):
        p.error(f"--inject-inf takes steps in [1, --steps={args.steps}], got: {args.inject_inf}")
    return args


@torch.no_grad()
def sample(engine: Any, prompts: torch.Tensor, length: int, generator: torch.Generator) -> Any:
    """Sample ``length`` tokens after each prompt from the engine's module (full forward per token:
    the model is tiny); returns the responses and their log-probs under the sampling policy."""
    tokens, log_probs = prompts, []
    for _ in range(length):
        logits = engine.module(input_ids=tokens).logits[:, -1].float()
        dist_ = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(dist_.exp().cpu(), 1, generator=generator).to(tokens.device)
        log_probs.append(dist_.gather(1, nxt))
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts.shape[1] :], torch.cat(log_probs, dim=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    require("verl", "launch/train_verl.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from common.verl_cpu import use_cpu_platform

        use_cpu_platform()
    from verl_job import (
        GROUP,
        PROMPT,
        RESPONSE,
        VOCAB,
        build_engine,
        grpo_advantages,
        poison_local_grad,
        ppo_loss,
        rl_batch,
        shared_model_dir,
    )

    from common.distributed import destroy_process_group
    from common.tensors import params_digest
    from lm.agreement import RankView, ranks_agree

    model = shared_model_dir()
    engine = build_engine(model, args.strategy, ours=not args.stock, fused=args.fused, lr=args.lr)
    if args.stock and not cuda:
        from common.verl_cpu import rebuild_stock_scaler_for_cpu

        rebuild_stock_scaler_for_cpu(engine)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    stepping = engine.optimizer_step
    state = {"step": 0}

    def optimizer_step() -> float:
        if state["step"] in args.inject_inf and rank == 1 % world_size:
            poison_local_grad(engine.module.parameters())
        return stepping()

    engine.optimizer_step = optimizer_step
    batch_size = PROMPTS * GROUP
    loss_fn = ppo_loss(batch_size)
    generator = torch.Generator().manual_seed(rank)
    rewards, norms, lrs, skipped, scales = [], [], [], [], []
    start = time.perf_counter()
    with engine.train_mode():
        for step in range(1, args.steps + 1):
            state["step"] = step
            prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT), generator=generator)
            prompts = prompts.repeat_interleave(GROUP, dim=0).to(device)
            responses, old_log_probs = sample(engine, prompts, RESPONSE, generator)
            reward = (responses < REWARDED_BELOW).float().mean(dim=1).cpu()
            batch = rl_batch(
                prompts.cpu(),
                responses.cpu(),
                torch.ones_like(responses.cpu()),
                grpo_advantages(reward),
                old_log_probs.cpu(),
            )
            output = engine.train_batch(batch, loss_function=loss_fn)
            lrs.append(float(engine.lr_scheduler_step()))
            norm = float(output["metrics"]["grad_norm"])
            rewards.append(float(reward.mean()))
            norms.append(norm)
            scales.append(float(engine.scaler.get_scale()))
            if not math.isfinite(norm):  # stock and ours: non-finite exactly when skipped
                skipped.append(step)
    seconds = time.perf_counter() - start
    mean_reward = torch.tensor(rewards).view(1, -1)
    dist.all_reduce(mean_reward)
    mean_reward = (mean_reward / world_size).view(-1).tolist()
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in engine.module.parameters()]
    # Each rank holds its own shard: scales and skips are compared, shards are not.
    view = RankView(rank, tuple(skipped), scales[-1], params_digest(shards), replica=rank)
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, view)
    problems = ranks_agree(views)
    summary = {
        "steps": args.steps,
        "strategy": args.strategy,
        "fused": args.fused,
        "mean_reward": mean_reward,
        "grad_norms": norms,
        "lrs": lrs,
        "scales": scales,
        "skipped_steps": skipped,
        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
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
            f"train_verl: {args.steps} steps ({args.strategy}{', fused' if args.fused else ''}) in "
            f"{seconds:.1f} s on {world_size} ranks, mean reward {mean_reward[0]:.3f} -> "
            f"{mean_reward[-1]:.3f}, skipped steps {skipped}, scale {scales[-1]:g}, ranks "
            f"{'agree' if not problems else 'DISAGREE'}",
            flush=True,
        )
        for problem in problems:
            print(f"train_verl: {problem}", file=sys.stderr, flush=True)
    destroy_process_group()  # after a barrier: gloo's teardown can hang on torch < 2.8
    if problems:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
