"""The host's share of the scaler phase on the Triton path, measured on any machine (no GPU).

On a GPU the eager phase is bound by the host below about 1 GB of gradients
(docs/benchmarks.md): its Python, torch's dispatch of the small ops around the kernels, and the
launches. This tool measures the first two where no GPU is: a ``GradScaler(kernels="triton")``
on CPU tensors, the phase a fused optimizer runs on a GPU (``found_inf`` never read on the host),
with the Triton kernels' launches replaced by no-ops (the reduction's results written through
numpy, no torch op), so what is timed is everything the scaler does on the host except the
kernels' launches and the kernels themselves. What it leaves out: a launch's own cost on a GPU's
host (about 25 us per Triton launch and 5 to 15 us per CUDA op on an H100's, docs/benchmarks.md),
so a GPU's host time per phase is this plus those.

The phase is ``bench.py``'s: ``clip_grad_norm_`` (or not) + ``step`` (the fused AdamW's own step
a no-op) + ``update``, over ``--tensors`` gradients of 16 float32 elements. Beside it, torch's
recipe on the same tensors (``torch.amp.GradScaler``: ``unscale_``, ``clip_grad_norm_``, ``step``,
``update``; its CPU kernels do the arithmetic of 16-element tensors inline, so its time here is
its host work too). Medians over ``--rounds`` rounds: ``hot`` runs each phase ``--calls`` times
back to back; ``alternating`` runs distscaler's and torch's phases one after the other, as
``bench.py`` interleaves contenders (each call finds the host's caches holding the other's code).
Per phase, too: torch ops dispatched (``DispatchCounter``) and Triton launches (stubbed, counted).

``--launches real`` keeps the kernels (counted, and launched): on ``--device cuda`` the host time
per phase call then includes the Triton and CUDA launches themselves, so that, beside the stubbed
run on the same machine, a GPU's host time splits into the scaler's Python and dispatch and the
launches (``--profile`` shows Triton's launch path among the rest). Each round starts from an idle
GPU (synchronized outside the timing); the gradients are 16 elements, so the device keeps up. On
the CPU ``real`` runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``; slow: a check
of this tool, not a timing).

    python launch/host_cost.py                       # 10, 144 and 1,000 tensors; about a minute
    python launch/host_cost.py --tensors 144 --profile   # and where the time goes (cProfile)
    python launch/host_cost.py --device cuda --launches real   # on a GPU's host, launches included
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import distscaler  # noqa: E402
from common.probes import DispatchCounter  # noqa: E402
from distscaler import _triton as tp  # noqa: E402
from distscaler._triton import diagnostics as diag  # noqa: E402

NUMEL = 16
MAX_NORM = 1.0


class _Stubbed:
    """``kernel[grid](*args, **constexprs)`` as Triton's launch is called: counted, nothing run.
    The reduction writes a clean step's results (nothing non-finite, norm 0.5, ``grad_scale``
    the inverse scale) with numpy, so the scaler reads what a clean step gives."""

    def __init__(self, name: str, launches: collections.Counter) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._run

    def _run(self, *args: Any, **consts: Any) -> None:
        self.launches[self.name] += 1
        if self.name == "_reduce_kernel":
            stat, per_tensor, scale, out = args[4], args[5], args[13], args[15]
            stat.numpy()[:] = 0.0
            per_tensor.numpy()[:] = 0.0
            if consts.get("FINISH"):
                o = out.numpy()
                o[0], o[1], o[2] = 0.0, 1.0 / float(scale.numpy()), 0.5
        elif self.name == "_finish_kernel":
            stat, scale, out = args[0], args[1], args[3]
            o = out.numpy()
            o[0], o[1], o[2] = 0.0, 1.0 / float(scale.numpy()), 0.5


def stub_kernels() -> collections.Counter:
    """Replace the Triton pass's kernels by `_Stubbed` launches and let it run on the CPU without
    Triton's interpreter. Returns the launch counter."""
    launches: collections.Counter = collections.Counter()
    stubs = types.SimpleNamespace(**{n: _Stubbed(n, launches) for n in diag.RAW})
    diag.use_kernels(lambda interpret: stubs)
    tp.available = lambda device: True  # type: ignore[assignment]
    return launches


class _Counted:
    """``kernel[grid](...)`` counted, then launched as it is (Triton's own launch)."""

    def __init__(self, name: str, kernel: Any, launches: collections.Counter) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        self.launches[self.name] += 1
        return self.kernel[grid]


def count_kernels() -> collections.Counter:
    """Count the Triton pass's launches and launch them for real. Returns the launch counter."""
    launches: collections.Counter = collections.Counter()
    cache: dict[bool, types.SimpleNamespace] = {}

    def counted(interpret: bool) -> types.SimpleNamespace:
        if interpret not in cache:
            ks = made(interpret)
            cache[interpret] = types.SimpleNamespace(
                **{n: _Counted(n, getattr(ks, n), launches) for n in diag.RAW}
            )
        return cache[interpret]

    made = diag.use_kernels(counted)
    return launches


def _params(n: int, seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.randn(NUMEL, generator=gen).to(device))
        p.grad = torch.randn(NUMEL, generator=gen).to(device)
        params.append(p)
    return params


def phases(n: int, clip: bool, device: str = "cpu") -> dict[str, Callable[[], None]]:
    """distscaler's (the Triton path, the GPU's step) and torch's phase over ``n`` tensors."""
    built: dict[str, Callable[[], None]] = {}
    for name in ("distscaler", "torch"):
        params = _params(n, 0, device)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        opt.step = lambda *a, **k: None  # type: ignore[method-assign]  # the optimizer's own left out
        if name == "distscaler":
            scaler: Any = distscaler.GradScaler(device, kernels="triton")
            scaler._host_reads = False  # the GPU's step: found_inf stays on the device
            scaler.scale(torch.ones((), device=device))

            def phase(scaler=scaler, opt=opt) -> None:
                if clip:
                    scaler.clip_grad_norm_(opt, MAX_NORM)
                scaler.step(opt)
                scaler.update()
        else:
            scaler = torch.amp.GradScaler(device)
            scaler.scale(torch.ones((), device=device))

            def phase(scaler=scaler, opt=opt, params=params) -> None:
                if clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                scaler.step(opt)
                scaler.update()
        built[name] = phase
    return built


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    n: int,
    clip: bool,
    rounds: int,
    calls: int,
    launches: collections.Counter,
    device: str = "cpu",
) -> dict:
    fns = phases(n, clip, device)
    for fn in fns.values():  # warm-up: tables built, caches filled, kernels compiled
        for _ in range(20):
            fn()
    hot: dict[str, list[float]] = {k: [] for k in fns}
    alternating: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _synchronize(device)  # an idle GPU at the start, outside the timing
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            hot[name].append((time.perf_counter() - start) / calls * 1e6)
        spent = {k: 0.0 for k in fns}
        for _ in range(calls):
            for name, fn in fns.items():
                _synchronize(device)
                start = time.perf_counter()
                fn()
                spent[name] += time.perf_counter() - start
        for name in fns:
            alternating[name].append(spent[name] / calls * 1e6)
    ops = {}
    for name, fn in fns.items():
        launches.clear()
        with DispatchCounter() as counter:
            fn()
        ops[name] = {"torch_ops": counter.total, "triton_launches": sum(launches.values())}
    med = {k: statistics.median(v) for k, v in hot.items()}
    alt = {k: statistics.median(v) for k, v in alternating.items()}
    return {
        "tensors": n,
        "clip": clip,
        "hot_us": med,
        "alternating_us": alt,
        "hot_ratio": med["distscaler"] / med["torch"],
        "alternating_ratio": alt["distscaler"] / alt["torch"],
        "ops": ops,
    }


def profile(n: int, clip: bool, top: int, device: str = "cpu") -> None:
    import cProfile
    import pstats

    fn = phases(n, clip, device)["distscaler"]
    for _ in range(20):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[10, 144, 1000])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200, help="phase calls per round")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--launches", choices=["stubbed", "real"], default=None,
                        help="the Triton kernels' launches: stubbed (default on the CPU) or real "
                        "(default and only choice on cuda; the interpreter on the CPU)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="cProfile distscaler's clip phase")
    parser.add_argument("--out", default=None, help="a JSON file for the records")
    args = parser.parse_args()
    mode = args.launches or ("real" if args.device == "cuda" else "stubbed")
    if args.device == "cuda" and mode == "stubbed":
        parser.error("--launches stubbed runs on --device cpu only (the stubs write with numpy)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    if args.device == "cpu" and mode == "real" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--launches real on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    torch.set_num_threads(1)
    launches = stub_kernels() if mode == "stubbed" else count_kernels()
    where = (torch.cuda.get_device_name() + ", host " if args.device == "cuda" else "") + (
        platform.processor() or platform.machine()
    )
    print(f"# host_cost: torch {torch.__version__}, {where}, Python {platform.python_version()}, "
          f"{NUMEL} float32 elements per tensor, fused AdamW (its step a no-op), Triton "
          f"launches {mode}")  # fmt: skip
    print("| tensors | clip | distscaler us (hot) | torch us (hot) | ratio | distscaler us "
          "(alternating) | torch us (alternating) | ratio | torch ops: distscaler / torch | "
          "Triton launches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for n in args.tensors:
        calls = max(10, args.calls * 144 // max(n, 144))
        for clip in (True, False):
            r = measure(n, clip, args.rounds, calls, launches, args.device)
            r.update(device=args.device, launches=mode)
            records.append(r)
            h, a, o = r["hot_us"], r["alternating_us"], r["ops"]
            print(f"| {n:,} | {'yes' if clip else 'no'} | {h['distscaler']:.0f} | {h['torch']:.0f} "
                  f"| {r['hot_ratio']:.2f} | {a['distscaler']:.0f} | {a['torch']:.0f} | "
                  f"{r['alternating_ratio']:.2f} | {o['distscaler']['torch_ops']} / "
                  f"{o['torch']['torch_ops']} | {o['distscaler']['triton_launches']} |",
                  flush=True)  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"records": records}, indent=1))
    if args.profile:
        profile(args.tensors[0], True, 30, args.device)


if __name__ == "__main__":
    main()
