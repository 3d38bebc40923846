"""register_model's table: weights by parameter, held weakly, never aliased by a reused id."""

from __future__ import annotations

import gc

import torch

import distscaler
from distscaler.layouts import LayoutResolver


def test_registered_parameters_are_held_weakly():
    resolver = LayoutResolver(None)
    model = torch.nn.Linear(4, 4)
    assert resolver.register_model(model, "sharded") == 2
    weight = model.weight
    assert resolver.weight(weight, torch.zeros(4, 4), 2, None) == 1.0
    del model, weight
    gc.collect()
    assert resolver._registered._entries == {}  # the scaler does not keep a model alive


def test_an_unregistered_tensor_gets_no_registered_weight():
    resolver = LayoutResolver(None)
    model = torch.nn.Linear(4, 4)
    resolver.register_model(model, "replicated")
    other = torch.nn.Parameter(torch.zeros(4, 4))
    assert resolver.weight(model.weight, torch.zeros(4, 4), 4, None) == 0.25
    assert resolver.weight(other, torch.zeros(4, 4), 4, None) is None  # unknown, not a guess
    # The scaler's own grad_layout covers what no registration does.
    assert LayoutResolver("sharded").weight(other, torch.zeros(4, 4), 4, None) == 1.0


def test_a_later_registration_wins():
    scaler = distscaler.GradScaler("cpu")
    model = torch.nn.Linear(4, 4)
    scaler.register_model(model, grad_layout="replicated").register_model(
        model, grad_layout="sharded"
    )
    assert scaler._layouts.weight(model.bias, torch.zeros(4), 2, None) == 1.0


def test_an_fsdp2_model_moves_after_steps_with_a_registered_model(tmp_path):
    """``model.to()`` swaps FSDP2's DTensor parameters (``torch.utils.swap_tensors``), which torch
    refuses for a tensor with a weak reference: the scaler's tables hold none, so a framework
    can offload its model between steps (ROLL's ``offload_states``, verl's offload)."""
    import _layout_scenarios as L
    from _harness import spawn

    (out,) = spawn(L.fsdp2_model_moves_after_a_step, 1, tmp_path)
    assert out["named"] == 4, out  # the registration ran (2 weights, 2 biases named)
    assert out["moved"] == ["torch.float64", "torch.float32"], out
    assert out["scales"] == [256.0, 256.0], out  # a step before and after the moves
