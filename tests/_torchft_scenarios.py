"""torchft scenarios: replica groups in child processes, a real lighthouse in the driver.

:func:`run` starts an in-process ``LighthouseServer`` (bound to port 0), one process per rank of each
replica group (``python tests/_torchft_scenarios.py SPEC_JSON``), restarts a rank that exits with
code 3 (an injected death) after a delay, as torchelastic would, stops what is still running at the
deadline, and returns every rank's records. Each rank writes one JSON line per iteration.

Every group trains the same small model on the same batch at a manager step, so the true update is
known: ``ratio = <applied gradient, true gradient> / |true gradient|**2``, the true gradient being
the average over the participants of each one's local gradient divided by its own scale (one
measurement-only ``manager.allreduce``). SGD without momentum: the applied gradient is ``p.grad``
after the step.

Spec keys: ``wiring`` ("ours" | "stock"), ``num_groups``, ``group_size``, ``steps`` (manager step to
stop at), ``crash`` ({group: manager step}: attempt 0 of that group exits there), ``late``
({group: seconds}; with ``late_after`` N, counted from group 0's N-th iteration record, so that
a loaded machine's slow start cannot let the late group arrive before group 0 has moved on),
``inject`` (list of [where, when, group, group_rank]: where "pre" (an inf in the
local gradient, before the average) or "post" (after it, on that group only); when a manager step,
"join" (the step a survivor sees a group join in), "join+K" or "heal" (a restarted group's first
step, the one it heals in)); where also "flip" (one low mantissa bit of a gradient flipped after
the average, on that group only: a finite silent corruption), ``sync_quorum``, ``clip``,
``report_lone``, ``bad_heal`` ("lr" | "param_bit": the restarted group's first heal loads a stale
learning rate, or its first parameter with one bit flipped, as a faulty load would),
``store_host`` (the name the group's manager gives for its store, which the other groups connect
to for the cross-group process group; default "localhost", one machine), ``external_stop`` (run
until the driver writes the manager step to stop at into ``rundir/stop_step``), ``rank_timeout``
(seconds a rank runs at most, default 50).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESTART_DELAY_S = 1.0
INIT_SCALE = 1024.0


#: The scenarios of issue 35 (``steps=0, after_join=K``: until a group (re)joins, then K steps), each run with ``wiring="ours"`` and ``wiring="stock"``. Scales are
#: driven below ``init_scale`` by agreed overflows first, so that a scale left behind shows.
SCENARIOS: dict[str, dict[str, Any]] = {
    # An inf written into group 0's gradients after the cross-replica average (local corruption).
    "inf_after_average": dict(num_groups=2, steps=8, inject=[["post", 3, 0, 0]], clip=True),
    # Group 1 dies at step 4 and is restarted; the default async quorum.
    "rejoin_async": dict(
        num_groups=2, steps=0, after_join=5, crash={1: 4}, sleep=0.1,
        inject=[["pre", 1, 0, 0], ["pre", 2, 0, 0]],
    ),  # fmt: skip
    "rejoin_sync": dict(
        num_groups=2, steps=0, after_join=5, crash={1: 4}, sync_quorum=True, sleep=0.1,
        inject=[["pre", 1, 0, 0], ["pre", 2, 0, 0]],
    ),  # fmt: skip
    # As rejoin_async, plus an overflow (before the average) in the step group 1 heals in.
    "skip_in_heal_step": dict(
        num_groups=2, steps=0, after_join=5, crash={1: 4}, sleep=0.1,
        inject=[["pre", 1, 0, 0], ["pre", 2, 0, 0], ["pre", "join", 0, 0]],
    ),  # fmt: skip
    # Group 1 starts 0.5 s after group 0's third iteration: group 0 backed off twice before; an
    # inf after the average on group 0 two steps after the join.
    "late_join": dict(
        num_groups=2, steps=0, after_join=5, late={1: 0.5}, late_after=3, sleep=0.1,
        inject=[["pre", 1, 0, 0], ["pre", 2, 0, 0], ["post", "join+2", 0, 0]],
    ),  # fmt: skip
    # 2 groups x 2 ranks, gradients sharded inside a group: an inf in rank 0's shard before the
    # average (it reaches group 1's rank 0, not the rank 1s), then one after the average on group
    # 1's rank 1 only.
    "two_by_two": dict(
        num_groups=2, group_size=2, steps=7, quorum_timeout=6,
        inject=[["pre", 2, 0, 0], ["post", 4, 1, 1]],
    ),  # fmt: skip
    # report_lone_replica=True (ours only): group 0 alone goes non-finite after the average.
    "report_lone_replica": dict(
        num_groups=2, steps=8, report_lone=True, inject=[["post", 3, 0, 0]]
    ),
    # Issue 41: group 1 dies at step 4 and is restarted; in the step it heals in, an inf appears in
    # its own gradients after the average (a local fault on the healer, whose contribution torchft
    # zeroes).
    "heal_step_inf": dict(
        num_groups=2, steps=0, after_join=5, crash={1: 4}, sleep=0.1,
        inject=[["post", "heal", 1, 0]],
    ),  # fmt: skip
    # The same with 2 groups x 2 ranks (gradients sharded inside a group), on the healer's rank 0.
    "heal_step_inf_2x2": dict(
        num_groups=2, group_size=2, steps=0, after_join=5, crash={1: 4}, sleep=0.1,
        quorum_timeout=6, inject=[["post", "heal", 1, 0]],
    ),  # fmt: skip
    # Issue 41, the heal verified: group 1 dies at step 4 and is restarted; its first heal loads
    # a stale learning rate (torchtitan #4598), or a parameter with one flipped bit. Found at its
    # first step after the heal, reported, healed again, then verified.
    "bad_heal_lr": dict(num_groups=2, steps=0, after_join=7, crash={1: 4}, sleep=0.1,
                        bad_heal="lr"),  # fmt: skip
    "bad_heal_param_bit": dict(num_groups=2, steps=0, after_join=7, crash={1: 4}, sleep=0.1,
                               bad_heal="param_bit"),  # fmt: skip
    # A good heal (verified, nothing reported), then one bit flipped in group 0's gradients after
    # the average, two steps after the join: the replica check across the participating groups.
    "heal_and_flip": dict(num_groups=2, steps=0, after_join=6, crash={1: 4}, sleep=0.1,
                          inject=[["flip", "join+2", 0, 0]]),  # fmt: skip
}


# ---------------------------------------------------------------------- the driver


def run(spec: dict[str, Any], rundir: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """Run one scenario; returns {"records": {group: [...]}, "exits": [...], "timed_out": bool,
    "wall_s": float}. ``records[g]`` holds group rank 0's lines in order (attempts in order); the
    other ranks' are under ``records_by_rank[(g, r)]``."""
    from torchft.coordination import LighthouseServer

    os.makedirs(rundir, exist_ok=True)
    for name in os.listdir(rundir):  # a rerun in the same folder starts clean
        os.remove(os.path.join(rundir, name))
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1500, heartbeat_timeout_ms=1500
    )
    spec = dict(spec, lighthouse=lighthouse.address(), rundir=rundir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    late = {int(g): float(s) for g, s in spec.get("late", {}).items()}
    spec["late"] = {str(g): s for g, s in late.items()}
    spec["crash"] = {str(g): s for g, s in spec.get("crash", {}).items()}
    group_size = spec.get("group_size", 1)
    t0 = time.time()

    def start(g: int, r: int, attempt: int) -> subprocess.Popen:
        args = dict(spec, group=g, group_rank=r, attempt=attempt)
        log = open(os.path.join(rundir, f"g{g}_r{r}_a{attempt}.log"), "w")
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(args)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip

    procs: dict[tuple[int, int], tuple[subprocess.Popen, int]] = {}
    pending = {
        (g, r): t0 + late.get(g, 0.0) for g in range(spec["num_groups"]) for r in range(group_size)
    }
    # The restart of a group that dies is started now, as a standby that imports torch and waits:
    # importing takes seconds on a loaded machine, and nothing of it matters to the scenario.
    standby = {
        (int(g), r): start(int(g), r, 1) for g in spec["crash"] for r in range(group_size)
    }
    exits: list[tuple[int, int, int, int]] = []
    timed_out = False
    try:
        while True:
            if time.time() - t0 > timeout:
                timed_out = True
                break
            for key, when in list(pending.items()):
                if key[0] in late and key not in procs and not _progressed(
                    rundir, spec.get("late_after", 0)
                ):
                    pending[key] = time.time() + late[key[0]]  # counted from group 0's progress
                    continue
                if time.time() >= when:
                    attempt = procs[key][1] + 1 if key in procs else 0
                    if attempt == 1 and key in standby:
                        open(os.path.join(rundir, f"go_g{key[0]}_r{key[1]}_a1"), "w").close()
                        procs[key] = (standby.pop(key), attempt)
                    else:
                        procs[key] = (start(*key, attempt), attempt)
                    del pending[key]
            for key, (proc, attempt) in procs.items():
                rc = proc.poll()
                if rc is None or any(e[:3] == (*key, attempt) for e in exits):
                    continue
                exits.append((*key, attempt, rc))
                if rc == 3:  # an injected death: restarted like torchelastic would
                    pending[key] = time.time() + RESTART_DELAY_S
            if not pending and all(p.poll() is not None for p, _ in procs.values()):
                break
            time.sleep(0.05)
    finally:
        for proc, _ in [*procs.values(), *((p, 1) for p in standby.values())]:
            if proc.poll() is None:
                proc.kill()  # our own child, by its handle
                proc.wait()
        lighthouse.shutdown()
    by_rank: dict[tuple[int, int], list[dict]] = {}
    for (g, r), (_, last) in procs.items():
        lines: list[dict] = []
        for attempt in range(last + 1):
            path = os.path.join(rundir, f"g{g}_r{r}_a{attempt}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    lines += [dict(json.loads(line), attempt=attempt) for line in f if line.strip()]
        by_rank[(g, r)] = lines
    return {
        "records": {g: by_rank.get((g, 0), []) for g in range(spec["num_groups"])},
        "records_by_rank": by_rank,
        "exits": exits,
        "timed_out": timed_out,
        "wall_s": round(time.time() - t0, 1),
    }


def _progressed(rundir: str, iterations: int) -> bool:
    """Whether group 0's rank 0 (attempt 0) has recorded ``iterations`` iterations."""
    if iterations <= 0:
        return True
    try:
        with open(os.path.join(rundir, "g0_r0_a0.jsonl")) as f:
            return sum('"scale_before"' in line for line in f) >= iterations
    except FileNotFoundError:
        return False


def steps_of(records: list[dict]) -> list[dict]:
    """The iteration records (not the events)."""
    return [d for d in records if "scale_before" in d]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the tests assert: per group the ratios of stepped iterations, the final scale and step,
    should_commit calls per iteration, heals; the largest parameter difference between groups 0 and
    1 at the end (both at the same manager step), or None."""
    out: dict[str, Any] = {"groups": {}}
    finals = {}
    for g, records in result["records"].items():
        steps = steps_of(records)
        ratios = [d["ratio"] for d in steps if d["ratio"] is not None]
        out["groups"][g] = {
            "ratios": ratios,
            "scale": steps[-1]["scale_after"] if steps else None,
            "step": steps[-1]["step_after"] if steps else None,
            "commit_calls": [d["commit_calls"] for d in steps],
            "heals": sum(d["healed"] for d in steps),
            "skips": sum(1 for d in steps if d["committed"] is not False and not d["stepped"]),
        }
        if steps:
            finals[g] = steps[-1]
    if 0 in finals and 1 in finals and finals[0]["step_after"] == finals[1]["step_after"]:
        out["dparam"] = max(abs(a - b) for a, b in zip(finals[0]["params"], finals[1]["params"]))
    else:
        out["dparam"] = None
    return out


# ---------------------------------------------------------------------- one rank


def _main(spec: dict[str, Any]) -> None:  # noqa: C901 - one training loop with its probes
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
    g, r, attempt = spec["group"], spec["group_rank"], spec["attempt"]
    group_size = spec.get("group_size", 1)
    rundir = spec["rundir"]
    if attempt > 0:  # a standby restart: imported, waits for the driver's word
        go = os.path.join(rundir, f"go_g{g}_r{r}_a{attempt}")
        while not os.path.exists(go):
            time.sleep(0.02)
    out = open(os.path.join(rundir, f"g{g}_r{r}_a{attempt}.jsonl"), "w", buffering=1)

    # The replica group's own store (its torchrun's): rank 0 binds port 0 and tells the others.
    port_file = os.path.join(rundir, f"store_g{g}_a{attempt}")
    if r == 0:
        store = dist.TCPStore("localhost", 0, group_size, is_master=True, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        while not os.path.exists(port_file):
            time.sleep(0.02)
        port = int(open(port_file).read())
        store = dist.TCPStore("localhost", port, group_size, is_master=False)
    if group_size > 1:  # the replica group's own group: its torchrun's WORLD
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("group", store), rank=r, world_size=group_size
        )

    torch.manual_seed(0)
    if group_size == 1:
        net: nn.Module = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    else:  # this rank's shard of a layer: gradients sharded inside the group, as FSDP leaves them
        torch.manual_seed(r)
        net = nn.Sequential(nn.Linear(6, 4))
    params = list(net.parameters())

    class CountingSGD(torch.optim.SGD):
        steps = 0

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            CountingSGD.steps += 1
            return super().step(closure)

    inner = CountingSGD(params, lr=0.05)
    holder = {"healed": 0}

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        holder["healed"] += 1
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        bad = spec.get("bad_heal")
        if bad and holder["healed"] == 1 and attempt > 0:  # the restarted group's first heal
            if bad == "lr":  # a stale schedule: the learning rate of an earlier step
                inner.param_groups[0]["lr"] = 0.04
            else:  # one bit of the first weight's mantissa
                with torch.no_grad():
                    params[0].view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 5)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=4)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"rg{g}",
        store_addr=spec.get("store_host", "localhost"),
        store_port=store.port,
        rank=r,
        world_size=group_size,
        lighthouse_addr=spec["lighthouse"],
        use_async_quorum=not spec.get("sync_quorum", False),
        timeout=timedelta(seconds=4),
        quorum_timeout=timedelta(seconds=spec.get("quorum_timeout", 20)),
        connect_timeout=timedelta(seconds=10),
    )
    # Attempt 0 of every group waits for the others' managers (not a late one): the first quorum
    # then holds every group.
    open(os.path.join(rundir, f"ready_g{g}_r{r}"), "w").close()
    if attempt == 0 and str(g) not in spec.get("late", {}):
        expected = [
            (h, q)
            for h in range(spec["num_groups"])
            if str(h) not in spec.get("late", {})
            for q in range(group_size)
        ]
        deadline = time.time() + 30
        while time.time() < deadline and not all(
            os.path.exists(os.path.join(rundir, f"ready_g{h}_r{q}")) for h, q in expected
        ):
            time.sleep(0.02)
    model = DistributedDataParallel(manager, net) if group_size == 1 else net
    opt = OptimizerWrapper(manager, inner)

    ours = spec["wiring"] == "ours"
    if ours:
        from distscaler import GradScaler
        from distscaler.integrations.torchft import install

        scaler: Any = install(
            manager,
            opt,
            scaler=GradScaler(
                "cpu", init_scale=INIT_SCALE, growth_interval=1000,
                grad_layout="sharded" if group_size > 1 else None, skip_log_interval=1,
                collapse_window=spec.get("collapse_window", 2000),
                param_check_interval=spec.get("param_check_interval", 1000),
            ),
            model=model,
            report_lone_replica=spec.get("report_lone", False),
        )  # fmt: skip
        if spec.get("heal_unfixed"):  # the contrast: a healer's own inf/NaN not counted
            scaler._heal_counts_own = False
    else:  # what a new torchft user writes
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1000)

    commits: list[bool] = []
    real_should_commit = manager.should_commit

    def should_commit(timeout: Any = None) -> bool:
        answer = real_should_commit(timeout)
        commits.append(answer)
        return answer

    manager.should_commit = should_commit  # type: ignore[method-assign]

    local: dict[int, torch.Tensor] = {}
    pre = {"on": False}

    def hook_for(i: int) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if pre["on"] and i == 0:
                grad = grad.clone()
                grad.view(-1)[0] = math.inf
            local[i] = grad.detach().clone()
            return grad

        return hook

    for i, p in enumerate(params):
        p.register_hook(hook_for(i))

    injects = [list(x) + [False] for x in spec.get("inject", []) if x[2] == g and x[3] == r]
    w_true = torch.randn(6, 1, generator=torch.Generator().manual_seed(4321))
    seen_size = None
    join_step = None
    crash_at = spec.get("crash", {}).get(str(g), -1)
    stop_file = os.path.join(rundir, "stop_step")
    t_start = time.time()
    it = 0
    while it < 400 and time.time() - t_start < spec.get("rank_timeout", 50):
        it += 1
        step0 = manager.current_step()
        target = spec["steps"]
        if spec.get("after_join") or spec.get("external_stop"):
            # Until the stop step is written: after_join steps after a group (re)joined, or the
            # driver's.
            target = 10**9
            if os.path.exists(stop_file):
                target = int(open(stop_file).read())
        if step0 >= target:
            break
        if attempt == 0 and step0 == crash_at:
            out.write(json.dumps({"event": "death", "step": step0}) + "\n")
            os._exit(3)
        healed_before = holder["healed"]
        inner_before = CountingSGD.steps
        commits_before = len(commits)
        opt.zero_grad()  # start_quorum (a sync quorum heals here)
        manager.wait_quorum()
        size = manager._pg.size()
        joined = seen_size is not None and size > seen_size
        seen_size = size
        if joined and join_step is None:
            join_step = manager.current_step()
            if spec.get("after_join") and not os.path.exists(stop_file):
                # The first rank to see the join sets the stop step for all: linked into place
                # (fails if it is there), where a replace let a later rank, which saw the join at
                # a later step, move the stop and the groups end apart (2 x 2, 1 in 4 runs).
                tmp = f"{stop_file}.{g}.{r}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(join_step + spec["after_join"]))
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, stop_file)
                os.remove(tmp)
        fire = set()
        for inj in injects:
            where, when = inj[0], str(inj[1])
            if inj[-1]:
                continue
            if when == "join":
                hit = joined
            elif when == "heal":  # a restarted group's first step: the step it heals in
                hit = attempt > 0 and it == 1
            elif when.startswith("join+"):
                hit = join_step is not None and manager.current_step() == join_step + int(when[5:])
            else:
                hit = manager.current_step() == int(when)
            if hit:
                inj[-1] = True
                fire.add(where)
        pre["on"] = "pre" in fire

        gen = torch.Generator().manual_seed(1000 + manager.current_step())
        x = torch.randn(16, 6, generator=gen)
        y = x @ w_true
        scale_before = float(scaler.get_scale())
        local.clear()
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        if group_size > 1:
            pred = pred.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(pred.float(), y)
        scaler.scale(loss).backward()
        pre["on"] = False
        if group_size > 1:  # the cross-replica average of this shard (torchft's HSDP would do it)
            for p in params:
                manager.allreduce(p.grad).wait()
        if "post" in fire:
            with torch.no_grad():
                params[0].grad.view(-1)[0] = math.inf
        if "flip" in fire:  # finite: only the replica check across groups sees it
            with torch.no_grad():
                params[0].grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 3)
        local_flat = torch.cat([local[i].reshape(-1).double() for i in range(len(params))])
        u_true = local_flat / scale_before
        manager.allreduce(u_true).wait()  # measurement only: the true average (healers zeroed)
        norm = None
        if spec.get("clip") and ours:
            norm = float(scaler.clip_grad_norm_(opt, max_norm=math.inf))
        scaler.step(opt)
        committed = commits[-1] if len(commits) > commits_before else None
        scaler.update()
        stepped = CountingSGD.steps > inner_before
        used = torch.cat([p.grad.reshape(-1).double() for p in params])
        ratio = None
        if stepped and math.isfinite(float(u_true.norm())) and float(u_true.norm()) > 0:
            ratio = float(used @ u_true / (u_true @ u_true))
        record = {
            "it": it,
            "step": step0,
            "step_after": manager.current_step(),
            "num_participants": manager.num_participants(),
            "healed": holder["healed"] > healed_before,
            "inject": sorted(fire),
            "scale_before": scale_before,
            "scale_after": float(scaler.get_scale()),
            "commit_calls": len(commits) - commits_before,
            "committed": committed,
            "stepped": stepped,
            "ratio": ratio,
            "norm": norm,
            "true_norm": float(u_true.norm()),
            "params": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in params])],
        }
        if ours:
            lone = scaler.replica_overflow
            record["lone"] = None if lone is None else [lone.step, lone.replica_rank, lone.this_group]
            record["ledger"] = scaler.replica_ledger.as_dict()
            record["found_inf"] = float(scaler.found_inf) if scaler.found_inf is not None else None
            record["skip_causes"] = scaler.skip_totals.causes
            record["collapsed"] = scaler.last_collapse is not None
            div = scaler.replica_divergence
            record["divergence"] = None if div is None else [
                div.step, div.what, list(div.replica_ranks), div.this_group, list(div.parts),
                div.reported,
            ]  # fmt: skip
        out.write(json.dumps(record) + "\n")
        time.sleep(spec.get("sleep", 0.05))
    out.write(json.dumps({"event": "done", "step": manager.current_step()}) + "\n")
    out.flush()
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
