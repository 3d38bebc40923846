"""Scaler states from torch, Megatron and DeepSpeed load into distscaler and continue the trajectory."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from test_policies import MegatronReference, ds_state, our_state

from distscaler import GradScaler

OVERFLOWS = (torch.rand(120, generator=torch.Generator().manual_seed(7)) < 0.3).tolist()


@pytest.fixture(autouse=True)
def quiet_deepspeed_comm(monkeypatch):
    import deepspeed.runtime.fp16.loss_scaler as ls

    monkeypatch.setattr(ls, "dist", type("Comm", (), {"get_rank": staticmethod(lambda g=None: 0)}))


def dynamic_loss_scaler(**overrides):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    kwargs = dict(
        init_scale=2.0**12,
        scale_window=4,
        min_scale=1.0,
        delayed_shift=3,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=False,
    )
    return DynamicLossScaler(**(kwargs | overrides))


def ds_policy_scaler(**overrides) -> GradScaler:
    kwargs = dict(
        init_scale=2.0**12, growth_interval=4, min_scale=1.0, policy="deepspeed", hysteresis=3
    )
    return GradScaler("cpu", **(kwargs | overrides))


def first_mid_hysteresis(ref, overflows) -> int:
    """Advance ``ref`` until its hysteresis is partly used; return the number of steps taken."""
    for i, overflow in enumerate(overflows):
        ref.update_scale(overflow)
        if 1 < ref.cur_hysteresis < ref.delayed_shift:
            return i + 1
    raise AssertionError("the sequence never left the hysteresis half-used")


def continue_both(ref, ours: GradScaler, overflows) -> int:
    n = 0
    for overflow in overflows:
        ref.update_scale(overflow)
        ours.update_scale(overflow)
        assert our_state(ours) == ds_state(ref)
        n += 1
    return n


@pytest.mark.parametrize("via", ["object", "zero_state_dict"])
def test_pickled_deepspeed_loss_scaler_continues_mid_hysteresis(via):
    ref = dynamic_loss_scaler()
    k = first_mid_hysteresis(ref, OVERFLOWS)
    blob = pickle.dumps(ref)  # what a ZeRO checkpoint holds under "loss_scaler"
    saved = pickle.loads(blob)
    ours = ds_policy_scaler()
    ours.load_state_dict(saved if via == "object" else {"loss_scaler": saved, "overflow": False})
    assert our_state(ours) == ds_state(ref) and 1 < ours.cur_hysteresis < 3  # guard
    assert continue_both(ref, ours, OVERFLOWS[k:]) > 50


def test_deepspeed_object_settings_replace_the_constructors_with_a_warning():
    ref = dynamic_loss_scaler(delayed_shift=4, consecutive_hysteresis=True, min_scale=2.0)
    k = first_mid_hysteresis(ref, OVERFLOWS)
    ours = ds_policy_scaler()
    with pytest.warns(UserWarning) as record:
        ours.load_state_dict(ref)
    messages = " | ".join(str(w.message) for w in record)
    assert "min_scale=1.0 given to the constructor is replaced" in messages
    assert "hysteresis=4, consecutive_hysteresis=True" in messages
    continue_both(ref, ours, OVERFLOWS[k:])


def test_deepspeed_fp16_optimizer_state_dict_continues():
    """ZeRO-0's FP16_Optimizer saves plain keys and has no hysteresis: DeepSpeed's rule with 1."""
    ref = dynamic_loss_scaler(delayed_shift=1)
    for overflow in OVERFLOWS[:30]:
        ref.update_scale(overflow)
    state = {  # the keys of deepspeed/runtime/fp16/fused_optimizer.py FP16_Optimizer.state_dict
        "dynamic_loss_scale": True,
        "cur_scale": ref.cur_scale,
        "cur_iter": ref.cur_iter,
        "last_overflow_iter": ref.last_overflow_iter,
        "scale_factor": ref.scale_factor,
        "scale_window": ref.scale_window,
        "optimizer_state_dict": {"state": {}, "param_groups": []},
        "fp32_groups_flat": [torch.zeros(3)],
        "clip_grad": 1.0,
    }
    ours = ds_policy_scaler(hysteresis=1, growth_interval=1000)
    ours.load_state_dict(state)
    assert ours.state_dict()["growth_interval"] == 4
    assert continue_both(ref, ours, OVERFLOWS[30:]) == 90


def test_megatron_state_dict_continues_mid_hysteresis():
    ref = MegatronReference(2.0**12, 1.0, 2.0, 0.5, 4, 3)
    k = 0
    while ref.hysteresis_tracker != 2:
        ref.update(OVERFLOWS[k])
        k += 1
    # Megatron saves its scale as a 1-element float32 tensor on its device.
    state = {
        "scale": torch.tensor([ref.scale], dtype=torch.float32),
        "growth_tracker": ref.growth_tracker,
        "hysteresis_tracker": ref.hysteresis_tracker,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    ours = GradScaler(
        "cpu", init_scale=2.0**12, min_scale=1.0, growth_interval=4, policy="megatron", hysteresis=3
    )
    ours.load_state_dict(torch.load(buffer, weights_only=True))
    assert ours.cur_hysteresis == 2  # guard: mid-hysteresis
    for overflow in OVERFLOWS[k:]:
        ref.update(overflow)
        ours.update_scale(overflow)
        assert (ours.get_scale(), ours.cur_hysteresis) == (ref.scale, ref.hysteresis_tracker)


@pytest.mark.parametrize("policy", ["deepspeed", "megatron", "torch"])
def test_resuming_mid_hysteresis_reproduces_the_uninterrupted_run(policy):
    kwargs = dict(init_scale=2.0**12, growth_interval=3, min_scale=1.0, policy=policy)
    if policy != "torch":
        kwargs["hysteresis"] = 3
    uninterrupted = GradScaler("cpu", **kwargs)
    trajectory = []
    saved = None
    for i, overflow in enumerate(OVERFLOWS):
        uninterrupted.update_scale(overflow)
        state = uninterrupted.state_dict()
        trajectory.append(state)
        mid = policy == "torch" or state.get("cur_hysteresis", state.get("hysteresis_tracker")) == 2
        if saved is None and i > 5 and mid:
            saved = (i, state)
    assert saved is not None
    k, state = saved
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = GradScaler("cpu", **kwargs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for i, overflow in enumerate(OVERFLOWS[k + 1 :], start=k + 1):
        resumed.update_scale(overflow)
        assert resumed.state_dict() == trajectory[i], f"step {i}"


def test_state_dict_round_trips_through_torch_gradscaler():
    ours = ds_policy_scaler()
    for overflow in OVERFLOWS[:20]:
        ours.update_scale(overflow)
    state = ours.state_dict()
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in state.values())
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(state)  # torch reads its five keys, ignores ours
    assert theirs.get_scale() == state["scale"]
    assert theirs._get_growth_tracker() == state["_growth_tracker"]
    # torch's own state into a deepspeed-policy scaler: scale, factors and the clean streak.
    back = ds_policy_scaler()
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == state["scale"]
    assert back.cur_hysteresis == 3  # torch has none: a full hysteresis


def test_torch_gradscaler_state_continues_under_the_torch_policy():
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    theirs.scale(torch.ones(()))
    theirs._growth_tracker.fill_(2)
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    for overflow in OVERFLOWS[:40]:
        found = torch.full((), float(overflow))
        torch._amp_update_scale_(theirs._scale, theirs._growth_tracker, found, 2.0, 0.5, 3)
        ours.update_scale(overflow)
        assert ours.get_scale() == theirs.get_scale()


def test_pickled_scaler_keeps_the_policy_state():
    ours = ds_policy_scaler()
    for overflow in OVERFLOWS[:11]:
        ours.update_scale(overflow)
    copy = pickle.loads(pickle.dumps(ours))
    assert our_state(copy) == our_state(ours)


def test_bad_policy_state_is_reported_with_the_rest():
    ours = ds_policy_scaler()
    state = ours.state_dict() | {"cur_iter": -3, "policy": "apex", "scale": 0.0}
    with pytest.raises(ValueError) as info:
        ours.load_state_dict(state)
    message = str(info.value)
    for part in ("state_dict['cur_iter'] must be an integer in [0, ", "'apex'", "'scale'"):
        assert part in message
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        ours.load_state_dict(["scale"])


def test_a_state_saved_under_another_policy_warns():
    megatron = GradScaler("cpu", policy="megatron", hysteresis=2, min_scale=1.0)
    megatron.update_scale(True)
    ours = ds_policy_scaler()
    with pytest.warns(UserWarning, match="saved under policy='megatron'; this scaler continues"):
        ours.load_state_dict(megatron.state_dict())
    assert ours.cur_hysteresis == 1  # Megatron's tracker, the same meaning
