"""Tearing a gloo process group down without hanging (launch/common/distributed.py).

Before torch 2.8, destroying gloo's process group joins gloo's worker threads while holding the
GIL, and a worker freeing the last reference to a finished collective's tensor waits for that GIL:
both wait forever (pytorch/pytorch PR 154976 releases the GIL there). On torch 2.6 the plain
``dist.destroy_process_group()`` in the loop below hung within the first 10 of 100 cycles, twice
in two tries, and once stopped CI with both ranks of a compiled-phase test stuck in
``~ProcessGroupGloo`` (2026-11-24, 2-core CPU); torch 2.13 ran 100 cycles of it. The helper every
job and the test harness use ran 400 cycles on 2.6. Here: 40 cycles on whatever torch is installed
(the compat stage runs it on the floor of the range).
"""

from __future__ import annotations

import subprocess
import sys

from _common import REPO, launch_env

CYCLES = 40

_RACE = """
import datetime, sys, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp
from common.distributed import destroy_process_group

def worker(rank, folder, cycles):
    torch.set_num_threads(1)
    for cycle in range(cycles):
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous{cycle}",
                                rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        for _ in range(20):
            dist.all_reduce(torch.ones(1000) * 2)  # a temporary: gloo may free the last reference
        destroy_process_group()
    if rank == 0:
        print("cycles done:", cycles)

if __name__ == "__main__":
    mp.spawn(worker, args=(tempfile.mkdtemp(), int(sys.argv[1])), nprocs=2)
"""


def test_process_groups_are_torn_down_without_hanging(tmp_path):
    env = launch_env()
    env["PYTHONPATH"] = f"{REPO / 'launch'}:{env['PYTHONPATH']}"
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    job = subprocess.run(
        [sys.executable, str(script), str(CYCLES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # a hang fails here (subprocess.TimeoutExpired) instead of holding the suite
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"cycles done: {CYCLES}" in job.stdout
