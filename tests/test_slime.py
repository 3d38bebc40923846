"""slime integration (``distscaler.integrations.slime``) against stock slime, side by side.

One spawn of 2 gloo ranks (tests/_slime_scenarios.py): slime's own ``train_one_step`` where
slime's source imports (it is not on PyPI: its source at ``TESTED_COMMIT`` on the path, in a venv
with megatron-core 0.19.2; docs/integrations/slime.md), else, in CI, a copy of its optimizer part
(the scenarios say which ran; both give the same numbers). Around it megatron-core's own
distributed optimizer in fp16 with fp32 gradient buffers, slime's LR scheduler, the
forward-backward a stand-in (slime's packed-sequence forward needs Transformer Engine).

* stock: every step unscales the main gradients twice (the optimizer steps with them divided by
  the scale a second time) and updates the scale twice (it grows twice as fast);
* ours (``--custom-megatron-before-train-step-hook-path distscaler.integrations.slime.HOOK``): once
  each; the norm and the stepped gradients are the unscaled ones;
* an inf in rank 1's gradient at step 1: skipped on both ranks, stock and ours, LR held;
* a checkpoint (Megatron's optimizer state) loaded into the stock optimizer, then the hook: the
  scale and its trackers carry on;
* a second unscale of a step's main gradients: stock applies it, ours refuses it.

Needs megatron-core (CI's suite installs 0.19.2); under ``DISTSCALER_SLIME_STAGE=1`` slime's own
source must import.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
from _harness import spawn

from common.megatron_cpu import stub_gpu_only_imports

stub_gpu_only_imports()  # triton, imported unguarded by one module of megatron-core
pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra; CI installs it)")

TWO_RANKS = pytest.mark.xdist_group("slime2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import _slime_scenarios as S

    return spawn(S.everything, 2, tmp_path_factory.mktemp("slime"))


@TWO_RANKS
def test_slimes_own_train_one_step_ran_where_slime_imports(runs):
    import _slime_scenarios as S

    for r in runs:
        assert r["slime"] == (S.SLIME is not None)
        if os.environ.get("DISTSCALER_SLIME_STAGE"):
            assert r["slime"], "the slime venv must import slime's source"
        assert not r["stock_installed"] and r["ours_installed"]


@TWO_RANKS
def test_stock_unscales_twice_and_ours_once(runs):
    for r in runs:
        stock, ours = r["stock_clean"], r["ours_clean"]
        # Step 0: the same backward; the reference is one unscale of it.
        assert ours[0]["stepped_main_grads"] == pytest.approx(r["reference_step0"], rel=1e-6)
        assert stock[0]["stepped_main_grads"] == pytest.approx(r["reference_step0"] / 8, rel=1e-6)
        # The norm slime logs: stock's is that of the twice-unscaled gradients.
        assert ours[0]["grad_norm"] == pytest.approx(8 * stock[0]["grad_norm"], rel=1e-5)
        # Every later step too: stock steps with gradients 1/scale of what it should.
        for s in stock[1:]:
            assert s["stepped_main_grads"] < ours[0]["stepped_main_grads"] / 4


@TWO_RANKS
def test_stock_updates_the_scale_twice_per_step_and_ours_once(runs):
    for r in runs:
        # loss_scale_window 4, hysteresis 1: growth after 4 clean updates.
        assert [s["scale"] for s in r["stock_clean"]] == [8.0, 16.0, 16.0, 32.0, 32.0]
        assert [s["scale"] for s in r["ours_clean"]] == [8.0, 8.0, 8.0, 16.0, 16.0]


@TWO_RANKS
def test_an_inf_on_one_rank_skips_on_both_and_holds_the_lr(runs):
    for r in runs:
        for name in ("stock", "ours"):
            steps = r[f"{name}_inf"]
            assert math.isnan(steps[1]["grad_norm"]) and not steps[1]["changed"], name
            assert steps[1]["stepped_main_grads"] is None, name  # no optimizer step
            assert steps[1]["scale"] == 4.0 and steps[1]["lr"] == steps[0]["lr"], name
            assert all(s["changed"] and math.isfinite(s["grad_norm"]) for s in steps[2:]), name
    # Every rank: the same skips, scales, LR and norms (NaN at the skip).
    for name in ("stock_inf", "ours_inf"):
        one, two = ([(s["scale"], s["lr"], str(s["grad_norm"])) for s in r[name]] for r in runs)
        assert one == two, name


@TWO_RANKS
def test_the_scale_is_in_megatrons_checkpoint_and_carries_on_after_the_hook(runs):
    for r in runs:
        assert r["ours_saved"] == {"scale": 4.0, "growth_tracker": 2.0, "hysteresis_tracker": 0.0}
        assert r["resumed_before_hook"] == 4.0  # slime's load, into the stock scaler
        # The hook installs with the stock scaler's state: the growth tracker goes on from 2.
        assert r["resumed_state"] == r["ours_after_step4"]
        assert r["resumed"][0]["scale"] == 4.0
        # docs/integrations/slime.md: distscaler's own counters restart after the resume.
        assert r["ours_totals"] == [5, 1]  # (updates, skipped), through JSON
        assert r["resumed_totals"] == [1, 0]


@TWO_RANKS
def test_a_second_unscale_is_applied_by_stock_and_refused_by_ours(runs):
    for r in runs:
        assert r["stock_second_unscale"] == "no error"
        assert r["stock_second_unscale_ratio"] == pytest.approx(1 / 4)  # the scale was 4
        assert r["stock_sub_second_unscale_ratio"] == pytest.approx(1 / 16)
        assert r["ours_second_unscale"].startswith("RuntimeError: with distscaler installed")
        assert r["ours_sub_second_unscale"].startswith(
            "CallOrderError: this step's main gradients are unscaled already"
        )
        assert r["ours_second_unscale_ratio"] == r["ours_sub_second_unscale_ratio"] == 1.0


# ----------------------------------------------------------------------------- in this process


def test_the_hook_does_nothing_in_bf16_or_without_an_optimizer(monkeypatch):
    from distscaler.integrations import slime as ds_slime

    assert ds_slime.HOOK == "distscaler.integrations.slime.before_train_step"
    calls = []
    monkeypatch.setattr(ds_slime, "install", lambda *a, **k: calls.append(a))
    ds_slime.before_train_step(SimpleNamespace(fp16=False), 0, 0, [], object(), None)
    ds_slime.before_train_step(SimpleNamespace(fp16=True), 0, 0, [], None, None)
    assert calls == []


def test_the_hook_checks_its_environment_before_it_changes_anything(monkeypatch, tmp_path):
    from distscaler.integrations import slime as ds_slime

    calls = []
    monkeypatch.setattr(ds_slime, "install", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("DISTSCALER_SLIME_SCALER", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such file"):
        ds_slime.before_train_step(SimpleNamespace(fp16=True), 0, 0, [], object(), None)
    assert calls == []
