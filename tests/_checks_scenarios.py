"""Scenarios of tests/test_checks.py on gloo ranks: a check that is not the library's (an FP8-style
amax agreed on the step's one collective, defined here and nowhere in distscaler/) added with
``GradScaler.add_check()``, beside the replica check, under DDP with and without clipping."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler
from distscaler.checks import Contribution, Settlement

#: The agreed amax above which the check skips the step (its own cause; the scale stays).
LIMIT = 1e4
STEPS = 6
#: The step at which rank 1's gradients are made large (after DDP's reduce: rank 1 alone), so
#: that only the agreed (maximum over ranks) amax crosses LIMIT on rank 0.
BIG_STEP = 3


class AmaxReading:
    """The agreed amax of the step's gradients (as the pass reads them: scaled)."""

    def __init__(self, check: AmaxCheck, amax: float) -> None:
        self.check, self.amax = check, amax

    @property
    def host_skip(self) -> bool:
        return self.amax > LIMIT

    def step_flag(self, found_inf: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        return one if self.host_skip else found_inf

    def settle(self, found_inf: Callable[[], bool]) -> Settlement:
        return Settlement("amax_limit", self.amax) if self.host_skip else Settlement()

    def close(self, number: int, found_inf: torch.Tensor, *, counted: bool) -> None:
        self.check.seen.append((number, self.amax))


class AmaxSlots:
    """The check's part of one step: this rank's amax, the group's maximum read back."""

    def __init__(self, check: AmaxCheck) -> None:
        self.check = check

    def local(
        self,
        params: tuple[torch.Tensor, ...],
        grads: Sequence[torch.Tensor],
        moments: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        amax = torch.stack([g.detach().abs().amax().float() for g in grads]).amax()
        self.check.local.append(float(amax))
        return amax.reshape(1)

    def read(
        self,
        reduced: torch.Tensor,
        local_flag: torch.Tensor | None = None,
        agreed: torch.Tensor | None = None,
    ) -> AmaxReading:
        return AmaxReading(self.check, float(reduced[0]))


class AmaxCheck:
    """An FP8-style amax agreed across ranks at every step, riding the scaler's collective."""

    every_step = False

    def __init__(self) -> None:
        self.local: list[float] = []
        self.seen: list[tuple[int, float]] = []
        self.ended: list[str | None] = []

    def contribution(self, plan: Any, layouts: Any, optimizer: Any, device: Any) -> Contribution:
        slots = AmaxSlots(self)
        return Contribution(1, slots.local, slots.read, combine="max")

    def end_iteration(self, cause: str | None, optimizers: Any) -> None:
        self.ended.append(cause)

    def count(self) -> list[tuple[int, str]]:
        return []

    def name(self) -> tuple[list[tuple[int, Any]], Exception | None]:
        return [], None

    def note_overflow(self, step: int, ranks: set[int]) -> None:
        pass

    def at_fault(self) -> tuple[str, ...]:
        return ()

    def nonfinite_seen(self) -> bool:
        return False

    def forget(self) -> None:
        pass

    def configure(self, config: Any) -> None:
        pass


def _run(rank: int, clip: bool, replica_check: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, replica_check=replica_check,
                        replica_check_interval=1).register_model(ddp)  # fmt: skip
    check = AmaxCheck()
    scaler.add_check(check)
    calls: list[str] = []
    names = ("all_reduce", "all_gather_into_tensor", "all_gather_single")
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append("all_gather" if name.startswith("all_gather") else name)
            return real[name](*args, **kwargs)

        return call

    out: dict[str, Any] = {"steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 + step + 10 * rank)
        scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
        if step == BIG_STEP and rank == 1:
            model[0].weight.grad[0, 0] = 2 * LIMIT  # after the reduce: rank 1 alone
        scale_before = scaler.get_scale()
        calls.clear()
        for name in real:
            setattr(dist, name, counting(name))
        try:
            if clip:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        scaler.update()
        out["steps"].append({
            "collectives": list(calls),
            "local_amax": check.local[-1],
            "agreed_amax": check.seen[-1][1] if check.seen else None,
            "skipped": scaler.step_was_skipped,
            "scale_before": scale_before,
            "scale_after": scaler.get_scale(),
        })  # fmt: skip
    totals = scaler.skip_totals
    out["causes"] = dict(totals.causes)
    out["report"] = scaler.report_skip()
    out["report"] = None if out["report"] is None else out["report"].cause
    out["ended"] = check.ended
    state = scaler.state_dict()  # the cause travels in a checkpoint: num_amax_limit_skips
    out["state_key"] = state.get("num_amax_limit_skips")
    fresh = GradScaler("cpu")
    fresh.load_state_dict(state)
    out["loaded_causes"] = dict(fresh.skip_totals.causes)
    # the reference: each step's local amax, maxed over the ranks by a collective of our own
    local = torch.tensor(check.local)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    out["reference_amax"] = local.tolist()
    out["mismatches"] = scaler.replica_ledger.mismatch_events
    return out


def amax_check(rank: int, world_size: int) -> dict[str, Any]:
    """The check alone (no replica check; clipping: the norm's SUM beside the amax's MAX) and
    beside the replica check (no clipping: the flag's MAX, the checksum's SUM, the amax's MAX)."""
    return {"alone": _run(rank, clip=True, replica_check=False),
            "beside": _run(rank, clip=False, replica_check=True)}  # fmt: skip
