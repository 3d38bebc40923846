"""One account, one set of words: every skipped step counted once, under one cause, and the
replica ledger, ``metrics()`` and ``skip_totals`` agreeing at every update on every rank.

The rule: a skipped update's cause is ``overflow`` where the agreed ``found_inf`` was 1.0 (the
scale backed off), so an inf written into one replica's gradients after DDP's reduce, which is a
replica mismatch too, is an overflow; ``replica_mismatch`` where the step was skipped for a
mismatch with every value the overflow check saw finite. The ledger's ``skipped`` and
``metrics()``' ``replica_skipped`` are ``skip_totals.causes["replica_mismatch"]``, the same number;
the ledger's ``replica_mismatches`` counts the mismatches found, whatever the skip was counted as.
Before, the inf after the reduce counted in the ledger's ``skipped`` and as an overflow, and one
``metrics()`` held ``replica_skipped: 2`` beside ``skipped_replica_mismatch: 1``.

Run with ``torch.Tensor.numpy`` raising, as on a plain install (no numpy): naming the ranks at a
mismatch once went through ``all_gather_object``, which needs it, and killed both ranks at the
first mismatch. 2 gloo ranks (tests/_account_scenarios.py).
"""

from __future__ import annotations

import _account_scenarios as S
import pytest
from _harness import spawn


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(S.every_skip, 2, tmp_path_factory.mktemp("account"))


def test_without_numpy_the_mismatches_are_named_and_skipped_on_every_rank(two):
    for run in two:
        steps = run["steps"]
        skipped = [i for i, s in enumerate(steps) if s["skipped"]]
        assert skipped == [S.OVERFLOW, S.FLIP, S.INF_AFTER_REDUCE, S.FLIP_NEW_SCALE]
        # two replicas: no majority, both named; the inf after the reduce held by rank 1
        assert steps[S.FLIP]["mismatch"] == [S.FLIP + 1, [0, 1], []]
        assert steps[S.INF_AFTER_REDUCE]["mismatch"] == [S.INF_AFTER_REDUCE + 1, [0, 1], [1]]
    assert two[0]["steps"] == two[1]["steps"]  # the same account on every rank


def test_each_skip_has_one_cause_and_the_inf_after_the_reduce_is_an_overflow(two):
    for run in two:
        steps = run["steps"]
        assert steps[S.OVERFLOW]["cause"] == "overflow"
        assert steps[S.FLIP]["cause"] == "replica_mismatch"
        assert steps[S.INF_AFTER_REDUCE]["cause"] == "overflow"
        assert steps[S.INF_AFTER_REDUCE]["scale"] < steps[S.INF_AFTER_REDUCE - 1]["scale"]
        assert steps[S.FLIP]["scale"] == steps[S.FLIP - 1]["scale"]
        # update(new_scale) consumes no found_inf: that update is in no count of skips
        last = steps[-1]
        assert last["causes"] == {"overflow": 2, "replica_mismatch": 1, "not_committed": 0}
        assert last["num_skipped"] == 3
        assert last["ledger"]["replica_mismatches"] == 3  # the flips and the inf: found


def test_the_ledger_metrics_and_skip_totals_agree_at_every_update(two):
    for run in two:
        for i, s in enumerate(run["steps"]):
            mismatch_skips = s["causes"]["replica_mismatch"]
            assert s["ledger"]["replica_skipped"] == mismatch_skips, i
            m = s["metrics"]
            assert m["distscaler/replica_skipped"] == m["distscaler/skipped_replica_mismatch"], i
            assert m["distscaler/skipped_replica_mismatch"] == mismatch_skips, i
            assert m["distscaler/skipped_total"] == sum(s["causes"].values()) == s["num_skipped"]
            assert m["distscaler/replica_mismatches"] == s["ledger"]["replica_mismatches"], i
