"""The scaler phase across hosts on a slow link: ``benchkit/distributed.py`` under torchrun on a
testbed of hosts (``launch/multihost.py``: network namespaces on one machine), once per link
rate, every contender on the same gradients in one run. Needs root and iproute2.

    sudo python launch/bench_hosts.py --rates none 100mbit 10mbit --layouts ddp fsdp2 \\
        --params 1000000 --tensors 16 --rounds 7 --warmup 2 --out runs/bench_hosts

Each rate limits every host's link both ways (``tc`` token bucket, ``none``: no limit). Writes
``results.json`` (every record, with the rate) and ``results.md`` (the table: the slowest rank's
median phase time per contender, its ratio to distscaler's, and per step the collectives and host
reads; the whole optimizer step's median beside it) into ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import multihost

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: distscaler, torch's two scalers, DeepSpeed's own check, distscaler's DeepSpeed and Megatron
#: rules, and distscaler without the replica check (the contenders of benchkit/contenders.py).
CONTENDERS = (
    "distscaler",
    "distscaler-nocheck",
    "distscaler-deepspeed",
    "distscaler-megatron",
    "torch",
    "torch-sharded",
    "deepspeed",
)
_MASTER_PORT = 29500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", nargs="+", default=["none", "100mbit", "10mbit"])
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default: 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per host")
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp2"])
    parser.add_argument("--params", type=int, default=1_000_000, help="whole-model elements")
    parser.add_argument("--tensors", type=int, default=16, help="parameter tensors")
    parser.add_argument("--optimizer", default="foreach", help="AdamW kind (default: foreach)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per rate")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_hosts"))
    return parser.parse_args(argv)


def run_rate(bed: multihost.Testbed, rate: str, index: int, args: argparse.Namespace) -> list[Any]:
    """The worker on every host with every link at ``rate``; rank 0's records."""
    for host in bed.hosts:
        if rate == "none":
            bed.clear_rate_limit(host)
        else:
            bed.rate_limit(host, rate)
    out = f"runs/rate-{index}.json"
    procs = []
    for host in bed.hosts:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(bed.hosts)),
            "--node-rank", str(host.index), "--nproc-per-node", str(args.nproc_per_node),
            "--master-addr", bed.hosts[0].addr, "--master-port", str(_MASTER_PORT + index),
            "launch/benchkit/distributed.py", "--layouts", *args.layouts,
            "--params", str(args.params), "--tensors", str(args.tensors),
            "--optimizer", args.optimizer, "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--contenders", *args.contenders, "--out", out,
        ]  # fmt: skip
        env = {"PYTHONPATH": multihost.WORKDIR, "OMP_NUM_THREADS": "1"}
        procs.append(bed.run(host, cmd, env=env, timeout=args.timeout))
    started = time.monotonic()
    codes = [p.wait() for p in procs]
    wall_s = round(time.monotonic() - started, 1)
    result = bed.host_path(bed.hosts[0], f"{multihost.WORKDIR}/{out}")
    if any(codes) or not result.exists():
        tails = "\n".join(f"== {p.host.hostname}:\n{p.output()[-3000:]}" for p in procs)
        raise RuntimeError(f"rate {rate}: exit codes {codes}\n{tails}")
    # The job's wall time (start, model broadcast, the gradients' all-reduce, every round) shows
    # the link's rate; the scaler phase's own collective is a few bytes.
    return [{**r, "rate": rate, "job_wall_s": wall_s} for r in json.loads(result.read_text())]


def table(records: list[dict[str, Any]], contenders: list[str]) -> str:
    """One row per (layout, rate, contender): median phase, ratio to distscaler, counts."""
    lines = [
        "| layout | link rate | contender | phase median | / distscaler | whole step median "
        "| collectives per step (bytes) | host reads per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        base = r["phase_ms"].get("distscaler")
        for name in contenders:
            ms = r["phase_ms"].get(name)
            if ms is None:
                error = r.get("errors", {}).get(name, "did not run")
                lines.append(f"| {r['layout']} | {r['rate']} | {name} | {error} | | | | |")
                continue
            counts = r.get("counts", {}).get(name, {})
            ratio = f"{ms / base:.2f}" if base else ""
            step = r.get("step_ms", {}).get(name)
            collectives = f"{counts.get('collectives', '')} ({counts.get('collective_bytes', 0)} B)"
            lines.append(
                f"| {r['layout']} | {r['rate']} | {name} | {ms:.2f} ms | {ratio} | "
                f"{f'{step:.2f} ms' if step is not None else ''} | "
                f"{collectives} | {counts.get('host_reads', '')} |"
            )
    walls = {r["rate"]: r["job_wall_s"] for r in records}
    lines.append("")
    lines.append(
        "Wall time of each rate's job: " + ", ".join(f"{k} {v} s" for k, v in walls.items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bed = multihost.Testbed(args.hosts, command_timeout_s=args.timeout).start()
    except multihost.TestbedUnavailable as e:
        print(f"bench_hosts: cannot run here: {e.reason}", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    with bed:
        for host in bed.hosts:
            for path in ("distscaler", "launch"):
                bed.put(host, REPO / path)
        for index, rate in enumerate(args.rates):
            print(f"rate {rate} ...", file=sys.stderr, flush=True)
            records += run_rate(bed, rate, index, args)
    records.sort(key=lambda r: (args.layouts.index(r["layout"]), args.rates.index(r["rate"])))
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "command": "python launch/bench_hosts.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "hosts": args.hosts,
        "nproc_per_node": args.nproc_per_node,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    report = f"{meta['command']}\n\n{table(records, args.contenders)}\n"
    (args.out / "results.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
