"""Test helpers: spawn gloo process groups with a private rendezvous, and spy on host reads."""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.distributed import destroy_process_group
from common.probes import HostReadSpy  # re-exported for the tests

__all__ = ["HostReadSpy", "spawn"]


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    with_device: bool,
    init_file: str,
    out_dir: str,
    scenarios: Callable[..., dict[str, Any]],
) -> None:
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        # Every rank runs the same kernels on the same data and the tests compare parameters bit
        # for bit across ranks: ask cuBLAS for its reproducible mode (must be set before it starts).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300 if backend == "nccl" else 120),
        device_id=torch.device("cuda", rank) if backend == "nccl" else None,
    )
    crashed = True
    try:
        try:
            if with_device:
                results = scenarios(rank, world_size, device)
            else:
                results = scenarios(rank, world_size)
            crashed = False
        except Exception:
            results = {"__crash__": traceback.format_exc()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        # After a crash the other ranks may be inside a collective: no barrier to pair with it.
        # Otherwise after one (gloo's teardown can hang on torch < 2.8), unless a rank crashed
        # meanwhile (its results say how).
        if not crashed:
            try:
                destroy_process_group()
            except Exception:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
    # The results are written and the group is gone: leave without the interpreter's finalization,
    # where native objects of torch's builds (gloo, FSDP) are torn down in no fixed order. (A rank
    # of tests/test_layouts.py's spawn aborted once on CI with torch 2.15.0's CUDA build on the
    # CPU, "free(): invalid pointer"; the same spawn passed again.) What the scenarios assert is
    # in the results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    scenarios: Callable[..., dict[str, Any]],
    world_size: int,
    tmp_path: Path,
    *,
    backend: str = "gloo",
    with_device: bool = False,
) -> list[dict[str, Any]]:
    """Run ``scenarios(rank, world_size)`` on ``world_size`` ranks; return each rank's result dict.

    gloo on the CPU by default; ``backend="nccl"`` puts rank ``r`` on ``cuda:r``. With
    ``with_device`` the scenarios also get the device type (``scenarios(rank, world_size,
    device)``). The rendezvous is a FileStore in ``tmp_path`` (no port), so tests run in parallel
    under xdist. ``scenarios`` must be a module-level function (spawned processes import it).
    """
    init_file = tmp_path / "rendezvous"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(
        _worker,
        args=(world_size, backend, with_device, str(init_file), str(out_dir), scenarios),
        nprocs=world_size,
        join=True,
    )
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    for r, res in enumerate(results):
        assert "__crash__" not in res, f"rank {r} crashed:\n{res['__crash__']}"
    return results
