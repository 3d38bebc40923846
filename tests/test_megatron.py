"""Megatron-core integration (``distscaler.integrations.megatron``) against stock megatron-core 0.19.2.

One spawn of 2 gloo ranks (tests/_megatron_scenarios.py: the model, what "stock" is;
launch/common/megatron_cpu.py: the CPU stand-ins, each with why):

* (a, b) dense + expert optimizers (``ChainedOptimizer``), non-distributed and distributed, an inf
  only in rank 0's expert gradients at step 1: stock splits the scales and mis-scales the expert
  gradients from then on (the ratio measured), ours keeps one scale, ratio 1.0, ranks identical;
  collectives and host reads per step, counted;
* (c) Megatron's own trajectory step for step where nothing splits (one optimizer, hysteresis 2,
  a minimum scale, a growth window, clipping);
* (d) checkpoints: a stock chained checkpoint whose scales differ loads into ours (the smallest,
  with a warning); ours loads into stock Megatron;
* ``prepare_grads`` twice, a sub-optimizer stepped alone, unsupported paths refused at install.

And ``launch/train_megatron.py``: a real ``GPTModel`` through torchrun with ``--inject-inf``.
"""

from __future__ import annotations

import math

import pytest
from _common import torchrun_summary
from _harness import spawn

from common.megatron_cpu import stub_gpu_only_imports

stub_gpu_only_imports()  # triton, imported unguarded by one module of megatron-core

#: The megatron-core release these tests pin (the wheel reports 0.19.2+<commit>); other releases
#: (a `.[test]` install on Python 3.11 resolves 0.16.1) skip. CI installs it and fails without
#: it (tests/test_megatron_installed.py).
TESTED = "0.19.2"
try:
    import megatron.core as megatron

    FOUND: str | None = megatron.__version__.split("+")[0]
except ImportError:
    FOUND = None
pytestmark = pytest.mark.skipif(
    FOUND != TESTED,
    reason=f"megatron-core {TESTED} (found {FOUND}): the megatron extra on Python >= 3.12, or "
    f"`pip install --ignore-requires-python --no-deps megatron-core=={TESTED}` on 3.11 "
    "(docs/integrations/megatron.md)",
)

import _megatron_scenarios as S  # noqa: E402

TWO_RANKS = pytest.mark.xdist_group("megatron2")
LAYOUTS = ["plain", "dist"]
#: Stock megatron-core 0.19.2 per step, (all_reduces, host reads) on a clean and a skipped step.
STOCK_COUNTS = {"plain": ((4, 6), (2, 2)), "dist": ((3, 4), (2, 2))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    return spawn(S.everything, 2, tmp)


@TWO_RANKS
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stock_splits_the_scales_and_misscales_expert_gradients(runs, layout):
    for r in runs:
        steps = r["split"][f"stock-{layout}"]
        assert [s["found_inf"] for s in steps] == [False, True, False, False]
        assert steps[1]["scales"] == [8.0, 4.0]  # only the expert scaler backed off
        # The loss is scaled by the dense scale (8), the expert gradients unscaled by 4: 2x.
        assert steps[2]["loss_scale"] == 8.0
        assert steps[2]["ratio"] == pytest.approx(2.0, rel=1e-6)
        assert steps[3]["ratio"] == pytest.approx(2.0, rel=1e-6)
        assert steps[0]["ratio"] == pytest.approx(1.0, rel=1e-6)
        # One all_reduce and one host read per sub-optimizer for the flag, then the norm's: the
        # non-distributed sub-optimizers' grad-stats groups differ (model-parallel: 1 rank for the
        # dense one, 2 for the expert one), so the chain takes one norm per sub-optimizer (and
        # reads each twice); the distributed ones' are the world, one norm.
        clean, skip = STOCK_COUNTS[layout]
        assert [s["all_reduces"] for s in steps] == [clean[0], skip[0], clean[0], clean[0]]
        assert [s["host_reads"] for s in steps] == [clean[1], skip[1], clean[1], clean[1]]


@TWO_RANKS
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_scale_for_dense_and_expert_and_ranks_agree(runs, layout):
    for r in runs:
        steps = r["split"][f"ours-{layout}"]
        assert [s["found_inf"] for s in steps] == [False, True, False, False]
        assert [s["scales"] for s in steps] == [[8.0, 8.0], [4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
        for s in steps:
            if not s["found_inf"]:
                assert s["ratio"] == pytest.approx(1.0, rel=1e-6)
        # One all_reduce per step for the whole chain: the flag and the norm together.
        assert [s["all_reduces"] for s in steps] == [1, 1, 1, 1]
        # The flag (Megatron's step returns a bool) and the norm (a float): one read each, and on
        # the CPU this rank's norm before the collective (its float32 norms are taken again in
        # float64 where it is not finite).
        assert [s["host_reads"] for s in steps] == [3, 2, 3, 3]
    ours = [r["split"][f"ours-{layout}"] for r in runs]
    for key in ("scales", "found_inf", "grad_norm"):
        assert [s[key] for s in ours[0]] == [s[key] for s in ours[1]], key
    # The same gradients before the split: the same norm as stock, to fp32 precision.
    stock = runs[0]["split"][f"stock-{layout}"]
    assert ours[0][0]["grad_norm"] == pytest.approx(stock[0]["grad_norm"], rel=1e-6)
    assert ours[0][0]["params"] == stock[0]["params"]


@TWO_RANKS
@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_trajectory_step_for_step_where_nothing_splits(runs, layout):
    for r in runs:
        stock = r["trajectory"][f"stock-{layout}"]
        ours = r["trajectory"][f"ours-{layout}"]
        skipped = [not s["success"] for s in stock]
        assert skipped == [i in S.TRAJECTORY_INF for i in range(S.TRAJECTORY_STEPS)]
        scales = [s["scale"] for s in stock]
        assert min(scales) == 4.0 and max(scales) > 4.0  # the minimum was reached, then growth
        assert [s["scale"] for s in ours] == scales
        assert [s["success"] for s in ours] == [s["success"] for s in stock]
        for a, b in zip(ours, stock):
            assert (a["grad_norm"] is None) == (b["grad_norm"] is None)
            if a["grad_norm"] is not None:
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["params"] == pytest.approx(b["params"], rel=1e-5, abs=1e-6)
    assert runs[0]["trajectory"][f"ours-{layout}"] == runs[1]["trajectory"][f"ours-{layout}"]


@TWO_RANKS
def test_stock_lets_data_parallel_ranks_diverge_on_a_one_rank_inf_and_ours_does_not(runs):
    stock = [r["trajectory"]["stock-one-rank"] for r in runs]
    ours = [r["trajectory"]["ours-one-rank"] for r in runs]
    assert [s["success"] for s in stock[0]] == [True, True, True]  # rank 0 stepped and went on
    assert [s["success"] for s in stock[1]] == [True, False, True]  # rank 1 skipped
    assert stock[0][1]["params"] != stock[1][1]["params"]
    for r in ours:
        assert [s["success"] for s in r] == [True, False, True]
    assert ours[0] == ours[1]


@TWO_RANKS
def test_prepare_grads_twice_unscales_once_and_sub_optimizers_refuse_to_step_alone(runs):
    for r in runs:
        c = r["contracts"]
        twice = c["prepare_twice"]
        assert twice["first"] is False and twice["second"] is False
        assert twice["same_grads"] and twice["second_all_reduces"] == 0
        assert "ChainedOptimizer given to install()" in c["sub_step"]


@TWO_RANKS
def test_checkpoints_stock_in_with_the_smallest_scale_and_ours_out_to_stock(runs):
    for r in runs:
        c = r["contracts"]
        assert c["stock_saved_scales"] == [8.0, 4.0]
        assert c["loaded_scales"] == [4.0, 4.0]
        assert len(c["load_warnings"]) == 1 and "[4.0, 8.0]" in c["load_warnings"][0]
        # Ours saved after one more backoff: Megatron's keys, one value for every sub-optimizer.
        assert c["ours_scale"] == 2.0
        assert c["ours_saved"][0] == c["ours_saved"][1]
        assert set(c["ours_saved"][0]) == {"scale", "growth_tracker", "hysteresis_tracker"}
        assert c["ours_saved"][0]["scale"] == [2.0]
        assert c["stock_loaded_scales"] == [2.0, 2.0]
        saved = c["ours_saved"][0]
        assert (
            c["stock_loaded_trackers"]
            == [[saved["growth_tracker"], saved["hysteresis_tracker"]]] * 2
        )


@TWO_RANKS
def test_scaler_argument_as_every_integration_takes_it(runs):
    for r in runs:
        args = r["contracts"]["arguments"]
        assert args["disabled"][0] == "ValueError" and "must be enabled" in args["disabled"][1]
        assert args["cuda"][0] == "ValueError" and "device type" in args["cuda"][1]
        assert args["int"][0] == "TypeError" and "ScalerConfig" in args["int"][1]
        assert args["stock_kept"] == "DynamicGradScaler"  # refused before anything changed
        assert args["config"] == [32.0, "torch", [32.0, 32.0]]
        assert "already installed" in args["twice"]


@TWO_RANKS
def test_sharded_state_dict_carries_megatrons_keys(runs):
    for r in runs:
        entries = r["contracts"]["sharded_grad_scalers"]
        assert entries == [{"scale": [8.0], "growth_tracker": 0, "hysteresis_tracker": 1}] * 2


@TWO_RANKS
def test_unsupported_paths_are_refused_at_install_by_name(runs):
    for r in runs:
        refused = r["contracts"]["refused"]
        names = {
            "use_precision_aware_optimizer": "precision-aware optimizer",
            "optimizer_cpu_offload": "CPU offloading",
            "fp16": "without fp16",
            "use_megatron_fsdp": "Megatron-FSDP",
            "mimo": "MIMO",
        }
        for field, words in names.items():
            message, stock_kept = refused[field]
            assert words in message and stock_kept, field


def test_install_refuses_what_is_not_a_megatron_optimizer():
    import torch

    from distscaler.integrations import megatron as ds_megatron

    with pytest.raises(TypeError, match="get_megatron_optimizer"):
        ds_megatron.install(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_scaler_config_follows_megatrons_rule():
    from megatron.core.optimizer import OptimizerConfig

    from distscaler.integrations import megatron as ds_megatron

    dynamic = ds_megatron.scaler_config(
        OptimizerConfig(fp16=True, initial_loss_scale=2.0**12, min_loss_scale=2.0,
                        loss_scale_window=50, hysteresis=3)
    )  # fmt: skip
    assert (dynamic.policy, dynamic.init_scale, dynamic.min_scale) == ("megatron", 4096.0, 2.0)
    assert (dynamic.growth_interval, dynamic.hysteresis) == (50, 3)
    assert (dynamic.growth_factor, dynamic.backoff_factor) == (2.0, 0.5)
    static = ds_megatron.scaler_config(OptimizerConfig(fp16=True, loss_scale=128.0))
    assert (static.policy, static.init_scale) == ("static", 128.0)


@pytest.mark.slow
def test_train_megatron_gpt_moe_with_an_inf_in_one_ranks_experts_keeps_one_scale(tmp_path):
    args = ("--steps", "6", "--inject-inf", "3")
    ours = torchrun_summary("train_megatron.py", *args, out=tmp_path / "ours")
    stock = torchrun_summary("train_megatron.py", *args, "--stock", out=tmp_path / "stock")
    for summary in (ours, stock):
        assert summary["sub_optimizers"] == ["Float16OptimizerWithFloat16Params"] * 2
        assert summary["skipped_steps"] == [3] and summary["ranks_agree"] is True
        assert summary["scheduler_steps"] == 5  # Megatron-LM's train_step: held on the skip
        assert math.isfinite(summary["final_loss"])
    assert ours["scales"] == [2048.0, 2048.0]  # one scale for the dense and the expert optimizer
    assert stock["scales"] == [4096.0, 2048.0]  # the expert scaler backed off alone
