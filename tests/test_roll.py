"""ROLL integration (``distscaler.integrations.roll``) against stock ROLL, side by side.

One spawn of 2 gloo ranks (tests/_roll_scenarios.py): ROLL's own ``FSDP2TrainStrategy``
(``initialize``, ``train_step``, ``save_checkpoint``, ``load_checkpoint``) where ROLL's source
imports (it is not on PyPI: the ``.venv-roll`` of docs/integrations/roll.md), else, as in CI,
tests/_roll_standin.py, a copy of its optimizer step (``ROLL`` in the scenarios says which; both
give these results). A tiny Llama in fp16, one optimizer step per ``train_step``, an inf in rank
1's loss at step 1:

* stock (ROLL's ``ShardedGradScaler``, enabled as on a CUDA device): the skipped step's NaN
  gradients are never zeroed (ROLL's fp16 branch has no ``zero_grad``), so **every later step is
  skipped too**, on both ranks, the scale halving each time; the LR scheduler never steps (no
  ``scheduler.step()`` in the fp16 branch); gradients are left after a clean step, to be unscaled
  again with the next; the checkpoint holds no scale (a resume starts from 65536);
* ours (``install``): the inf step skipped on both ranks, the LR held on it and stepped on every
  other, the gradients zeroed after each step, ``grad_norm`` a number on every clean step and
  non-finite on the skipped one; the scale (32768) in ROLL's checkpoint directory and resumed,
  the resumed run's scale, LR and first gradient norm those of the uninterrupted one (ROLL's
  checkpoint does not restore AdamW's moments into a fresh optimizer, stock and ours alike); a
  stock checkpoint loads with a warning;
* a second ``scaler.unscale_`` in one step: torch refuses it for stock (``RuntimeError``), ours
  with ``CallOrderError``.

ROLL's source, where importable, needs the packages of docs/integrations/roll.md; under
``DISTSCALER_ROLL_STAGE=1`` it must import.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from _harness import spawn

pytest.importorskip("transformers", reason="the tiny Llama of the scenarios (the train extra's)")

TWO_RANKS = pytest.mark.xdist_group("roll2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import _roll_scenarios as S

    return spawn(S.everything, 2, tmp_path_factory.mktemp("roll"))


@TWO_RANKS
def test_rolls_own_strategy_ran_where_roll_imports(runs):
    import _roll_scenarios as S

    for r in runs:
        assert r["roll"] == S.ROLL
        if os.environ.get("DISTSCALER_ROLL_STAGE"):
            assert r["roll"], "the ROLL venv must import ROLL's source"
        assert r["stock_scaler"] == "ShardedGradScaler"
        # ROLL builds ShardedGradScaler() for device "cuda": on the CPU torch disables it.
        assert r["stock_built_scaler_enabled"] is False
        assert r["ours_class"] == "distscaler.integrations.roll.FSDP2TrainStrategy"
        assert r["ours_scaler"] == "_StepScaler"


@TWO_RANKS
def test_stock_skips_every_step_after_one_inf_and_ours_only_that_one(runs):
    import _roll_scenarios as S

    for r in runs:
        stock, ours = r["stock"], r["ours"]
        assert [s["changed"] for s in stock] == [True] + [False] * (S.STEPS - 1)
        assert [s["adam"] for s in stock] == [1] * S.STEPS
        assert [s["scale"] for s in stock] == [65536.0 / 2**i for i in range(S.STEPS)]
        assert all(math.isnan(s["grads_left"]) for s in stock[S.INF_STEP :])
        assert [s["changed"] for s in ours] == [i != S.INF_STEP for i in range(S.STEPS)]
        assert [s["adam"] for s in ours] == [1, 1, 2, 3, 4, 5]
        assert [s["scale"] for s in ours] == [65536.0] + [32768.0] * (S.STEPS - 1)
        assert [s["skipped_metric"] for s in ours] == [
            float(i == S.INF_STEP) for i in range(S.STEPS)
        ]
        assert [s["scale_metric"] for s in ours] == [s["scale"] for s in ours]

    # Agreed: both ranks skipped the same steps, with the same scale and norm.
    def agreed(s):
        return {k: repr(v) for k, v in s.items() if k != "grads_left"}

    for name in ("stock", "ours"):
        assert [agreed(s) for s in runs[0][name]] == [agreed(s) for s in runs[1][name]]


@TWO_RANKS
def test_stock_never_steps_the_lr_and_ours_holds_it_on_the_skip(runs):
    import _roll_scenarios as S

    for r in runs:
        assert [s["sched"] for s in r["stock"]] == [0] * S.STEPS
        assert {s["lr"] for s in r["stock"]} == {S.LR}
        assert [s["sched"] for s in r["ours"]] == [1, 1, 2, 3, 4, 5]
        lrs = [s["lr"] for s in r["ours"]]
        assert lrs[S.INF_STEP] == lrs[S.INF_STEP - 1]
        assert all(a > b for a, b in zip(lrs[S.INF_STEP :], lrs[S.INF_STEP + 1 :], strict=False))


@TWO_RANKS
def test_stock_leaves_gradients_to_unscale_again_and_ours_zeroes_them(runs):
    for r in runs:
        assert r["stock"][0]["grads_left"] > 0  # the unscaled step-0 gradients, carried over
        assert all(s["grads_left"] is None for s in r["ours"])


@TWO_RANKS
def test_grad_norm_is_defined_on_every_step(runs):
    import _roll_scenarios as S

    for r in runs:
        for s in r["ours"]:
            assert isinstance(s["grad_norm"], float)
            assert math.isfinite(s["grad_norm"]) == (s["step"] != S.INF_STEP)


@TWO_RANKS
def test_scale_is_checkpointed_and_resumed_by_ours_only(runs):
    import _roll_scenarios as S

    for r in runs:
        assert r["stock_saved_scale"] == 16384.0 and r["stock_resumed_scale"] == 65536.0
        assert r["stock_resumed_sched"] == 0
        assert not any(f.startswith("distscaler_") for f in r["stock_listing"])
        assert {"distscaler_world_size_2_rank_0.pt", "distscaler_world_size_2_rank_1.pt"} <= set(
            r["ours_listing"]
        )
        assert r["ours_saved_scale"] == r["ours_resumed_scale"] == 32768.0
        assert r["ours_resumed_sched"] == 2
        resumed, uninterrupted = r["ours_resumed"], r["ours"][S.SAVE_AFTER + 1 :]
        # The parameters, the LR schedule and the scale carry on: the first resumed step's norm is
        # the uninterrupted run's, and so are the scales and learning rates after it.
        assert resumed[0]["grad_norm"] == uninterrupted[0]["grad_norm"]
        for key in ("scale", "lr", "sched", "changed", "skipped_metric"):
            assert [s[key] for s in resumed] == [s[key] for s in uninterrupted], key
        # ROLL's DCP load gives a fresh AdamW no moments (its state_dict has none to fill: stock
        # and ours alike), so AdamW counts again from 1 and the parameters drift after step 3.
        assert [s["adam"] for s in resumed] == list(range(1, len(resumed) + 1))
        assert r["ours_from_stock_scale"] == 65536.0
        assert len(r["ours_from_stock_warnings"]) == 1


@TWO_RANKS
def test_a_second_unscale_is_refused(runs):
    for r in runs:
        assert r["stock_unscale_twice"]["second"].startswith("RuntimeError: unscale_() has already")
        assert r["ours_unscale_twice"]["second"].startswith(
            "CallOrderError: unscale_() has already"
        )


# ---------------------------------------------------------------------- in-process: refusals


def _strategy(**config):
    import _roll_standin as standin

    worker = SimpleNamespace(
        worker_config=SimpleNamespace(
            strategy_args=SimpleNamespace(strategy_config={"param_dtype": "fp16", **config})
        )
    )
    return standin.FSDP2TrainStrategy(worker)


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
def test_install_refuses_what_it_does_not_cover():
    from distscaler import GradScaler, ScalerConfig
    from distscaler.integrations.roll import ROLL_SCALER, install, scaler_of

    with pytest.raises(TypeError, match="ROLL's FSDP2 training strategy"):
        install(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="fp16"):
        install(_strategy(param_dtype="bf16"))
    with pytest.raises(NotImplementedError, match="ep_size"):
        install(_strategy(ep_size=2))
    with pytest.raises(NotImplementedError, match="offload_policy"):
        install(_strategy(offload_policy=True))
    with pytest.raises(ValueError, match="device type"):
        install(_strategy(), scaler=GradScaler("cuda"))
    stock = _strategy()
    assert scaler_of(stock) is None
    scaler = install(stock)
    assert scaler_of(stock) is scaler and install(stock) is scaler
    assert scaler.get_growth_interval() == ROLL_SCALER.growth_interval == 400
    with pytest.raises(ValueError, match="already"):
        install(stock, scaler=ScalerConfig())
    assert type(stock).__mro__[2].__module__ == "_roll_standin"


def test_create_strategy_needs_roll():
    import _roll_scenarios as S

    from distscaler.integrations.roll import create_strategy

    if S.ROLL is None:
        with pytest.raises(ImportError, match="ROLL"):
            create_strategy(SimpleNamespace())
        return
    worker = SimpleNamespace(
        worker_config=SimpleNamespace(
            strategy_args=SimpleNamespace(
                strategy_name="fsdp2_train", strategy_config={"param_dtype": "fp16"}
            ),
            offload_nccl=False,
            checkpoint_config=None,
        )
    )
    from distscaler.integrations.roll import scaler_of

    assert scaler_of(create_strategy(worker)) is not None
    worker.worker_config.strategy_args.strategy_config["param_dtype"] = "bf16"
    assert scaler_of(create_strategy(worker)) is None
