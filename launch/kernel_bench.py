"""GPU microbenchmark of the fused Triton pass (``distscaler/_triton/``) beside torch's ops.

On the same gradients, interleaved per case, CUDA events, the median of ``--iters`` timed
iterations after ``--warmup``:

* ``torch-recipe``: what ``torch.amp.GradScaler.unscale_`` + ``clip_grad_norm_`` launch:
  ``_amp_foreach_non_finite_check_and_unscale_`` (read + write; for bfloat16, which that CUDA
  kernel refuses, ``_foreach_mul_``), ``_foreach_norm`` + ``stack`` + ``vector_norm`` (read), the
  clip coefficient, ``_foreach_mul_`` (read + write), per dtype group.
* ``torch-norm``: distscaler's torch path for a fused optimizer: ``_foreach_norm(p=2)`` per dtype
  group + ``stack`` + ``vector_norm`` (read only).
* ``triton``: ``grad_pass(norm_type=2, flags=True)`` + ``finish`` (read only: found_inf,
  grad_scale, total norm, per-tensor norms); ``triton+moments`` with the replica checksum;
  ``triton+div``: the same + ``div_`` (read, then read + write: the non-fused step).
* ``read-ref``: one read of the same bytes, ``torch.sum`` over a flat float32 buffer;
  ``copy-ref``: one read + one write of them (``copy_``).
* Where installed (neither is a dependency; ``meta`` says which were found): ``te-unscale-l2norm``,
  Transformer Engine's ``multi_tensor_unscale_l2norm`` (unscale + norm in one read, per dtype
  group, the groups' norms combined with torch's ops), and ``apex-l2norm``, Apex's
  ``amp_C.multi_tensor_l2norm`` (the norm only), each through its ``multi_tensor_applier``.

Each call is timed alone (the host's time to issue it counts where it exceeds the device's), and
``queued_ms`` times ten calls queued back to back (the device's time: the host runs ahead, as in
a training loop) for the torch recipe, the kernel and the read.

Cases: one bf16 and one fp32 tensor of 1 MB to 2 GB, 500 mixed-dtype matrices of 225M elements in
all (bf16/fp32/fp16), one 1.536e9-element bf16 tensor. Also the kernel launches of one iteration of
each recipe (torch.profiler) and a sweep of the kernel's tile size and warps. Last, what a deferred
replica reading adds to an update (its mismatch flag and the held update: a handful of 0-dim ops),
alone and queued, its kernels counted.

    python launch/kernel_bench.py --out runs/kernel_bench          # about 2 minutes on an H100
    python launch/kernel_bench.py --quick                           # smaller sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distscaler import _triton as tp  # noqa: E402
from distscaler._triton import diagnostics as diag  # noqa: E402

MB = 1 << 20
#: The recipes timed queued too (and Transformer Engine's and Apex's norms where installed).
QUEUED = ("torch-recipe", "triton", "triton+moments", "read-ref")
#: (BLOCK, num_warps, _TARGET_BLOCKS) of the sweep; the first is the module's default.
SWEEP = [(2048, 8, 32768), (2048, 8, 8192), (1024, 4, 32768), (1024, 4, 8192), (4096, 8, 32768),
         (512, 4, 32768)]  # fmt: skip


def timed(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (CUDA events around each)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued(fn, warmup: int, iters: int, reps: int = 10) -> float:
    """Median milliseconds per call of ``reps`` calls queued back to back between two CUDA events:
    the device's time when the host runs ahead (as in a training loop, where the backward's
    kernels are still running while the host issues the phase), the host's own time hidden."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, iters // reps)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len([n for n in names if "memcpy" not in n.lower() and "memset" not in n.lower()])


def groups(grads):
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        out.setdefault(g.dtype, []).append(g)
    return list(out.values())


def foreign_norms() -> tuple[dict[str, Any], dict[str, str]]:
    """The multi-tensor norms of Transformer Engine and Apex that import here: ``{name: (applier,
    op, takes_inv_scale)}``, and for each of the two what was found (a version, or why not)."""
    found: dict[str, Any] = {}
    seen: dict[str, str] = {}
    try:
        import transformer_engine
        from transformer_engine.pytorch.optimizers import (
            multi_tensor_applier,
            multi_tensor_unscale_l2norm,
        )

        found["te-unscale-l2norm"] = (multi_tensor_applier, multi_tensor_unscale_l2norm, True)
        seen["transformer_engine"] = getattr(transformer_engine, "__version__", "installed")
    except Exception as exc:  # not installed, or its CUDA extension does not load
        seen["transformer_engine"] = f"not used: {type(exc).__name__}: {exc}"[:160]
    try:
        import amp_C
        from apex.multi_tensor_apply import multi_tensor_applier as apex_applier

        found["apex-l2norm"] = (apex_applier, amp_C.multi_tensor_l2norm, False)
        seen["apex"] = "installed"
    except Exception as exc:
        seen["apex"] = f"not used: {type(exc).__name__}: {exc}"[:160]
    return found, seen


def make_recipes(grads):
    dev = grads[0].device
    found = torch.zeros(1, device=dev)
    inv = torch.ones((), device=dev)  # 1.0: values unchanged from iteration to iteration
    scale = torch.tensor(1.0, device=dev)
    max_norm = torch.tensor(1e30, device=dev)  # clip coefficient 1.0
    gs = groups(grads)
    total_bytes = sum(g.numel() * g.element_size() for g in grads)
    flat = torch.randn(total_bytes // 4, device=dev)
    flat2 = torch.empty_like(flat)

    def torch_recipe():
        for g in gs:  # torch's CUDA unscale kernel has no bfloat16: a multiply pass there
            if g[0].dtype == torch.bfloat16:
                torch._foreach_mul_(g, inv)
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(g, found, inv)
        norms = [n for g in gs for n in torch._foreach_norm(g, 2.0)]
        total = torch.linalg.vector_norm(torch.stack(norms))
        clip = torch.clamp(1e30 / (total + 1e-6), max=1.0)
        for g in gs:
            torch._foreach_mul_(g, clip)  # as clip_grad_norm_: a float32 0-dim tensor

    def torch_norm():
        norms = [n for g in gs for n in torch._foreach_norm(g, 2.0, dtype=torch.float32)]
        return torch.linalg.vector_norm(torch.stack(norms))

    def triton():
        r = tp.grad_pass(grads, norm_type=2.0)
        return tp.finish(r.stat, scale, max_norm=max_norm)

    def triton_moments():
        r = tp.grad_pass(grads, norm_type=2.0, primes=(16777213, 16777199))
        return tp.finish(r.stat, scale, max_norm=max_norm)

    def triton_div():
        out = triton()
        tp.div_(grads, out.grad_scale)

    def foreign(applier, op, takes_inv_scale):
        noop = torch.zeros(1, dtype=torch.int32, device=dev)
        inv_1 = torch.ones(1, device=dev)

        def run():  # one launch per dtype group (and per 110 tensors), the norms combined
            extra = (inv_1, False) if takes_inv_scale else (False,)
            norms = [applier(op, noop, [g], *extra)[0].reshape(()) for g in gs]
            return torch.linalg.vector_norm(torch.stack(norms))

        return run

    others = {name: foreign(*how) for name, how in foreign_norms()[0].items()}
    return {
        "torch-recipe": torch_recipe,
        "torch-norm": torch_norm,
        "triton": triton,
        "triton+moments": triton_moments,
        "triton+div": triton_div,
        "read-ref": lambda: torch.sum(flat),
        "copy-ref": lambda: flat2.copy_(flat),
        **others,
    }, total_bytes


def run_case(name: str, grads, args, sweep: bool = False, launches: bool = False) -> dict[str, Any]:
    recipes, nbytes = make_recipes(grads)
    record: dict[str, Any] = {
        "case": name,
        "tensors": len(grads),
        "elements": sum(g.numel() for g in grads),
        "bytes": nbytes,
        "ms": {},
    }
    for key, fn in recipes.items():
        record["ms"][key] = timed(fn, args.warmup, args.iters)
    # a second round, interleaved the other way, against drift
    for key, fn in reversed(list(recipes.items())):
        record["ms"][key] = min(record["ms"][key], timed(fn, args.warmup, args.iters))
    ms = record["ms"]
    record["queued_ms"] = {k: queued(recipes[k], args.warmup, 3 * args.iters)
                           for k in recipes if k in QUEUED or k.startswith(("te-", "apex-"))}
    record["queued_GBps"] = {k: nbytes / (v * 1e-3) / 1e9 for k, v in record["queued_ms"].items()}
    record["GBps"] = {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}
    record["vs_read"] = {k: v / ms["read-ref"] for k, v in ms.items()}
    record["vs_torch_recipe"] = {k: v / ms["torch-recipe"] for k, v in ms.items()}
    # agreement of the norms
    ours = tp.grad_pass(grads, norm_type=2.0)
    theirs = recipes["torch-norm"]()
    record["norm_rel_diff"] = abs(math.sqrt(ours.stat[1].item()) - theirs.item()) / max(
        theirs.item(), 1e-30
    )
    record["norm_bound"] = tp.norm_bound([g.numel() for g in grads])
    if args.launches and launches:
        record["launches"] = {
            k: kernels_per_call(fn) for k, fn in recipes.items() if not k.endswith("-ref")
        }
    if sweep:  # the kernels' tile, warps and block count, queued (the device's time)
        record["sweep"] = {}
        saved = dict(diag.CONFIG)
        for block, warps, blocks in SWEEP:
            diag.CONFIG.update(BLOCK=block, num_warps=warps, target_blocks=blocks)
            record["sweep"][f"BLOCK={block},warps={warps},target_blocks={blocks}"] = {
                k: queued(recipes[k], args.warmup, 3 * args.iters)
                for k in ("triton", "triton+moments", "triton+div")
            }
        diag.CONFIG.update(saved)
        print(json.dumps({"sweep": record["sweep"]}, default=lambda x: round(x, 4)), flush=True)
    print(json.dumps({k: record[k] for k in ("case", "ms", "vs_read", "vs_torch_recipe",
                                             "queued_ms")},
                     default=lambda x: round(x, 4)), flush=True)  # fmt: skip
    with open(Path(args.out) / "kernel_bench.jsonl", "a") as f:  # kept if a later case fails
        f.write(json.dumps(record) + "\n")
    return record


def deferred_reading_ops(device: torch.device):
    """(plain, deferred): one update as the scaler runs it without a deferred replica reading, and
    with one (`distscaler._replica.checksum.mismatch_flag` of the reduced slots, this rank's flag
    kept, the step's ``fmax``, the update held by the mismatch flag: `DeviceState.update_(held=)`),
    the torch rule, agreeing replicas (the mismatch flag 0.0)."""
    from distscaler._replica.checksum import mismatch_flag
    from distscaler._state import DeviceState, HostValues
    from distscaler.config import ScalerConfig
    from distscaler.policies import get_policy

    config = ScalerConfig()
    state = DeviceState(device, HostValues(2.0**16, 0))
    state.prepare(get_policy(config.policy), config.rule())
    found = state.zero
    joint = torch.zeros(6, device=device)
    reduced = joint[2:]
    primes = (16777213, 16777199)

    def plain():
        counters = state.next_counters(torch._foreach_addcdiv(*state.counter_terms()))
        state.update_(found, counters, False)

    def deferred():
        joint[:1].clone()
        mismatch = mismatch_flag(reduced, primes)
        torch.fmax(found, mismatch)
        counters = state.next_counters(torch._foreach_addcdiv(*state.counter_terms()))
        state.update_(found, counters, False, held=mismatch)

    return plain, deferred


def deferred_reading(args) -> dict[str, Any]:
    """What a deferred replica reading adds to an update on the GPU: timed alone (the host's
    time to issue the ops, which bounds them) and queued (the device's), kernels counted."""
    plain, deferred = deferred_reading_ops(torch.device("cuda"))
    record: dict[str, Any] = {}
    for name, fn in (("update", plain), ("update+deferred", deferred)):
        record[name] = {"ms": timed(fn, args.warmup, max(args.iters, 50)),
                        "queued_ms": queued(fn, args.warmup, max(args.iters, 50)),
                        "kernels": kernels_per_call(fn)}  # fmt: skip
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/kernel_bench")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="sizes up to 64 MB, no 1.5e9 case")
    parser.add_argument("--no-launches", dest="launches", action="store_false")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "argv": sys.argv,
        "warmup": args.warmup,
        "iters": args.iters,
        "config": dict(diag.CONFIG),
        "others": foreign_norms()[1],
    }
    print(json.dumps(meta), flush=True)
    records = []
    sizes = [1, 16, 64] if args.quick else [1, 16, 64, 256, 1024, 2048]
    for dtype in (torch.bfloat16, torch.float32):
        for mb in sizes:
            n = mb * MB // torch.tensor([], dtype=dtype).element_size()
            grads = [torch.randn(n, device=dev, dtype=dtype)]
            name = f"1 x {mb} MB {str(dtype)[6:]}"
            records.append(run_case(name, grads, args, launches=mb == 64))
            del grads
            torch.cuda.empty_cache()
    # 500 mixed-dtype matrices, 225M elements in all
    gen = torch.Generator().manual_seed(1)
    total = 225_000_000 if not args.quick else 22_500_000
    weights = torch.rand(500, generator=gen) + 0.2
    numels = (weights / weights.sum() * total).long().tolist()
    numels[-1] += total - sum(numels)
    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    grads = []
    for i, n in enumerate(numels):
        cols = 1024 if n >= 1024 else 1
        grads.append(torch.randn(n // cols, cols, device=dev, dtype=dtypes[i % 3]))
    name = f"500 mixed matrices, {total} elements"
    records.append(run_case(name, grads, args, sweep=True, launches=True))
    del grads
    torch.cuda.empty_cache()
    if not args.quick:
        grads = [torch.randn(1_536_000_000, device=dev, dtype=torch.bfloat16)]
        records.append(run_case("1 x 1.536e9 bf16", grads, args, sweep=True, launches=True))
        del grads
    deferred = deferred_reading(args)
    (out / "kernel_bench.json").write_text(
        json.dumps({"meta": meta, "records": records, "deferred_reading": deferred}, indent=1)
    )
    lines = [f"# kernel_bench: {meta['gpu']}, {meta['date']}, torch {meta['torch']}, "
             f"triton {meta['triton']}", "",
             "| case | " + " | ".join(records[0]["ms"]) + " |",
             "|---" * (len(records[0]["ms"]) + 1) + "|"]  # fmt: skip
    for r in records:
        cells = [f"{r['ms'][k]:.3f} ms ({r['GBps'][k]:.0f} GB/s)" for k in r["ms"]]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    lines += ["", "| deferred replica reading | alone | queued | kernels |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['ms']:.4f} ms | {v['queued_ms']:.4f} ms | {v['kernels']} |"
              for k, v in deferred.items()]  # fmt: skip
    (out / "kernel_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
