"""fp16 training under torchft: 2 replica groups, one killed and restarted every N steps.

Runs, on this machine, a torchft lighthouse and two replica groups (one process each, gloo, CPU,
fp16 autocast) training a small MLP regression with SGD; group 1 dies (``os._exit``) every
``--kill-every`` manager steps and is restarted, as torchelastic would, and heals from group 0. A
fault-free run of the same job goes alongside. At the end it prints both groups' final scale and
their largest parameter difference, and plots the loss per step beside the fault-free run's::

    python launch/train_torchft.py                       # distscaler (install(manager, optimizer))
    python launch/train_torchft.py --inject-inf          # + overflows before and after the average
    python launch/train_torchft.py --stock --inject-inf  # torch.amp.GradScaler as a new user wires it
    python launch/train_torchft.py --steps 60 --kill-every 15 --plot torchft.png

Exit status 0 when the groups end with equal parameters and scales (always expected with
distscaler; the stock scaler usually ends split), 1 otherwise. Needs ``pip install
'distscaler[torchft]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The restarted group's process is started in advance (importing torch takes seconds) and waits.
RESTART_DELAY_S = 0.5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="manager steps to train (default 30)")
    p.add_argument("--kill-every", type=int, default=10, help="group 1 dies every N steps (0: never)")
    p.add_argument("--inject-inf", action="store_true", help="overflows: before the average at steps 3, 4 and in the first step after each rejoin, and after the average on group 0 at step 7")
    p.add_argument("--stock", action="store_true", help="torch.amp.GradScaler + OptimizerWrapper, as a new torchft user writes it")
    p.add_argument("--init-scale", type=float, default=1024.0)
    p.add_argument("--step-time", type=float, default=0.1, help="seconds each step sleeps, standing for a real step's compute (default 0.1): a lighthouse that sees a survivor's quorum requests back to back keeps re-forming its one-group quorum, and a restarted group then forms one of its own")
    p.add_argument("--plot", metavar="PATH", help="write the loss curves (matplotlib) to PATH")
    p.add_argument("--out", metavar="DIR", help="folder for the per-group JSON lines (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds before the job is stopped")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a group's process: its JSON spec
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the driver


def run_job(args: argparse.Namespace, rundir: str, *, faults: bool) -> dict[int, list[dict]]:
    """One job (two groups, a lighthouse); returns each group's records in order."""
    from torchft.coordination import LighthouseServer

    os.makedirs(rundir, exist_ok=True)
    for name in os.listdir(rundir):  # a rerun into the same folder starts clean
        os.remove(os.path.join(rundir, name))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1500, heartbeat_timeout_ms=1500)
    spec = {
        "lighthouse": lighthouse.address(), "rundir": rundir, "steps": args.steps,
        "kill_every": args.kill_every if faults else 0, "inject": args.inject_inf,
        "stock": args.stock, "init_scale": args.init_scale, "step_time": args.step_time,
    }  # fmt: skip

    def start(group: int, attempt: int) -> subprocess.Popen:
        worker = json.dumps(dict(spec, group=group, attempt=attempt))
        log = open(os.path.join(rundir, f"g{group}_a{attempt}.log"), "w")
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", worker],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    procs = {0: start(0, 0), 1: start(1, 0)}
    attempts = {0: 0, 1: 0}
    standby = start(1, 1) if spec["kill_every"] else None
    t0 = time.time()
    try:
        while time.time() - t0 < args.timeout:
            if all(p.poll() is not None for p in procs.values()):
                break
            if procs[1].poll() == 3:  # group 1 died: its restart takes over
                attempts[1] += 1
                time.sleep(RESTART_DELAY_S)
                assert standby is not None
                open(os.path.join(rundir, f"go_g1_a{attempts[1]}"), "w").close()
                procs[1], standby = standby, start(1, attempts[1] + 1)
            time.sleep(0.05)
    finally:
        for p in [*procs.values(), *([standby] if standby else [])]:
            if p.poll() is None:
                p.kill()  # our own children, by their handles
                p.wait()
        lighthouse.shutdown()
    records: dict[int, list[dict]] = {0: [], 1: []}
    for group in (0, 1):
        for attempt in range(attempts[group] + 1):
            path = os.path.join(rundir, f"g{group}_a{attempt}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    records[group] += [json.loads(line) for line in f if line.strip()]
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    import threading

    rundir = args.out or tempfile.mkdtemp(prefix="train_torchft_")
    results: dict[str, dict[int, list[dict]]] = {}
    jobs = [threading.Thread(target=lambda n=name, f=faults: results.__setitem__(n, run_job(args, os.path.join(rundir, n), faults=f)))
            for name, faults in (("faults", True), ("fault_free", False))]  # fmt: skip
    started = time.time()
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    wiring = "torch.amp.GradScaler (stock)" if args.stock else "distscaler"
    faulty = results["faults"]
    last = {g: [d for d in recs if "params" in d][-1] for g, recs in faulty.items() if any("params" in d for d in recs)}
    ok = len(last) == 2 and last[0]["step"] == last[1]["step"]
    dparam = max(abs(a - b) for a, b in zip(last[0]["params"], last[1]["params"])) if ok else math.nan
    scales = [last[g]["scale"] for g in sorted(last)]
    ok = ok and dparam == 0.0 and len(set(scales)) == 1
    deaths = sum(1 for d in faulty[1] if d.get("event") == "death")
    print(f"{wiring}: {args.steps} steps, group 1 killed {deaths} times; final scales {scales}, "
          f"largest parameter difference between the groups {dparam:.3g}; "
          f"{time.time() - started:.1f} s; records in {rundir}")  # fmt: skip
    if args.plot:
        _plot(results, args.plot, wiring)
    return 0 if ok else 1


def _plot(results: dict[str, dict[int, list[dict]]], path: str, wiring: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("fault_free", "-"), ("faults", "--")):
        for group in (0, 1):
            recs = [d for d in results[name][group] if "loss" in d]
            label = f"{name.replace('_', '-')}, group {group}"
            # One line per stretch of consecutive steps: a dead group draws no line.
            cuts = [0] + [i for i in range(1, len(recs)) if recs[i]["step"] != recs[i - 1]["step"] + 1]
            for k, (a, b) in enumerate(zip(cuts, [*cuts[1:], len(recs)])):
                part = recs[a:b]
                ax.plot([d["step"] for d in part], [d["loss"] for d in part], style, marker=".",
                        color=f"C{2 * (name == 'faults') + group}", label=label if k == 0 else None, alpha=0.8)  # fmt: skip
    ax.set_xlabel("manager step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(f"torchft, 2 replica groups, group 1 killed and restarted: {wiring}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- one replica group


def _worker(spec: dict[str, Any]) -> None:
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    group, attempt, rundir = spec["group"], spec["attempt"], spec["rundir"]
    if attempt > 0:  # started in advance; runs once the driver says so
        while not os.path.exists(os.path.join(rundir, f"go_g{group}_a{attempt}")):
            time.sleep(0.02)
    out = open(os.path.join(rundir, f"g{group}_a{attempt}.jsonl"), "w", buffering=1)
    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)
    torch.manual_seed(attempt)  # a restarted group starts from other weights: it must heal
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    inner = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)

    def load_state_dict(sd: dict) -> None:
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": net.state_dict(), "optim": inner.state_dict()},
        replica_id=f"group{group}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=spec["lighthouse"], timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10),
    )  # fmt: skip
    # The first quorum holds both groups: each first attempt waits for the other's manager (two
    # groups starting apart could each form a quorum of their own, with min_replicas=1).
    open(os.path.join(rundir, f"ready_g{group}_a{attempt}"), "w").close()
    while attempt == 0 and not os.path.exists(os.path.join(rundir, f"ready_g{1 - group}_a0")):
        time.sleep(0.02)
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, inner)
    if spec["stock"]:
        scaler: Any = torch.amp.GradScaler("cpu", init_scale=spec["init_scale"])
    else:
        from distscaler import GradScaler
        from distscaler.integrations.torchft import install

        scaler = install(manager, optimizer, scaler=GradScaler("cpu", init_scale=spec["init_scale"]))
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    kill_every = spec["kill_every"]
    rejoined_at = None
    seen = None
    first = True
    fired: set[int] = set()
    while manager.current_step() < spec["steps"]:
        step = manager.current_step()
        if kill_every and step > 0 and step % kill_every == 0 and group == 1 and not first:
            out.write(json.dumps({"event": "death", "step": step}) + "\n")
            os._exit(3)
        first = False
        optimizer.zero_grad()
        manager.wait_quorum()
        size = manager._pg.size()
        if seen is not None and size > seen:
            rejoined_at = manager.current_step()
        seen = size
        step = manager.current_step()
        gen = torch.Generator().manual_seed(step)  # every group draws the same batch at a step
        x = torch.randn(32, 16, generator=gen)
        y = torch.sin(x @ w_true)
        # Once per step number: a skipped step may not advance the manager step (stock).
        inf_before = spec["inject"] and group == 0 and (step in (3, 4) or step == rejoined_at)
        inf_after = spec["inject"] and group == 0 and step == 7
        if step in fired:
            inf_before = inf_after = False
        if inf_before or inf_after:
            fired.add(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaled = scaler.scale(loss)
        if inf_before:  # an overflow in backward: it reaches every group through the average
            scaled = scaled * math.inf
        scaled.backward()
        if inf_after:  # after the average, on this group only
            with torch.no_grad():
                next(net.parameters()).grad.view(-1)[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        out.write(json.dumps({
            "step": step, "loss": float(loss), "scale": float(scaler.get_scale()),
            "params": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in net.parameters()])],
        }) + "\n")  # fmt: skip
        time.sleep(spec["step_time"])
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
