"""launch/benchkit/distributed.py: the world-size / layout sweep, one torchrun job per world size.

One sweep (world sizes 1 and 2, DDP and FSDP2, fused AdamW with clipping) on gloo, shared by every
test of this module.
"""

from __future__ import annotations

import pytest
from _torch_gaps import GapMap, gap_in
from benchkit.distributed import run_worlds

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_distributed")]

WORLD_SIZES = (1, 2)
LAYOUTS = ("ddp", "fsdp2")
PARAMS = 200_000
TENSORS = 8


def _sweep(layouts: list[str]) -> list[dict]:
    return run_worlds(
        list(WORLD_SIZES),
        layouts,
        params=PARAMS,
        tensors=TENSORS,
        optimizer="fused",
        clip=True,
        rounds=3,
        warmup=1,
        timeout=300,
    )


@pytest.fixture(scope="module")
def records() -> GapMap:
    """(world size, layout) -> record; a layout torch itself cannot run here (FSDP2 on an old
    torch's CPU, tests/_torch_gaps.py) is swept alone and skips the tests that read it."""
    gaps: dict[tuple[int, str], str] = {}
    try:
        found = _sweep(list(LAYOUTS))
    except RuntimeError as error:
        if gap_in(str(error)) is None:
            raise
        found = []
        for layout in LAYOUTS:
            try:
                found += _sweep([layout])
            except RuntimeError as layout_error:
                reason = gap_in(str(layout_error))
                if reason is None:
                    raise
                gaps.update({(w, layout): reason for w in WORLD_SIZES})
    return GapMap({(r["world_size"], r["layout"]): r for r in found}, gaps)


def test_one_record_per_world_size_and_layout(records):
    assert sorted([*records, *records.gaps]) == [
        (w, layout) for w in WORLD_SIZES for layout in LAYOUTS
    ]
    for r in records.values():
        assert r["params"] == pytest.approx(PARAMS, rel=0.02)
        assert (r["tensors"], r["dtype"], r["optimizer"], r["clip"], r["device"]) == (
            TENSORS,
            "float32",
            "fused",
            True,
            "cpu",
        )
        assert r["optimizer_ms"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_distscaler_agrees_with_one_collective_and_no_host_read(records, world_size, layout):
    r = records[(world_size, layout)]
    assert "distscaler" not in r["errors"]
    # One all_reduce per step across the ranks; none in a world of one rank.
    assert r["counts"]["distscaler"]["collectives"] == (1 if world_size > 1 else 0)
    # Fused AdamW reads found_inf on the device; the CPU's clipped step reads this rank's norm
    # (its float32 norms are taken again in float64 where it is not finite) and the agreed flag
    # (no sync on a CPU: distscaler._plan.host_read_is_free), a GPU's none. The replica check (on
    # by default, every 32nd update with torch's kernels: none in these rounds) reads its slots
    # once more where gradients are replicated (ddp at more than one rank; fsdp2 on a 1-D mesh
    # shards every gradient), at every update with replica_check_interval=1.
    checked = layout == "ddp" and world_size > 1
    assert r["counts"]["distscaler"]["host_reads"] == 2
    assert r["counts"]["distscaler-everycheck"]["host_reads"] == 2 + checked
    assert r["counts"]["distscaler-nocheck"]["host_reads"] == 2
    assert r["counts"]["distscaler-nocheck"]["collectives"] == (1 if world_size > 1 else 0)
    for name in ("distscaler", "distscaler-nocheck"):
        assert r["phase_ms"][name] > 0
        assert r["step_ms"][name] > 0


def test_torch_sharded_scaler_on_fsdp2_needs_more_collectives_or_fails(records):
    r = records[(2, "fsdp2")]
    if "torch-sharded" in r["errors"]:
        # torch 2.13: ShardedGradScaler.step hands fused AdamW a found_inf of shape [1], which its
        # step counters of shape [] cannot take.
        assert "shape" in r["errors"]["torch-sharded"]
    else:
        # found_inf's all_reduce plus the clip's norm all_reduce at least.
        assert r["counts"]["torch-sharded"]["collectives"] >= 2


def test_torch_scaler_on_ddp_does_not_agree_across_ranks(records):
    r = records[(2, "ddp")]
    assert r["counts"]["torch"]["collectives"] == 0
    assert r["phase_ms"]["torch"] > 0


def test_fsdp2_has_no_plain_torch_or_deepspeed_path(records):
    for world_size in WORLD_SIZES:
        errors = records[(world_size, "fsdp2")]["errors"]
        assert "ShardedGradScaler" in errors["torch"]
        assert "FSDP2" in errors["deepspeed"]


def test_fsdp2_shards_the_gradients_over_the_world(records):
    assert records[(2, "fsdp2")]["grad_bytes"] == pytest.approx(
        records[(1, "fsdp2")]["grad_bytes"] / 2, rel=0.05
    )
    # DDP replicates them: every rank holds all of them.
    assert records[(2, "ddp")]["grad_bytes"] == records[(1, "ddp")]["grad_bytes"]
