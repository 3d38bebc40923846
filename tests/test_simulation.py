"""One all_reduce per scaler step at 8 to 4096 ranks, simulated with the fake backend, of the size
docs/facts.yml gives 2 real ranks with the same settings (fused AdamW, clipping, replica_check=False).

launch/benchkit/fake_world.py runs in its own process (it initialises the default process group): FSDP2 on a
1-D mesh and HSDP on a (world / 8) x 8 mesh, a real forward/backward of a tiny model sharded over
the whole fake world, then the scaler step under CommDebugMode and a byte-counting dispatch mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _torch_gaps import skip_if_gap_in

import distscaler

# One subprocess for the module: keep its tests on one xdist worker.
pytestmark = pytest.mark.xdist_group("fake_world")

HERE = Path(__file__).parent
WORLD_SIZES = (8, 64, 1024, 4096)
yaml = pytest.importorskip("yaml", reason="PyYAML (the `train` extra): docs/facts.yml")
FACTS = yaml.safe_load((HERE.parent / "docs" / "facts.yml").read_text(encoding="utf-8"))[
    "step_collective"
]["layouts"]


@pytest.fixture(scope="module")
def records() -> dict[tuple[str, int], dict]:
    repo = Path(distscaler.__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "launch" / "benchkit" / "fake_world.py"),
            "--world-sizes",
            *map(str, WORLD_SIZES),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:  # every layout here is FSDP2's, which an old torch's CPU may fail
        skip_if_gap_in(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(r["layout"], r["world_size"]): r for r in json.loads(proc.stdout)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["fsdp2", "hsdp"])
def test_one_all_reduce_of_two_float32_per_step_at_any_world_size(records, layout, world_size):
    record = records[(layout, world_size)]
    # Guard: the model really is sharded over the whole simulated world, in the intended mesh.
    expected_mesh = (
        [world_size]
        if layout == "fsdp2"
        else [world_size // min(8, world_size // 2), min(8, world_size // 2)]
    )
    assert record["mesh"] == expected_mesh
    assert record["local_grad_elements"] > 0
    ours = record["ours"]
    assert ours["counts"] == {"c10d.allreduce_": 1}
    # [non-finite flag, sum of squares]: fused AdamW, clipping, replica_check=False, as the
    # 2-rank run of tests/test_docs_facts.py measures it (docs/facts.yml, which the pages state).
    values, op, dtype = FACTS["DDP (2 ranks)"]["replica_check=False, clipping"]["fused"]
    assert op == "SUM"
    assert ours["calls"] == [["c10d.allreduce_", {"float32": 4, "float64": 8}[dtype] * values]]
    assert record["norm_finite"]
    # Contrast: torch's ShardedGradScaler + clip on the same gradients costs three all-reduces.
    assert record["torch"]["total"] >= 2
