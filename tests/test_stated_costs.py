"""What each entry point's docstring states of its collectives is what it issues: counted on 2 gloo
ranks under DDP (tests/_cost_scenarios.py: every collective the scaler may call, patched to record
its kind and its float32 elements), a fused and a foreach AdamW, the replica check on and off.

Each row below is a statement taken from a public docstring (the test checks the docstring still
says it) and the collectives it promises, without the replica check; the check adds 16 float32 to
the first collective of the step at 2 ranks (its checksum's limbs), its first check preceded by
one broadcast of its key, also stated."""

from __future__ import annotations

import inspect

import pytest
from _cost_scenarios import SEQUENCES, costs
from _harness import spawn

from distscaler import GradScaler

#: (the calls, the optimizer) -> (the method whose docstring states it, the words, what it issues).
STATED = {
    ("unscale_", "fused"): ("unscale_", "one ``all_reduce`` of 2 float32", [("all_reduce", 2)]),
    ("unscale_", "foreach"): ("unscale_", "one ``all_reduce`` of 2 float32", [("all_reduce", 2)]),
    ("clip_grad_norm_", "fused"): ("clip_grad_norm_", "one ``all_reduce`` of 2 float32",
                                   [("all_reduce", 2)]),
    ("clip_grad_norm_", "foreach"): ("clip_grad_norm_", "one ``all_reduce`` of 2 float32",
                                     [("all_reduce", 2)]),
    ("clip_grad_norm_ inf", "fused"): ("clip_grad_norm_", "one ``all_reduce`` of 2 float32",
                                       [("all_reduce", 2)]),
    ("clip_grad_norm_ inf", "foreach"): ("clip_grad_norm_", "one ``all_reduce`` of 2 float32",
                                         [("all_reduce", 2)]),
    ("unscale_ then clip_grad_norm_", "fused"): (
        "clip_grad_norm_", "a second ``all_reduce`` of 2 float32, replicated gradients too",
        [("all_reduce", 2), ("all_reduce", 2)]),
    ("unscale_ then clip_grad_norm_", "foreach"): (
        "clip_grad_norm_", "a second ``all_reduce`` of 2 float32, replicated gradients too",
        [("all_reduce", 2), ("all_reduce", 2)]),
    ("step", "fused"): ("step", "``all_reduce`` of 1 float32 for a fused optimizer",
                        [("all_reduce", 1)]),
    ("step", "foreach"): ("step", "2 for another", [("all_reduce", 2)]),
}  # fmt: skip

#: Where the replica check rides: the words on each method's page.
CHECK_STATED = {
    "unscale_": "16 float32 more where the replica check rides in it (up to 4,096 ranks",
    "clip_grad_norm_": "16 float32 more where the replica check rides in it (up to 4,096 ranks",
    "step": "16 more where the replica check rides in it",
}
#: ... and at ``norm_type=inf`` the collective is a gather (the checksum sums, the norm maxes).
GATHER_STATED = "then at ``norm_type=inf`` one\n        ``all_gather`` of as many float32 per rank instead"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(costs, 2, tmp_path_factory.mktemp("costs"))


def _doc(method: str) -> str:
    return inspect.getdoc(getattr(GradScaler, method)) or ""


def _dedent(words: str) -> str:
    return " ".join(words.split())


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
@pytest.mark.parametrize("calls", list(SEQUENCES))
def test_each_entry_point_issues_the_collectives_its_docstring_states(two, calls, optimizer):
    method, words, stated = STATED[(calls, optimizer)]
    assert _dedent(words) in _dedent(_doc(method)), (method, words)
    for r in two:
        counted = [tuple(c) for c in r[f"{optimizer}-nocheck-{calls}"]]
        assert counted == stated, (calls, optimizer, counted)


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
@pytest.mark.parametrize("calls", list(SEQUENCES))
def test_the_replica_check_adds_the_float32_stated_to_the_first_collective(
    two, calls, optimizer
):
    method, _, stated = STATED[(calls, optimizer)]
    assert _dedent(CHECK_STATED[method]) in _dedent(_doc(method)), method
    assert "one ``broadcast`` of its key" in _dedent(_doc(method)) or method == "step"
    # the run's first check: its key's broadcast, once (each sequence runs on a fresh scaler)
    expected = [("broadcast", 1), (stated[0][0], stated[0][1] + 16), *stated[1:]]
    if calls == "clip_grad_norm_ inf":  # the norm's MAX beside the checksum's SUM: a gather
        assert _dedent(GATHER_STATED) in _dedent(_doc("clip_grad_norm_"))
        expected = [("broadcast", 1), ("all_gather", stated[0][1] + 16)]
    for r in two:
        counted = [tuple(c) for c in r[f"{optimizer}-check-{calls}"]]
        assert counted == expected, (calls, optimizer, counted)
