"""The agreement matrix on NCCL, one process per GPU, plus FSDP2 and host-sync checks on GPUs.

Skipped without two or more CUDA GPUs (marker ``multigpu``, see conftest.py). One spawn over every
visible GPU (world size = ``torch.cuda.device_count()``) runs tests/_nccl.py's
``everything_on_gpus``: the scenarios of tests/_scenarios.py on ``device="cuda"`` and two that need
GPUs. The gloo tests' assertions are imported from tests/test_distributed.py, so pytest collects
them here a second time, where they read this module's ``runs`` fixture: the very same checks,
on NCCL. Run on a multi-GPU machine (or with docker/Dockerfile) by ``pytest -m "cuda or multigpu"``.
"""

from __future__ import annotations

import math

import _nccl
import pytest
import torch

# Re-collected here with this module's `runs` (NCCL); the assertions live in one place.
from test_distributed import (  # noqa: F401
    test_clip_grad_norm_matches_torch_on_full_gradients,
    test_ddp_end_to_end,
    test_inf_on_one_rank_skips_step_on_every_rank,
    test_one_all_reduce_per_step_and_host_reads_only_when_not_fused,
    test_rank_without_gradients_joins_the_collective,
)

pytestmark = [pytest.mark.multigpu, pytest.mark.xdist_group("nccl")]

FSDP2_FAULT_STEP = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    world_size = torch.cuda.device_count()
    results = _nccl.spawn_per_gpu(
        _nccl.everything_on_gpus, world_size, tmp_path_factory.mktemp("nccl")
    )
    return world_size, results


@pytest.mark.parametrize("clip", ["noclip", "clip"])
@pytest.mark.parametrize("opt_kind", ["fused", "foreach"])
def test_fsdp2_inf_in_one_shard_skips_step_on_every_rank(runs, opt_kind, clip):
    world_size, results = runs
    per_rank = [r["fsdp2"][f"{opt_kind}-{clip}"] for r in results]
    expected = [step == FSDP2_FAULT_STEP for step in range(5)]
    # Guard: only the last rank's shard held the inf.
    assert [run["local_nonfinite"] for run in per_rank] == [[False] * 5] * (world_size - 1) + [
        expected
    ]
    for run in per_rank:
        assert run["skipped"] == expected
        assert run["unchanged"] == expected  # the skipped step left every shard as it was
        assert run["all_reduces"] == [1] * 5
        assert run["scales"] == per_rank[0]["scales"]
        assert run["norms"] == per_rank[0]["norms"]
    assert per_rank[0]["scales"][FSDP2_FAULT_STEP] < per_rank[0]["scales"][FSDP2_FAULT_STEP - 1]
    if clip == "clip":
        norms, refs = per_rank[0]["norms"], per_rank[0]["ref_norms"]
        assert not math.isfinite(norms[FSDP2_FAULT_STEP])
        finite = [(n, r) for n, r in zip(norms, refs) if math.isfinite(r)]
        assert len(finite) == 4
        for norm, ref in finite:
            assert norm == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("clip", ["noclip", "clip"])
def test_fused_step_and_update_never_sync_on_nccl(runs, clip):
    world_size, results = runs
    for r in results:
        run = r["sync_free"][clip]
        assert run["guard_syncs"] >= 1, "sync debug mode reported nothing: the check is blind"
        assert run["syncs"] == [0] * 4
        assert run["skipped"] == [step == 2 for step in range(4)]


@pytest.mark.parametrize("opt_kind", ["fused", "foreach"])
def test_fsdp1_cpu_offload_agrees_with_one_collective_and_no_per_gradient_host_reads(
    runs, opt_kind
):
    world_size, results = runs
    per_rank = [r["fsdp1_cpu_offload"][opt_kind] for r in results]
    expected = [step == 2 for step in range(4)]
    for run in per_rank:
        assert run["grad_devices"] == [["cpu"]] * 4  # guard: the gradients really were offloaded
        assert run["skipped"] == expected
        assert run["scales"] == per_rank[0]["scales"]
        assert run["norms"] == per_rank[0]["norms"]
        assert run["all_reduces"] == [1] * 4
        # 0 with a fused optimizer, the agreed flag's 1 otherwise: not one per gradient.
        assert run["host_reads"][1:] == [0 if opt_kind == "fused" else 1] * 3
        for norm, ref, skipped in zip(run["norms"], run["ref_norms"], expected):
            if not skipped:
                assert norm == pytest.approx(ref, rel=1e-5)
