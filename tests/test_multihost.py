"""The multi-host testbed (``launch/multihost.py``) and the reference job across its hosts.

Each host is a network namespace on a bridge with its own hostname, ``/etc/hosts``, ``/tmp`` and
``/dev/shm``; no folder the job writes to is shared. The tests check the testbed itself (nothing
left after teardown, also after a failed, a timed-out and a killed command; hosts that cannot see
each other's files; a link cut that breaks TCP and a restore that mends it; a rate limit that
slows a transfer) and then run ``launch/train.py`` under ``torchrun`` on 2 hosts x 2 ranks, with
the static and the c10d rendezvous, against the same job on one host with 4 ranks: the same
metrics, skipped steps, final scale, replica checks and final parameters, bit for bit.

Faults of that job (a 6 s process-group timeout, a checkpoint every 20 steps, no shared
filesystem): a link cut longer than the timeout fails the collective on every rank and torchrun's
restart resumes from each node's own checkpoint; a killed host ends the job with rank 0 naming it,
and a replacement node without the checkpoint, or with a copy of another step, is refused by
name until the checkpoint is copied over. Last, ``launch/bench_hosts.py`` on rate-limited hosts,
small.

They need root and iproute2; elsewhere they skip with the reason ``TestbedUnavailable`` gives (in
CI's multi-host stage they fail: tests/_testbed.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# By module: pytest would try to collect its Test* classes from this module's namespace.
import multihost
import pytest
import yaml
from _testbed import build_testbeds, cannot_run
from multihost import WORKDIR, Host, HostProcess

pytestmark = [pytest.mark.slow, pytest.mark.multihost]

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 150.0
#: What every host of the job needs, copied into its working directory (no shared filesystem).
JOB_FILES = ("distscaler", "launch", "configs")
#: Ports inside the hosts' own network namespaces: no other run can hold them.
MASTER_PORT = 29500
RDZV_PORT = 29400
#: Steps of the job; the inf is written on rank 3 (the second host's) at INF_STEP.
STEPS = 5
INF_STEP = 2


@pytest.fixture
def make_testbed() -> Iterator[Callable[[int], multihost.Testbed]]:
    """Builds build_testbeds (skips where the machine cannot); tears each down at the end and fails if
    anything of it is left."""
    yield from build_testbeds(JOB_TIMEOUT_S)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _run(bed: multihost.Testbed, host: Host, cmd: str | list[str], timeout: float = 30) -> str:
    """``cmd`` on ``host``, waited for; its output. Fails on a non-zero exit."""
    proc = bed.run(host, cmd, timeout=timeout)
    rc = proc.wait()
    assert rc == 0, f"{cmd} on {host.hostname} exited {rc}:\n{proc.output()}"
    return proc.output()


# ------------------------------------------------------------------------------- testbed


def test_teardown_leaves_nothing_after_failed_timed_out_and_running_commands(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    bed = make_testbed(2)
    h0, h1 = bed.hosts
    failed = bed.run(h0, "echo on $(hostname); exit 3")
    assert failed.wait() == 3
    assert "on host0" in failed.output()
    # A command that outlives its timeout is killed with the process it started.
    slow = bed.run(h1, "sleep 300 & echo child $!; wait", timeout=1.0)
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait()
    assert slow.timed_out and slow.returncode is not None
    assert bed.host_pids(h1) == []
    # kill_host: every process of the host, whoever started it.
    for _ in range(2):
        bed.run(h0, "sleep 300")
    deadline = time.monotonic() + 10
    while len(bed.host_pids(h0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bed.kill_host(h0) >= 2
    assert bed.host_pids(h0) == []
    # Left running at teardown: a process tree on each host.
    running = [bed.run(h, "sleep 300 & sleep 300") for h in bed.hosts]
    deadline = time.monotonic() + 10
    # One snapshot of every host, taken until each shows both sleeps (a shell still forking or
    # exec'ing counts apart from them for a moment: two lookups could see different trees).
    seen = [bed.host_pids(h) for h in bed.hosts]
    while not all(len(p) >= 2 for p in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = [bed.host_pids(h) for h in bed.hosts]
    pids = [pid for p in seen for pid in p]
    assert len(pids) >= 4  # guard: the teardown has processes to end
    assert multihost.leftovers(bed.tag) != []  # guard: the check sees a running testbed
    bed.teardown()
    assert bed.leftovers() == []
    assert [pid for pid in pids if _alive(pid)] == []
    assert all(p.returncode is not None for p in running)
    assert bed.run_dir is not None and not bed.run_dir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        bed.run(h0, "true")


def test_unavailable_machines_are_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multihost.os, "geteuid", lambda: 1000)
    with pytest.raises(multihost.TestbedUnavailable, match=r"needs root .* as uid 1000"):
        multihost.Testbed(2).start()
    monkeypatch.setattr(multihost.os, "geteuid", lambda: 0)
    which = multihost.shutil.which
    monkeypatch.setattr(multihost.shutil, "which", lambda t: None if t == "tc" else which(t))
    with pytest.raises(multihost.TestbedUnavailable, match=r"needs tc on PATH") as e:
        multihost.Testbed(2).start()
    assert e.value.reason == "needs tc on PATH (iproute2, util-linux)"
    with pytest.raises(ValueError, match=r"num_hosts must be in \[1, 64\], got: 0"):
        multihost.Testbed(0)


_OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import multihost
bed = multihost.Testbed(2).start()
bed.run(bed.hosts[1], "sleep 300")
print(bed.tag, flush=True)
time.sleep(300)
"""


def test_a_testbed_whose_process_was_killed_is_cleaned_by_clean_stale(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    make_testbed(1)  # skips where no testbed can be built
    # SIGKILL leaves no chance to tear down: what the run built stays until clean_stale.
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(REPO / "launch")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        tag = owner.stdout.readline().strip()
    finally:
        owner.kill()
        owner.wait(timeout=30)
    assert tag, "the owner process printed no tag"
    left = multihost.leftovers(tag)
    assert any(item.startswith("network namespace") for item in left), left
    assert any(item.startswith("link") for item in left), left
    removed = multihost.clean_stale(tag)
    assert sorted(removed) == sorted(left)
    assert multihost.leftovers(tag) == []


def test_the_command_line_runs_on_every_host_and_tears_down_on_sigterm(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    make_testbed(1)  # skips where no testbed can be built
    cli = [sys.executable, str(REPO / "launch" / "multihost.py"), "--hosts", "2"]
    done = subprocess.run(
        [*cli, "--", "sh", "-c", "echo on $(hostname) {addr} of {num_hosts}; exit {node_rank}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr  # host1's exit code
    assert "on host0 10.213.0.1 of 2" in done.stdout and "on host1 10.213.0.2 of 2" in done.stdout
    assert done.stdout.rstrip().endswith("testbed torn down; nothing left")
    # A SIGTERM (a scheduler's, timeout(1)'s) unwinds through the teardown.
    running = subprocess.Popen([*cli, "--", "sleep", "300"], stdout=subprocess.PIPE, text=True)
    try:
        assert running.stdout is not None
        tag = running.stdout.readline().split()[1].rstrip(":")
        assert multihost.leftovers(tag) != []
        running.terminate()
        assert running.wait(timeout=60) == 143
    finally:
        running.kill()
    assert multihost.leftovers(tag) == []


def test_hosts_have_own_hostnames_and_cannot_see_each_others_files(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    bed = make_testbed(2)
    h0, h1 = bed.hosts
    _run(
        bed,
        h0,
        "echo secret > /tmp/only-host0 && echo shm > /dev/shm/only-host0 && echo work > only-host0",
    )
    run_dir = str(bed.run_dir)
    show = (
        "hostname; pwd; ls -A /tmp /dev/shm; "
        f"test -e {run_dir} && ls -A {run_dir} || echo no-run-dir; getent hosts host0 host1"
    )
    out0, out1 = (_run(bed, h, show) for h in bed.hosts)
    assert out0.splitlines()[:2] == ["host0", WORKDIR]
    assert out1.splitlines()[:2] == ["host1", WORKDIR]
    assert out0.count("only-host0") == 2  # /tmp, /dev/shm (the working dir is under /tmp)
    assert "only-host0" not in out1
    assert (bed.host_path(h0, WORKDIR) / "only-host0").read_text() == "work\n"
    assert not (bed.host_path(h1, WORKDIR) / "only-host0").exists()
    # Neither host sees the testbed's folder, where the other's disk lies.
    assert "host1" not in out0.split("no-run-dir")[0].splitlines()[2:]
    for out in (out0, out1):
        assert f"{h0.addr}" in out and f"{h1.addr}" in out  # /etc/hosts names every host
    # A copy reaches one host only.
    bed.put(h1, REPO / "configs" / "smoke.yaml", "cfg/smoke.yaml")
    assert "cfg" in _run(bed, h1, "ls") and "cfg" not in _run(bed, h0, "ls")


_SERVER = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", 5000))
s.settimeout(1.0)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    try:
        c, _ = s.accept()
    except TimeoutError:
        continue
    with c:
        c.sendall(b"x" * int(sys.argv[2]))
"""

_CLIENT = """
import socket, sys, time
t = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], 5000), timeout=2.0) as c:
        c.settimeout(10.0)
        n = 0
        while chunk := c.recv(65536):
            n += len(chunk)
    print(f"ok {n} {time.monotonic() - t:.3f}")
except OSError as e:
    print(f"failed {type(e).__name__}")
"""


def _fetch(bed: multihost.Testbed, client: Host, server: Host) -> tuple[str, int, float]:
    """One connection from ``client`` to the server on ``server``: ("ok", bytes, seconds) or
    ("failed", 0, 0)."""
    words = _run(bed, client, [sys.executable, "-c", _CLIENT, server.addr]).split()
    return (words[0], int(words[1]), float(words[2])) if words[0] == "ok" else (words[0], 0, 0.0)


def test_link_cut_breaks_tcp_until_restored_and_rate_limit_slows_it(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    bed = make_testbed(2)
    h0, h1 = bed.hosts
    size = 200_000
    server = bed.run(h0, [sys.executable, "-c", _SERVER, "60", str(size)], timeout=70)
    deadline = time.monotonic() + 10
    while _fetch(bed, h1, h0)[0] != "ok":  # the server is listening
        assert time.monotonic() < deadline and server.poll() is None, server.output()
    assert _fetch(bed, h1, h0)[:2] == ("ok", size)
    restore = bed.cut_link(h1, 4.0)
    assert _fetch(bed, h1, h0)[0] == "failed"
    restore.join(timeout=10)
    assert not restore.is_alive()
    assert _fetch(bed, h1, h0)[:2] == ("ok", size)
    # 1 Mbit/s: 200 kB take at least about 1.5 s (the bucket's burst goes at once).
    _, _, fast = _fetch(bed, h1, h0)
    bed.rate_limit(h1, "1mbit", burst="16kbit", latency="2s")
    state, received, slow = _fetch(bed, h1, h0)
    assert (state, received) == ("ok", size)
    assert slow > 1.4 > fast, (slow, fast)
    bed.clear_rate_limit(h1)
    assert _fetch(bed, h1, h0)[2] < 1.4
    server.kill()


# ------------------------------------------------------------------------- reference job


def _job_config(parallelism: str = "ddp") -> str:
    """configs/smoke.yaml on the CPU, logging every step, an inf on rank 3 at INF_STEP."""
    cfg = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    cfg.update(device="cpu", log_interval=1, inject_inf={"steps": [INF_STEP], "rank": 3})
    cfg.update(parallelism=parallelism, hsdp_shard_size=2)
    return yaml.safe_dump(cfg)


def _prepare(bed: multihost.Testbed, tmp_path: Path, parallelism: str = "ddp") -> None:
    (tmp_path / "job.yaml").write_text(_job_config(parallelism))
    corpus = tmp_path / "corpus.txt"  # about 100 KB of real text: the source of argparse
    corpus.write_bytes(Path(argparse.__file__).read_bytes())
    for host in bed.hosts:
        for path in JOB_FILES:
            bed.put(host, REPO / path)
        bed.put(host, tmp_path / "job.yaml")
        bed.put(host, corpus)


def _torchrun(*launcher_args: str) -> list[str]:
    train = ["launch/train.py", "--config", "job.yaml", "--data", "corpus.txt"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        *train,
        "--steps",
        str(STEPS),
        "--out",
        "runs/job",
    ]


def _run_job(bed: multihost.Testbed, cmds: list[list[str]]) -> dict[str, Any]:
    """``cmds[i]`` on host i, concurrently; host 0's metrics and summary, read from its disk."""
    env = {"PYTHONPATH": WORKDIR, "OMP_NUM_THREADS": "1"}
    procs: list[HostProcess] = [bed.run(h, cmd, env=env) for h, cmd in zip(bed.hosts, cmds)]
    failed = []
    for proc in procs:
        try:
            rc = proc.wait()
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            tail = "\n".join(proc.output().splitlines()[-30:])
            failed.append(
                f"{proc.host.hostname} exited {rc} (timed out: {proc.timed_out}):\n{tail}"
            )
            for other in procs:
                other.kill()  # the others would wait for it at the next collective
    assert not failed, "\n\n".join(failed)
    out = bed.host_path(bed.hosts[0], f"{WORKDIR}/runs/job")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    log = procs[0].output()
    return {"records": records, "summary": summary, "log": log}


#: What two runs of the same job must agree on (``tokens_per_s`` and wall times differ).
SAME = (
    "step",
    "loss",
    "scale",
    "skipped",
    "grad_norm",
    "lr",
    "eval_loss",
    "overflow",
    "replica_mismatch",
)
SAME_SUMMARY = (
    "steps",
    "skipped_steps",
    "num_growths",
    "num_backoffs",
    "final_scale",
    "first_loss",
    "last_loss",
    "eval_loss",
    "world_size",
    "ranks_consistent",
    "skipped_per_rank",
    "replica_checks",
    "replica_mismatches",
    "params_digests",
)


def _one_host(tmp_path: Path, parallelism: str) -> dict[str, Any]:
    """The job on one host, 4 ranks (one torchrun, standalone rendezvous), with the guards
    against a vacuous comparison."""
    bed = multihost.Testbed(1, command_timeout_s=JOB_TIMEOUT_S)
    try:
        bed.start()
    except multihost.TestbedUnavailable as e:
        cannot_run(f"no multi-host testbed here: {e.reason}")
    with bed:
        _prepare(bed, tmp_path, parallelism)
        run = _run_job(bed, [_torchrun("--standalone", "--nproc-per-node", "4")])
    assert bed.leftovers() == []
    summary = run["summary"]
    # Guards against a vacuous comparison: the inf on rank 3 was seen and skipped, the replicas
    # were compared at every update, and the run is on 4 ranks.
    assert summary["skipped_steps"] == 1 and summary["world_size"] == 4
    assert [r["step"] for r in run["records"] if r["skipped"]] == [INF_STEP]
    assert run["records"][INF_STEP - 1]["overflow"][0]["rank"] == 3
    assert summary["replica_checks"] == STEPS
    assert len(summary["params_digests"]) == 1 and len(summary["params_digests"][0]) == 64
    assert summary["parallelism"] == parallelism and summary["hosts"] == ["host0"] * 4
    return run


@pytest.fixture(scope="module")
def one_host_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The DDP job on one host, 4 ranks."""
    return _one_host(tmp_path_factory.mktemp("one_host"), "ddp")


@pytest.fixture(scope="module")
def one_host_hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The HSDP job (mesh replicate=2 x shard=2) on one host, 4 ranks."""
    return _one_host(tmp_path_factory.mktemp("one_host_hsdp"), "hsdp")


def _assert_same_run(run: dict[str, Any], reference: dict[str, Any]) -> None:
    def pick(record: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
        return {k: record.get(k) for k in keys}

    assert [pick(r, SAME) for r in run["records"]] == [pick(r, SAME) for r in reference["records"]]
    assert pick(run["summary"], SAME_SUMMARY) == pick(reference["summary"], SAME_SUMMARY)


def test_two_hosts_static_rendezvous_match_one_host(
    make_testbed: Callable[[int], multihost.Testbed], tmp_path: Path, one_host_run: dict[str, Any]
) -> None:
    bed = make_testbed(2)
    _prepare(bed, tmp_path)
    host0 = bed.hosts[0].addr
    cmds = [
        _torchrun(
            "--nnodes",
            "2",
            "--node-rank",
            str(h.index),
            "--nproc-per-node",
            "2",
            "--master-addr",
            host0,
            "--master-port",
            str(MASTER_PORT),
        )
        for h in bed.hosts
    ]
    run = _run_job(bed, cmds)
    _assert_same_run(run, one_host_run)
    # The inf came from the other host: rank 3 is host1's second rank.
    assert "inf in `tok_emb.weight` on rank 3" in run["log"]
    assert "agreed on all 4 rank(s)" in run["log"]


def test_two_hosts_c10d_rendezvous_by_hostname_match_one_host(
    make_testbed: Callable[[int], multihost.Testbed], tmp_path: Path, one_host_run: dict[str, Any]
) -> None:
    bed = make_testbed(2)
    _prepare(bed, tmp_path)
    launcher = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"host0:{RDZV_PORT}",
        "--rdzv-id",
        "multihost",
    )
    run = _run_job(bed, [_torchrun(*launcher) for _ in bed.hosts])
    _assert_same_run(run, one_host_run)


def _static(bed: multihost.Testbed, host: Host) -> list[str]:
    """torchrun of the job on ``host``: static rendezvous at host 0, 2 ranks per host (host i
    runs ranks 2i and 2i+1)."""
    return _torchrun(
        "--nnodes",
        str(len(bed.hosts)),
        "--node-rank",
        str(host.index),
        "--nproc-per-node",
        "2",
        "--master-addr",
        bed.hosts[0].addr,
        "--master-port",
        str(MASTER_PORT),
    )


def test_hsdp_replicates_across_hosts_and_shards_inside_each_match_one_host(
    make_testbed: Callable[[int], multihost.Testbed],
    tmp_path: Path,
    one_host_hsdp_run: dict[str, Any],
) -> None:
    # The mesh (replicate=2, shard=2) is laid over the ranks row by row: its rows, the shard
    # groups, are ranks [0, 1] and [2, 3], which torchrun puts on one node each; the replicate
    # dimension (ranks 0 and 2, 1 and 3: the gradients' all-reduce between the replicas) crosses
    # the hosts' link.
    bed = make_testbed(2)
    _prepare(bed, tmp_path, "hsdp")
    run = _run_job(bed, [_static(bed, h) for h in bed.hosts])
    summary = run["summary"]
    layout = "HSDP, mesh (replicate=2, shard=2), shard groups [[0, 1], [2, 3]]"
    assert summary["layout"] == one_host_hsdp_run["summary"]["layout"] == layout
    assert summary["hosts"] == ["host0", "host0", "host1", "host1"]
    _assert_same_run(run, one_host_hsdp_run)
    # The inf was written into rank 3's own shard, on the other host: every rank skipped it.
    assert run["records"][INF_STEP - 1]["overflow"][0]["rank"] == 3
    assert summary["skipped_per_rank"] == [1, 1, 1, 1]
    assert "agreed on all 4 rank(s)" in run["log"]


def test_c10d_rendezvous_needs_each_host_to_resolve_its_own_hostname(
    make_testbed: Callable[[int], multihost.Testbed],
) -> None:
    # Without /etc/hosts entries torchrun's c10d backend fails at once on every host: it asks
    # whether the endpoint is this machine (`_matches_machine_hostname`), which resolves the
    # machine's own hostname (socket.gaierror -3). The endpoint is an address here, so that the
    # failure is not the endpoint's own name.
    bed = make_testbed(2)
    assert bed.run_dir is not None
    (bed.run_dir / "hosts").write_text("127.0.0.1 localhost\n")
    code = textwrap.dedent(f"""
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        print(_matches_machine_hostname("{bed.hosts[0].addr}"))
    """)
    proc = bed.run(bed.hosts[1], [sys.executable, "-c", code], timeout=60)
    assert proc.wait() != 0
    assert "Temporary failure in name resolution" in proc.output()


# ------------------------------------------------------------------------------------ faults

#: The fault jobs: long enough to be hit mid-run, a checkpoint every CKPT_EVERY steps, and a
#: process-group timeout of TIMEOUT_S seconds (the collectives, and the start of a restart).
FAULT_STEPS = 200
CKPT_EVERY = 20
TIMEOUT_S = 6
#: The fault comes once host 0's metrics.jsonl has this many lines.
FAULT_AT = 50


def _fault_config() -> str:
    cfg = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    cfg.update(
        device="cpu",
        log_interval=CKPT_EVERY,
        ckpt_interval=CKPT_EVERY,
        dist_timeout_s=TIMEOUT_S,
        decay_steps=FAULT_STEPS,
    )
    return yaml.safe_dump(cfg)


def _fault_torchrun(
    bed: multihost.Testbed, host: Host, nproc: int, *extra: str, restarts: int = 1
) -> list[str]:
    """torchrun of the fault job on ``host`` (static rendezvous at host 0), ``restarts``
    restarts allowed."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(bed.hosts)),
        "--node-rank",
        str(host.index),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        bed.hosts[0].addr,
        "--master-port",
        str(MASTER_PORT),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        "launch/train.py",
        "--config",
        "fault.yaml",
        "--data",
        "corpus.txt",
        "--steps",
        str(FAULT_STEPS),
        "--out",
        "runs/job",
        *extra,
    ]


def _start_fault_job(
    bed: multihost.Testbed, tmp_path: Path, nproc: int, *extra: str, restarts: int = 1
) -> list[HostProcess]:
    (tmp_path / "fault.yaml").write_text(_fault_config())
    env = {"PYTHONPATH": WORKDIR, "OMP_NUM_THREADS": "1"}
    for host in bed.hosts:
        bed.put(host, tmp_path / "fault.yaml")
    cmds = [_fault_torchrun(bed, h, nproc, *extra, restarts=restarts) for h in bed.hosts]
    return [bed.run(h, cmd, env=env) for h, cmd in zip(bed.hosts, cmds)]


def _when_step(bed: multihost.Testbed, procs: list[HostProcess], step: int) -> int:
    """Waits until host 0's metrics.jsonl holds ``step`` lines; returns how many it holds."""
    metrics = bed.host_path(bed.hosts[0], f"{WORKDIR}/runs/job/metrics.jsonl")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if lines >= step:
            return lines
        assert all(p.poll() is None for p in procs), "\n".join(p.output()[-3000:] for p in procs)
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {JOB_TIMEOUT_S} s")


def _wait_all(procs: list[HostProcess]) -> list[int | None]:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait())
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def _ckpt(bed: multihost.Testbed, host: Host) -> dict[str, Any]:
    import torch

    path = bed.host_path(host, f"{WORKDIR}/runs/job/ckpt.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_link_cut_past_the_timeout_fails_the_collective_and_the_restart_resumes_on_each_node(
    make_testbed: Callable[[int], multihost.Testbed], tmp_path: Path
) -> None:
    # host1 is cut off for longer than the process group's timeout: every rank's collective
    # fails within it, torchrun restarts the workers once the link is back, and each node's
    # ranks resume from the checkpoint its own first rank wrote (no shared filesystem).
    bed = make_testbed(2)
    _prepare(bed, tmp_path)
    procs = _start_fault_job(bed, tmp_path, 2, "--resume", "auto")
    at = _when_step(bed, procs, FAULT_AT)
    t_cut = time.monotonic()
    bed.cut_link(bed.hosts[1], TIMEOUT_S + 2)
    codes = _wait_all(procs)
    took = time.monotonic() - t_cut
    logs = [p.output() for p in procs]
    assert codes == [0, 0], "\n\n".join(log[-4000:] for log in logs)
    # The collective failed within the timeout, and the message says so.
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms for recv operation" in "".join(logs)
    out = bed.host_path(bed.hosts[0], f"{WORKDIR}/runs/job")
    summary = json.loads((out / "summary.json").read_text())
    resumed = summary["resumed_from"]
    assert resumed is not None and resumed["restart"] == 1, summary
    # The last checkpoint before the cut (at least FAULT_AT steps were done when it came).
    assert resumed["step"] % CKPT_EVERY == 0 and resumed["step"] >= at // CKPT_EVERY * CKPT_EVERY
    assert f"resumed from runs/job/ckpt.pt at step {resumed['step']}" in logs[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, FAULT_STEPS + 1))
    # The resumed scale is the one the uninterrupted steps went on with.
    assert resumed["scale"] == records[resumed["step"]]["scale"]
    assert summary["ranks_consistent"] is True and summary["world_size"] == 4
    # Each node holds its own final checkpoint; the two agree on the scaler and the model.
    ckpts = [_ckpt(bed, h) for h in bed.hosts]
    assert [c["step"] for c in ckpts] == [FAULT_STEPS, FAULT_STEPS]
    assert ckpts[0]["scaler"] == ckpts[1]["scaler"]
    assert all(ckpts[0]["model"][k].equal(ckpts[1]["model"][k]) for k in ckpts[0]["model"])
    assert took < 90, took


def test_a_killed_host_ends_the_job_naming_it_and_a_fresh_node_needs_the_checkpoint_copied(
    make_testbed: Callable[[int], multihost.Testbed], tmp_path: Path
) -> None:
    bed = make_testbed(2)
    h0, h1 = bed.hosts
    _prepare(bed, tmp_path)
    procs = _start_fault_job(bed, tmp_path, 1, "--resume", "auto")
    at = _when_step(bed, procs, FAULT_AT)
    t_kill = time.monotonic()
    assert bed.kill_host(h1) >= 2  # guard: its torchrun and its rank were running
    codes = _wait_all(procs)
    took = time.monotonic() - t_kill
    log = procs[0].output()
    # host0's rank loses its peer, torchrun restarts it, and the restart waits for rank 1 for
    # the process group's timeout, then names the host it last ran on. No restart is left.
    assert codes[0] == 1 and codes[1] == -9, log[-4000:]
    assert (
        f"1 of 2 rank(s) did not join the process group within {TIMEOUT_S} s (dist_timeout_s): "
        "rank 1 (last on host1); is host1 up and reachable from host0?"
    ) in log, log[-4000:]
    assert took < 60, took
    last = at // CKPT_EVERY * CKPT_EVERY
    assert last >= CKPT_EVERY and _ckpt(bed, h1)["step"] >= last  # host1 kept its own copy
    # host1 replaced by a fresh machine (its disk without the run): a resume is refused on every
    # rank, naming the node without the checkpoint and the one with it.
    shutil.rmtree(bed.host_path(h1, f"{WORKDIR}/runs"))
    procs = _start_fault_job(bed, tmp_path, 1, "--resume", restarts=0)
    assert _wait_all(procs) == [1, 1]
    refused = (
        "--resume: no checkpoint runs/job/ckpt.pt on host1 (ranks [1]); it is on host0 "
        "(ranks [0]). Each rank reads the one on its own node: every node's first rank writes a "
        "copy at each checkpoint; copy runs/job/ckpt.pt from a node that has it"
    )
    assert all(refused in p.output() for p in procs), procs[1].output()[-3000:]
    # A stale copy on host1 (another step): refused after loading, each rank's host and step.
    import torch

    step = _ckpt(bed, h0)["step"]
    saved = bed.host_path(h0, f"{WORKDIR}/runs/job/ckpt.pt")
    copy = bed.host_path(h1, f"{WORKDIR}/runs/job/ckpt.pt")
    torch.save({**_ckpt(bed, h0), "step": step - CKPT_EVERY}, copy)
    procs = _start_fault_job(bed, tmp_path, 1, "--resume", restarts=0)
    assert _wait_all(procs) == [1, 1]
    stale = (
        "--resume: the nodes' copies of runs/job/ckpt.pt are of different steps (rank 0 on "
        f"host0: step {step}, rank 1 on host1: step {step - CKPT_EVERY})"
    )
    assert all(stale in p.output() for p in procs), procs[0].output()[-3000:]
    # The checkpoint copied over: the job resumes on both nodes and finishes.
    shutil.copy2(saved, copy)
    procs = _start_fault_job(bed, tmp_path, 1, "--resume", restarts=0)
    assert _wait_all(procs) == [0, 0], procs[1].output()[-3000:]
    assert f"resumed from runs/job/ckpt.pt at step {step}" in procs[0].output()
    assert [_ckpt(bed, h)["step"] for h in bed.hosts] == [FAULT_STEPS, FAULT_STEPS]


def test_bench_hosts_times_every_contender_across_rate_limited_hosts(
    make_testbed: Callable[[int], multihost.Testbed], tmp_path: Path
) -> None:
    import bench_hosts

    make_testbed(1)  # skips where no testbed can be built
    argv = ["--rates", "10mbit", "--layouts", "ddp", "--params", "20000", "--tensors", "4"]
    argv += ["--rounds", "2", "--warmup", "0", "--contenders", "distscaler", "torch"]
    assert bench_hosts.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (record,) = results["records"]
    assert (record["layout"], record["rate"], record["world_size"]) == ("ddp", "10mbit", 2)
    assert set(record["phase_ms"]) == {"distscaler", "torch"}
    # distscaler's one collective per step; torch's scaler has none under DDP.
    assert record["counts"]["distscaler"]["collectives"] == 1
    assert record["counts"]["torch"]["collectives"] == 0
    table = (tmp_path / "results.md").read_text()
    assert "| ddp | 10mbit | distscaler |" in table and "| ddp | 10mbit | torch |" in table
