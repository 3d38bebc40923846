"""What the scaler phase costs in each layout, distscaler beside torch's own scaler, in one run.

For every ``--parallelism`` asked for, the reference model (``launch/lm``) is laid out as the
training job lays it out, one forward/backward makes real scaled fp16-autocast gradients, and then
the same gradients are handed, interleaved (A B C A B C ...), to:

* **distscaler**: ``scaler.clip_grad_norm_`` + ``scaler.step`` + ``scaler.update``;
* **torch**: torch's recipe for that layout: ``unscale_`` + clip + ``step`` + ``update`` with
  ``torch.amp.GradScaler`` (DDP, pipeline) or ``ShardedGradScaler`` (FSDP1, FSDP2, HSDP, TP), and
  the clip that layout needs: ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware for FSDP2/HSDP/TP),
  FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``, and for pipeline stages the local norm
  plus the all_reduce over the stages that torchtitan adds;
* **optimizer alone**: ``optimizer.step()`` on the same gradients, to show what is the optimizer's.

The first two are the benchmark's contenders (``benchkit.contenders``: ``distscaler`` and ``torch``
/ ``torch-sharded``), given the layout's registration and torch's clip for that layout.

It reports per layout: collectives per step inside the phase (``CommDebugMode``), and the median
wall time of the phase over ``--repeats`` rounds. The scaler's share is the phase minus the
optimizer alone. Run it with torchrun (gloo on CPU, NCCL on GPUs); ``hsdp`` needs 4 ranks::

    torchrun --standalone --nproc-per-node=2 launch/layout_costs.py --parallelism ddp fsdp1 fsdp2 tp pp
    torchrun --standalone --nproc-per-node=4 launch/layout_costs.py --parallelism hsdp

Rank 0 prints a markdown table and writes ``--out`` (JSON, one record per layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchkit.contenders import build_contender, optimizer_like
from benchkit.timing import interleave

from common.distributed import Dist, destroy_process_group, setup_distributed
from common.tensors import local_tensor
from distscaler import GradScaler
from lm.config import load_config
from lm.layout import Parallel
from lm.optim import make_optimizer
from lm.parallel import build_parallel

LAYOUTS = ("ddp", "fsdp1", "fsdp2", "hsdp", "tp", "pp")
#: The scale of the gradients and of every scaler: low enough that no layout overflows.
INIT_SCALE = 2.0**10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallelism", nargs="+", choices=LAYOUTS, default=["ddp", "fsdp2"])
    parser.add_argument(
        "--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    )
    parser.add_argument("--n-layer", type=int, default=8, help="transformer blocks (default 8)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--out", default="runs/layout_costs.json")
    return parser.parse_args(argv)


def _torch_clip(par: Parallel, parallelism: str, params: list[torch.Tensor]) -> Any:
    """torch's clip for this layout (what a torch user writes today), given the max norm."""

    def clip(max_norm: float) -> None:
        if parallelism == "fsdp1":
            par.model.clip_grad_norm_(max_norm)  # FSDP1's own: all-reduces the sharded norms
        elif parallelism == "pp":
            # torchtitan's pipeline clip: local norm, then all_reduce of norm**2 over the stages.
            local = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            total = local.pow(2)
            dist.all_reduce(total)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.sqrt())
        else:
            torch.nn.utils.clip_grad_norm_(params, max_norm)

    return clip


def _contenders(
    par: Parallel, parallelism: str, args: argparse.Namespace, d: Dist, optimizers: dict[str, Any]
) -> dict[str, Any]:
    """name -> one clip + step + update with the real optimizer (benchkit's ``step``), or the
    optimizer alone. torch's scaler is ``torch.amp.GradScaler`` for DDP and pipeline stages,
    ``ShardedGradScaler`` for the sharded layouts."""
    torch_name = "torch" if parallelism in ("ddp", "pp") else "torch-sharded"
    runs: dict[str, Any] = {}
    for kind, optimizer in optimizers.items():
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def fresh(optimizer: Any = optimizer) -> Any:
            return optimizer_like(optimizer, [dict(g) for g in optimizer.param_groups])

        for name in ("distscaler", torch_name):
            contender = build_contender(
                name,
                params=params,
                make_optimizer=fresh,
                optimizer=optimizer,
                clip=args.max_norm,
                device=d.device,
                layout=parallelism,
                init_scale=INIT_SCALE,
                setup_scaler=par.setup_scaler,
                torch_clip=_torch_clip(par, parallelism, params),
            )
            if contender.error is not None or contender.step is None:
                raise RuntimeError(f"{name} cannot run on {parallelism}: {contender.error}")
            runs[f"{name.split('-')[0]}/{kind}"] = contender.step
        runs[f"optimizer/{kind}"] = optimizer.step
    return runs


def measure(parallelism: str, args: argparse.Namespace, d: Dist) -> dict[str, Any]:
    cfg = load_config(
        args.config, parallelism=parallelism, n_layer=args.n_layer, d_model=args.d_model
    )
    par = build_parallel(cfg, d)
    fused = make_optimizer(par.state_module, cfg, d.device)
    foreach = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in fused.param_groups],
        foreach=True,
    )
    optimizers = {"fused": fused, "foreach": foreach}

    gen = torch.Generator().manual_seed(cfg.seed + par.dp_rank)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size), generator=gen).to(d.device)
    warm = par.setup_scaler(GradScaler(d.device.type, init_scale=INIT_SCALE))
    par.forward_backward(x, x.roll(-1, 1), fused, warm, cfg)
    params = [p for g in fused.param_groups for p in g["params"]]
    saved = [None if p.grad is None else local_tensor(p.grad).detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, g in zip(params, saved):
                if g is not None and p.grad is not None:
                    local_tensor(p.grad).copy_(g)

    from torch.distributed.tensor.debug import CommDebugMode

    runs, collectives, failed = {}, {}, {}
    for name, run in _contenders(par, parallelism, args, d, optimizers).items():
        restore()  # one counted round each; a recipe torch cannot run is reported, not timed
        try:
            with CommDebugMode() as comm:
                run()
        except RuntimeError as e:
            failed[name] = str(e).splitlines()[0]
            for optimizer in optimizers.values():  # what torch's scaler leaves behind on error
                for key in ("grad_scale", "found_inf"):
                    vars(optimizer).pop(key, None)
            continue
        counts: Counter[str] = Counter()
        for op, n in comm.get_comm_counts().items():
            counts[str(op).split(".")[-1]] += n
        runs[name], collectives[name] = run, dict(counts)

    def restore_in_step() -> None:  # every rank starts each timed call together
        restore()
        d.barrier()

    times = interleave(
        runs,
        reset=restore_in_step,
        rounds=args.repeats,
        warmup=args.warmup,
        device=d.device,
    )
    late = {name: t for name, t in times.items() if isinstance(t, str)}
    if late:  # it ran in the counted round: a failure now is not a missing torch feature
        raise RuntimeError(f"contenders failed while timed: {late}")
    # Every rank's median; the slowest rank sets the pace of a step.
    medians = torch.tensor([statistics.median(times[name]) for name in runs], dtype=torch.float64)
    if d.enabled:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    ms = dict(zip(runs, (medians * 1e3).tolist()))
    scaler_ms = {
        name: ms[name] - ms[f"optimizer/{name.split('/')[1]}"]
        for name in ms
        if not name.startswith("optimizer/")
    }
    return {
        "parallelism": parallelism,
        "layout": par.describe,
        "world_size": d.world_size,
        "num_params": par.num_params,
        "device": str(d.device.type),
        "collectives": {
            name: counts
            for name, counts in collectives.items()
            if not name.startswith("optimizer/")
        },
        "median_ms": ms,
        "scaler_phase_ms": scaler_ms,
        "failed": failed,
        "repeats": args.repeats,
    }


def _fmt_counts(counts: dict[str, int] | None) -> str:
    if counts is None:
        return "-"
    total = sum(counts.values())
    detail = ", ".join(f"{n} {op}" for op, n in sorted(counts.items()))
    return f"{total} ({detail})" if total else "0"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: collectives per step, and the scaler phase (phase minus optimizer alone) in ms."""
    lines = [
        "| layout | ranks | params | collectives/step distscaler | collectives/step torch "
        "| scaler ms, fused AdamW: distscaler / torch | scaler ms, foreach AdamW: distscaler / torch "
        "| optimizer alone ms, fused / foreach |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pair(r: dict[str, Any], kind: str) -> str:
        share = r["scaler_phase_ms"]
        ours, theirs = share.get(f"distscaler/{kind}"), share.get(f"torch/{kind}")
        if theirs is None:
            return f"{ours:.1f} / fails*"
        return f"{ours:.1f} / {theirs:.1f}"

    for r in records:
        ms, coll = r["median_ms"], r["collectives"]
        lines.append(
            f"| {r['parallelism']} | {r['world_size']} | {r['num_params'] / 1e6:.1f}M "
            f"| {_fmt_counts(coll.get('distscaler/fused'))} "
            f"| {_fmt_counts(coll.get('torch/foreach'))} "
            f"| {pair(r, 'fused')} | {pair(r, 'foreach')} "
            f"| {ms['optimizer/fused']:.1f} / {ms['optimizer/foreach']:.1f} |"
        )
    failures = {f"{r['parallelism']} {k}": v for r in records for k, v in r["failed"].items()}
    for name, why in failures.items():
        lines.append(f"\n\\* {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = setup_distributed(load_config(args.config).device)
    records = [measure(parallelism, args, d) for parallelism in args.parallelism]
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=2))
        print(table(records))
        print(f"(medians of {args.repeats} rounds, slowest rank; written to {out})")
    destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
