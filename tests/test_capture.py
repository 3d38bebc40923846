"""A scaler step a graph can replay: every counter lives on the device.

``clip_grad_norm_`` + ``step`` + ``update`` of a fused optimizer reads nothing on the host and keeps
the scale, the growth tracker, the policy's counters and the skip counters in device tensors that it
updates in place. So a step recorded once and replayed N times must leave exactly what N eager steps
leave, faults included. On the CPU this is proven with ``make_fx`` (the step traced once into an FX
graph of aten ops, the host code then never runs again); on a GPU with ``torch.cuda.graph`` (marker
``cuda``), and with the NCCL all_reduce inside the graph (marker ``multigpu``).
"""

from __future__ import annotations

import math
import operator

import _capture as C
import _nccl
import pytest
import torch
from _common import gpu_path
from torch.fx.experimental.proxy_tensor import make_fx

STEPS = C.STEPS


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("policy", ["torch", "deepspeed", "megatron"])
def test_traced_step_replayed_matches_eager_steps(policy, clip):
    faults = C.FAULTS
    # Both on the path a GPU runs (what a trace records): on the CPU's own path the clip's
    # per-tensor norms are float32 (torch's), on a GPU's float64 (docs/pass-semantics.md).
    eager = C.Run.build(policy, clip)
    gpu_path(eager.scaler)
    for step in range(STEPS):
        eager.set_grads(step, faults)
        eager.step()

    traced = C.Run.build(policy, clip)
    gpu_path(traced.scaler)
    traced.set_grads(0, faults)
    traced.step()  # warm-up: the plan, the constants, the device state
    traced.set_grads(1, faults)
    graph = make_fx(lambda: traced.step())()  # runs step 1 for real while it records it
    ops = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert torch.ops.aten._local_scalar_dense.default not in ops  # no host read was recorded
    for step in range(2, STEPS):
        traced.set_grads(step, faults)
        graph()  # aten ops only: nothing of the scaler's Python runs

    assert traced.snapshot() == eager.snapshot()
    totals = eager.scaler.skip_totals
    # Guards: every fault was seen (and skipped), growths happened, and replays did the counting.
    assert (totals.num_updates, totals.num_skipped) == (STEPS, len(faults))
    assert totals.last_skipped == max(faults) + 1
    assert eager.scaler.get_scale() > C.INIT_SCALE / 2 ** len(faults)


def test_a_traced_step_sees_a_fault_injected_after_the_trace():
    run = C.Run.build("torch", clip=True)
    run.set_grads(0, {})
    run.step()
    run.set_grads(1, {})
    graph = make_fx(lambda: run.step())()
    before = [p.detach().clone() for p in run.params]
    run.set_grads(2, {2: ("nan", 0)})
    graph()
    assert all(torch.equal(a, p) for a, p in zip(before, run.params))  # skipped: unchanged
    totals = run.scaler.skip_totals
    assert (totals.num_updates, totals.num_skipped, totals.last_skipped) == (3, 1, 3)
    assert totals.last_skipped_scale == C.INIT_SCALE
    assert run.scaler.get_scale() == C.INIT_SCALE / 2


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_cuda_graph_replay_matches_eager_steps(clip):
    faults = C.FAULTS
    eager = C.Run.build("torch", clip, device="cuda")
    for step in range(STEPS):
        eager.set_grads(step, faults)
        eager.step()
    graphed = C.Run.build("torch", clip, device="cuda")
    graph = C.capture(graphed, faults)
    for step in range(C.WARMUP, STEPS):
        graphed.set_grads(step, faults)
        graph.replay()
    torch.cuda.synchronize()
    assert graphed.snapshot() == eager.snapshot()
    totals = graphed.scaler.skip_totals
    assert (totals.num_updates, totals.num_skipped) == (STEPS, len(faults))


@pytest.mark.multigpu
@pytest.mark.xdist_group("nccl")
def test_nccl_all_reduce_inside_a_cuda_graph_agrees_on_every_rank(tmp_path):
    results = _nccl.spawn_per_gpu(C.graphed_agreement, 2, tmp_path)
    fault_steps = sorted(C.RANK_FAULTS)
    for res in results:
        assert res["skipped"] == [step in C.RANK_FAULTS for step in range(STEPS)]
        assert res["scales"] == results[0]["scales"]
        assert res["digest"] == results[0]["digest"]
        assert res["totals"] == [STEPS, len(fault_steps), fault_steps[-1] + 1]
    assert not math.isclose(results[0]["scales"][-1], C.INIT_SCALE)


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose output ``node`` is a view of (itself if it is none): through view ops and
    the items of one that gives several (``unbind``)."""
    while node.op == "call_function" and (
        getattr(node.target, "is_view", False) or node.target is operator.getitem
    ):
        node = node.args[0]  # type: ignore[assignment]
    return node


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
def test_a_traced_step_keeps_the_overflow_record_on_the_device(clip):
    # An interval no replay reaches: the record is only advanced by the traced ops, and read once
    # at the end (report_overflow, outside the graph), as after CUDA graph replays.
    faults = {3: ("inf", 1), 6: ("nan", 0), 8: ("-inf", 4)}
    eager = C.Run.build("torch", clip, skip_log_interval=10_000)
    for step in range(STEPS):
        eager.set_grads(step, faults)
        eager.step()
    traced = C.Run.build("torch", clip, skip_log_interval=10_000)
    traced.set_grads(0, faults)
    traced.step()
    traced.set_grads(1, faults)
    graph = make_fx(lambda: traced.step())()
    # The skip counters' four elements and the overflow flags in one _foreach_lerp_, traced: the
    # flags weighed by found_inf in one element per gradient, a view of the clamp that makes the
    # skip counters' found_inf (a weight of the flags' sizes keeps torch's CUDA foreach on its
    # one-kernel path), and no lerp_ of their own.
    (lerp,) = [n for n in graph.graph.nodes if n.target == torch.ops.aten._foreach_lerp_.List]
    assert len(lerp.args[0]) == 5
    assert not [n for n in graph.graph.nodes if n.target == torch.ops.aten.lerp_.Tensor]
    weights = lerp.args[2]
    clamp = _through_views(weights[1])
    assert clamp.target in (torch.ops.aten.clamp.default, torch.ops.aten.clamp.Tensor)
    assert _through_views(weights[-1]) is clamp and weights[-1] is not weights[1]
    for step in range(2, STEPS):
        traced.set_grads(step, faults)
        graph()
    assert traced.scaler.last_overflow is None  # nothing was read during the replays
    report = traced.scaler.report_overflow()
    assert report == eager.scaler.report_overflow()
    assert report.step == 9 and [(e.rank, e.param, e.kind) for e in report.entries] == [
        (0, "param_groups[0][4]", "inf")
    ]
