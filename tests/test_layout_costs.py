"""launch/layout_costs.py runs under torchrun and measures one collective per step in each layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _torch_gaps import gap_in

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ["ddp", "fsdp1", "fsdp2", "tp", "pp"]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("layout_costs")]


def _measure(layouts: list[str], out: Path) -> tuple[dict[str, dict], str]:
    """One torchrun job over ``layouts``: records by layout (none when it failed) and its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "launch/layout_costs.py", "--parallelism", *layouts, "--repeats", "1", "--warmup", "0",
        "--n-layer", "2", "--d-model", "32", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    if proc.returncode != 0:
        return {}, output
    return {r["parallelism"]: r for r in json.loads(out.read_text())}, proc.stdout


def test_layout_costs_counts_one_collective_for_distscaler_in_every_layout(tmp_path):
    records, output = _measure(LAYOUTS, tmp_path / "costs.json")
    gaps: dict[str, str] = {}
    if not records:
        # A layout torch itself cannot run here (FSDP2 on an old torch's CPU, tests/_torch_gaps.py)
        # takes the job down with it: then each layout alone, the ones torch fails on skipped.
        assert gap_in(output) is not None, output
        outputs = []
        for layout in LAYOUTS:
            found, alone = _measure([layout], tmp_path / f"{layout}.json")
            reason = None if found else gap_in(alone)
            assert found or reason is not None, alone
            if reason is not None:
                gaps[layout] = reason
            records.update(found)
            outputs.append(alone)
        output = "\n".join(outputs)
    assert sorted([*records, *gaps]) == sorted(LAYOUTS)
    for name, r in records.items():
        for kind in ("fused", "foreach"):
            assert r["collectives"][f"distscaler/{kind}"] == {"allreduce_": 1}, name
        assert r["median_ms"]["distscaler/fused"] > 0
    # torch's recipe: ShardedGradScaler's found_inf all-reduce plus the clip's norm all-reduce;
    # a pipeline's torch GradScaler does not agree at all (only its norm is all-reduced).
    for name in ("fsdp1", "fsdp2", "tp"):
        if name in records:
            assert sum(records[name]["collectives"]["torch/foreach"].values()) >= 2, name
    if "pp" in records:
        assert records["pp"]["collectives"]["torch/foreach"] == {"allreduce_": 1}
    assert "| layout |" in output
    if gaps:
        pytest.skip(
            f"{', '.join(sorted(records))} checked; "
            + "; ".join(f"{layout}: {reason}" for layout, reason in gaps.items())
        )
