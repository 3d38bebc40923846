"""The ``launch`` sweep: host time and device ops per step where a step is launch-bound.

On a GPU every small op of the scaler phase costs a launch (microseconds of host time) whatever its
bytes, so below about 1 GB of gradients the number of ops and the host time per op set the step's
time. This sweep measures both on tiny gradients (16 elements each) at several tensor counts, fused
AdamW, with and without clipping:

* ``host_us``: host time of one phase call, median over interleaved rounds, without waiting for the
  device (on a CPU, where ops run synchronously, it is the whole time);
* ``ops``: device ops the phase dispatches (:class:`common.probes.DispatchCounter`), the same
  on every machine: what a GPU launches (per dtype group, independent of the tensor count). On a
  CPU one of distscaler's is the host read of its flag (``_local_scalar_dense``: no sync there,
  see ``distscaler._plan.host_read_is_free``); a GPU runs the step without it instead.

Beside ``distscaler`` (the torch rule, overflow report on) run its variants
(``benchkit.contenders.VARIANTS``): the DeepSpeed rule as ``ScalerConfig.from_deepspeed`` gives it,
Megatron's, and the torch rule without the overflow report.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from common.probes import count_per_step

from .cases import Case, build_contenders, plain_params
from .contenders import VARIANTS

__all__ = ["LAUNCH_NUMEL", "launch_table", "launch_targets", "measure_launch"]

#: Elements per gradient in the launch sweep: tiny, so that launches, not bytes, cost the time.
LAUNCH_NUMEL = 16


def measure_launch(
    case: Case, *, device: torch.device, contenders: list[str], rounds: int, warmup: int
) -> dict[str, Any]:
    """Host microseconds and device ops per phase call of each contender on ``case.tensors`` tiny
    gradients. Returns ``{**case, "device", "host_us": {name: us}, "ops": {name: n}, "errors"}``."""
    case = case.but(params=case.tensors * LAUNCH_NUMEL)
    params = plain_params(case, device)
    saved = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
    grads = [p.grad for p in params]

    def reset() -> None:
        torch._foreach_copy_(grads, saved)

    _, built = build_contenders(case, params, device, contenders)
    phases = {n: c.phase for n, c in built.items() if c.error is None and c.phase is not None}
    times: dict[str, list[float]] = {n: [] for n in phases}
    errors = {n: c.error for n, c in built.items() if c.error is not None}
    # Enough calls per round that the noise of one call averages out.
    calls = max(1, 2000 // case.tensors)
    for i in range(warmup + rounds):
        for name, phase in phases.items():
            if name in errors:
                continue
            elapsed = 0.0
            try:
                for _ in range(calls):
                    reset()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    phase()
                    elapsed += time.perf_counter() - start
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            if i >= warmup:
                times[name].append(elapsed / calls * 1e6)
    ops = {}
    for name, phase in phases.items():
        if name not in errors and built[name].countable:
            ops[name] = count_per_step(phase, untimed=reset)["ops"]
    return {
        **case.asdict(),
        "device": device.type,
        "host_us": {
            n: round(statistics.median(t), 1) for n, t in times.items() if t and n not in errors
        },
        "ops": ops,
        "errors": errors,
    }


def _ratio(r: dict[str, Any], key: str) -> float | None:
    ours, theirs = r[key].get("distscaler"), r[key].get("torch")
    return None if ours is None or not theirs else ours / theirs


def launch_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU-first issue's targets on ops and host time, measured side by side."""
    out = []

    def target(name: str, selected: list[dict[str, Any]], key: str, limit: float) -> None:
        values = [_ratio(r, key) for r in selected]
        if selected:
            worst = max((v if v is not None else float("inf")) for v in values)
            out.append(
                {
                    "target": name,
                    "measured": worst,
                    "limit": limit,
                    "where": f"{len(selected)} launch cases, worst",
                    "met": worst <= limit,
                }
            )

    target(
        "device ops per step with clipping: distscaler / torch",
        [r for r in rows if r["clip"]],
        "ops",
        0.5,
    )
    target(
        "device ops per step without clipping: distscaler / torch",
        [r for r in rows if not r["clip"]],
        "ops",
        1.0,
    )
    target(
        "host time per step, tiny gradients, <= 144 tensors, with and without clipping: "
        "distscaler / torch",
        [r for r in rows if r["tensors"] <= 144],
        "host_us",
        1.0,
    )
    target(
        "host time per step at 10,000 tiny gradients, with and without clipping: "
        "distscaler / torch",
        [r for r in rows if r["tensors"] >= 10_000],
        "host_us",
        0.5,
    )
    return out


def launch_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per (tensor count, clipping), host time and ops per contender."""
    order = ("distscaler", *VARIANTS, "distscaler-compiled", "torch", "torch-sharded", "deepspeed")
    names = [n for n in order if any(n in r["host_us"] or n in r["errors"] for r in rows)]
    lines = [
        "| tensors, clip | "
        + " | ".join(f"{n} host us" for n in names)
        + " | distscaler / torch | "
        + " | ".join(f"{n} ops" for n in names)
        + " | distscaler / torch |",
        "|" + "---|" * (2 * len(names) + 3),
    ]
    for r in rows:
        host = [f"{r['host_us'][n]:.1f}" if n in r["host_us"] else "n/a" for n in names]
        ops = [str(r["ops"][n]) if n in r["ops"] else "n/a" for n in names]
        host_ratio, ops_ratio = _ratio(r, "host_us"), _ratio(r, "ops")
        lines.append(
            f"| {r['tensors']}, {'clip' if r['clip'] else 'no clip'} | "
            + " | ".join(host)
            + f" | {'n/a' if host_ratio is None else f'{host_ratio:.2f}'} | "
            + " | ".join(ops)
            + f" | {'n/a' if ops_ratio is None else f'{ops_ratio:.2f}'} |"
        )
    return lines
