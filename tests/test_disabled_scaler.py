"""A disabled scaler only clips, as torch's ``clip_grad_norm_`` would, whatever the layout.

``GradScaler("cuda")`` on a machine without CUDA is disabled (torch's warning); its
``clip_grad_norm_`` under DDP once asked for the gradients' layout and raised
``UnknownLayoutError`` on every rank. Now it is ``torch.nn.utils.clip_grad_norm_`` over the
optimizer's parameters: the same norm and the same clipped gradients, bit for bit, as torch's on a
twin model holding the same gradients, and no collective but torch's own (none under DDP; under
FSDP2 exactly those of torch's norm over DTensors). 2 gloo ranks (tests/_disabled_scenarios.py),
and a single process.
"""

from __future__ import annotations

import math

import _disabled_scenarios as S
import pytest
import torch
from _harness import spawn

from distscaler import GradScaler


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(S.disabled_clip, 2, tmp_path_factory.mktemp("disabled"))


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_a_disabled_scalers_clip_is_torchs_clip_bit_for_bit(two, layout):
    for run in two:
        for case in run[layout]:
            assert case["norm_bits"] and case["type"], case
            assert case["grads_bits"], case
            assert case["collectives"] == case["torch_collectives"], case
            assert math.isfinite(case["norm"]) and case["norm"] > 0, case  # not vacuous
    # Under FSDP2 torch's norm over DTensors reduces over the mesh: the scaler adds nothing to it.
    assert all(c["torch_collectives"] > 0 for c in two[0]["fsdp2"]), two[0]["fsdp2"]
    # Clipping did clip: at max_norm 0.05 the norm was above it (the gradients changed).
    assert all(c["norm"] > 0.05 for c in two[0]["ddp"] if c["clip"][0] == 0.05)


def test_under_ddp_a_disabled_scalers_clip_issues_no_collective(two):
    for run in two:
        assert [c["collectives"] for c in run["ddp"]] == [0] * len(S.CLIPS)
    # Each rank's own gradients (DDP averaged them): the same norm on both ranks.
    assert [c["norm"] for c in two[0]["ddp"]] == [c["norm"] for c in two[1]["ddp"]]


@pytest.mark.parametrize(("max_norm", "norm_type"), S.CLIPS)
def test_a_disabled_scaler_clips_as_torch_in_one_process(max_norm, norm_type):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(16, 8)
    for m in (model, twin):
        m(x).square().sum().backward()
    scaler = GradScaler("cpu", enabled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type)
    assert torch.equal(norm, expected) and norm.dtype == expected.dtype
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(ValueError, match="max_norm"):  # the same checks as an enabled scaler's
        scaler.clip_grad_norm_(opt, -1.0)
