"""Benchmark the scaler (+ clip) phase: distscaler side by side with torch, ShardedGradScaler and
DeepSpeed's overflow check, on the same gradients, interleaved, with the memory-traffic floors.

Sweeps (one knob at a time from a base case of 38M fp32 parameters in 144 tensors, fused AdamW,
clipping at 1.0): gradient bytes, tensor count at equal bytes, gradient dtype, optimizer (fused,
foreach, for-loop) x clipping on/off, the launch-bound case (tiny gradients, 10 to 10,000 tensors:
host microseconds and device ops per step, also for distscaler's DeepSpeed and Megatron rules and
without its overflow report), world size 1/2/4 under torchrun (gloo) for DDP and
FSDP2, and the collectives of FSDP2/HSDP at up to 4096 ranks with the fake process group. For each
case it reports the phase's median time, the whole optimizer step, the optimizer alone, the floors
(one read pass ``_foreach_norm``, one read+write pass ``_foreach_mul_``) and, per step, device ops,
collectives and host reads of each contender. On ``--device cuda`` a captured-graph distscaler
(``distscaler-graph``: the same sequence replayed from a CUDA graph) runs too. See
``benchkit/contenders.py`` for exactly what each contender runs.

    python launch/bench.py                 # everything, about 10 minutes on a 2-core CPU
    python launch/bench.py --quick         # smoke run, under 2 minutes
    python launch/bench.py --sweeps bytes tensors --max-params 64000000

Writes ``--out`` (default ``runs/bench``): ``results.md`` (the tables and the targets),
``results.json`` (every record), and ``phase_vs_bytes.png``, ``phase_vs_tensors.png``,
``phase_vs_world_size.png``. Exits 0 even when a target is missed (the report says which).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchkit.cases import measure, plain_params
from benchkit.contenders import CONTENDERS, ON_REQUEST, VARIANTS
from benchkit.launch_cost import measure_launch
from benchkit.report import check_targets, markdown, plot
from benchkit.sweeps import SWEEPS, plan
from tqdm import tqdm

from common.distributed import destroy_process_group

HERE = Path(__file__).resolve().parent


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small cases, 3 rounds")
    parser.add_argument(
        "--sweeps", nargs="+", choices=SWEEPS, default=list(SWEEPS), help="default: all"
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=CONTENDERS + tuple(VARIANTS),
        default=None,
        help="default: all but distscaler-compiled (distscaler-graph on --device cuda only); the launch sweep adds "
        "distscaler's variants (its DeepSpeed and Megatron rules, no overflow report) when "
        "distscaler runs",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--max-params",
        type=int,
        default=None,
        help="largest case of the bytes sweep, in parameters (default: what fits in a quarter "
        "of this machine's memory at 24 bytes per parameter, at most 256M)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 11; 3 quick)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed rounds (default 2; 1 quick)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: torch's)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="output directory")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="measure nothing: render the tables, targets and plots of an earlier results.json",
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "warmup", "max_params", "threads"):
        value = getattr(args, name)
        minimum = 0 if name == "warmup" else 1
        if value is not None and value < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}, got: {value}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got: {args.device!r}")
    if args.from_json is not None and not args.from_json.is_file():
        parser.error(f"--from-json: no such file: {args.from_json}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.contenders is None:
        args.contenders = [
            c
            for c in CONTENDERS
            if c not in ON_REQUEST and (args.device == "cuda" or c != "distscaler-graph")
        ]
    return args


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _simulate(world_sizes: list[int]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "benchkit" / "fake_world.py"),
            "--world-sizes",
            *map(str, world_sizes),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fake_world.py failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def write_report(
    out: Path, meta: dict[str, Any], records: list[dict[str, Any]], simulation: list[dict[str, Any]]
) -> str:
    """Write results.md, results.json and the plots to ``out``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    targets = check_targets(records, simulation)
    report = markdown(meta, records, simulation, targets)
    (out / "results.md").write_text(report)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "targets": targets, "records": records, "simulation": simulation},
            indent=1,
        )
    )
    plots = plot(records, out)
    print(
        f"wrote {out / 'results.md'}, {out / 'results.json'}, " + ", ".join(map(str, plots)),
        file=sys.stderr,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        print(write_report(args.out, earlier["meta"], earlier["records"], earlier["simulation"]))
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    max_params = args.max_params or min(256_000_000, _memory_bytes() // 4 // 24)
    p = plan(args.sweeps, quick=args.quick, max_params=max_params)
    rounds = args.rounds or p.rounds
    warmup = p.warmup if args.warmup is None else args.warmup
    args.out.mkdir(parents=True, exist_ok=True)

    # A process group of one rank: ShardedGradScaler needs one (distscaler skips its collective
    # at world size 1; torch.amp.GradScaler and DeepSpeed's check issue none).
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    records: list[dict[str, Any]] = []
    try:
        for sweep, case in tqdm(p.single, desc="single-process cases", unit="case"):
            if sweep == "launch":
                variants = list(VARIANTS) if "distscaler" in args.contenders else []
                launch = measure_launch(
                    case,
                    device=device,
                    contenders=[c for c in args.contenders if c != "distscaler-graph"] + variants,
                    rounds=rounds,
                    warmup=warmup,
                )
                records.append({"sweep": sweep, **launch})
                continue
            params = plain_params(case, device)
            record = measure(
                case,
                params=params,
                device=device,
                contenders=args.contenders,
                rounds=rounds,
                warmup=warmup,
            )
            records.append({"sweep": sweep, **record})
            del params
    finally:
        destroy_process_group()  # one rank: its barrier waits for nobody

    world_sizes = p.world_sizes
    if device.type == "cuda":  # one GPU per rank
        world_sizes = [w for w in world_sizes if w <= torch.cuda.device_count()]
    if world_sizes:
        from benchkit.distributed import run_worlds

        c = p.world_case
        for optimizer in p.world_optimizers:
            print(
                f"torchrun worlds {world_sizes} x {p.world_layouts}, {optimizer} AdamW ...",
                file=sys.stderr,
            )
            for record in run_worlds(
                world_sizes,
                p.world_layouts,
                params=c.params,
                tensors=c.tensors,
                optimizer=optimizer,
                clip=c.clip,
                rounds=rounds,
                warmup=warmup,
                device=args.device,
            ):
                records.append({"sweep": "world", **record})
    simulation = []
    if p.simulate_world_sizes:
        print(f"simulating world sizes {p.simulate_world_sizes} ...", file=sys.stderr)
        simulation = _simulate(p.simulate_world_sizes)

    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": device.type,
        "device_name": _device_name(device),
        "threads": torch.get_num_threads(),
        "command": "python launch/bench.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "rounds": rounds,
        "warmup": warmup,
        "quick": args.quick,
    }
    print(write_report(args.out, meta, records, simulation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
