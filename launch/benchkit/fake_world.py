"""One scaler step of FSDP2 / HSDP at thousands of ranks, simulated in one process.

``torch.distributed``'s "fake" backend (``torch.testing._internal.distributed.fake_pg``) gives one
process the rank-0 view of a world of N ranks: every collective returns at once without moving
data. FSDP2 (``fully_shard``) and HSDP really shard a tiny model over that world, a real forward and
backward run (fp16 autocast; FSDP2's all-gathers and reduce-scatters are fake), and the scaler
step (``clip_grad_norm_`` + ``step`` + ``update``) runs under CommDebugMode and a dispatch mode that
records each collective's payload in bytes. The same is done for torch's scaler + clip
(``ShardedGradScaler.unscale_`` + ``get_total_norm``/``clip_grads_with_norm_`` on the DTensor
gradients, as torchtitan does) for contrast.

Run as a script (it initialises the default process group, so it must own its process)::

    python launch/benchkit/fake_world.py            # JSON on stdout: one record per (layout, world size)
    python launch/benchkit/fake_world.py --table    # the same as a markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# As a script, launch/benchkit/ is sys.path[0]: swap it for launch/, so that ``common`` imports as a
# package (the same as benchkit/distributed.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from common.probes import CollectiveLog  # noqa: E402
from common.wrapping import fully_shard_blocks  # noqa: E402

WORLD_SIZES = (8, 64, 1024, 4096)
LAYOUTS = ("fsdp2", "hsdp")
#: Ranks per "node": the shard dimension of the HSDP mesh (replicate x shard).
HSDP_SHARD = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Mixed sizes so that some ranks of a big world hold empty shards (they still join the step's collective).
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


def _shard(model: nn.Module, layout: str, world_size: int) -> Any:
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        shard = min(HSDP_SHARD, world_size // 2)
        mesh = init_device_mesh(
            "cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    fully_shard_blocks([layer for layer in model if isinstance(layer, nn.Linear)], model, mesh)
    return mesh


def _backward(model: nn.Module, scale: Any) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    scale(loss).backward()
    for p in model.parameters():  # a fake reduce-scatter leaves arbitrary values: make them finite
        if p.grad is not None:
            p.grad._local_tensor.nan_to_num_(0.0, 0.0, 0.0)


def simulate(layout: str, world_size: int) -> dict[str, Any]:
    """Collectives and bytes of one scaler step (ours, then torch's) on rank 0 of a fake world."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from distscaler import GradScaler

    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = _model()
        mesh = _shard(model, layout, world_size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        # The replica check off: a fake collective returns its input, so HSDP's replicas would
        # never sum to agreement (with it on, the all_reduce carries 8 more bytes: 16 on a
        # parameter check; counted at 2 and 4 real ranks by tests/test_replica_check.py).
        scaler = GradScaler("cpu", init_scale=2.0**10, replica_check=False)
        record: dict[str, Any] = {
            "layout": layout,
            "world_size": world_size,
            "mesh": list(mesh.shape),
            "local_grad_elements": 0,
        }
        for name in ("ours", "torch"):
            opt.zero_grad(set_to_none=True)
            if name == "ours":
                _backward(model, scaler.scale)
                record["local_grad_elements"] = sum(
                    p.grad._local_tensor.numel() for p in model.parameters()
                )
                with CommDebugMode() as comm, CollectiveLog() as log:
                    norm = scaler.clip_grad_norm_(opt, 1.0)
                    scaler.step(opt)
                    scaler.update()
                record["norm_finite"] = bool(math.isfinite(float(norm)))
            else:
                # A foreach AdamW: torch 2.13's ShardedGradScaler keeps found_inf of shape (1,),
                # which the fused kernel rejects after unscale_.
                ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
                ref = ShardedGradScaler("cpu", init_scale=2.0**10)
                _backward(model, ref.scale)
                with CommDebugMode() as comm, CollectiveLog() as log:
                    ref.unscale_(ref_opt)
                    params = list(model.parameters())
                    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
                    if isinstance(total, DTensor):
                        total = total.full_tensor()
                    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)
                    ref.step(ref_opt)
                    ref.update()
            record[name] = {
                "counts": {str(k): v for k, v in comm.get_comm_counts().items()},
                "total": comm.get_total_counts(),
                "calls": log.calls,
                "bytes": sum(n for _, n in log.calls),
            }
        record["seconds"] = round(time.perf_counter() - start, 2)
        return record
    finally:
        dist.destroy_process_group()


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | world size | mesh | distscaler collectives | bytes | torch collectives | bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ours, ref = r["ours"], r["torch"]
        ours_ops = ", ".join(f"{n} x {k}" for k, n in ours["counts"].items())
        ref_ops = ", ".join(f"{n} x {k}" for k, n in ref["counts"].items())
        mesh = " x ".join(map(str, r["mesh"]))
        lines.append(
            f"| {r['layout']} | {r['world_size']} | {mesh} | {ours_ops} | {ours['bytes']} "
            f"| {ref_ops} | {ref['bytes']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--table", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = [simulate(layout, n) for layout in args.layouts for n in args.world_sizes]
    print(table(records) if args.table else json.dumps(records))


if __name__ == "__main__":
    main()
