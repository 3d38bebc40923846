"""AReaL's FSDP engine in fp16 with distscaler: GRPO on a tiny Qwen2, no rollout server.

AReaL's own actor engine (``FSDPPPOActor``, built and initialized as AReaL's ``PPOTrainer`` builds
it in SPMD mode), then ``distscaler.integrations.areal.install(engine)`` (the one line), a 2-layer
Qwen2 saved locally, ``dtype: float16``. Each step every rank samples responses to its prompts from
the current policy (a plain sampling loop over the engine's model: no rollout server), rewards each
response by the share of its tokens below 64, and runs AReaL's RL step on the actor:
``compute_logp``, ``compute_advantages`` (GRPO: rewards normalized within the group of responses to
one prompt), ``ppo_update``, ``step_lr_scheduler``. Two CPU processes (gloo, AReaL's CPU platform)::

    torchrun --nproc-per-node 2 launch/train_areal.py --inject-inf 3

On GPUs the same script runs on NCCL (``--nproc-per-node gpu``). Options::

    --steps N          RL steps, one optimizer step each (default 30)
    --inject-inf S     write an inf into rank 1's gradient shard at step S (1-based, repeatable):
                       every rank skips it, the scale backs off, the LR is held
    --stock            AReaL's own engine, fp16 with no loss scale (to compare)
    --lr LR            AdamW's learning rate (default 1e-2)
    --out DIR          rank 0 writes summary.json there (default runs/areal)

At the end every rank reports its skipped steps and its scale; the job exits non-zero if the ranks
disagree. AReaL 1.0.4 in a venv of its own (docs/integrations/areal.md). On CPU processes it runs
with what launch/common/areal_cpu.py sets (``LOCAL_RANK``; torch.compile off).
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
    p.add_argument("--inject-inf", type=int, action="append", default=[])
    p.add_argument("--stock", action="store_true")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="runs/areal")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got: {args.steps}")
    if any(not 1 <= s <= args.steps for s in args.inject_inf):
        p.error(f"--inject-inf takes steps in [1, --steps={args.steps}], got: {args.inject_inf}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got: {args.lr}")
    return args


@torch.no_grad()
def sample(engine: Any, prompts: torch.Tensor, length: int, generator: torch.Generator) -> Any:
    """Sample ``length`` tokens after each prompt from the engine's model (full forward per token:
    the model is tiny); returns the responses and their log-probs under the sampling policy."""
    tokens, log_probs = prompts, []
    for _ in range(length):
        logits = engine.model(input_ids=tokens).logits[:, -1].float()
        dist_ = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(dist_.exp().cpu(), 1, generator=generator).to(tokens.device)
        log_probs.append(dist_.gather(1, nxt))
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts.shape[1] :], torch.cat(log_probs, dim=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    require("areal", "launch/train_areal.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from common.areal_cpu import prepare

        prepare()
    from areal_job import (
        GROUP,
        PROMPT,
        RESPONSE,
        VOCAB,
        actor_config,
        build_engine,
        poison_local_grad,
        rl_step,
        shared_model_dir,
        trajectory,
    )

    from common.distributed import destroy_process_group
    from common.tensors import params_digest
    from lm.agreement import RankView, ranks_agree

    model = shared_model_dir()
    engine = build_engine(actor_config(model, lr=args.lr), total_steps=args.steps)
    if not args.stock:
        from distscaler.integrations.areal import install

        install(engine)  # the one line
    from distscaler.integrations.areal import scaler_of

    scaler = scaler_of(engine)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    stepping = engine.optimizer_step
    state = {"step": 0}
    norms: list[float] = []

    def optimizer_step() -> dict[str, float]:
        if state["step"] in args.inject_inf and rank == 1 % world_size:
            poison_local_grad(engine.model.parameters())
        stats = stepping()
        norms.append(float(stats["grad_norm"]))
        return stats

    engine.optimizer_step = optimizer_step
    generator = torch.Generator().manual_seed(rank)
    rewards, lrs, skipped, scales = [], [], [], []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        state["step"] = step
        engine.eval()
        prompts = torch.randint(0, VOCAB - 2, (PROMPTS, PROMPT), generator=generator)
        prompts = prompts.repeat_interleave(GROUP, dim=0).to(device)
        responses, log_probs = sample(engine, prompts, RESPONSE, generator)
        reward = (responses < REWARDED_BELOW).float().mean(dim=1).cpu()
        batch = [
            trajectory(p.cpu(), r.cpu(), lp.cpu(), float(w))
            for p, r, lp, w in zip(prompts, responses, log_probs, reward)
        ]
        rl_step(engine, batch)
        lrs.append(float(engine.lr_scheduler.get_last_lr()[0]))
        rewards.append(float(reward.mean()))
        scales.append(None if scaler is None else scaler.get_scale())
        if not math.isfinite(norms[-1]):  # stock and ours: non-finite exactly when skipped
            skipped.append(step)
    seconds = time.perf_counter() - start
    mean_reward = torch.tensor(rewards).view(1, -1)
    dist.all_reduce(mean_reward)
    mean_reward = (mean_reward / world_size).view(-1).tolist()
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in engine.model.parameters()]
    # Each rank holds its own shard: scales and skips are compared, shards are not.
    view = RankView(rank, tuple(skipped), scales[-1] or 0.0, params_digest(shards), replica=rank)
    views: list[Any] = [None] * world_size
    dist.all_gather_object(views, view)
    problems = ranks_agree(views)
    summary = {
        "steps": args.steps,
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
            f"train_areal: {args.steps} steps in {seconds:.1f} s on {world_size} ranks, mean "
            f"reward {mean_reward[0]:.3f} -> {mean_reward[-1]:.3f}, skipped steps {skipped}, "
            f"scale {scales[-1]}, ranks {'agree' if not problems else 'DISAGREE'}",
            flush=True,
        )
        for problem in problems:
            print(f"train_areal: {problem}", file=sys.stderr, flush=True)
    destroy_process_group()  # after a barrier: gloo's teardown can hang on torch < 2.8
    if problems:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
