"""A check on the step's one collective that the library does not know (distscaler.checks): an
FP8-style amax agreed across ranks (tests/_checks_scenarios.py), added with
``GradScaler.add_check()`` and nothing else, on 2 gloo ranks under DDP. Its slot rides the same
collective (one per step, counted), every rank reads the same agreed amax (the maximum over the
ranks' local ones, against a MAX all_reduce of our own), a step it skips is skipped on every rank
under its own cause with the scale unchanged, and it sits beside the replica check."""

from __future__ import annotations

import pytest
import torch
from _checks_scenarios import BIG_STEP, LIMIT, STEPS, AmaxCheck, amax_check
from _harness import spawn

from distscaler import GradScaler
from distscaler.errors import CallOrderError


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(amax_check, 2, tmp_path_factory.mktemp("amax"))


@pytest.mark.parametrize("run", ["alone", "beside"])
def test_a_check_of_our_own_rides_the_one_collective_and_every_rank_reads_the_same(two, run):
    ranks = [r[run] for r in two]
    for step in range(STEPS):
        agreed = {r["steps"][step]["agreed_amax"] for r in ranks}
        assert len(agreed) == 1, (step, agreed)  # every rank read the same value
        (value,) = agreed
        assert value == ranks[0]["reference_amax"][step]  # the MAX over the ranks' own
        # one collective per step: the gather that carries the amax's MAX beside the rest; at a
        # replica mismatch one more, which names the ranks
        naming = ["all_gather"] if run == "beside" and step == BIG_STEP else []
        for r in ranks:
            assert r["steps"][step]["collectives"] == ["all_gather", *naming], (run, step)
    local = [r["steps"][BIG_STEP]["local_amax"] for r in ranks]
    assert local[0] < LIMIT < local[1]  # the case was there: only rank 1 saw the large value


def test_a_step_the_check_skips_is_skipped_on_every_rank_under_its_cause(two):
    for r in two:
        steps = r["alone"]["steps"]
        assert [s["skipped"] for s in steps] == [i == BIG_STEP for i in range(STEPS)]
        big = steps[BIG_STEP]
        assert big["scale_after"] == big["scale_before"]  # a check never moves the scale
        causes = r["alone"]["causes"]
        assert causes["amax_limit"] == 1 and sum(causes.values()) == 1, causes
        assert r["alone"]["report"] == "amax_limit"
        assert r["alone"]["ended"][BIG_STEP] == "amax_limit"
        assert r["alone"]["state_key"] == 1
        assert r["alone"]["loaded_causes"]["amax_limit"] == 1
        assert r["alone"]["loaded_causes"]["overflow"] == 0


def test_beside_the_replica_check_a_mismatch_settles_first(two):
    # the same write after the reduce is a replica mismatch too: the replica check's slots come
    # first, so its cause is the step's; the amax check still read the agreed value
    for r in two:
        beside = r["beside"]
        assert beside["mismatches"] == 1
        assert beside["causes"]["replica_mismatch"] == 1
        assert sum(beside["causes"].values()) == 1, beside["causes"]
        assert beside["steps"][BIG_STEP]["skipped"]
        assert beside["steps"][BIG_STEP]["agreed_amax"] > LIMIT


def test_add_check_refuses_an_object_that_is_not_a_check_and_a_call_inside_an_iteration():
    scaler = GradScaler("cpu")
    with pytest.raises(TypeError, match="lacks: contribution, end_iteration"):
        scaler.add_check(object())  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(CallOrderError, match="between iterations"):
        scaler.add_check(AmaxCheck())
    assert scaler.add_check is not None
