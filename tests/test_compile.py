"""torch.compile of the scaler phase: compiled equals eager, at world size 1 and 2 (gloo).

One spawn per world size runs every scenario with one compiled function (tests/_compile_scenarios.py):
compiling on a small CPU is the expensive part.
"""

from __future__ import annotations

import math

import _compile_scenarios as C
import pytest
import torch
from _harness import spawn
from _torch_gaps import CRASH, fullgraph_gaps

from distscaler import GradScaler

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
            if clip:  # torch's own compiled 2-norm may round an ulp off its eager one (2.6.0)
                assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-6), rank
            else:
                assert compiled["norms"] == eager["norms"], rank
        else:
            torch_diff = res["torch-foreach"]["param_diff"]
            assert run["param_diff"] <= torch_diff, (rank, run["param_diff"], torch_diff)
    assert len({str(r[f"{opt_kind}-clip"]["compiled"]) for r in results}) == 1  # ranks agree


def _whole(result: dict) -> dict:
    """A result of the whole phase as one graph (``fullgraph=True``). Where this torch is below
    distscaler's gate (``TRACES_WHOLE_PHASE``), skip with the proof: dynamo failing torch-only
    recipes of the Python the phase needs (``tests/_torch_gaps.FULLGRAPH_RECIPES``)."""
    if not C.TRACES_WHOLE_PHASE:
        pytest.skip(
            f"torch {torch.__version__}: dynamo cannot trace, fullgraph: {fullgraph_gaps()}"
        )
    assert CRASH not in result, result.get(CRASH)
    return result


def test_the_fullgraph_gate_is_what_torchs_dynamo_can_trace():
    # Neither too strict (torch traces it all, yet we take graph breaks) nor too lax.
    gaps = fullgraph_gaps()
    assert C.TRACES_WHOLE_PHASE == (not gaps), (torch.__version__, gaps)


@pytest.mark.parametrize("clip_id", list(C.CLIP_IDS))
def test_fused_phase_traces_whole_with_fullgraph(runs, clip_id):
    # clip_grad_norm_ (its all_reduce included at 2 ranks), the fused AdamW step and update in
    # one graph: torch's step alone cannot be (its graph breaks; dynamo skips fused kernels).
    world_size, results = runs
    for rank, res in enumerate(results):
        full = _whole(res["fullgraph"][clip_id])
        eager_graphs, compiled_graphs = full["graphs"]
        assert eager_graphs == 0 and 1 <= compiled_graphs <= 2, full[
            "graphs"
        ]  # no per-step compile
        assert full["scales"][0] == full["scales"][1] == EXPECTED_SCALES, rank
        if clip_id == "clip":
            assert full["norms"][1][C.INJECT_STEP] == float("inf")
            # Inductor takes the square root of the summed squares (2 ranks) in its own fused
            # kernel: the returned norm may differ from eager's in the last bit.
            assert full["norms"][1] == pytest.approx(full["norms"][0], rel=1e-6), rank
        # The same fused kernel: bit for bit, the gradients it unscales in place included.
        assert full["param_diff"] == 0.0 and full["grad_diff"] == 0.0, rank
        # The step count undone on the skip, as torch's fused step does.
        assert full["steps"][0] == full["steps"][1] == [C.NUM_STEPS - 1.0] * 4, rank
        # torch's step hooks ran at every step, skipped steps too; the LR scheduler saw each step
        # (tensor lr) and had nothing to warn about.
        assert full["hook_calls"][0] == full["hook_calls"][1] == [C.NUM_STEPS] * 2, rank
        assert full["lrs"][0] == full["lrs"][1], rank
        assert full["scheduler_warnings"] == [[], []], rank
    assert len({str(r["fullgraph"][clip_id]["norms"]) for r in results}) == 1  # ranks agree


def test_graph_breaks_of_the_phase(runs):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("checked in one process")
    breaks = _whole(results[0]["breaks"])
    assert breaks["fused"] == []
    # A non-fused step is decided on the host (the agreed flag, read once, by the step's inf check:
    # distscaler._plan.plan_step): that read breaks it.
    assert breaks["foreach"], "the non-fused step's graph break was not seen"
    assert all(
        "distscaler/_inf_check.py" in site and "item()" in site or "torch/optim/optimizer.py" in site
        for site in breaks["foreach"]
    ), breaks["foreach"]


@pytest.mark.parametrize("variant", ["adam-amsgrad-maximize", "adamw-two-dtypes"])
def test_traced_fused_step_variants_equal_eager(runs, variant):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("checked in one process")
    run = _whole(results[0]["variants"])[variant]
    assert run["graphs"] >= 1
    assert run["scales"][0] == run["scales"][1] == [16.0, 16.0, 16.0, 8.0]  # the inf skipped
    assert run["param_diff"] == 0.0 and run["state_diff"] == 0.0
    # step, exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad) for each of 4 parameters
    assert run["num_state"] == (16 if "amsgrad" in variant else 12)


def test_eager_and_compiled_calls_can_take_turns(runs):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("checked in one process")
    run = _whole(results[0]["interleaved"])
    assert "error" not in run, run["error"]  # e.g. fullgraph=True at dynamo's recompile limit
    assert 1 <= run["graphs"] <= 3, run  # not one per call
    # The device counted every update, compiled or not: skips at updates 4 and 5.
    assert run["totals"] == [12, 2, 5], run


def test_inductor_kernels_of_the_whole_phase(runs):
    world_size, results = runs
    if world_size != 1:
        pytest.skip("counted in one process")
    kernels = _whole(results[0]["kernels"])
    for counts in kernels.values():
        assert counts["eager_ops"]["aten._fused_adamw_.default"] == 1, counts  # the step counted
    # With clipping the inf check's counter terms and the step counts fuse: fewer kernels than eager ops.
    assert kernels["clip"]["compiled"] < kernels["clip"]["eager"], kernels
    assert kernels["clip"]["compiled"] < kernels["clip"]["eager_gpu_path"], kernels
    # Without clipping there is little to fuse, and the copy of the kernel's outputs back into
    # the parameters, gradients and moments is one kernel more.
    assert kernels["noclip"]["compiled"] <= kernels["noclip"]["eager"] + 1, kernels


@pytest.mark.cuda
def test_reduce_overhead_captures_the_whole_phase_in_a_cuda_graph():
    run = _whole(C.reduce_overhead_runs("cuda") if C.TRACES_WHOLE_PHASE else {})
    assert run["cudagraph_skips"] == 0  # inductor took the whole phase into a CUDA graph
    assert run["scales"][0] == run["scales"][1] == EXPECTED_SCALES
    assert run["norms"][1][C.INJECT_STEP] == float("inf")
    assert run["norms"][1] == pytest.approx(run["norms"][0], rel=1e-6)
    assert run["param_diff"] == 0.0


@pytest.mark.parametrize("policy", ["torch", "deepspeed"])
def test_the_compiled_phase_compiles_once(policy):
    # dynamo guards on what the phase reads: state made at its first call (the policy's counters,
    # a cache) would compile the whole phase again at its second call. backend="eager": the guards
    # are dynamo's, whatever the backend.
    if not C.TRACES_WHOLE_PHASE:
        # With graph breaks, inf_check.run is a frame of its own, compiled once per plan it is
        # called with (the clip's and the step's): one graph each, not a recompile of the phase.
        pytest.skip(f"torch {torch.__version__} breaks the phase into frames")
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(4)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    hysteresis = 2 if policy == "deepspeed" else 1
    scaler = GradScaler("cpu", skip_log_interval=0, policy=policy, hysteresis=hysteresis)
    scaler.materialize()

    def phase() -> None:
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()

    compiled = torch.compile(phase, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p) * (math.inf if step == 1 else 1.0)
            compiled()
    assert scaler.skip_totals.num_skipped == 1  # guard: the phase ran, the inf was seen
