"""The skip account under torchft (tests/test_skip_account.py): one run of 2 replica groups x 2
ranks, gradients replicated everywhere (torch DDP inside a group over the group's own gloo
``WORLD``, then ``manager.allreduce`` across groups, as HSDP's replicate dimension under torchft),
the scaler installed with ``distscaler.integrations.torchft.install`` and the replica check on
(``replica_check=True, replica_check_interval=1``). Three faults, at three iterations:

* `OVERFLOW`: an inf in group 1 rank 0's batch, before any average (every rank's average
  overflows: cause ``overflow``, the scale backs off);
* `FLIP`: one finite bit flipped in group 0 rank 1's weight gradient, after both averages (that
  replica alone differs: cause ``replica_mismatch``, were the check to compare it);
* `UNCOMMITTED`: ``manager.report_error()`` on group rank 0 of every group, after the averages and
  before ``scaler.step`` (torchft commits nowhere: cause ``not_committed``).

Each rank writes one JSON line per iteration: whether the step was skipped (``step_was_skipped``),
the recipe's pattern run on a skipped step (``report_skip()`` and its ``describe()``; also
``report_overflow()``, the pattern of the Recipes page's ``examples/ddp.py``), the scale, the skip
totals, ``metrics()``, the replica ledger, torchft's commit and a digest of the parameters.

:func:`run` starts the lighthouse (``min_replicas=2``: every quorum holds both groups; with the
managers' ``init_sync=False`` no group heals, and every rank runs the same iterations) and the 4 rank processes (``python
tests/_skip_torchft_scenarios.py SPEC_JSON``; tests/_torchft_scenarios.py's driver starts its own
file, and its rank loop has no place for these probes), and returns every rank's lines.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

NUM_GROUPS = 2
GROUP_SIZE = 2
OVERFLOW = 1
FLIP = 3
UNCOMMITTED = 5
ITERATIONS = 7
INIT_SCALE = 1024.0
RANKS = [(g, r) for g in range(NUM_GROUPS) for r in range(GROUP_SIZE)]


def run(rundir: str, *, timeout: float = 90.0) -> dict[str, Any]:
    """Run the scenario; returns {"records": {(group, rank): [line, ...]}, "exits": {(group, rank):
    returncode or None}, "timed_out": bool, "wall_s": float, "logs": {(group, rank): str}}."""
    from torchft.coordination import LighthouseServer

    os.makedirs(rundir, exist_ok=True)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=NUM_GROUPS, join_timeout_ms=1500, heartbeat_timeout_ms=1500
    )
    paths = [ROOT, HERE, os.path.join(ROOT, "launch"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))  # pytest's pythonpath, and ours
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    timed_out = False
    try:
        for g, r in RANKS:
            spec = {"group": g, "rank": r, "lighthouse": lighthouse.address(), "rundir": rundir}
            log = open(os.path.join(rundir, f"g{g}_r{r}.log"), "w")
            procs[(g, r)] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            )  # fmt: skip
        while any(p.poll() is None for p in procs.values()):
            if time.time() - t0 > timeout:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()  # our own child, by its handle
                proc.wait()
        lighthouse.shutdown()
    records: dict[tuple[int, int], list[dict]] = {}
    logs: dict[tuple[int, int], str] = {}
    for g, r in RANKS:
        path = os.path.join(rundir, f"g{g}_r{r}.jsonl")
        with open(path) if os.path.exists(path) else open(os.devnull) as f:
            records[(g, r)] = [json.loads(line) for line in f if line.strip()]
        with open(os.path.join(rundir, f"g{g}_r{r}.log")) as f:
            logs[(g, r)] = f.read()[-4000:]
    return {
        "records": records,
        "exits": {key: p.returncode for key, p in procs.items()},
        "timed_out": timed_out,
        "wall_s": round(time.time() - t0, 1),
        "logs": logs,
    }


# ---------------------------------------------------------------------- one rank


def _main(spec: dict[str, Any]) -> None:
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from _replica_scenarios import digest, flip_bit_
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from distscaler import GradScaler
    from distscaler.integrations.torchft import install

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    g, r, rundir = spec["group"], spec["rank"], spec["rundir"]
    out = open(os.path.join(rundir, f"g{g}_r{r}.jsonl"), "w", buffering=1)

    # The replica group's own store and WORLD (its torchrun's): rank 0 binds port 0.
    port_file = os.path.join(rundir, f"store_g{g}")
    if r == 0:
        store = dist.TCPStore("localhost", 0, GROUP_SIZE, is_master=True, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        while not os.path.exists(port_file):
            time.sleep(0.02)
        store = dist.TCPStore("localhost", int(open(port_file).read()), GROUP_SIZE, is_master=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("group", store), rank=r, world_size=GROUP_SIZE
    )

    torch.manual_seed(0)  # the same model on every rank of every group: replicas
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    ddp = DDP(net)  # the gradient average inside the replica group
    inner = torch.optim.SGD(net.parameters(), lr=0.05)

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:  # never called: init_sync=False, nobody falls behind
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=NUM_GROUPS,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"rg{g}",
        store_addr="localhost",
        store_port=store.port,
        rank=r,
        world_size=GROUP_SIZE,
        lighthouse_addr=spec["lighthouse"],
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        # Every rank built the same weights. With torchft's step-0 sync a group heals per group
        # rank (rank 0s from one group, rank 1s from the other), its part of that step's average
        # zeroed: the two ranks of a group would apply different gradients at step 0.
        init_sync=False,
    )
    opt = OptimizerWrapper(manager, inner)
    scaler = install(
        manager, opt, model=ddp,
        scaler=GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1000, skip_log_interval=1,
                          replica_check=True, replica_check_interval=1),
    )  # fmt: skip

    w_true = torch.randn(6, 1, generator=torch.Generator().manual_seed(4321))
    for it in range(ITERATIONS):
        step0 = manager.current_step()
        opt.zero_grad()  # torchft's quorum starts here
        gen = torch.Generator().manual_seed(1000 + 10 * it + 3 * g + r)  # each rank its batch
        x = torch.randn(8, 6, generator=gen)
        if it == OVERFLOW and (g, r) == (1, 0):
            x[0, 0] = math.inf  # this rank's data: every average overflows
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w_true)
        scaler.scale(loss).backward()  # DDP: the average inside the group
        for p in net.parameters():  # the average across replica groups (HSDP's replicate dim)
            manager.allreduce(p.grad).wait()
        if it == FLIP and (g, r) == (0, 1):
            flip_bit_(net[0].weight.grad, 3, 30)  # after the averages: this replica only
        if it == UNCOMMITTED and r == 0:
            manager.report_error(RuntimeError("injected: a fault torchft saw on this group"))
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        skipped = scaler.step_was_skipped  # the same on every rank (one host read)
        line: dict[str, Any] = {"it": it, "step": step0, "skipped": skipped}
        if skipped:  # the recipe's pattern: every rank calls it, whatever the cause
            report = scaler.report_skip()
            line["cause"] = None if report is None else report.cause
            line["update"] = None if report is None else report.update
            line["describe"] = None if report is None else report.describe()
            try:  # the Recipes page's examples/ddp.py pattern
                over = scaler.report_overflow()
                line["overflow_report"] = None if over is None else [over.step, over.describe()]
            except Exception as e:  # recorded, not raised: the test says what it expects
                line["overflow_report"] = f"raised {type(e).__name__}: {e}"
        totals = scaler.skip_totals
        line.update(
            scale=scaler.get_scale(),
            committed=scaler.last_step_committed,
            step_after=manager.current_step(),
            causes=totals.causes,
            num_skipped=totals.num_skipped,
            num_updates=totals.num_updates,
            totals=totals.describe(),
            metrics=scaler.metrics(),
            ledger=scaler.replica_ledger.as_dict(),
            params=digest(net.parameters()),
        )
        out.write(json.dumps(line) + "\n")
    out.flush()
    dist.barrier()
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
