"""NeMo-RL's DTensor policy worker in fp16 with distscaler: GRPO on a tiny Qwen2, no Ray.

NeMo-RL's own ``DTensorPolicyWorkerV2Impl`` (distscaler's subclass, what
``worker_extension_cls_fqn=distscaler.integrations.nemo_rl.WORKER`` builds; ``--stock``: NeMo-RL's
class), built by its ``__init__`` from a policy config (``precision: "float16"``, AdamW, NeMo-RL's
warmup schedule), a 2-layer Qwen2 saved locally, NeMo-RL's GRPO loss (``ClippedPGLossFn``). Each
step every rank samples responses to its prompts from the current policy (a plain sampling loop
over the worker's model: no vLLM), rewards each response by the share of its tokens below 64, turns
the rewards into GRPO advantages (normalized within the group of responses to one prompt) and runs
the worker's ``train`` (one global batch, one optimizer step, one scheduler step), as NeMo-RL's GRPO
loop calls ``policy.train``. Two CPU processes (gloo)::

    torchrun --nproc-per-node 2 launch/train_nemo_rl.py --inject-inf 3

Options::

    --steps N          RL steps (default 12)
    --inject-inf S     write an inf into rank 1's gradient shard at step S (1-based, repeatable):
                       every rank skips it, the scale backs off, the LR is held
    --stock            NeMo-RL's own worker: fp16 with no loss scale; the step is taken on the inf
    --lr LR            AdamW's learning rate (default 1e-3; NeMo-RL's linear warmup over 4 steps)
    --out DIR          rank 0 writes summary.json there (default runs/nemo_rl)

At the end every rank reports its skipped steps and its scale; the job exits non-zero if the ranks
disagree. NeMo-RL is not on PyPI: its source at ``distscaler.integrations.nemo_rl.TESTED_COMMIT``
must be importable (docs/integrations/nemo_rl.md). On CPU processes it runs with the stand-ins of
``launch/common/nemo_rl_cpu.py`` (NeMo-RL is written for Ray GPU actors; each says why).
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

NEMO_RL_MISSING = (
    "launch/train_nemo_rl.py needs NeMo-RL, which is not on PyPI: its source at "
    "distscaler.integrations.nemo_rl.TESTED_COMMIT and its worker's dependencies on the path "
    "(docs/integrations/nemo_rl.md, 'Install')"
)
#: Prompts per rank per step; each gets GROUP sampled responses.
PROMPTS = 2
GROUP = 4
PROMPT = 4
RESPONSE = 8
#: A response token below this earns reward (a quarter of the vocabulary at random).
REWARDED_BELOW = 64


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inject-inf", type=int, action="append", default=[])
    p.add_argument("--stock", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="runs/nemo_rl")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got: {args.steps}")
    if any(not 1 <= s <= args.steps for s in args.inject_inf):
        p.error(f"--inject-inf takes steps in [1, --steps={args.steps}], got: {args.inject_inf}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got: {args.lr}")
    return args


@torch.no_grad()
def sample(model: Any, prompts: torch.Tensor, generator: torch.Generator) -> Any:
    """Sample RESPONSE tokens after each prompt (full forward per token: the model is tiny);
    returns the sequences, the sampling policy's log-probs (0 for the prompt) and whether the
    policy gave non-finite probabilities (NaN weights): then the token is drawn uniformly instead,
    so that every rank runs the same forwards (their all-gathers) whatever its own weights gave."""
    tokens, log_probs, nonfinite = prompts, [torch.zeros(prompts.shape)], False
    for _ in range(RESPONSE):
        logits = model(input_ids=tokens).logits[:, -1].float()
        dist_ = torch.log_softmax(logits, dim=-1)
        probs = dist_.exp()
        if not bool(torch.isfinite(probs).all()):
            nonfinite = True
            probs = torch.ones_like(probs)
        nxt = torch.multinomial(probs, 1, generator=generator)
        log_probs.append(dist_.gather(1, nxt))
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens, torch.cat(log_probs, dim=1), nonfinite


def grpo_advantages(reward: torch.Tensor) -> torch.Tensor:
    """GRPO: each response's reward minus its group's mean, over the group's std."""
    grouped = reward.view(-1, GROUP)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    require("train", "launch/train_nemo_rl.py")
    try:
        import nemo_rl.models.policy.workers.dtensor_policy_worker_v2  # noqa: F401
    except ImportError as e:
        print(f"{NEMO_RL_MISSING}; {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from nemo_rl_job import (
        VOCAB,
        build_worker,
        grpo_batch,
        on_cpu,
        pg_loss,
        poison_on,
        policy_config,
        shared_model_dir,
        train,
    )

    from common.distributed import destroy_process_group
    from common.tensors import params_digest
    from lm.agreement import RankView, ranks_agree

    model = shared_model_dir()
    samples = PROMPTS * GROUP
    config = policy_config(
        model,
        global_batch=samples * world_size,
        micro_batch=samples // 2,
        lr=args.lr,
        warmup=4,
    )
    worker = build_worker(config, ours=not args.stock)
    state = {"step": 0}
    poison_on(worker, lambda: state["step"] in args.inject_inf and rank == 1 % world_size)
    loss = pg_loss()
    generator = torch.Generator().manual_seed(rank)
    rewards, norms, lrs, skipped, scales, finite = [], [], [], [], [], []
    crashed: dict[str, Any] | None = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        state["step"] = step
        prompts = torch.randint(2, VOCAB, (PROMPTS, PROMPT), generator=generator)
        prompts = prompts.repeat_interleave(GROUP, dim=0)
        worker.model.eval()
        # Under autocast as NeMo-RL's own forward passes (on_cpu: CUDA's autocast is the CPU's).
        with on_cpu(), torch.autocast("cuda", dtype=worker.dtype):
            tokens, old_log_probs, nonfinite = sample(worker.model, prompts, generator)
        failed = torch.tensor([float(nonfinite)])
        dist.all_reduce(failed)  # every rank stops together
        if failed.item():  # the policy is NaN: a sampler (vLLM's too) has nothing to draw from
            crashed = {"step": step, "error": "the policy's probabilities are not finite"}
            break
        responses = tokens[:, PROMPT:]
        reward = (responses < REWARDED_BELOW).float().mean(dim=1)
        advantages = grpo_advantages(reward)[:, None].expand(-1, tokens.shape[1]).clone()
        batch = grpo_batch(
            step, rank, input_ids=tokens, advantages=advantages, prev_logprobs=old_log_probs
        )
        batch["token_mask"][:, :PROMPT] = 0  # the loss is over the responses
        metrics = train(worker, batch, loss)
        norm = float(metrics["grad_norm"])
        rewards.append(float(reward.mean()))
        norms.append(norm)
        lrs.append(metrics["lr_after"])
        scales.append(metrics.get("distscaler/scale"))
        nonfinite_here = not all(
            bool(torch.isfinite(p.to_local()).all()) for p in worker.model.parameters()
        )
        nonfinite_anywhere = torch.tensor([float(nonfinite_here)])
        dist.all_reduce(nonfinite_anywhere)  # the weights of every rank's shards
        finite.append(not nonfinite_anywhere.item())
        if metrics.get("distscaler/skipped"):
            skipped.append(step)
    seconds = time.perf_counter() - start
    mean_reward = torch.tensor(rewards).view(1, -1)
    dist.all_reduce(mean_reward)
    mean_reward = (mean_reward / world_size).view(-1).tolist()
    from torch.distributed.fsdp import FSDPModule

    for module in worker.model.modules():  # a forward without backward leaves some gathered
        if isinstance(module, FSDPModule):
            module.reshard()
    shards = [p.to_local() for p in worker.model.parameters()]
    # Each rank holds its own shard: skips and scales are compared, shards are not.
    last_scale = scales[-1] if scales and scales[-1] is not None else 0.0
    view = RankView(rank, tuple(skipped), last_scale, params_digest(shards), replica=rank)
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
        "weights_finite": finite,
        "sampling_failed": crashed,
        "worker": f"{type(worker).__module__}.{type(worker).__qualname__}",
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
        nonfinite = [i + 1 for i, n in enumerate(norms) if not math.isfinite(n)]
        if crashed is not None:
            print(f"train_nemo_rl: sampling failed at step {crashed['step']}: {crashed['error']}")
        print(
            f"train_nemo_rl: {len(norms)} steps in {seconds:.1f} s on {world_size} ranks, "
            f"mean reward {mean_reward[0]:.3f} -> {mean_reward[-1]:.3f}, non-finite grad norm at "
            f"steps {nonfinite}, skipped steps {skipped}, scale {scales[-1] if scales else None}, weights finite at "
            f"the end: {finite[-1] if finite else None}, ranks {'agree' if not problems else 'DISAGREE'}",
            flush=True,
        )
        for problem in problems:
            print(f"train_nemo_rl: {problem}", file=sys.stderr, flush=True)
    destroy_process_group()  # after a barrier: gloo's teardown can hang on torch < 2.8
    if problems:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
