"""Scenarios of tests/test_capture.py: one scaler step on static gradients, run eagerly or replayed.

A graph (``make_fx`` on CPU, ``torch.cuda.graph`` on GPUs) replays fixed tensors, so the gradients
are static: allocated once, refilled in place before every step (``set_grads``), never set to None.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distscaler import GradScaler

STEPS = 14
#: Warm-up steps before a CUDA graph capture (torch's recipe runs a few on a side stream).
WARMUP = 3
INIT_SCALE = 2.0**10
MAX_NORM = 0.5
#: step -> (value, parameter index): faults of the single-process runs (some after the trace).
FAULTS = {3: ("inf", 1), 6: ("nan", 0), 7: ("-inf", 4), 11: ("nan", 2)}
#: Faults of the last rank only, in the multi-GPU run.
RANK_FAULTS = {4: ("inf", 1), 9: ("nan", 3)}
_VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_SIZES = (7, 33, 16, 40, 5)


@dataclass
class Run:
    """A model's parameters with static gradients, a fused AdamW and a scaler."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: GradScaler
    clip: bool

    @classmethod
    def build(cls, policy: str, clip: bool, device: str = "cpu", skip_log_interval: int = 0) -> Run:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in _SIZES]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(
            params, lr=1e-2, fused=True, capturable=torch.device(device).type == "cuda"
        )
        hysteresis = 1 if policy == "torch" else 2
        scaler = GradScaler(
            torch.device(device).type,
            init_scale=INIT_SCALE,
            growth_interval=3,
            policy=policy,  # type: ignore[arg-type]
            hysteresis=hysteresis,
            skip_log_interval=skip_log_interval,
        )
        scaler.materialize(device)
        return cls(params, optimizer, scaler, clip)

    def set_grads(self, step: int, faults: dict[int, tuple[str, int]]) -> None:
        """This step's (scaled) gradients, written into the static gradient tensors."""
        gen = torch.Generator().manual_seed(1000 + step)
        for p in self.params:
            p.grad.copy_(torch.randn(p.shape, generator=gen) * 64)  # type: ignore[union-attr]
        if step in faults:
            kind, index = faults[step]
            self.params[index].grad.view(-1)[step % self.params[index].numel()] = _VALUES[kind]  # type: ignore[union-attr]

    def step(self) -> None:
        if self.clip:
            self.scaler.clip_grad_norm_(self.optimizer, MAX_NORM)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def snapshot(self) -> dict[str, Any]:
        """Everything a step changes, as host values (compared exactly)."""
        state = self.optimizer.state
        return {
            "scaler": self.scaler.state_dict(),
            "totals": self.scaler.skip_totals,
            "params": [p.detach().cpu().tolist() for p in self.params],
            "optimizer": [
                [state[p][k].detach().cpu().tolist() for k in sorted(state[p])] for p in self.params
            ],
        }


def capture(
    run: Run, faults: dict[int, tuple[str, int]], after: Callable[[], Any] | None = None
) -> torch.cuda.CUDAGraph:
    """torch's recipe: ``WARMUP`` eager steps on a side stream (``after()`` once each is done),
    then one step captured (not run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            run.set_grads(step, faults)
            run.step()
            if after is not None:
                torch.cuda.synchronize()
                after()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run.step()
    return graph


def graphed_agreement(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """The step, NCCL all_reduce included, replayed from a CUDA graph on every rank; the last rank
    alone overflows at ``RANK_FAULTS``. Each rank reports what it skipped, its scales and params."""
    run = Run.build("torch", clip=True, device=device)
    faults = RANK_FAULTS if rank == world_size - 1 else {}
    skipped, scales = [], []
    seen = 0

    def after_step() -> None:
        nonlocal seen
        totals = run.scaler.skip_totals  # a host read between steps, outside the graph
        skipped.append(totals.num_skipped > seen)
        seen = totals.num_skipped
        scales.append(run.scaler.get_scale())

    graph = capture(run, faults, after=after_step)
    for step in range(WARMUP, STEPS):
        run.set_grads(step, faults)
        graph.replay()
        torch.cuda.synchronize()
        after_step()
    totals = run.scaler.skip_totals
    digest = hashlib.sha256()
    for p in run.params:
        digest.update(p.detach().cpu().numpy().tobytes())
    return {
        "skipped": skipped,
        "scales": scales,
        "digest": digest.hexdigest(),
        "totals": [totals.num_updates, totals.num_skipped, totals.last_skipped],
    }
