"""torch.compile of the scaler phase: compiled equals eager, at world size 1 and 2 (gloo).

One spawn per world size runs every scenario with one compiled function (tests/_compile_scenarios.py):
compiling on a small CPU is the expensive part.
"""

from __future__ import annotations

import _compile_scenarios as C
import pytest
from _harness import spawn

WORLD_SIZES = [
    pytest.param(1, marks=pytest.mark.xdist_group("compile1"), id="1rank"),
    pytest.param(2, marks=pytest.mark.xdist_group("compile2"), id="2ranks"),
]

#: growth_interval 2 from 2**4: grows after steps 1 and 5, skips and backs off at step 3.
EXPECTED_SCALES = [16.0, 32.0, 32.0, 16.0, 16.0, 32.0]
EXPECTED_SKIPS = [step == C.INJECT_STEP for step in range(C.NUM_STEPS)]


@pytest.fixture(scope="module", params=WORLD_SIZES)
def runs(request, tmp_path_factory):
    world_size = request.param
    return world_size, spawn(
        C.compile_scenarios, world_size, tmp_path_factory.mktemp(f"compile{world_size}")
    )


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("opt_kind", C.OPT_KINDS)
def test_compiled_phase_equals_eager_through_growth_skip_and_backoff(runs, opt_kind, clip):
    world_size, results = runs
    for rank, res in enumerate(results):
        run = res[f"{opt_kind}-{'clip' if clip else 'noclip'}"]
        eager, compiled = run["eager"], run["compiled"]
        # The run really grew, skipped (every rank, the inf was on the last one) and backed off.
        assert eager["scales"] == EXPECTED_SCALES, rank
        assert eager["skips"] == EXPECTED_SKIPS, rank
        assert compiled["scales"] == eager["scales"], rank
        assert compiled["skips"] == eager["skips"], rank
        if clip:
            assert compiled["norms"][C.INJECT_STEP] == float("inf")
            assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-5), rank
        # As close as torch's own compiled recipe is to its eager one (inductor's foreach AdamW
        # rounds differently; a fused step is exact), with the same steps on the same rank.
        if opt_kind == "fused":
            assert run["param_diff"] == 0.0
            assert compiled["norms"] == eager["norms"]
        else:
            torch_diff = res["torch-foreach"]["param_diff"]
            assert run["param_diff"] <= torch_diff, (rank, run["param_diff"], torch_diff)
    assert len({str(r[f"{opt_kind}-clip"]["compiled"]) for r in results}) == 1  # ranks agree


def test_fused_clip_and_update_trace_with_fullgraph(runs):
    # clip_grad_norm_ (its all_reduce included at 2 ranks) and update each as one graph; torch's
    # optimizer step between them is torch's (it breaks any graph by design).
    world_size, results = runs
    for res in results:
        full = res["fullgraph"]
        eager_scales, compiled_scales = full["scales"]
        assert eager_scales == compiled_scales == EXPECTED_SCALES
        eager_norms, compiled_norms = full["norms"]
        assert compiled_norms == eager_norms
        assert compiled_norms[C.INJECT_STEP] == float("inf")
        assert full["param_diff"] == 0.0


def test_only_torchs_optimizer_step_breaks_the_fused_phase(runs):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("checked in one process")
    breaks = results[0]["breaks"]
    assert breaks, "the optimizer step's graph break was not seen"
    assert all("torch/optim/optimizer.py" in site for site in breaks), breaks


def test_inductor_fuses_the_clip_verdict(runs):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("counted in one process")
    kernels = results[0]["kernels"]
    # Eager: _foreach_norm, stack, vector_norm, _foreach_addcdiv, nan_to_num, fmax, nan_to_num.
    assert kernels["compiled"]["clip_grad_norm_"] < kernels["eager"]["clip_grad_norm_"], kernels
    assert kernels["compiled"]["update"] >= 1, kernels
