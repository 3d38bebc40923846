"""torch.compile of the scaler phase (``clip_grad_norm_`` + ``step`` + ``update``) against eager.

One compiled function per recipe is reused across every scenario of a process (dynamo recompiles
per optimizer, not per step): compiling on a small CPU is the expensive part. Every scenario runs
the same steps eagerly and compiled, from the same initial parameters and the same gradients, and
injects an inf on the last rank at ``INJECT_STEP`` so that the run grows, skips and backs off.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from _common import gpu_path_of, make_optimizer
from _torch_gaps import run_case

from distscaler import GradScaler
from distscaler._traced_step import TRACES_WHOLE_PHASE

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
    difference), and torch's recipe's parameter difference compiled vs eager with clipping; the
    whole fused phase with ``fullgraph=True``; at world size 1 the graph breaks, the traced step's
    optimizer variants and inductor's kernel counts."""
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
    if not TRACES_WHOLE_PHASE:  # older dynamo: the phase compiles between graph breaks only
        out["fullgraph"] = {clip_id: {} for clip_id in CLIP_IDS}
        out.update(breaks={}, variants={}, interleaved={}, kernels={})
        return out
    # Each fullgraph case fails alone (run_case), not the spawn's others.
    out["fullgraph"] = {
        clip_id: run_case(functools.partial(_fullgraph, rank, world_size, clip))
        for clip_id, clip in CLIP_IDS.items()
    }
    if world_size == 1:
        out["breaks"] = run_case(lambda: {kind: _break_sites(kind) for kind in OPT_KINDS})
        out["variants"] = run_case(_traced_variants)
        out["interleaved"] = run_case(_interleaved)
        out["kernels"] = run_case(compiled_kernels)
    return out


CLIP_IDS = {"noclip": False, "clip": True}


def _whole_phase(scaler: Any, optimizer: torch.optim.Optimizer, clip: bool) -> Any:
    # The same phase under its own code object, so that dynamo's cache of _COMPILED (graph
    # breaks allowed) can never stand in for a fullgraph=True compile.
    return _scaler_phase(scaler, optimizer, clip)


#: The whole phase as one graph: clip_grad_norm_ (its all_reduce included), step, update.
_FULLGRAPH = torch.compile(_whole_phase, fullgraph=True)


def _num_graphs() -> int:
    # Graphs dynamo has compiled in this process: proof that a compiled run really compiled
    # (past the recompile limit dynamo would run the function eagerly instead).
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _break_sites(opt_kind: str) -> list[str]:
    """Where dynamo breaks the graph of the clipped phase (``skip_log_interval=0``): the file and
    line of each break. Fused AdamW: none; foreach: torch's optimizer step (``_use_grad``) and the
    host read of the agreed flag that decides a non-fused step."""
    model = _model()
    optimizer = make_optimizer(opt_kind, model.parameters())
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)
    _backward(model, scaler, 0, 0, 1)
    explained = torch._dynamo.explain(_scaler_phase)(scaler, optimizer, True)
    return [
        f"{r.user_stack[-1].filename}:{r.user_stack[-1].lineno}: {r.reason.splitlines()[0]}"
        for r in explained.break_reasons
    ]


def _fullgraph(rank: int, world_size: int, clip: bool) -> dict[str, Any]:
    """Fused AdamW on a tensor lr under an LR scheduler, with a step pre- and post-hook,
    ``skip_log_interval=0``: the whole phase traced with ``fullgraph=True`` against eager (the
    hooks' calls, the scheduler's lr and its warnings, the optimizer's step counts and
    gradients)."""
    results = {}
    for compiled in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        # Hooks count into a tensor: a list that grew would make dynamo recompile at every step.
        hook_calls = torch.zeros(2)

        def pre_hook(*_: Any, calls: torch.Tensor = hook_calls) -> None:
            calls[0] += 1

        def post_hook(*_: Any, calls: torch.Tensor = hook_calls) -> None:
            calls[1] += 1

        optimizer.register_step_pre_hook(pre_hook)
        optimizer.register_step_post_hook(post_hook)
        scaler = GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, skip_log_interval=0
        ).register_model(model, grad_layout="replicated")
        phase = _FULLGRAPH if compiled else _scaler_phase
        torch._dynamo.reset()  # this scenario's compiles alone, far from the recompile limit
        graphs = _num_graphs()
        scales, norms, lrs = [], [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(NUM_STEPS):
                optimizer.zero_grad(set_to_none=True)
                _backward(model, scaler, step, rank, world_size)
                norm = phase(scaler, optimizer, clip)
                schedule.step()
                scales.append(scaler.get_scale())
                norms.append(None if norm is None else float(norm))
                lrs.append(float(optimizer.param_groups[0]["lr"]))
        results["compiled" if compiled else "eager"] = {
            "graphs": _num_graphs() - graphs,
            "scales": scales,
            "norms": norms,
            "lrs": lrs,
            "hook_calls": hook_calls.tolist(),
            "scheduler_warnings": [
                str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)
            ],
            "steps": [float(s["step"]) for s in optimizer.state.values()],
            "params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.detach().clone() for p in model.parameters()],
        }
    eager, compiled_run = results["eager"], results["compiled"]
    out = {k: [eager[k], compiled_run[k]] for k in eager if k not in ("params", "grads")}
    out["param_diff"] = _max_diff(eager["params"], compiled_run["params"])
    out["grad_diff"] = _max_diff(eager["grads"], compiled_run["grads"])
    return out


def _traced_variants() -> dict[str, Any]:
    """The fused step's other shapes traced whole, against eager: ``Adam`` (coupled weight decay)
    with amsgrad and maximize, and ``AdamW`` over two parameter groups of two dtypes (one
    kernel per dtype). Clipped, an inf at ``INJECT_STEP``."""
    variants = {
        "adam-amsgrad-maximize": lambda params: torch.optim.Adam(
            params, lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True, fused=True
        ),
        "adamw-two-dtypes": lambda params: torch.optim.AdamW(
            [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.01, fused=True
        ),
    }
    out = {}
    for name, make in variants.items():
        runs = {}
        for compiled in (False, True):
            model = _model()
            if name == "adamw-two-dtypes":
                model[2].to(torch.bfloat16)
                model[2].register_forward_pre_hook(lambda _, args: (args[0].bfloat16(),))
            optimizer = make(list(model.parameters()))
            scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)
            phase = _FULLGRAPH if compiled else _scaler_phase
            torch._dynamo.reset()
            graphs = _num_graphs()
            scales = []
            for step in range(4):
                optimizer.zero_grad(set_to_none=True)
                _backward(model, scaler, step, 0, 1)
                phase(scaler, optimizer, True)
                scales.append(scaler.get_scale())
            runs[compiled] = {
                "graphs": _num_graphs() - graphs,
                "scales": scales,
                "params": [p.detach().float().clone() for p in model.parameters()],
                "state": [
                    t.detach().float().clone() for s in optimizer.state.values() for t in s.values()
                ],
            }
        out[name] = {
            "graphs": runs[True]["graphs"],
            "scales": [runs[False]["scales"], runs[True]["scales"]],
            "param_diff": _max_diff(runs[False]["params"], runs[True]["params"]),
            "state_diff": _max_diff(runs[False]["state"], runs[True]["state"]),
            "num_state": len(runs[True]["state"]),
        }
    return out


#: The form docs/compile.md shows: a compiled phase that takes its scaler and optimizer from module globals
#: (dynamo guards on a global's attributes as values: no automatic dynamic ints there).
_GLOBALS: dict[str, Any] = {}


@torch.compile(fullgraph=True)
def _global_phase() -> Any:
    return _scaler_phase(_GLOBALS["scaler"], _GLOBALS["optimizer"], True)


#: The 0-based updates ``_interleaved`` runs eagerly; the others, up to NUM_INTERLEAVED, compiled.
NUM_INTERLEAVED = 12
EAGER_UPDATES = (1, 3, 4)


def _interleaved() -> dict[str, Any]:
    """Eager and ``fullgraph=True`` calls of the phase taking turns on one scaler for 12 updates
    (``EAGER_UPDATES`` eager), an inf at update 4 (eager: ``_backward``'s) and 5 (eager),
    graphs compiled (the host's update count, which advances
    in eager calls only, must not be baked into the graph: dynamo would recompile at every call
    and, with fullgraph=True, fail at its recompile limit) and the totals the device counted."""
    torch._dynamo.reset()
    graphs = _num_graphs()
    model = _model()
    optimizer = make_optimizer("fused", model.parameters())
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)

    _GLOBALS.update(scaler=scaler, optimizer=optimizer)

    for step in range(NUM_INTERLEAVED):
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, step, 0, 1)
        if step == INJECT_STEP + 1:
            next(model.parameters()).grad[0, 0] = math.inf
        try:
            if step in EAGER_UPDATES:
                _scaler_phase(scaler, optimizer, True)
            else:
                _global_phase()
        except Exception as exc:  # this case fails alone, not the spawn's others
            return {"error": f"update {step + 1}: {type(exc).__name__}: {exc}"[:2000]}
    totals = scaler.skip_totals
    return {
        "graphs": _num_graphs() - graphs,
        "totals": [totals.num_updates, totals.num_skipped, totals.last_skipped],
    }


def compiled_kernels() -> dict[str, Any]:
    """Kernels inductor generates for the whole fused phase (``clip_grad_norm_`` or not, then
    ``step`` and ``update``; ``skip_log_interval=0``) traced as one graph on the CPU, against the
    device ops eager dispatches for the same calls (:class:`common.probes.DispatchCounter`), the
    optimizer's fused step included, after a warm-up step (the optimizer's state exists): the
    CPU's eager inf check (it reads its flag on the host) and the one a GPU runs, which is also the
    one a trace takes."""
    from torch._inductor.utils import run_and_get_code

    from common.probes import DispatchCounter

    counts: dict[str, Any] = {}
    for clip_id, clip in CLIP_IDS.items():
        model = _model()
        optimizer = make_optimizer("fused", model.parameters())
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, skip_log_interval=0)
        _backward(model, scaler, 0, 0, 1)
        _scaler_phase(scaler, optimizer, clip)  # warm-up: the optimizer's state, the plans
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, 1, 0, 1)
        with DispatchCounter() as ops:
            _scaler_phase(scaler, optimizer, clip)
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, 2, 0, 1)
        with gpu_path_of(scaler), DispatchCounter() as gpu_ops:  # what an eager GPU step launches
            _scaler_phase(scaler, optimizer, clip)
        optimizer.zero_grad(set_to_none=True)
        _backward(model, scaler, 3, 0, 1)
        _, code = run_and_get_code(
            torch.compile(_whole_phase, fullgraph=True), scaler, optimizer, clip
        )
        counts[clip_id] = {
            "eager": ops.total,
            "eager_ops": ops.ops,
            "eager_gpu_path": gpu_ops.total,
            "compiled": _kernels(code),
        }
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
            # A bare torch.ops.* line: an op that returns nothing (distscaler's fused step).
            if (
                line.startswith(("cpp_fused_", "torch.ops."))
                or "= torch.ops." in line
                or "extern_kernels." in line
            ):
                count += 1
    return count


def reduce_overhead_runs(device: str) -> dict[str, Any]:
    """The whole fused phase compiled with ``mode="reduce-overhead"`` (inductor's CUDA graphs)
    against eager on ``device``, clipped, an inf at ``INJECT_STEP``: scales, norms, parameters,
    and how many times inductor declined a CUDA graph (``cudagraph_skips``)."""
    runs: dict[str, Any] = {}
    skips_before = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
    for compiled in (False, True):
        model = _model().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        scaler = GradScaler(
            device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, skip_log_interval=0
        )
        phase = (
            torch.compile(_whole_phase, fullgraph=True, mode="reduce-overhead")
            if compiled
            else _scaler_phase
        )
        scales, norms = [], []
        for step in range(NUM_STEPS):
            optimizer.zero_grad(set_to_none=False)  # the same gradient tensors: static inputs
            gen = torch.Generator().manual_seed(1000 * step)
            x = torch.randn(4, 8, generator=gen).to(device)
            scaler.scale(model(x).square().mean()).backward()
            if step == INJECT_STEP:
                next(model.parameters()).grad[0, 0] = math.inf
            norms.append(float(phase(scaler, optimizer, True)))
            scales.append(scaler.get_scale())
        runs["compiled" if compiled else "eager"] = {
            "scales": scales,
            "norms": norms,
            "params": [p.detach().cpu().clone() for p in model.parameters()],
        }
    return {
        "scales": [runs["eager"]["scales"], runs["compiled"]["scales"]],
        "norms": [runs["eager"]["norms"], runs["compiled"]["norms"]],
        "param_diff": _max_diff(runs["eager"]["params"], runs["compiled"]["params"]),
        "cudagraph_skips": int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
        - skips_before,
    }
