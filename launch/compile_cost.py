"""What ``torch.compile`` of the scaler phase costs: distscaler beside torch's own recipe, one run.

For each tensor count, on the same gradients (1-D fp32 tensors of ``--numel`` elements, loss-scaled
by 2**16) and a fused AdamW, each contender's phase (clip at 1.0, the optimizer step, the scale
update) is compiled cold (dynamo reset, inductor's on-disk caches off; a small function is compiled
once before any contender, so the process's one-time costs, importing inductor and its first C++
compile, are not charged to whichever contender comes first) and called: the first call's
seconds (trace + inductor compile + one run), the second call's (dynamo may recompile once the
scaler's per-optimizer caches are warm), then the steady host time per call (median of
``--rounds``; on a CPU the host time is the phase's time). Contenders:

* ``distscaler``: ``clip_grad_norm_`` + ``step`` + ``update``, ``torch.compile`` default
  (graph breaks allowed);
* ``distscaler-fullgraph``: the same with ``fullgraph=True`` (the whole phase one graph);
* ``distscaler-eager-step``: the same, default mode, with ``step`` wrapped in
  ``torch.compiler.disable``: the optimizer step runs eagerly between the graphs, as torch's
  recipe's does, instead of being traced into them (``distscaler._traced_step``);
* ``torch``: ``torch.amp.GradScaler``'s recipe, ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``
  + ``step`` + ``update``, ``torch.compile`` default (its step cannot be traced whole).

distscaler runs without its overflow report (``skip_log_interval=0``: the periodic report reads the
host, a graph break by design). ::

    python launch/compile_cost.py                      # 144 and 1,000 tensors
    python launch/compile_cost.py --tensors 144 --out runs/compile_cost.json

Prints one markdown table; ``--out`` also writes the records as JSON.
"""

from __future__ import annotations

import os

# Cold compiles: nothing from an earlier run's on-disk caches (set before torch imports inductor).
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import distscaler  # noqa: E402

CONTENDERS = ("distscaler", "distscaler-fullgraph", "distscaler-eager-step", "torch")
INIT_SCALE = 2.0**16


def _params(num_tensors: int, numel: int, device: str) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = []
    for _ in range(num_tensors):
        p = torch.nn.Parameter(torch.empty(numel, device=device).normal_(0.0, 0.02))
        p.grad = torch.empty_like(p).normal_(0.0, 1e-4 * INIT_SCALE)
        params.append(p)
    return params


def _phase(name: str, params: list[torch.nn.Parameter], device: str) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    if name == "torch":
        scaler: Any = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
        scaler.scale(torch.ones((), device=device))

        def run() -> None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()

        return run
    ours = distscaler.GradScaler(device, init_scale=INIT_SCALE, skip_log_interval=0)
    ours.materialize(device)

    step = torch.compiler.disable(ours.step) if name == "distscaler-eager-step" else ours.step

    def run_ours() -> None:
        ours.clip_grad_norm_(optimizer, 1.0)
        step(optimizer)
        ours.update()

    return run_ours


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(device: str) -> None:
    """Compile and run a small foreach function once, so that what a process pays once (importing
    inductor, the first C++/Triton compile) is not charged to the first contender measured."""
    tensors = [torch.ones(4, device=device) for _ in range(3)]
    torch._dynamo.reset()
    torch.compile(lambda ts: torch._foreach_add(ts, 1.0), fullgraph=True)(tensors)
    _sync(device)


def measure(
    name: str, num_tensors: int, numel: int, rounds: int, device: str = "cpu"
) -> dict[str, Any]:
    """One contender's compile and steady costs at ``num_tensors`` tensors on ``device``."""
    params = _params(num_tensors, numel, device)
    torch._dynamo.reset()
    fn = torch.compile(_phase(name, params, device), fullgraph=name.endswith("fullgraph"))
    record: dict[str, Any] = {
        "contender": name,
        "tensors": num_tensors,
        "numel": numel,
        "device": device,
    }
    try:
        for key in ("first_call_s", "second_call_s"):
            start = time.perf_counter()
            fn()
            _sync(device)
            record[key] = round(time.perf_counter() - start, 3)
    except Exception as exc:  # reported in the table: this contender cannot compile so
        record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        return record
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    record["steady_ms"] = round(statistics.median(times) * 1e3, 3)
    return record


def markdown(records: list[dict[str, Any]]) -> str:
    lines = [
        "| tensors | contender | first call (s) | second call (s) | steady host time (ms) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['tensors']} | {r['contender']} | {r['error']} | | |")
            continue
        lines.append(
            f"| {r['tensors']} | {r['contender']} | {r['first_call_s']:.1f} | "
            f"{r['second_call_s']:.1f} | {r['steady_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[144, 1000])
    parser.add_argument("--numel", type=int, default=256, help="elements per tensor")
    parser.add_argument("--rounds", type=int, default=20, help="steady calls timed")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    warm_up(args.device)
    records = []
    for num_tensors in args.tensors:
        for name in args.contenders:
            record = measure(name, num_tensors, args.numel, args.rounds, args.device)
            print(json.dumps(record), flush=True)
            records.append(record)
    print(
        f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads\n"
    )
    print(markdown(records))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(records, indent=2))
    return records


if __name__ == "__main__":
    main()
