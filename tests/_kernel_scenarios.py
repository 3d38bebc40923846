"""Scenarios of tests/test_kernels.py on gloo ranks: the scaler with ``kernels="triton"`` (Triton's
interpreter on the CPU) beside ``kernels="torch"``, DDP on 2 ranks, a bit flipped on rank 1 after
the reduce at one step and an inf on rank 0 before the backward at another."""

from __future__ import annotations

import os
from typing import Any

import torch
from _common import gpu_path
from _replica_scenarios import digest, flip_bit_
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distscaler import GradScaler

FLIP_STEP = 1
INF_STEP = 3
STEPS = 5


class _launches:
    """The names of the Triton kernels launched until `stop()` (the interpreter's)."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.names: list[str] = []
        self._cls, self._run = InterpretedFunction, InterpretedFunction.run
        names, run = self.names, self._run

        def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            names.append(fn.fn.__name__)
            return run(fn, *args, **kwargs)

        InterpretedFunction.run = counting  # type: ignore[method-assign]

    def stop(self) -> list[str]:
        self._cls.run = self._run  # type: ignore[method-assign]
        return self.names


def _faulty_backward(rank: int, step: int, ddp: DDP, scaler: GradScaler, *, inf_step: int,
                     flip_step: int, device: str = "cpu") -> None:  # fmt: skip
    """One step's batch (each rank its own: DDP averages) and scaled backward, with an inf in rank
    0's input at ``inf_step`` (before the reduce: every replica sees it, an overflow) and bit 30
    of one gradient element flipped on rank 1 at ``flip_step`` (after the reduce: this replica
    only)."""
    torch.manual_seed(100 + 10 * step + rank)
    x = torch.randn(4, 8)
    if step == inf_step and rank == 0:
        x[0, 0] = float("inf")
    scaler.scale(ddp(x.to(device)).square().mean()).backward()
    if step == flip_step and rank == 1:
        flip_bit_(ddp.module[0].weight.grad, 5, 30)


def _run(rank: int, kernels: str, clip: float | None, fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    scaler = gpu_path(GradScaler("cpu", init_scale=2.0**8, kernels=kernels,
                                 replica_check_interval=1).register_model(ddp))  # fmt: skip
    out: dict[str, Any] = {"scales": [], "skipped": [], "norms": [], "mismatch_steps": []}
    for step in range(STEPS):
        opt.zero_grad()
        _faulty_backward(rank, step, ddp, scaler, inf_step=INF_STEP, flip_step=FLIP_STEP)
        launched = _launches() if kernels == "triton" and step == STEPS - 1 else None
        try:
            norm = scaler.clip_grad_norm_(opt, clip) if clip is not None else None
            scaler.step(opt)
            scaler.update()
        finally:
            if launched is not None:
                out["launched"] = launched.stop()
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(scaler.step_was_skipped)
        out["norms"].append(None if norm is None else float(norm))
        mismatch = scaler.last_replica_mismatch
        if mismatch is not None and mismatch.step not in out["mismatch_steps"]:
            out["mismatch_steps"].append(mismatch.step)
    out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    out["repr"] = repr(scaler)
    return out


def triton_beside_torch(rank: int, world_size: int) -> dict[str, Any]:
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels run in Triton's interpreter on the CPU
    results = {}
    for clip, fused in ((None, True), (1.0, True), (1.0, False), (None, False)):
        key = f"{'clip' if clip else 'noclip'}-{'fused' if fused else 'foreach'}"
        results[key] = {k: _run(rank, k, clip, fused) for k in ("torch", "triton")}
    return results


# ------------------------------------------------------------- the deferred replica check

#: The deferred check's run: a flip after the reduce (a finite mismatch) at update 2, an inf
#: before the reduce (an overflow) at update 4, an inf after the reduce on rank 1 only (a mismatch
#: that is an overflow too) at update 5; the periodic read every 3 updates (3, 6).
DEFER_FLIP, DEFER_INF, DEFER_MIXED, DEFER_STEPS, DEFER_LOG = 1, 3, 4, 7, 3
#: (clip, policy, counters packed): every rule's counters held through a finite mismatch.
DEFER_CASES = {
    "noclip-torch": (None, "torch", True),
    "clip-torch": (1.0, "torch", True),
    "noclip-deepspeed": (None, "deepspeed", True),
    "clip-deepspeed-plain": (1.0, "deepspeed", False),
    "noclip-megatron": (None, "megatron", True),
}


def _deferred_run(rank: int, mode: str, clip: float | None, policy: str, packed: bool,
                  on_mismatch: str = "skip", device: str = "cpu",
                  fused: bool = True, param_flip: int | None = None,
                  new_scale_at: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One run of the deferred-check scenario. ``mode``: ``"deferred"`` (the GPU's path, Triton
    kernels, the default cadence), ``"immediate"`` (the same with ``replica_check_interval=1``:
    read at the step), ``"off"`` (the same without the check) or ``"cpu"`` (torch's kernels on
    the CPU's path, checking every update as the Triton kernels do by default:
    ``replica_check_interval=1``). ``device="cuda"``: every rank on the one GPU (gloo), the
    kernels compiled."""
    from common.probes import DispatchCounter, HostReadSpy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    every = mode in ("immediate", "cpu")
    settings: dict[str, Any] = {"replica_check_interval": 1} if every else {}
    if mode == "off":
        settings["replica_check"] = False
    if param_flip is not None:  # the parameters compared every other update
        settings["param_check_interval"] = 2
    if policy != "torch":
        settings["hysteresis"] = 2
    scaler = GradScaler(device, init_scale=2.0**8, growth_interval=2, policy=policy,
                        kernels="torch" if mode == "cpu" else "triton",
                        skip_log_interval=DEFER_LOG, on_replica_mismatch=on_mismatch,
                        **settings).register_model(ddp)  # fmt: skip
    scaler._state.pack_counters = packed
    if mode != "cpu" and device == "cpu":
        gpu_path(scaler)
    out: dict[str, Any] = {"scales": [], "params": [], "named": [], "reads": [], "raised": []}
    scales = []
    for step in range(DEFER_STEPS):
        opt.zero_grad()
        _faulty_backward(rank, step, ddp, scaler, inf_step=DEFER_INF, flip_step=DEFER_FLIP,
                         device=device)  # fmt: skip
        if step == DEFER_MIXED and rank == 1:
            model[0].weight.grad.view(-1)[3] = float("inf")  # this replica only, an inf
        spy = HostReadSpy()
        spy.exclude_optimizer(opt)
        with DispatchCounter() as counter, spy:
            if clip is not None:
                scaler.clip_grad_norm_(opt, clip)
            scaler.step(opt)
            try:
                scaler.update(2.0**6 if step == new_scale_at else None)
            except Exception as e:  # noqa: BLE001 - "raise": which update raised, and what
                out["raised"].append([step, type(e).__name__, list(e.mismatch.ranks),
                                      e.mismatch.step])  # fmt: skip
        out["reads"].append(list(spy.reads))
        if step == param_flip and rank == 1:  # a parameter of this replica only, after its update
            with torch.no_grad():
                flip_bit_(model[2].bias, 1, 20)
        if step == DEFER_STEPS - 1:  # a clean update between two periodic reads
            out["ops"] = dict(counter.ops)
        scales.append(scaler._scale.clone())  # no host read: read after the run
        out["params"].append(digest([p.cpu() for p in model.parameters()]))
        last = scaler.last_replica_mismatch
        out["named"].append(None if last is None else [last.step, list(last.ranks),
                                                       list(last.nonfinite)])  # fmt: skip
    out["scales"] = [float(s) for s in scales]
    totals = scaler.skip_totals
    out["causes"] = totals.causes
    out["skipped"] = totals.num_skipped
    out["state"] = {k: v for k, v in scaler.state_dict().items() if not isinstance(v, dict)}
    out["ledger"] = scaler.replica_ledger.as_dict()
    out["report"] = repr(scaler.report_skip())
    return out


def deferred_beside_immediate(rank: int, world_size: int) -> dict[str, Any]:
    """The deferred replica check (Triton kernels, the GPU's path, the default cadence) beside
    the check read at the step and beside torch's kernels on the CPU's path, on the same data."""
    os.environ["TRITON_INTERPRET"] = "1"
    results: dict[str, Any] = {}
    for key, (clip, policy, packed) in DEFER_CASES.items():
        results[key] = {m: _deferred_run(rank, m, clip, policy, packed)
                        for m in ("deferred", "immediate", "off", "cpu")}  # fmt: skip
    results["raise"] = _deferred_run(rank, "deferred", None, "torch", True, on_mismatch="raise")
    # a parameter flipped on rank 1 after update 3: the parameter check at update 4 (and every
    # later one: the replicas stay apart) sees it, read later as at once
    results["params"] = {m: _deferred_run(rank, m, None, "torch", True, param_flip=2)
                         for m in ("deferred", "immediate")}  # fmt: skip
    # update(new_scale) at the flipped step: the ledger still takes the mismatch
    results["new_scale"] = {m: _deferred_run(rank, m, None, "torch", True, new_scale_at=DEFER_FLIP)
                            for m in ("deferred", "immediate")}  # fmt: skip
    # a foreach AdamW (its step reads found_inf on the host): checked every update, read at once
    results["foreach"] = {m: _deferred_run(rank, m, None, "torch", True, fused=False)
                          for m in ("deferred", "cpu")}  # fmt: skip
    return results


def deferred_on_a_gpu(rank: int, world_size: int) -> dict[str, Any]:
    """The deferred check with the compiled kernels: both ranks on the one GPU over gloo, beside
    the check read at the step and beside no check."""
    torch.cuda.set_device(0)
    return {key: {m: _deferred_run(rank, m, *DEFER_CASES[key], device="cuda")
                  for m in ("deferred", "immediate", "off")}
            for key in ("noclip-torch", "clip-deepspeed-plain")}  # fmt: skip


# ------------------------------------------------------------- the keyed sums' cadence

#: The keyed sums ride in the kernel's read at every INTERVAL-th update (the 32nd here).
KEYED_UPDATE = 32


def _second_difference_run(rank: int, at_update: int) -> dict[str, Any]:
    """DDP on 2 ranks, the Triton kernels on the GPU's path checking every update: rank 1 adds
    (+1, -2, +1) to three neighbouring 16-bit words of a gradient after the reduce at update
    ``at_update`` only (a change ``A``, ``B`` and ``C`` sum to 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = gpu_path(GradScaler("cpu", init_scale=2.0**8, kernels="triton",
                                 replica_check_interval=1).register_model(ddp))  # fmt: skip
    out: dict[str, Any] = {"skipped": [], "mismatch": [], "changed": None}
    for step in range(KEYED_UPDATE):
        opt.zero_grad()
        torch.manual_seed(100 + step)  # the same batch on both ranks
        scaler.scale(ddp(torch.randn(4, 8)).square().mean()).backward()
        if step + 1 == at_update and rank == 1:
            words = model[0].weight.grad.view(-1).view(torch.int16)
            wide = words[40:43].to(torch.int32) + torch.tensor([1, -2, 1], dtype=torch.int32)
            assert wide.abs().max() < 2**15  # no wrap: the change is exactly (+1, -2, +1)
            words[40:43] = wide.to(torch.int16)
            out["changed"] = step + 1
        scaler.step(opt)
        scaler.update()
        out["skipped"].append(scaler.step_was_skipped)
        last = scaler.last_replica_mismatch
        out["mismatch"].append(None if last is None else last.step)
    out["params"] = digest(model.parameters())
    return out


def keyed_every_interval(rank: int, world_size: int) -> dict[str, Any]:
    """The second difference at update 31 (no keyed sums at that check) and, in a second run, at
    update 32 (keyed)."""
    os.environ["TRITON_INTERPRET"] = "1"
    return {str(u): _second_difference_run(rank, u) for u in (KEYED_UPDATE - 1, KEYED_UPDATE)}
