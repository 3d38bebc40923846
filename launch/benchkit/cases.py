"""One benchmark case: its knobs, the gradients it builds, and the record it reports.

A record (one JSON object per case, the same for one process and for torchrun worlds)::

    {"sweep": "bytes", "device": "cpu", "world_size": 1, "layout": "single",
     "params": 38000000, "tensors": 144, "dtype": "float32", "optimizer": "fused", "clip": true,
     "grad_bytes": 152000000,                     # local gradient bytes on one rank
     "phase_ms": {"distscaler": 7.1, "torch": 39.0, ...},     # scaler (+ clip) phase, medians
     "step_ms": {"distscaler": 38.2, "torch": 70.1, ...},     # whole optimizer step, medians
     "optimizer_ms": 28.8,                        # optimizer.step() alone on the same gradients
     "floor_read_ms": 14.2, "floor_read_write_ms": 9.3,       # _foreach_norm / _foreach_mul_
     "floor_read_dot_ms": 6.8,       # the read as BLAS dot products (CPU fp32 only, else null)
     "counts": {"distscaler": {"collectives": 0, "collective_bytes": 0, "host_reads": 0}, ...},
     "errors": {"torch-sharded": "RuntimeError: ..."}}        # contenders that could not run

Times are medians over interleaved rounds; on more than one rank, each round's time is the slowest
rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from common.probes import count_per_step
from common.tensors import local_tensor

from .contenders import build_contender, floors
from .timing import interleave, median_ms

__all__ = [
    "DTYPES",
    "OPTIMIZERS",
    "Case",
    "build_contenders",
    "make_optimizer",
    "measure",
    "split_sizes",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OPTIMIZERS = ("fused", "foreach", "for-loop")
MAX_NORM = 1.0


@dataclass(frozen=True)
class Case:
    """The knobs of one case. ``params`` and ``tensors`` count the whole model (all ranks)."""

    params: int = 38_000_000
    tensors: int = 144
    dtype: str = "float32"
    optimizer: str = "fused"
    clip: bool = True
    world_size: int = 1
    layout: str = "single"

    def but(self, **changes: Any) -> Case:
        return replace(self, **changes)

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def split_sizes(params: int, tensors: int) -> list[int]:
    """``tensors`` sizes adding up to ``params``, as equal as possible."""
    if tensors < 1 or params < tensors:
        raise ValueError(f"need 1 <= tensors <= params, got tensors={tensors}, params={params}")
    base, extra = divmod(params, tensors)
    return [base + (i < extra) for i in range(tensors)]


def make_optimizer(kind: str, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW in one of torch's three implementations: "fused", "foreach" or "for-loop"."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got: {kind!r}")
    return torch.optim.AdamW(
        params,
        lr=1e-4,
        fused=kind == "fused",
        foreach=kind == "foreach" if kind != "fused" else None,
    )


def measure(
    case: Case,
    *,
    params: Sequence[nn.Parameter],
    device: torch.device,
    contenders: Sequence[str],
    rounds: int,
    warmup: int,
    model: nn.Module | None = None,
    slowest: Callable[[list[float]], list[float]] | None = None,
    barrier: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Time every contender (phase and whole step), the optimizer alone and the floors, interleaved.

    ``params`` must hold their (loss-scaled) gradients; each timed call starts from a copy of them.
    ``slowest`` turns one rank's per-round times into the slowest rank's (an all_reduce MAX; called
    after timing, outside the timed calls). ``barrier`` (a ``dist.barrier``) lines the ranks up
    before every timed call, so one rank's lag is not charged to the next collective. Returns the record described in the module docstring.
    """
    params = list(params)
    grads = [p.grad for p in params]
    # DTensor gradients (FSDP2) have no sharding rule for _foreach_copy_: copy into the local shards
    # (the DTensor's own storage, so the gradient itself is restored).
    local_grads = [local_tensor(g) for g in grads]
    saved = [g.detach().clone() for g in local_grads]

    def reset() -> None:
        torch._foreach_copy_(local_grads, saved)
        if barrier is not None:
            barrier()

    optimizer, built = build_contenders(case, params, device, contenders, model=model)
    fns: dict[str, Callable[[], Any]] = {}
    for name, c in built.items():
        if c.error is None:
            assert c.phase is not None and c.step is not None
            fns[f"phase/{name}"] = c.phase
            fns[f"step/{name}"] = _leaving_no_amp_attributes(c.step, optimizer)
    fns["optimizer"] = optimizer.step
    fns.update(floors(grads))
    times = interleave(fns, reset=reset, rounds=rounds, warmup=warmup, device=device)
    if slowest is not None:
        times = {k: v if isinstance(v, str) else slowest(v) for k, v in times.items()}

    errors = {name: c.error for name, c in built.items() if c.error is not None}
    for key, value in times.items():
        if isinstance(value, str) and "/" in key:
            errors.setdefault(key.split("/", 1)[1], value)
    counts = {}
    for name, c in built.items():
        if name not in errors and c.phase is not None and c.countable:
            counts[name] = count_per_step(c.phase, untimed=reset)
    return {
        **case.asdict(),
        "device": device.type,
        "grad_bytes": sum(g.numel() * g.element_size() for g in local_grads),
        "phase_ms": {n: median_ms(times[f"phase/{n}"]) for n in built if n not in errors},
        "step_ms": {n: median_ms(times[f"step/{n}"]) for n in built if n not in errors},
        "optimizer_ms": median_ms(times["optimizer"]),
        "floor_read_ms": median_ms(times["floor: one read"]),
        "floor_read_write_ms": median_ms(times["floor: one read+write"]),
        "floor_read_dot_ms": median_ms(times.get("floor: one read (BLAS dot)", [])),
        "counts": counts,
        "errors": errors,
    }


def build_contenders(
    case: Case,
    params: Sequence[nn.Parameter],
    device: torch.device,
    contenders: Sequence[str],
    *,
    model: nn.Module | None = None,
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """The case's real optimizer over ``params`` and each contender built over them."""
    optimizer = make_optimizer(case.optimizer, params)
    built = {
        name: build_contender(
            name,
            params=params,
            make_optimizer=lambda: make_optimizer(case.optimizer, params),
            optimizer=optimizer,
            clip=MAX_NORM if case.clip else None,
            device=device,
            layout=case.layout,
            model=model,
        )
        for name in contenders
    }
    return optimizer, built


def _leaving_no_amp_attributes(
    step: Callable[[], Any], optimizer: torch.optim.Optimizer
) -> Callable[[], Any]:
    """``step`` on the shared optimizer, then drop the ``grad_scale``/``found_inf`` attributes torch's
    scalers leave on it, so the next contender (and the optimizer alone) starts clean."""

    def run() -> None:
        try:
            step()
        finally:
            for key in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(key, None)

    return run


def plain_params(case: Case, device: torch.device, *, seed: int = 0) -> list[nn.Parameter]:
    """``case.tensors`` 1-D parameters of ``case.dtype`` on ``device`` with loss-scaled gradients.

    Gradients are N(0, 1e-4) values times the contenders' initial loss scale (2**16), finite in
    every dtype; their unscaled global norm is above the max norm, so clipping really scales.
    """
    from .contenders import INIT_SCALE

    torch.manual_seed(seed)
    dtype = DTYPES[case.dtype]
    params = []
    for numel in split_sizes(case.params, case.tensors):
        p = nn.Parameter(torch.empty(numel, dtype=dtype, device=device).normal_(0.0, 0.02))
        p.grad = torch.empty_like(p).normal_(0.0, 1e-4 * INIT_SCALE)
        params.append(p)
    return params
