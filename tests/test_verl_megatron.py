"""verl's Megatron engine in fp16 with ``distscaler.integrations.verl``, against stock verl 0.9.1.

One spawn of 2 gloo ranks per model (tests/_verl_megatron_scenarios.py: the engine, the models,
the CPU stand-ins with why). verl's ``MegatronEngineWithLMHead`` (distributed optimizer), fp16,
verl's PPO loss, an inf in rank 1's main gradients at step 1; "dense": a tiny Qwen2, DP = 2, one
optimizer; "moe": a tiny Qwen3-MoE, EP = 2, Megatron's ``ChainedOptimizer`` of a dense and an
expert optimizer:

* stock verl raises ``NotImplementedError("Megatron optimizer step failed...")`` from
  ``optimizer_step`` on the skipped step, on both ranks;
* ours skips on both ranks (parameters unchanged, ``grad_norm`` nan, ``distscaler/skipped``),
  then trains on; one scale for every sub-optimizer, halved once by the skip (hysteresis 1); the
  LR scheduler held on the skipped step; the same norm as stock before the skip.

Needs verl 0.9.1, megatron-core 0.19.2 and mbridge (``pip install mbridge einops``); skips otherwise.
"""

from __future__ import annotations

import math

import pytest
from _harness import spawn

from common.megatron_cpu import stub_gpu_only_imports

TESTED_VERL, TESTED_MCORE = "0.9.1", "0.19.2"
try:
    stub_gpu_only_imports()
    import megatron.core as megatron

    MCORE: str | None = megatron.__version__.split("+")[0]
except ImportError:
    MCORE = None
try:
    import verl

    VERL: str | None = verl.__version__
except ImportError:
    VERL = None
try:
    import einops  # noqa: F401  (mbridge imports it)
    import mbridge  # noqa: F401

    MBRIDGE = True
except ImportError:
    MBRIDGE = False

pytestmark = [
    pytest.mark.skipif(
        VERL != TESTED_VERL or MCORE != TESTED_MCORE or not MBRIDGE,
        reason=f"verl {TESTED_VERL} (found {VERL}), megatron-core {TESTED_MCORE} (found {MCORE}) "
        f"and mbridge (found: {MBRIDGE})",
    ),
    pytest.mark.xdist_group("verl_megatron2"),
]

INF_STEP = 1


#: Sub-optimizers Megatron builds: one (dense), dense + expert (MoE, EP = 2).
SUBS = {"dense": 1, "moe": 2}


@pytest.fixture(scope="module", params=sorted(SUBS))
def run(request, tmp_path_factory):
    import _verl_megatron_scenarios as S

    tmp = tmp_path_factory.mktemp(f"verl-megatron-{request.param}")
    return request.param, spawn(getattr(S, request.param), 2, tmp)


@pytest.fixture
def results(run):
    return run[1]


def test_the_registry_builds_verls_megatron_engine_stock_and_ours(results):
    for r in results:
        assert r["stock_engine"] == "verl.workers.engine.megatron.transformer_impl"
        assert r["ours_engine"] == "distscaler.integrations.verl"


def test_stock_raises_on_the_skipped_step_on_both_ranks(results):
    for r in results:
        steps = r["stock"]
        assert len(steps) == INF_STEP + 1
        assert "error" not in steps[0] and math.isfinite(steps[0]["grad_norm"])
        assert steps[INF_STEP]["error"].startswith(
            "NotImplementedError: Megatron optimizer step failed"
        )


def test_ours_skips_on_both_ranks_and_trains_on(results):
    for r in results:
        steps = r["ours"]
        assert [s.get("error") for s in steps] == [None] * 4
        skipped = steps[INF_STEP]
        assert math.isnan(skipped["grad_norm"])
        assert skipped["metrics"]["distscaler/skipped"] == 1.0
        assert skipped["metrics"]["distscaler/overflow_tensors"] >= 1
        assert not skipped["changed"]  # skipped: parameters untouched
        for s in steps[INF_STEP + 1 :]:
            assert math.isfinite(s["grad_norm"]) and s["changed"]
            assert s["metrics"]["distscaler/skipped"] == 0.0
    # Both ranks report the same norms (one agreed step).
    assert [s["grad_norm"] for s in results[0]["ours"] if math.isfinite(s["grad_norm"])] == [
        s["grad_norm"] for s in results[1]["ours"] if math.isfinite(s["grad_norm"])
    ]


def test_one_scale_for_every_sub_optimizer(run):
    kind, results = run
    for r in results:
        assert r["stock_subs"] == r["ours_subs"] == SUBS[kind]
        assert r["stock"][0]["scales"] == [32768.0] * SUBS[kind]  # verl's initial_loss_scale
        for s in r["ours"]:
            assert s["scales"] == [s["metrics"]["distscaler/scale"]] * SUBS[kind]
        assert [s["scales"][0] for s in r["ours"]] == [32768.0] + [16384.0] * 3


def test_the_lr_scheduler_is_held_on_the_skipped_step(results):
    for r in results:
        lrs = [s["lr"] for s in r["ours"]]
        assert lrs[INF_STEP] == lrs[INF_STEP - 1]  # held
        assert lrs[INF_STEP + 1] > lrs[INF_STEP] and lrs[INF_STEP + 2] > lrs[INF_STEP + 1]
        # Before the skip, ours and stock took the same step.
        assert r["ours"][0]["lr"] == r["stock"][0]["lr"]
        assert r["ours"][0]["grad_norm"] == pytest.approx(r["stock"][0]["grad_norm"], rel=1e-5)
