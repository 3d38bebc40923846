"""What the test scenarios share: optimizer kinds, faults and the ranks they hit, a small model,
and digests that compare parameters and optimizer state bit for bit (across ranks or runs)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.tensors import local_tensor

__all__ = [
    "FAULTS",
    "OPTIMIZERS",
    "TARGETS",
    "digest",
    "gpu_path",
    "gpu_path_of",
    "make_optimizer",
    "mlp",
    "model_digest",
    "optim_digest",
    "optimizer_tensors",
    "set_rank_env",
    "target_ranks",
]

#: torch's three AdamW implementations (benchkit's spelling too).
OPTIMIZERS = ("fused", "foreach", "for-loop")
#: The non-finite values a fault writes into a gradient.
FAULTS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
#: Which ranks a fault hits: the first, the last, or every rank.
TARGETS = ("first", "last", "all")


def interpreted_mark() -> Any:
    """The mark of a test that runs the Triton pass's kernels in Triton's interpreter on the CPU:
    skipped where that interpreter cannot run them
    (`distscaler._triton.diagnostics.interpreter_runs`: Triton 3.6's cannot, 3.9's can), as on a
    GPU machine whose torch brings an older Triton."""
    import pytest

    from distscaler._triton import diagnostics

    reason = "Triton's interpreter here cannot run the kernels (a loop over a loaded bound)"
    return pytest.mark.skipif(not diagnostics.interpreter_runs(), reason=reason)


def interpreted(test: Any) -> Any:
    """`interpreted_mark()` as a decorator."""
    return interpreted_mark()(test)


def gpu_path(scaler: Any) -> Any:
    """``scaler`` (a ``distscaler.GradScaler``) set to run the step a GPU runs, on the CPU:
    ``found_inf`` never read on the host (the CPU's own path reads it, free there:
    ``distscaler._plan.host_read_is_free``). For tests that prove a fused step's no-read promise on
    gloo. Returns ``scaler``."""
    scaler._host_reads = False
    return scaler


@contextlib.contextmanager
def gpu_path_of(scaler: Any) -> Iterator[None]:
    """:func:`gpu_path` for the duration of a ``with`` block (the CPU's path again after it)."""
    saved, scaler._host_reads = scaler._host_reads, False
    try:
        yield
    finally:
        scaler._host_reads = saved


def target_ranks(target: str, world_size: int) -> set[int]:
    """The ranks that ``target`` (one of ``TARGETS``) names in a world of ``world_size``."""
    return {"first": {0}, "last": {world_size - 1}, "all": set(range(world_size))}[target]


def make_optimizer(kind: str, params: Iterable[Any], lr: float = 1e-2) -> torch.optim.Optimizer:
    """AdamW of ``OPTIMIZERS``' kind, or SGD: ``"sgd-fused"``, ``"sgd-for-loop"`` (momentum 0.9)."""
    params = list(params)
    if kind in OPTIMIZERS:
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(
            kind, {"foreach": False}
        )
        return torch.optim.AdamW(params, lr=lr, **flags)
    if kind == "sgd-fused":
        # No momentum: torch 2.13's fused SGD leaves a momentum buffer uninitialised when its very
        # first step is skipped (found_inf), with torch's scaler and ours alike.
        return torch.optim.SGD(params, lr=lr, fused=True)
    if kind == "sgd-for-loop":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    raise ValueError(
        f"kind must be one of {(*OPTIMIZERS, 'sgd-fused', 'sgd-for-loop')}, got: {kind!r}"
    )


def mlp(seed: int = 0, dims: tuple[int, ...] = (8, 16, 4)) -> nn.Sequential:
    """Linear layers of widths ``dims`` with ReLUs between, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the bytes of each tensor's local part (a DTensor's shard), in order."""
    h = hashlib.sha256()
    for t in tensors:
        local = local_tensor(t).detach().reshape(-1).contiguous().cpu()
        h.update(local.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor of ``opt`` (numbers as 0-d tensors), parameter by parameter."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                out.append(value if isinstance(value, torch.Tensor) else torch.tensor(value))
    return out


def model_digest(model: nn.Module) -> str:
    return digest(model.parameters())


def optim_digest(opt: torch.optim.Optimizer) -> str:
    return digest(optimizer_tensors(opt))


def set_rank_env(rank: int, world_size: int) -> None:
    """torchrun's rank variables for a spawned rank: Accelerate (and so the Trainer) reads the
    process layout from the environment; the process group already exists."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip


#: The repository root (what launched jobs import distscaler and launch/ from).
REPO = Path(__file__).resolve().parents[1]


def launch_env() -> dict[str, str]:
    """The environment of a job a test launches: no rank variables inherited from a spawned test
    process, one thread per process, no GPU, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torchrun_summary(
    script: str, *args: str, out: Path, nproc: int = 2, timeout: float = 240
) -> dict[str, Any]:
    """Run ``launch/<script> --out out *args`` under torchrun on ``nproc`` CPU processes (its own
    rendezvous port) and return the ``summary.json`` it wrote; fails with the job's output tail."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
        str(REPO / "launch" / script), "--out", str(out), *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env=launch_env(), cwd=out.parent, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())
