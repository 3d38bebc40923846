"""torch.compile of the scaler phase (``clip_grad_norm_`` + ``step`` + ``update``) against eager.

One compiled function per recipe is reused across every scenario of a process (dynamo recompiles
per optimizer, not per step): compiling on a small CPU is the expensive part. Every scenario runs
the same steps eagerly and compiled, from the same initial parameters and the same gradients, and
injects an inf on the last rank at ``INJECT_STEP`` so that the run grows, skips and backs off.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from _common import make_optimizer

from distscaler import GradScaler

__all__ = ["INJECT_STEP", "NUM_STEPS", "compile_scenarios", "compiled_kernels"]

NUM_STEPS = 6
#: growth_interval 2: grows after steps 1 and 5, skips and backs off at step 3.
INJECT_STEP = 3
GROWTH_INTERVAL = 2
INIT_SCALE = 2.0**4
#: foreach first: on torch 2.13, dynamo compiling a fused AdamW step and then a foreach one in the
#: same process fails inside torch ("Expected scalars to be on CPU, got meta"), torch's scaler too.
OPT_KINDS = ("foreach", "fused")


def _scaler_phase(scaler: Any, optimizer: torch.optim.Optimizer, clip: bool) -> Any:
    # The user's compiled step, distscaler's or torch's scaler alike (torch's with an unscale_
    # first, as torch's recipe has it).
    norm = None
    if clip:
        if isinstance(scaler, GradScaler):
            norm = scaler.clip_grad_norm_(optimizer, 1.0)
        else:
            scaler.unscale_(optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(optimizer)
    scaler.update()
    return norm


#: The compiled phase, one per process (graph breaks allowed: torch's optimizer step has two).
_COMPILED = torch.compile(_scaler_phase)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _backward(model: torch.nn.Module, scaler: Any, step: int, rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=gen)
    scaler.scale(model(x).square().mean()).backward()
    if world_size > 1:  # DDP's job, by hand: the same gradients on every rank
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    if step == INJECT_STEP and rank == world_size - 1:
        next(model.parameters()).grad[0, 0] = math.inf


def _run(
    ours: bool, opt_kind: str, clip: bool, compiled: bool, rank: int, world_size: int, **kwargs: Any
) -> dict[str, Any]:
    model = _model()
    optimizer = make_optimizer(opt_kind, model.parameters())
    settings = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    if ours:
        scaler: Any = GradScaler("cpu", **settings, **kwargs).register_model(
            model, grad_layout="replicated"
        )
    else:
        scaler = torch.amp.GradScaler("cpu", **settings)
    phase = _COMPILED if compiled else _scaler_phase
    scales, skips, norms = [], [], []
    for step in range(NUM_STEPS):
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, step, rank, world_size)
        before = [p.detach().clone() for p in model.parameters()]
        norm = phase(scaler, optimizer, clip)
        skips.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
        norms.append(None if norm is None else float(norm))
    return {
        "scales": scales,
        "skips": skips,
        "norms": norms,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def compile_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Per (optimizer kind, clip): ours eager and compiled (scales, skips, norms, parameter
    difference), and torch's recipe's parameter difference compiled vs eager with clipping."""
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for opt_kind in OPT_KINDS:
        for clip in (False, True):
            eager = _run(True, opt_kind, clip, False, rank, world_size)
            comp = _run(True, opt_kind, clip, True, rank, world_size)
            out[f"{opt_kind}-{'clip' if clip else 'noclip'}"] = {
                "eager": {k: v for k, v in eager.items() if k != "params"},
                "compiled": {k: v for k, v in comp.items() if k != "params"},
                "param_diff": _max_diff(eager["params"], comp["params"]),
                "param_scale": max(float(p.abs().max()) for p in eager["params"]),
            }
        # torch's recipe, compiled vs eager: how close inductor's rounding lets a compiled step be
        # (fused steps: exactly; the tests ask ours for 0 there). Its ranks may disagree on the
        # skip: each run is compared with itself, rank by rank.
        if opt_kind == "foreach":
            t_eager = _run(False, opt_kind, True, False, rank, world_size)  # with clipping
            t_comp = _run(False, opt_kind, True, True, rank, world_size)
            out[f"torch-{opt_kind}"] = {
                "param_diff": _max_diff(t_eager["params"], t_comp["params"]),
                "scales": [t_eager["scales"], t_comp["scales"]],
            }
    out["fullgraph"] = _fullgraph(rank, world_size)
    if world_size == 1:
        out["breaks"] = _break_sites()
        out["kernels"] = compiled_kernels()
    return out


def _break_sites() -> list[str]:
    """Where dynamo breaks the graph of the fused, clipped phase (``skip_log_interval=0``): the
    file and line of each break (torch's optimizer step only, if nothing of ours breaks it)."""
    model = _model()
    optimizer = make_optimizer("fused", model.parameters())
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)
    _backward(model, scaler, 0, 0, 1)
    explained = torch._dynamo.explain(_scaler_phase)(scaler, optimizer, True)
    return [
        f"{r.user_stack[-1].filename}:{r.user_stack[-1].lineno}: {r.reason.splitlines()[0]}"
        for r in explained.break_reasons
    ]


def _fullgraph(rank: int, world_size: int) -> dict[str, Any]:
    """Fused AdamW, ``skip_log_interval=0``: ``clip_grad_norm_`` (the collective included) and
    ``update`` each traced with ``fullgraph=True``; torch's optimizer step between them breaks any
    graph by design (``torch/optim/optimizer.py``: ``_use_grad`` calls ``graph_break()``)."""
    results = {}
    for compiled in (False, True):
        model = _model()
        optimizer = make_optimizer("fused", model.parameters())
        scaler = GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, skip_log_interval=0
        ).register_model(model, grad_layout="replicated")
        clip, update = scaler.clip_grad_norm_, scaler.update
        if compiled:
            clip = torch.compile(clip, fullgraph=True)
            update = torch.compile(update, fullgraph=True)
        scales, norms = [], []
        for step in range(NUM_STEPS):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, scaler, step, rank, world_size)
            norms.append(float(clip(optimizer, 1.0)))
            scaler.step(optimizer)
            update()
            scales.append(scaler.get_scale())
        results["compiled" if compiled else "eager"] = {
            "scales": scales,
            "norms": norms,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return {
        "scales": [results["eager"]["scales"], results["compiled"]["scales"]],
        "norms": [results["eager"]["norms"], results["compiled"]["norms"]],
        "param_diff": _max_diff(results["eager"]["params"], results["compiled"]["params"]),
    }


def compiled_kernels() -> dict[str, Any]:
    """Kernels inductor generates for the fused, clipped phase's two scaler graphs on the CPU
    (``clip_grad_norm_`` and ``update``, ``skip_log_interval=0``) against the device ops eager
    dispatches for the same calls (:class:`common.probes.DispatchCounter`)."""
    from torch._inductor.utils import run_and_get_code

    from common.probes import DispatchCounter

    model = _model()
    optimizer = make_optimizer("fused", model.parameters())
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)
    counts: dict[str, Any] = {}
    for compiled in (False, True):
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, 0, 0, 1)
        if compiled:
            clip = torch.compile(scaler.clip_grad_norm_, fullgraph=True)
            update = torch.compile(scaler.update, fullgraph=True)
            _, clip_code = run_and_get_code(clip, optimizer, 1.0)
            scaler.step(optimizer)
            _, update_code = run_and_get_code(update)
            counts["compiled"] = {
                "clip_grad_norm_": _kernels(clip_code),
                "update": _kernels(update_code),
            }
        else:
            with DispatchCounter() as ops:
                scaler.clip_grad_norm_(optimizer, 1.0)
            clip_ops = ops.total
            scaler.step(optimizer)
            with DispatchCounter() as ops:
                scaler.update()
            counts["eager"] = {"clip_grad_norm_": clip_ops, "update": ops.total}
    return counts


def _kernels(codes: list[str]) -> int:
    """Kernel calls in inductor's generated ``call``: its own C++ kernels (``cpp_fused_*``) and
    the ops it leaves to ATen (``torch.ops.*``, ``extern_kernels.*``); checks, views and frees
    left out."""
    count = 0
    for code in codes:
        body = code.split("def call(", 1)[1]
        for line in body.splitlines()[1:]:
            line = line.strip()
            if line.startswith("return "):
                break
            if line.startswith(("assert", "#")):
                continue
            if line.startswith("cpp_fused_") or "= torch.ops." in line or "extern_kernels." in line:
                count += 1
    return count
