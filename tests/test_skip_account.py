"""One skip account: every skipped optimizer step counted once with its cause (an overflow, a
replica mismatch, torchft's uncommitted step), ``step_was_skipped`` and the account agreeing on
every rank, and ``report_skip()`` returning the last skip's report whatever its cause; and the
collapse watch, which names a run whose every step skips (the torchft heal that stepped on its own
inf, reproduced with the healer's own flag left out) and stays quiet when the healer is handled.
Under torchft, 2 replica groups x 2 ranks, the three faults in one run
(tests/_skip_torchft_scenarios.py).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import _skip_scenarios as S
import pytest
from _harness import spawn

from distscaler import CollapseReport, GradScaler, SkipTotals, TrainingCollapsedError


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(S.overflow_and_flip, 2, tmp_path_factory.mktemp("skips2"))


def test_an_overflow_and_a_flip_are_two_skips_of_two_causes_on_every_rank(two):
    for run in two:
        steps = run["steps"]
        assert [s["skipped"] for s in steps] == [
            i in (S.OVERFLOW_STEP, S.FLIP_STEP) for i in range(S.STEPS)
        ]
        over, flip = steps[S.OVERFLOW_STEP], steps[S.FLIP_STEP]
        assert over["cause"] == "overflow" and over["update"] == S.OVERFLOW_STEP + 1
        assert flip["cause"] == "replica_mismatch" and flip["update"] == S.FLIP_STEP + 1
        assert "rank(s) 0, 1 differ" in flip["describe"]  # the mismatch's report, named
        assert "overflow" in over["describe"]
        # The overflow backed the scale off; the mismatch left it where it was.
        assert over["scale"] < steps[S.OVERFLOW_STEP - 1]["scale"]
        assert flip["scale"] == steps[S.FLIP_STEP - 1]["scale"]
        last = steps[-1]
        assert last["causes"] == {"overflow": 1, "replica_mismatch": 1, "not_committed": 0}
        assert last["num_skipped"] == 2 and last["num_updates"] == S.STEPS
        assert last["totals"] == "skipped steps: 2 of 5 (overflow 1, replica_mismatch 1)"
        assert run["ledger"]["replica_mismatches"] == 1  # one event ...
        assert run["ledger"]["replica_mismatched_ranks"] == 2  # ... naming both replicas
    assert two[0]["steps"] == two[1]["steps"]  # the same account on every rank


def test_report_skip_is_none_only_before_any_skip():
    scaler = GradScaler("cpu")
    assert scaler.report_skip() is None
    assert SkipTotals().causes == {"overflow": 0, "replica_mismatch": 0, "not_committed": 0}


def test_collapse_report_and_error_describe_the_run():
    report = CollapseReport(40, 31, {"overflow": 10}, ((35, 64.0), (40, 2.0)), ("rank 3",))
    text = report.describe()
    assert "10 updates in a row, since update 31" in text and "64 -> 2" in text
    assert "rank 3" in text
    assert str(TrainingCollapsedError(report)) == text


def test_collapse_window_and_on_collapse_are_validated():
    with pytest.raises(ValueError, match="collapse_window"):
        GradScaler("cpu", collapse_window=-1)
    with pytest.raises(ValueError, match="on_collapse must be 'warn' or 'raise'"):
        GradScaler("cpu", on_collapse="log")  # type: ignore[arg-type]


def test_a_run_that_skips_every_step_is_named_collapsed():
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**4, collapse_window=5, skip_log_interval=1,
                        on_collapse="raise")  # fmt: skip
    with pytest.raises(TrainingCollapsedError, match="skipped for 5 updates in a row") as err:
        for _ in range(20):
            opt.zero_grad()
            scaler.scale(model(torch.full((2, 4), float("nan"))).sum()).backward()
            scaler.step(opt)
            scaler.update()
    assert err.value.report.causes == {"overflow": 5, "replica_mismatch": 0, "not_committed": 0}
    assert [s for _, s in err.value.report.scales][-1] < 2.0**4


# ---------------------------------------------------------------------- torchft


@pytest.fixture(scope="module")
def heals(tmp_path_factory):
    """The heal with an inf in the healer's own gradients (tests/test_faults.py's), once as the
    integration runs it and once with the healer's own flag left out (how it ran before), each
    with collapse_window=4."""
    pytest.importorskip("torchft")
    import _torchft_scenarios as T

    root = tmp_path_factory.mktemp("collapse")
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def go(name: str, unfixed: bool) -> None:
        try:
            spec = dict(T.SCENARIOS["heal_step_inf"], wiring="ours", collapse_window=4,
                        heal_unfixed=unfixed, param_check_interval=1)  # fmt: skip
            results[name] = T.run(spec, str(root / name), timeout=240)
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=a) for a in (("fixed", False), ("unfixed", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_the_collapse_watch_fires_on_the_bad_heal_and_not_on_the_handled_one(heals):
    import _torchft_scenarios as T

    def collapsed(result: dict[str, Any]) -> dict[tuple, bool]:
        assert not result["timed_out"], result["exits"]
        return {key: any(d.get("collapsed") for d in T.steps_of(records))
                for key, records in result["records_by_rank"].items()}  # fmt: skip

    # Before the fix the healer steps on its own inf and trains on with non-finite parameters
    # (its group's own flag was replaced by the others'): the parameter check names it.
    assert collapsed(heals["unfixed"])[(1, 0)], "the collapse went unnamed"
    assert not any(collapsed(heals["fixed"]).values()), "a handled heal was named a collapse"
    healer = T.steps_of(heals["fixed"]["records_by_rank"][(1, 0)])
    # The healer's own inf/NaN made its heal step an uncommitted one, counted with its cause.
    assert max(d["skip_causes"]["not_committed"] for d in healer) >= 1


# ---------------------------------------------------------------------- torchft: three causes

@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """tests/_skip_torchft_scenarios.py: 2 torchft replica groups x 2 ranks, gradients replicated
    on all 4, the replica check on; an overflow, a bit flip on one replica and a step torchft
    commits nowhere, at three iterations (about 5 s on 2 cores)."""
    pytest.importorskip("torchft")
    import _skip_torchft_scenarios as F

    result = F.run(str(tmp_path_factory.mktemp("three")), timeout=120)
    assert not result["timed_out"] and set(result["exits"].values()) == {0}, (
        result["exits"], result["logs"])  # fmt: skip
    for key, lines in result["records"].items():
        assert [d["it"] for d in lines] == list(range(F.ITERATIONS)), (key, result["logs"][key])
    return result["records"]


def _skip_metrics(line: dict) -> dict:
    return {k: v for k, v in line["metrics"].items() if k.startswith("distscaler/skipped")}


def test_under_torchft_each_skip_is_counted_with_its_cause_alike_on_every_rank(three):
    """The overflow and the uncommitted step are skips of their causes on all 4 ranks, with the
    recipe's pattern (``if scaler.step_was_skipped: scaler.report_skip().describe()``) after each;
    the scale, the account and ``metrics()`` agree on every rank after every iteration (the flip's
    own expectations: the next test)."""
    import _skip_torchft_scenarios as F

    skips = {F.OVERFLOW: "overflow", F.FLIP: "replica_mismatch", F.UNCOMMITTED: "not_committed"}
    for key, lines in three.items():
        assert [d["skipped"] for d in lines] == [i in skips for i in range(F.ITERATIONS)], key
        for it, cause in skips.items():
            line = lines[it]
            assert line["cause"] == cause and line["update"] == it + 1, (key, line)
            assert line["describe"].startswith(
                f"step {it + 1} was skipped ({cause.replace('_', ' ')})"
            )
        over, unc = lines[F.OVERFLOW], lines[F.UNCOMMITTED]
        # The overflow: torchft committed, the scaler skipped and backed off.
        assert over["committed"] is True and over["scale"] == F.INIT_SCALE / 2
        assert "inf in" in over["describe"] or "nan in" in over["describe"]
        # The uncommitted step: committed nowhere, the manager's step and the scale stayed.
        assert unc["committed"] is False and unc["step_after"] == unc["step"]
        assert f"torchft did not commit step {unc['step']} on this replica group" in unc["describe"]
        assert unc["scale"] == lines[F.UNCOMMITTED - 1]["scale"]
        last = lines[-1]
        causes = {"overflow": 1, "replica_mismatch": 1, "not_committed": 1}
        assert last["causes"] == causes
        assert last["num_skipped"] == len(skips) and last["num_updates"] == F.ITERATIONS
        assert _skip_metrics(last) == {
            "distscaler/skipped_total": len(skips),
            **{f"distscaler/skipped_{cause}": n for cause, n in causes.items()},
        }
    # The same scale, skips, account and metrics on every rank after every iteration.
    keys = ("scale", "skipped", "cause", "update", "describe", "causes", "totals", "metrics")
    for it in range(F.ITERATIONS):
        seen = {json.dumps([lines[it].get(k) for k in keys]) for lines in three.values()}
        assert len(seen) == 1, (it, seen)


def test_under_torchft_a_bit_flip_is_the_third_cause_three_skips_on_every_rank(three):
    """Issue 43's run: an overflow, a bit flip and an uncommitted torchft step, 3 skips of 3
    causes on every rank, the replica mismatch in ``report_skip()`` and counted once (one event)
    in every rank's ledger, no replica's parameters parted."""
    import _skip_torchft_scenarios as F

    for key, lines in three.items():
        flip = lines[F.FLIP]
        assert flip["skipped"] and flip["cause"] == "replica_mismatch", (key, flip)
        assert flip["update"] == F.FLIP + 1 and flip["describe"], (key, flip)
        assert flip["scale"] == lines[F.FLIP - 1]["scale"]
        assert lines[-1]["ledger"]["replica_mismatches"] == 1, (key, lines[-1]["ledger"])
        last = lines[-1]
        assert last["causes"] == {"overflow": 1, "replica_mismatch": 1, "not_committed": 1}
        assert last["totals"] == (
            "skipped steps: 3 of 7 (overflow 1, replica_mismatch 1, not_committed 1)"
        )
        assert last["metrics"]["distscaler/skipped_replica_mismatch"] == 1
        assert last["params"] == three[(0, 0)][-1]["params"], key


def test_under_torchft_an_uncommitted_step_is_no_overflow_in_the_overflow_report(three):
    """After the uncommitted step the Recipes page's ``report_overflow()`` (examples/ddp.py's
    pattern) and ``metrics()`` still name the run's one overflow (update 2), not update 6, where
    no gradient held inf/NaN."""
    import _skip_torchft_scenarios as F

    for key, lines in three.items():
        unc = lines[F.UNCOMMITTED]
        assert unc["overflow_report"][0] == F.OVERFLOW + 1, (key, unc["overflow_report"])
        assert lines[-1]["metrics"]["distscaler/overflow_step"] == F.OVERFLOW + 1, key


def test_a_loaded_state_keeps_the_account_cause_by_cause():
    """A resumed or healed scaler (torchft loads the donor's state_dict) continues the account of
    each cause; a state without them (torch's, an older one) counts its skips as overflows; causes
    that sum past ``num_skipped_steps`` are refused, the scaler unchanged."""
    saved = {**GradScaler("cpu").state_dict(), "num_updates": 9, "num_skipped_steps": 4,
             "num_replica_mismatch_skips": 1, "num_not_committed_skips": 2}  # fmt: skip
    scaler = GradScaler("cpu")
    scaler.load_state_dict(saved)
    totals = scaler.skip_totals
    assert totals.causes == {"overflow": 1, "replica_mismatch": 1, "not_committed": 2}
    again = scaler.state_dict()
    assert (again["num_replica_mismatch_skips"], again["num_not_committed_skips"]) == (1, 2)
    older = {k: v for k, v in saved.items() if not k.endswith("_skips")}
    scaler.load_state_dict(older)
    assert scaler.skip_totals.causes == {"overflow": 4, "replica_mismatch": 0, "not_committed": 0}
    with pytest.raises(ValueError, match="num_not_committed_skips"):
        scaler.load_state_dict({**saved, "num_not_committed_skips": 4})
    assert scaler.skip_totals.causes["overflow"] == 4  # unchanged
