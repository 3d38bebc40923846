"""Multi-process tests on gloo: every rank agrees on the skip and the scale.

One spawn per world size runs every scenario (tests/_scenarios.py); the tests below check its
results. Each rank's data comes back to this process, so the comparisons are across ranks.
"""

from __future__ import annotations

import math

import _scenarios as S
import pytest
from _common import FAULTS, OPTIMIZERS, TARGETS, target_ranks
from _harness import spawn

WORLD_SIZES = [
    pytest.param(2, marks=pytest.mark.xdist_group("gloo2"), id="2ranks"),
    pytest.param(4, marks=pytest.mark.xdist_group("gloo4"), id="4ranks"),
]


@pytest.fixture(scope="module", params=WORLD_SIZES)
def runs(request, tmp_path_factory):
    world_size = request.param
    return world_size, spawn(S.everything, world_size, tmp_path_factory.mktemp(f"w{world_size}"))


def expected_skips() -> list[bool]:
    return [step in S.INJECT_STEPS for step in range(S.NUM_STEPS)]


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
def test_inf_on_one_rank_skips_step_on_every_rank(runs, opt_kind, fault, target, clip):
    world_size, results = runs
    key = f"{opt_kind}-{fault}-{target}-{'clip' if clip else 'noclip'}"
    ours = [r["agreement"][key]["ours"] for r in results]
    faulty = target_ranks(target, world_size)

    # Guard: the fault was really injected on the chosen ranks only, and seen there.
    for rank, run in enumerate(ours):
        assert run["local_nonfinite"] == [
            step in S.INJECT_STEPS and rank in faulty for step in range(S.NUM_STEPS)
        ]
    # Every rank skips exactly the injected steps, and a skipped step changes nothing.
    for run in ours:
        assert run["skipped"] == expected_skips()
        assert [u for u, s in zip(run["unchanged"], run["skipped"]) if s] == [True] * 2
        assert not any(u for u, s in zip(run["unchanged"], run["skipped"]) if not s)
    # Same scale trajectory, parameters, optimizer state (and clipped norm) on every rank.
    for run in ours[1:]:
        for field in ("scales", "params", "optim", "norms"):
            assert run[field] == ours[0][field], field
    scales = ours[0]["scales"]
    assert scales[S.INJECT_STEPS[0]] < scales[S.INJECT_STEPS[0] - 1], "no backoff after overflow"
    if clip:
        assert all(not math.isfinite(ours[0]["norms"][s]) for s in S.INJECT_STEPS)

    # Contrast: torch's GradScaler decides per rank, so its ranks diverge when one rank overflows.
    torch_runs = [r["agreement"][key]["torch"] for r in results]
    distinct = {tuple(run["scales"]) for run in torch_runs}
    assert len(distinct) == (1 if target == "all" else 2)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "linf"])
@pytest.mark.parametrize("opt_kind", ["for-loop", "fused"])
@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_clip_grad_norm_matches_torch_on_full_gradients(runs, layout, opt_kind, norm_type):
    _, results = runs
    key = f"{layout}-{opt_kind}-p{norm_type}"
    ours = [r["clip_norms"][key] for r in results]
    for res in ours:
        assert res["norm"] == ours[0]["norm"], "norm differs across ranks"
        assert res["norm_dtype"] == "torch.float32" and res["norm_shape"] == []
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        # The optimizer moved each parameter by exactly torch's clipped gradient.
        assert res["rel_err_update"] < 1e-5
        assert not res["skipped"]
        assert res["all_reduces"] == 1


def test_more_ranks_add_only_the_all_reduce_to_the_device_ops(runs):
    _, results = runs
    single = S.fused_step_ops()  # this process has no process group: world size 1
    collective = {"c10d.allreduce_.default": 1}
    # With clipping the squares are summed across ranks: the local sum goes into the step's collective
    # buffer (addmv_, in place of linalg_vector_norm) and the norm is its square root after.
    clip = {k: v for k, v in single["clip"].items() if k != "aten.linalg_vector_norm.default"}
    clip |= {"aten.addmv_.default": 1, "aten.sqrt.default": 1, **collective}
    for r in results:
        assert r["fused_ops"]["noclip"] == single["noclip"] | collective
        assert r["fused_ops"]["clip"] == clip


@pytest.mark.parametrize("clip", ["noclip", "clip"])
@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
def test_one_all_reduce_per_step_and_host_reads_only_when_not_fused(runs, opt_kind, clip):
    _, results = runs
    for r in results:
        on = r["step_costs"][f"{opt_kind}-{clip}-on"]
        assert on["skipped_total"] == 1.0  # the injected NaN was seen, and skipped
        assert on["all_reduces"] == [1] * 6
        assert on["host_reads"] == [0 if opt_kind == "fused" else 1] * 6
        # enabled=False is a true no-op: no collective (replicated clipping is local), no read.
        off = r["step_costs"][f"{opt_kind}-{clip}-off"]
        assert off["all_reduces"] == [0] * 6 and off["host_reads"] == [0] * 6


@pytest.mark.parametrize("clip", ["noclip", "clip"])
@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
def test_rank_without_gradients_joins_the_collective(runs, opt_kind, clip):
    _, results = runs
    runs_ = [r["empty_rank"][f"{opt_kind}-{clip}"] for r in results]
    for run in runs_:
        assert run["skipped"] == [False, True, False]
        assert run == runs_[0]


@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
def test_ddp_end_to_end(runs, opt_kind):
    world_size, results = runs
    runs_ = [r["ddp"][opt_kind] for r in results]
    # Only the last rank saw the inf injected after DDP's all-reduce ...
    assert [run["local_nonfinite"][3] for run in runs_] == [False] * (world_size - 1) + [True]
    # ... and every rank skipped that step, and only that one.
    for run in runs_:
        assert run["skipped"] == [step == 3 for step in range(8)]
        for field in ("scales", "norms", "params", "optim"):
            assert run[field] == runs_[0][field], field
    assert any(g for g in (b > a for a, b in zip(runs_[0]["scales"], runs_[0]["scales"][1:])))
