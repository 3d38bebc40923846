"""launch/layout_costs.py runs under torchrun and measures one collective per step in each layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("layout_costs")]


def test_layout_costs_counts_one_collective_for_distscaler_in_every_layout(tmp_path):
    out = tmp_path / "costs.json"
    layouts = ["ddp", "fsdp1", "fsdp2", "tp", "pp"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "launch/layout_costs.py", "--parallelism", *layouts, "--repeats", "1", "--warmup", "0",
        "--n-layer", "2", "--d-model", "32", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["parallelism"]: r for r in json.loads(out.read_text())}
    assert sorted(records) == sorted(layouts)
    for name, r in records.items():
        for kind in ("fused", "foreach"):
            assert r["collectives"][f"distscaler/{kind}"] == {"allreduce_": 1}, name
        assert r["median_ms"]["distscaler/fused"] > 0
    # torch's recipe: ShardedGradScaler's found_inf all-reduce plus the clip's norm all-reduce;
    # a pipeline's torch GradScaler does not agree at all (only its norm is all-reduced).
    for name in ("fsdp1", "fsdp2", "tp"):
        assert sum(records[name]["collectives"]["torch/foreach"].values()) >= 2, name
    assert records["pp"]["collectives"]["torch/foreach"] == {"allreduce_": 1}
    assert "| layout |" in proc.stdout
