"""The world-size / layout sweep: every contender on DDP and FSDP2 gradients, under torchrun.

Each rank of the job builds a model of about ``--params`` elements over ``--tensors`` parameter
tensors (fp32), lays it out (``ddp``: ``DistributedDataParallel``; ``fsdp2``: ``fully_shard`` on a
1-D device mesh of the world, gradients are DTensors), makes real loss-scaled gradients with one
fp16-autocast forward/backward (the loss times the contenders' initial scale), and hands them to
:func:`benchkit.cases.measure`. Per-round times are all-reduced (MAX) across the ranks, so every
median is the slowest rank's. Run one world size with torchrun (gloo on the CPU, NCCL with one GPU
per rank for ``--device cuda``)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 launch/benchkit/distributed.py \\
        --layouts ddp fsdp2 --params 200000 --tensors 8 --optimizer fused \\
        --rounds 10 --warmup 2 --out runs/bench_w2.json

Rank 0 writes the records (one per layout, the schema of :mod:`benchkit.cases`) to ``--out`` as a
JSON list. From a parent process, :func:`run_worlds` runs that job once per world size (world size
1 under torchrun too) and returns all the records.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# As a script, launch/benchkit/ is sys.path[0]: swap it for launch/, so that ``benchkit`` and ``common``
# import as packages and these modules never import as top-level names (``distributed``, ...).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchkit.cases import OPTIMIZERS, Case, measure  # noqa: E402
from benchkit.contenders import CONTENDERS, INIT_SCALE, ON_REQUEST, VARIANTS  # noqa: E402
from common.distributed import Dist, destroy_process_group, setup_distributed  # noqa: E402
from common.tensors import local_tensor  # noqa: E402
from common.wrapping import ddp_device_ids, fully_shard_blocks  # noqa: E402

__all__ = [
    "DEFAULT_CONTENDERS",
    "LAYOUTS",
    "Blocks",
    "build_model",
    "main",
    "run_worlds",
    "slowest_rank",
]

LAYOUTS = ("ddp", "fsdp2")
#: Who runs unless ``--contenders`` says otherwise.
DEFAULT_CONTENDERS = (*(c for c in CONTENDERS if c not in ON_REQUEST), "distscaler-nocheck",
                      "distscaler-everycheck")
BATCH = 8
_STDERR_TAIL = 4000
#: What torchrun sets in its ranks' environment (prefixes).
_TORCHRUN_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_", "MASTER_", "TORCHELASTIC_",
)  # fmt: skip


class Blocks(nn.Module):
    """``tensors`` residual blocks ``h + tanh(h @ W.T)``, one bias-free ``width x width`` weight each.

    Cheap (``2 * batch * params`` flops per forward), every parameter gets a gradient, and the
    residual path keeps activations and gradients from vanishing however deep it is.
    """

    def __init__(self, width: int, tensors: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(tensors))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


def build_model(params: int, tensors: int, device: torch.device, *, seed: int = 0) -> Blocks:
    """A :class:`Blocks` model of ``tensors`` square weights totalling about ``params`` elements
    (the width is ``round(sqrt(params / tensors))``), identical on every rank (same seed)."""
    if tensors < 1 or params < tensors:
        raise ValueError(f"need 1 <= tensors <= params, got tensors={tensors}, params={params}")
    width = max(1, round(math.sqrt(params / tensors)))
    torch.manual_seed(seed)
    return Blocks(width, tensors).to(device)


def layout_model(model: Blocks, layout: str, d: Dist) -> nn.Module:
    """``model`` laid out over the world: DDP (replicated gradients) or FSDP2 (sharded DTensors)."""
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=ddp_device_ids(d.device))
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("dp",))
        fully_shard_blocks(model.blocks, model, mesh)
        return model
    raise ValueError(f"layout must be one of {LAYOUTS}, got: {layout!r}")


def scaled_gradients(model: nn.Module, width: int, d: Dist, *, seed: int = 0) -> None:
    """One fp16-autocast forward/backward of a loss multiplied by ``INIT_SCALE`` on this rank's own
    batch, as a training step with a loss scaler makes them. Raises if a gradient is not finite."""
    gen = torch.Generator().manual_seed(seed + 1 + d.rank)
    x = torch.randn(BATCH, width, generator=gen).to(d.device)
    with torch.autocast(d.device.type, dtype=torch.float16):
        out = model(x)
    loss = out.float().square().mean() * INIT_SCALE
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise RuntimeError("some parameters got no gradient")
    local = [local_tensor(g) for g in grads]
    finite = torch.stack([torch.isfinite(g).all() for g in local]).all()
    if not bool(finite):
        raise RuntimeError(
            f"non-finite loss-scaled gradients (scale {INIT_SCALE}) on rank {d.rank}"
        )


def slowest_rank(d: Dist) -> Callable[[list[float]], list[float]]:
    """``slowest`` for :func:`benchkit.cases.measure`: each round's time, the slowest rank's (one
    all_reduce MAX of a float64 tensor; called after timing, outside the timed calls)."""

    def slowest(times: list[float]) -> list[float]:
        if not d.enabled or d.world_size == 1:
            return list(times)
        t = torch.tensor(times, dtype=torch.float64, device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    return slowest


def run_layout(layout: str, args: argparse.Namespace, d: Dist) -> dict[str, Any]:
    """One record: ``layout`` at this world size."""
    model = build_model(args.params, args.tensors, d.device)
    width = model.blocks[0].in_features
    numel = sum(p.numel() for p in model.parameters())
    wrapped = layout_model(model, layout, d)
    scaled_gradients(wrapped, width, d)
    case = Case(
        params=numel,
        tensors=args.tensors,
        dtype="float32",
        optimizer=args.optimizer,
        clip=args.clip,
        world_size=d.world_size,
        layout=layout,
    )
    return measure(
        case,
        params=list(wrapped.parameters()),
        device=d.device,
        contenders=args.contenders,
        rounds=args.rounds,
        warmup=args.warmup,
        model=wrapped if layout == "ddp" else None,
        slowest=slowest_rank(d),
        barrier=dist.barrier if d.enabled and d.world_size > 1 else None,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--params", type=int, default=38_000_000, help="whole-model elements")
    parser.add_argument("--tensors", type=int, default=144, help="parameter tensors")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="fused", help="AdamW kind")
    parser.add_argument("--no-clip", dest="clip", action="store_false", help="no grad clipping")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=CONTENDERS + tuple(VARIANTS),
        default=list(DEFAULT_CONTENDERS),
        help=f"default: {' '.join(DEFAULT_CONTENDERS)}",
    )
    parser.add_argument("--out", required=True, help="JSON file (written by rank 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: python -m torch.distributed.run ... (see --help)")
    d = setup_distributed(args.device)
    try:
        records = [run_layout(layout, args, d) for layout in args.layouts]
        if d.is_main:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(records, indent=2))
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may be inside a collective
        raise
    destroy_process_group()
    return 0


def run_worlds(
    world_sizes: Sequence[int],
    layouts: Sequence[str],
    *,
    params: int,
    tensors: int,
    optimizer: str,
    clip: bool,
    rounds: int,
    warmup: int,
    device: str = "cpu",
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Run the worker under torchrun once per world size; every record, in order.

    Raises:
        RuntimeError: a run failed or ran past ``timeout`` seconds (with the tail of its stderr).
    """
    # A clean launch: nothing of a torchrun job this process may itself be a rank of.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_TORCHRUN_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_distributed_") as tmp:
        for world_size in world_sizes:
            out = Path(tmp) / f"w{world_size}.json"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={world_size}", str(Path(__file__).resolve()),
                "--layouts", *layouts, "--params", str(params), "--tensors", str(tensors),
                "--optimizer", optimizer, "--rounds", str(rounds), "--warmup", str(warmup),
                "--device", device, "--out", str(out), *([] if clip else ["--no-clip"]),
            ]  # fmt: skip
            # A session of its own: on timeout the whole job (torchrun and its ranks) is killed.
            proc = subprocess.Popen(
                cmd,
                cwd=_HERE.parents[1],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                raise RuntimeError(
                    f"world size {world_size} ran past {timeout} s: {' '.join(cmd)}\n"
                    f"{stderr[-_STDERR_TAIL:]}"
                ) from None
            teardown_abort = "terminate called without an active exception" in stderr
            if proc.returncode != 0 and out.exists() and teardown_abort:
                # The results were written; a rank aborted while gloo was torn down at exit (a
                # torch hazard, pytorch/pytorch#179291). Keep the results, say so.
                print(
                    f"world size {world_size}: a rank aborted at exit after the results were "
                    "written (gloo teardown); keeping them",
                    file=sys.stderr,
                )
            elif proc.returncode != 0 or not out.exists():
                raise RuntimeError(
                    f"world size {world_size} failed (exit {proc.returncode}): "
                    f"{_rank_error(stderr)}\n{' '.join(cmd)}\n{(stdout + stderr)[-_STDERR_TAIL:]}"
                )
            records += json.loads(out.read_text())
    return records


def _rank_error(output: str) -> str:
    """The last exception a rank printed (``[rank1]: ValueError: ...``), or a placeholder."""
    errors = [
        line.split(": ", 1)[1]
        for line in output.splitlines()
        if re.match(r"\[rank\d+\]: [A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", line)
    ]
    return errors[-1] if errors else "no rank printed an exception"


if __name__ == "__main__":
    raise SystemExit(main())
