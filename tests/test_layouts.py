"""Every gradient layout of issue 3 on gloo: one collective, the exact global norm, agreed skips.

One spawn per world size (2 and 4 ranks) runs every layout of that size with the three AdamW
implementations (tests/_layout_scenarios.py); the tests below compare the ranks' results.

Fault matrix run (each cell: every rank skips, nothing changes, same scale everywhere):

* full {inf, -inf, NaN} x {first, last, every rank} x {fused, foreach, for-loop}: FSDP1
  FULL_SHARD (flat parameters), FSDP2 1-D with an fp16 MixedPrecisionPolicy, HSDP (2 x 2);
* a Latin square (9 of the 27 cells: each (fault, target), (optimizer, fault) and (optimizer,
  target) pair once) on every other layout;
* faults on the first rank only for the pipeline whose last stage has no trainable parameters.
"""

from __future__ import annotations

import math

import _layout_scenarios as S
import numpy as np
import pytest
from _harness import spawn
from _torch_gaps import skip_if_torch_gap

WORLD_SIZES = (2, 4)
#: torch rounds each bf16 gradient's norm to bf16 (get_total_norm keeps the gradient dtype); the
#: reference norm (fp64 over the gathered gradients) is what distscaler is held to at 1e-5.
TORCH_NORM_RTOL = {"fsdp2-mixed-dtypes": 2.0**-8}
#: bf16 parameters: one bf16 ulp at the parameters' magnitude (< 1) after a different clip rounding.
TORCH_PARAM_ATOL = {"fsdp2-mixed-dtypes": 2.0**-8}
#: torch's GradScaler cannot update() on a rank without gradients ("No inf checks were recorded"),
#: so a pipeline with a frozen stage has no torch run to match.
NO_TORCH_REFERENCE = frozenset({"pp-frozen-stage"})
#: A known distscaler bug (see the report of issue 3): a DTensor gradient on the 1-D dp sub-mesh of
#: a (dp, tp) mesh is held by every tp rank, but its placements only describe the dp sub-mesh, so
#: its weight is 1 instead of 1/tp and the norm counts it tp times.
NORM_BUG: set[str] = set()


def _case(layout: str, opt_kind: str):
    world_size = S.LAYOUTS[layout][0]
    marks = [pytest.mark.xdist_group(f"layouts{world_size}")]
    return pytest.param(layout, opt_kind, marks=marks, id=f"{layout}-{opt_kind}")


CASES = [_case(layout, opt) for layout in S.LAYOUTS for opt in S.OPTIMIZERS]


def _norm_cases(exclude: frozenset[str] = frozenset()):
    for layout in S.LAYOUTS:
        if layout in exclude:
            continue
        for opt in S.OPTIMIZERS:
            case = _case(layout, opt)
            if layout in NORM_BUG:
                case = pytest.param(
                    *case.values,
                    marks=[*case.marks, pytest.mark.xfail(strict=True, reason="known bug")],
                    id=case.id,
                )
            yield case


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    cache: dict[int, list] = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            cache[world_size] = spawn(
                S.everything, world_size, tmp_path_factory.mktemp(f"layouts{world_size}")
            )
        return cache[world_size]

    return get


def runs(spawned, layout: str, opt_kind: str) -> tuple[int, list[dict], list[dict], list]:
    world_size = S.LAYOUTS[layout][0]
    results = spawned(world_size)
    key = f"{layout}-{opt_kind}"
    for r in results:
        skip_if_torch_gap(r["matrix"][key], r["torch_gaps"])
    ours = [r["matrix"][key]["ours"] for r in results]
    torch_runs = [r["matrix"][key]["torch"] for r in results]
    schedule = S.schedule_for(layout, S.OPTIMIZERS.index(opt_kind))
    return world_size, ours, torch_runs, schedule


def same(a: list[float], b: list[float]) -> bool:
    """Equal, NaN included (a NaN norm on every rank is agreement)."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("layout, opt_kind", CASES)
def test_one_all_reduce_per_step_for_found_inf_and_norm(spawned, layout, opt_kind):
    _, ours, _, schedule = runs(spawned, layout, opt_kind)
    for run in ours:
        # clip_grad_norm_ + step + update: exactly one all_reduce, nothing else, every step.
        assert run["comms"] == [{"c10d.allreduce_": 1}] * len(schedule)


@pytest.mark.parametrize("layout, opt_kind", list(_norm_cases()))
def test_norm_equals_reference_on_gathered_gradients(spawned, layout, opt_kind):
    _, ours, _, schedule = runs(spawned, layout, opt_kind)
    clean = [s for s, fault in enumerate(schedule) if fault is None]
    for run in ours:
        # Guard: the copies that the reference counted once really were identical.
        assert all(run["replicas_equal"][s] for s in clean)
        for s in clean:
            assert run["norms"][s] == pytest.approx(run["ref_norms"][s], rel=1e-5), f"step {s}"
        assert all(not math.isfinite(run["norms"][s]) for s, f in enumerate(schedule) if f)
        assert same(run["norms"], ours[0]["norms"]), "norm differs across ranks"


@pytest.mark.parametrize("layout, opt_kind", CASES)
def test_fault_on_some_ranks_skips_on_every_rank_and_changes_nothing(spawned, layout, opt_kind):
    world_size, ours, _, schedule = runs(spawned, layout, opt_kind)
    faulty = [fault is not None for fault in schedule]
    assert sum(faulty) >= 3
    for rank, run in enumerate(ours):
        # Guard: the fault was seen locally on the targeted ranks only.
        expected_local = [
            fault is not None and rank in S.target_ranks(fault[1], world_size) for fault in schedule
        ]
        assert run["local_nonfinite"] == expected_local
        assert run["skipped"] == faulty
        # Parameters and optimizer state are bit-for-bit unchanged by every skipped step, and
        # changed by every clean step (except on a stage without trainable parameters).
        assert all(run["unchanged"][s] for s in range(len(schedule)) if faulty[s])
        if not run["no_grads"]:
            assert not any(run["unchanged"][s] for s in range(len(schedule)) if not faulty[s])
        assert run["scales"] == ours[0]["scales"]
    scales = [S.INIT_SCALE, *ours[0]["scales"]]
    for s, fault in enumerate(schedule):
        assert (scales[s + 1] < scales[s]) == (fault is not None), f"scale at step {s}: {scales}"


@pytest.mark.parametrize("layout, opt_kind", list(_norm_cases(NO_TORCH_REFERENCE)))
def test_clean_steps_match_torch_where_torch_is_correct(spawned, layout, opt_kind):
    _, ours, torch_runs, schedule = runs(spawned, layout, opt_kind)
    rtol = TORCH_NORM_RTOL.get(layout, 1e-5)
    atol = TORCH_PARAM_ATOL.get(layout, 1e-6)
    for run, ref in zip(ours, torch_runs):
        # torch ran the same steps with the faults on every rank: it skipped the same steps.
        assert ref["skipped"] == [fault is not None for fault in schedule]
        assert run["scales"] == ref["scales"]
        for s, fault in enumerate(schedule):
            if fault is None:
                assert run["norms"][s] == pytest.approx(ref["norms"][s], rel=rtol), f"step {s}"
        assert len(run["params"]) == len(ref["params"]) > 0
        np.testing.assert_allclose(run["params"], ref["params"], rtol=0, atol=atol)


@pytest.mark.parametrize("layout, opt_kind", CASES)
def test_host_reads_zero_with_fused_one_otherwise(spawned, layout, opt_kind):
    _, ours, _, _ = runs(spawned, layout, opt_kind)
    expected = 0 if opt_kind == "fused" else 1
    for run in ours:
        # From the second step on: the first step also reads each DeviceMesh's rank list once
        # (a CPU tensor, DeviceMesh.mesh) to check that the mesh lies inside the scaler's process group.
        assert run["host_reads"][1:] == [expected] * (len(run["host_reads"]) - 1)


@pytest.mark.xdist_group("layouts2")
def test_torch_pays_more_collectives_than_one(spawned):
    """The contrast the layouts exist for: torch's scaler + clip costs 2 or more all-reduces."""
    results = spawned(2)
    for layout in ("fsdp1-full_shard", "fsdp2-fp16"):
        for r in results:
            skip_if_torch_gap(r["matrix"][f"{layout}-foreach"], r["torch_gaps"])
        torch_comms = results[0]["matrix"][f"{layout}-foreach"]["torch"]["comms"][0]
        assert sum(torch_comms.values()) >= 2, torch_comms


@pytest.mark.xdist_group("layouts2")
@pytest.mark.parametrize("case", S.UNKNOWN_CASES)
def test_unknown_layout_raises_on_every_rank_before_changing_anything(spawned, case):
    results = [r["unknown"][case] for r in spawned(2)]
    for record, r in zip(results, spawned(2)):
        skip_if_torch_gap(record, r["torch_gaps"])
    for record in results:
        assert record["error_type"] == "UnknownLayoutError"
        if case == "fsdp2-sub-mesh":
            assert "lies on a device mesh of 1 of the scaler's process group (2 ranks)" in record["error"]
        else:
            assert "cannot tell how the gradients" in record["error"]
        assert "register_model" in record["error"] and "grad_layout" in record["error"]
        if case == "fsdp1-unregistered":
            assert "FSDP1 flat parameters" in record["error"]
        # Raised before the collective: no rank waits in a collective the others never join ...
        assert record["collectives"] == 0
        # ... and the ranks are still in step: a later all_reduce over both completes.
        assert record["probe"] == 2.0
        assert record["grads_unchanged"] and record["stage"] == "READY"
        # Once the layout is given, the same scaler clips.
        assert math.isfinite(record["norm_after_fix"]) and record["norm_after_fix"] > 0
        if case == "fsdp2-sub-mesh":  # registered as copies: counted once, not once per rank
            assert record["norm_after_fix"] == pytest.approx(record["local_norm"], rel=1e-5)


@pytest.mark.xdist_group("layouts2")
@pytest.mark.parametrize("case", list(S.EMPTY_SHARD_CASES))
def test_an_empty_shard_clips_and_reports_as_any_other(spawned, case):
    """FSDP2 gives rank 1 an empty shard (0 elements) of a one-row layer: the clip at p = inf, at
    p = 2 and the overflow report take it as holding nothing, on every rank alike (torch's
    ``_foreach_norm`` raises on an empty tensor at p = inf, and so did the scaler's pass, on rank 1
    only, leaving rank 0 in the collective; tests/test_inf_check.py shows torch's own
    ``clip_grad_norm_`` raising there)."""
    results = [r["empty_shard"][case] for r in spawned(2)]
    for record, r in zip(results, spawned(2)):
        skip_if_torch_gap(record, r["torch_gaps"])
    assert results[0]["local_numels"] == [4, 1, 2, 2]
    assert results[1]["local_numels"] == [0, 0, 1, 1]  # the case: empty shards on rank 1
    step = S.EMPTY_SHARD_INF_STEP
    for record in results:
        assert record["skipped"] == [i == step for i in range(3)]  # the inf seen, on every rank
        assert record["scales"][step] < record["scales"][step - 1]
        assert record["report"] == [[0, "0.weight", "inf"]]
        if S.EMPTY_SHARD_CASES[case] is None:
            continue
        assert math.isinf(record["norms"][step]) and math.isinf(record["reference"][step])
        for i in (0, 2):  # the gathered gradients' norm (p = inf: exactly; a power-of-2 scale)
            assert record["norms"][i] == pytest.approx(record["reference"][i], rel=1e-6)
            if case == "pinf":
                assert record["norms"][i] == record["reference"][i]
    assert results[0] == {**results[1], "local_numels": results[0]["local_numels"]}
