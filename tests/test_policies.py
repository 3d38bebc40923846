"""Scale policies against the real implementations: DeepSpeed's DynamicLossScaler, Megatron's rule.

DeepSpeed is the oracle itself (``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``, a test
dependency); Megatron-LM's ``DynamicGradScaler`` hard-codes CUDA tensors, so its rule is restated
below from its source (megatron-core's ``megatron/core/optimizer/grad_scaler.py``,
``DynamicGradScaler.update``) as an independent reference (and, where megatron-core's source is
available, the real class runs on CPU under a device-rewriting mode: see
``test_megatron_reference_matches_megatron_core``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import _policy_scenarios as PS
import pytest
import torch
from _common import gpu_path, make_optimizer
from _harness import spawn
from _models import make_model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import distscaler
from common.probes import HostReadSpy
from distscaler import GradScaler, LossScaleAtMinimumError, ScalerConfig, policies
from distscaler._state import HostValues, ScalerState
from distscaler.policies import LossScalePolicy, ScaleRule, get_policy, register_policy

DS_PARITY_EXAMPLES = 400  # random overflow sequences of test_deepspeed_policy_matches_...
_ds_examples_run: list[int] = []


@pytest.fixture(autouse=True)
def deepspeed_without_process_group(monkeypatch):
    """DeepSpeed's update_scale asks ``deepspeed.comm.get_rank()`` (only to decide who logs)."""
    ls = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")

    class _Comm:
        @staticmethod
        def get_rank(group: Any = None) -> int:
            return 0

    monkeypatch.setattr(ls, "dist", _Comm)
    return ls


def deepspeed_scaler(init: float, window: int, min_scale: float, hyst: int, consec: bool, raise_):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(
        init_scale=init,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hyst,
        consecutive_hysteresis=consec,
        raise_error_at_min_scale=raise_,
    )


def ds_state(s: Any) -> tuple:
    return (s.cur_scale, s.cur_hysteresis, s.cur_iter, s.last_overflow_iter)


def our_state(s: GradScaler) -> tuple:
    return (s.cur_scale, s.cur_hysteresis, s.cur_iter, s.last_overflow_iter)


ds_params = st.fixed_dictionaries(
    {
        # m * 2**e: halving and doubling stay exact in float32 as in DeepSpeed's Python floats.
        "init": st.builds(lambda m, e: m * 2.0**e, st.sampled_from([1, 3, 5]), st.integers(0, 12)),
        "min_exp": st.integers(-3, 6),
        "window": st.integers(1, 6),
        "hyst": st.integers(1, 4),
        "consec": st.booleans(),
        "raise_": st.booleans(),
    }
)


def build_pair(p: dict) -> tuple[Any, GradScaler]:
    min_scale = min(2.0 ** p["min_exp"], p["init"])
    args = (p["init"], p["window"], min_scale, p["hyst"], p["consec"], p["raise_"])
    ours = GradScaler(
        "cpu",
        init_scale=p["init"],
        growth_interval=p["window"],
        policy="deepspeed",
        hysteresis=p["hyst"],
        consecutive_hysteresis=p["consec"],
        min_scale=min_scale,
        raise_error_at_min_scale=p["raise_"],
    )
    return deepspeed_scaler(*args), ours


def update_scale_driver(scaler: GradScaler):
    """Drive ``scaler`` through DeepSpeed's ``update_scale(overflow)`` API."""

    def step(overflow: bool) -> GradScaler:
        scaler.update_scale(overflow)
        return scaler

    return step


def run_both(ref: Any, step_ours, overflows: list[bool]) -> dict[str, int]:
    """Feed ``overflows`` to DeepSpeed and to ours; compare after every step, and the exception."""
    seen = {"backoffs": 0, "absorbed": 0, "growths": 0, "raised": 0}
    for i, overflow in enumerate(overflows):
        before = ds_state(ref)
        ref_error = our_error = None
        try:
            ref.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception
            ref_error = str(e)
        try:
            ours = step_ours(overflow)
        except LossScaleAtMinimumError as e:
            our_error = str(e)
        assert our_error == ref_error, f"step {i}"
        if ref_error is not None:
            seen["raised"] += 1
            return seen
        assert our_state(ours) == ds_state(ref), f"step {i}: overflows {overflows[: i + 1]}"
        seen["backoffs"] += ref.cur_scale < before[0]
        seen["growths"] += ref.cur_scale > before[0]
        seen["absorbed"] += overflow and ref.cur_hysteresis < before[1]
    return seen


@settings(max_examples=DS_PARITY_EXAMPLES, deadline=None, derandomize=True)
@given(p=ds_params, overflows=st.lists(st.booleans(), min_size=1, max_size=80))
def test_deepspeed_policy_matches_dynamic_loss_scaler_update_scale(p, overflows):
    ref, ours = build_pair(p)
    run_both(ref, update_scale_driver(ours), overflows)
    _ds_examples_run.append(1)


def test_deepspeed_parity_ran_and_exercised_every_branch():
    """Guard and record: how many random sequences ran, and that each rule branch was hit."""
    seen = {"backoffs": 0, "absorbed": 0, "growths": 0, "raised": 0}
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        draws = torch.rand(8, generator=gen).tolist()
        p = {
            "init": 2.0 ** int(draws[0] * 6),
            "min_exp": int(draws[1] * 3) - 1,
            "window": 1 + int(draws[2] * 3),
            "hyst": 1 + int(draws[3] * 3),
            "consec": draws[4] < 0.5,
            "raise_": draws[5] < 0.5,
        }
        overflows = (torch.rand(60, generator=gen) < 0.35).tolist()
        ref, ours = build_pair(p)
        for key, n in run_both(ref, update_scale_driver(ours), overflows).items():
            seen[key] += n
    assert all(n > 0 for n in seen.values()), seen
    print(f"DeepSpeed parity: {len(_ds_examples_run)} hypothesis sequences ran; branches {seen}")
    if _ds_examples_run:  # the property test ran in this process (not deselected)
        assert len(_ds_examples_run) == DS_PARITY_EXAMPLES


def _inject(model: torch.nn.Module, value: float) -> None:
    next(iter(model.parameters())).grad.view(-1)[0] = value


def real_step_driver(scaler: GradScaler, opt_kind: str):
    """Drive ``scaler`` through scale/backward/step/update, with an inf in a gradient on overflow."""
    model = make_model()
    opt = make_optimizer(opt_kind, model.parameters())
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    stats = {"skipped": 0, "overflows": 0}

    def step(overflow: bool) -> GradScaler:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(data).float().pow(2).mean()
        scaler.scale(loss).backward()
        if overflow:
            _inject(model, math.inf)
        scaler.step(opt)
        scaler.update()
        stats["overflows"] += overflow
        stats["skipped"] += scaler.step_was_skipped
        return scaler

    return step, stats


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    p=ds_params,
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    opt_kind=st.sampled_from(["fused", "for-loop"]),
)
def test_deepspeed_policy_matches_dynamic_loss_scaler_in_real_steps(p, overflows, opt_kind):
    ref, ours = build_pair(p)
    step, stats = real_step_driver(ours, opt_kind)
    seen = run_both(ref, step, overflows)
    # Every overflow skipped the step, including those hysteresis absorbed.
    n = stats["overflows"] - seen["raised"]
    assert stats["skipped"] == n


# ----------------------------------------------------------------------------- Megatron


class MegatronReference:
    """Megatron's DynamicGradScaler rule (``megatron/core/optimizer/grad_scaler.py``, ``update``),
    in plain Python."""

    def __init__(self, init, min_scale, growth_factor, backoff_factor, interval, hysteresis):
        self.scale, self.min_scale = init, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.interval, self.hysteresis = interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor


megatron_params = st.fixed_dictionaries(
    {
        "init": st.builds(lambda e: 2.0**e, st.integers(0, 16)),
        "min_exp": st.integers(-2, 4),
        "growth_factor": st.sampled_from([2.0, 4.0]),
        "backoff_factor": st.sampled_from([0.5, 0.25]),
        "interval": st.integers(1, 6),
        "hyst": st.integers(1, 4),
    }
)


def build_megatron(p: dict) -> tuple[MegatronReference, GradScaler]:
    min_scale = min(2.0 ** p["min_exp"], p["init"])
    ref = MegatronReference(
        p["init"], min_scale, p["growth_factor"], p["backoff_factor"], p["interval"], p["hyst"]
    )
    ours = GradScaler(
        "cpu",
        init_scale=p["init"],
        growth_factor=p["growth_factor"],
        backoff_factor=p["backoff_factor"],
        growth_interval=p["interval"],
        policy="megatron",
        hysteresis=p["hyst"],
        min_scale=min_scale,
    )
    return ref, ours


@settings(max_examples=150, deadline=None, derandomize=True)
@given(p=megatron_params, overflows=st.lists(st.booleans(), min_size=1, max_size=60))
def test_megatron_policy_matches_megatron_rule(p, overflows):
    ref, ours = build_megatron(p)
    backoffs = 0
    for i, overflow in enumerate(overflows):
        before = ref.scale
        ref.update(overflow)
        ours.update_scale(overflow)
        backoffs += ref.scale < before
        state = ours.state_dict()
        got = (state["scale"], state["_growth_tracker"], state["hysteresis_tracker"])
        assert got == (ref.scale, ref.growth_tracker, ref.hysteresis_tracker), f"step {i}"


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    p=megatron_params,
    overflows=st.lists(st.booleans(), min_size=1, max_size=25),
    opt_kind=st.sampled_from(["fused", "foreach"]),
)
def test_megatron_policy_in_real_steps(p, overflows, opt_kind):
    ref, ours = build_megatron(p)
    step, stats = real_step_driver(ours, opt_kind)
    for overflow in overflows:
        ref.update(overflow)
        step(overflow)
        assert ours.get_scale() == ref.scale
        assert ours.cur_hysteresis == ref.hysteresis_tracker
    assert stats["skipped"] == stats["overflows"]


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` in factory calls and ``.cuda()``: Megatron's class on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _megatron_grad_scaler_source() -> Path | None:
    env = os.environ.get("DISTSCALER_MEGATRON_GRAD_SCALER")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "core/optimizer/grad_scaler.py")
    return path if path.exists() else None


def test_megatron_reference_matches_megatron_core():
    """Where megatron-core's grad_scaler.py exists (installed, or the path in
    DISTSCALER_MEGATRON_GRAD_SCALER), the restated rule above is checked against the real class."""
    source = _megatron_grad_scaler_source()
    if source is None:
        pytest.skip("megatron-core is not installed (its rule is tested through the reference)")
    spec = importlib.util.spec_from_file_location("_megatron_grad_scaler", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        args = (2.0**12, 2.0 ** (trial % 4), 2.0, 0.5, 1 + trial % 5, 1 + trial % 3)
        ref = MegatronReference(*args)
        ours = GradScaler(
            "cpu",
            init_scale=args[0],
            min_scale=args[1],
            growth_interval=args[4],
            policy="megatron",
            hysteresis=args[5],
        )
        with _CudaToCpu():
            real = module.DynamicGradScaler(*args)
            for overflow in (torch.rand(50, generator=gen) < 0.4).tolist():
                real.update(overflow)
                ref.update(overflow)
                ours.update_scale(overflow)
                state = real.state_dict()
                expected = (state["scale"].item(), state["hysteresis_tracker"])
                assert (ref.scale, ref.hysteresis_tracker) == expected
                assert (ours.get_scale(), ours.cur_hysteresis) == expected


# ----------------------------------------------------------------------------- static, bf16


def test_static_scale_never_moves_and_skips_every_overflow():
    scaler = GradScaler("cpu", init_scale=128.0, policy="static")
    step, stats = real_step_driver(scaler, "fused")
    for i in range(12):
        step(i in (2, 3, 7))
        assert scaler.get_scale() == 128.0
    assert stats["skipped"] == 3 == scaler.state_dict()["num_skipped_steps"]


@pytest.mark.parametrize("path", ["step", "unscale_then_clip"])
@pytest.mark.parametrize("skip", [True, False])
def test_bf16_training_at_scale_one_skips_nonfinite_steps_unless_told_not_to(skip, path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = GradScaler("cpu", init_scale=1.0, policy="static", skip_nonfinite=skip)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    scaled = scaler.scale(loss)
    assert torch.equal(scaled, loss)  # scale 1.0: the loss is unchanged
    scaled.backward()
    model.weight.grad[0, 0] = math.nan
    before = model.weight.detach().clone()
    caplog.set_level("INFO", logger="distscaler")
    if path == "unscale_then_clip":  # the norm is NaN too: it must not skip either
        scaler.unscale_(opt)
        assert not scaler.clip_grad_norm_(opt, 1.0).isfinite()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0
    assert scaler.step_was_skipped is skip
    assert torch.equal(model.weight, before) is skip
    assert scaler.state_dict()["num_skipped_steps"] == int(skip)
    assert ("1 optimizer step(s) skipped" in caplog.text) is skip  # get_scale() reported it


# ----------------------------------------------------------------------------- costs, errors


@pytest.mark.parametrize("policy", ["torch", "deepspeed", "megatron", "static"])
def test_update_reads_nothing_on_the_host_for_every_policy(policy):
    # The path a GPU runs (the CPU's reads its flag each step, see test_step_cost).
    hyst = 2 if policy in ("deepspeed", "megatron") else 1
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, policy=policy, hysteresis=hyst)
    gpu_path(scaler)
    model = make_model()
    opt = make_optimizer("fused", model.parameters())
    scales = set()
    for i in range(6):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        if i in (1, 2):
            _inject(model, math.inf)
        with HostReadSpy() as spy:
            scaler.step(opt)
            scaler.update()
        assert spy.reads == [], (i, spy.reads)
        scales.add(scaler.get_scale())
    assert (len(scales) > 1) is (policy != "static")  # the rule really ran


def test_raise_error_at_min_scale_costs_one_host_read_per_update_and_uses_deepspeeds_message():
    scaler = GradScaler(
        "cpu",
        init_scale=4.0,
        min_scale=2.0,
        policy="deepspeed",
        hysteresis=1,
        raise_error_at_min_scale=True,
    )
    gpu_path(scaler)  # a GPU's path
    step, _ = real_step_driver(scaler, "fused")
    with HostReadSpy() as spy:
        step(True)  # 4 -> 2
    assert scaler.get_scale() == 2.0
    # step_was_skipped (one read) inside the driver, plus the raise check (one read).
    assert len(spy.reads) == 2, spy.reads
    with pytest.raises(Exception, match="^Current loss scale already at minimum - cannot decrease"):
        step(True)
    assert isinstance(LossScaleAtMinimumError("x"), RuntimeError)
    assert scaler.get_scale() == 2.0 and scaler.cur_iter == 1  # nothing moved, as DeepSpeed


def test_without_raise_the_scale_clamps_at_min_scale():
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0, policy="deepspeed", hysteresis=1)
    for _ in range(3):
        scaler.update_scale(True)
    assert scaler.get_scale() == 2.0 and scaler.last_overflow_iter == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(policy="apex"), r"policy must be one of .*'deepspeed'.*, got: 'apex'"),
        (
            dict(hysteresis=0, policy="deepspeed"),
            r"hysteresis must be an integer in \[1, 9223372036854775807\], got: 0",
        ),
        (dict(hysteresis=2), r"hysteresis must be 1 for policy='torch'"),
        (dict(consecutive_hysteresis=True, policy="megatron"), r"needs policy='deepspeed'"),
        (dict(raise_error_at_min_scale=True), r"raise_error_at_min_scale=True needs min_scale"),
        (dict(skip_nonfinite=False), r"skip_nonfinite=False needs policy='static'"),
    ],
)
def test_bad_policy_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradScaler("cpu", **kwargs)


def test_deepspeed_attributes_need_the_deepspeed_policy():
    scaler = GradScaler("cpu")
    with pytest.raises(AttributeError, match="policy='torch'"):
        scaler.cur_iter  # noqa: B018
    assert not hasattr(scaler, "cur_hysteresis")
    assert scaler.cur_scale == scaler.loss_scale == 2.0**16
    with pytest.raises(TypeError, match="overflow must be a bool"):
        scaler.update_scale(1)


# ----------------------------------------------------------------------------- multi-rank


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    return spawn(PS.policies_on_ranks, 2, tmp_path_factory.mktemp("policies"))


@pytest.mark.xdist_group("policies2")
@pytest.mark.parametrize("policy", PS.POLICY_KWARGS)
def test_policies_stay_identical_across_ranks_with_overflows_on_one_rank(rank_runs, policy):
    runs = [r[policy] for r in rank_runs]
    # Guard: the inf was seen on one rank only, at the injected steps.
    for rank, run in enumerate(runs):
        assert run["local_nonfinite"] == [
            step in PS.INJECT and PS.INJECT[step] == rank for step in range(PS.NUM_STEPS)
        ]
    for run in runs:
        assert run["skipped"] == [step in PS.INJECT for step in range(PS.NUM_STEPS)]
    assert runs[0]["trajectory"] == runs[1]["trajectory"]
    assert runs[0]["params"] == runs[1]["params"]
    # The agreed trajectory is the single-process rule applied to the agreed overflow sequence.
    reference = GradScaler("cpu", **PS.POLICY_KWARGS[policy])
    expected = []
    for step in range(PS.NUM_STEPS):
        reference.update_scale(step in PS.INJECT)
        expected.append(PS.snapshot(reference))
    assert runs[0]["trajectory"] == expected


def test_public_names():
    assert distscaler.ScalerConfig is not None and distscaler.LossScaleAtMinimumError


# ----------------------------------------------------------------------------- packed counters


def test_megatron_growth_interval_changed_mid_run_continues_the_count():
    ours = GradScaler("cpu", init_scale=8.0, growth_interval=3, policy="megatron", hysteresis=2)
    ref = MegatronReference(8.0, 0.0, 2.0, 0.5, 3, 2)
    overflows = [False, True, False, False, True, True, False, False]
    for overflow in overflows:
        ref.update(overflow)
        ours.update_scale(overflow)
    assert ours.state_dict()["_growth_tracker"] == ref.growth_tracker == 2  # guard: mid-count
    ours.set_growth_interval(5)  # raised: the counter moves with it, as Megatron's own
    ref.interval = 5
    scale_at_change = ref.scale
    for overflow in [False, False, False, True, False, False, False, False, False, False]:
        ref.update(overflow)
        ours.update_scale(overflow)
        state = ours.state_dict()
        assert (state["scale"], state["_growth_tracker"], state["hysteresis_tracker"]) == (
            ref.scale,
            ref.growth_tracker,
            ref.hysteresis_tracker,
        )
    assert ref.scale > scale_at_change  # guard: a growth happened under the new interval
    # Lowered below the count: the next clean step grows (tracker >= interval), then counts anew.
    for _ in range(3):
        ours.update_scale(False)
    before = ours.get_scale()
    ours.set_growth_interval(2)
    ours.update_scale(False)
    assert ours.get_scale() == 2 * before and ours.state_dict()["_growth_tracker"] == 0


def test_deepspeed_state_round_trips_mid_hysteresis_through_a_fold_and_a_reload():
    ref, ours = build_pair(
        {"init": 2.0**10, "min_exp": 0, "window": 3, "hyst": 3, "consec": False, "raise_": False}
    )
    overflows = [False] * 4 + [True, False, True, False, False]
    run_both(ref, update_scale_driver(ours), overflows)  # reads (folds) after every update
    assert ours.cur_hysteresis == 1 and ours.cur_iter == 9  # guard: mid-hysteresis
    resumed = GradScaler("cpu", policy="deepspeed", hysteresis=3, growth_interval=3, min_scale=1.0)
    resumed.load_state_dict(ours.state_dict())
    run_both(ref, update_scale_driver(resumed), [False, False, False, True, True, False] * 2)


def test_a_growth_interval_past_float32_counting_warns_once_packed():
    scaler = GradScaler("cpu", policy="megatron", hysteresis=2, growth_interval=2**23)
    with pytest.warns(UserWarning, match=r"growth_interval=8388608 > 4194304 growth may come"):
        scaler.update_scale(False)
    scaler.update_scale(False)  # packed already: no second warning (pytest errors on unexpected)
    assert scaler.state_dict()["_growth_tracker"] == 2


# ----------------------------------------------------------------------------- plain vs packed


def _state_pair(config: ScalerConfig) -> tuple[ScalerState, ScalerState]:
    """The same initial state, run plainly (each policy's ``update_``) and packed."""
    counters = get_policy(config.policy).initial_state(config.rule())
    states = []
    for pack in (False, True):
        state = ScalerState(HostValues(config.init_scale, 0, counters), pack_counters=pack)
        state.materialize("cpu")
        states.append(state)
    return states[0], states[1]


def _step_both(
    plain: ScalerState, packed: ScalerState, config: ScalerConfig, overflow: bool, fold: bool
) -> tuple[str | None, HostValues]:
    """One update of both from ``overflow``, compared; returns (the error raised, the state)."""
    errors: list[str | None] = []
    read = []
    for state in (plain, packed):
        found = torch.tensor(1.0 if overflow else 0.0)
        try:
            state.update(found, None, config)
            errors.append(None)
        except LossScaleAtMinimumError as e:
            errors.append(str(e))
        read.append(state.read(fold=fold, world_size=1)[1])
    assert errors[0] == errors[1]
    assert read[0] == read[1]  # scale, growth tracker and every counter
    return errors[0], read[1]


packed_params = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["deepspeed", "megatron"]),
        "init": st.builds(lambda m, e: m * 2.0**e, st.sampled_from([1, 3, 5]), st.integers(0, 12)),
        "growth_factor": st.sampled_from([2.0, 1.5, 4.0]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.3]),
        "window": st.integers(1, 6),
        "hyst": st.integers(1, 4),
        "consec": st.booleans(),
        "min_exp": st.none() | st.integers(-2, 6),
        "max_exp": st.none() | st.integers(0, 16),
        "raise_": st.booleans(),
    }
)
#: One update: (overflow, a new growth interval set before it or None, fold the record after it).
packed_steps = st.lists(
    st.tuples(st.booleans(), st.none() | st.integers(1, 6), st.booleans()), min_size=1, max_size=60
)


def _packed_config(p: dict) -> ScalerConfig:
    deepspeed = p["policy"] == "deepspeed"
    min_scale = None if p["min_exp"] is None else min(2.0 ** p["min_exp"], p["init"])
    max_scale = None if p["max_exp"] is None else max(2.0 ** p["max_exp"], p["init"])
    return ScalerConfig(
        init_scale=p["init"],
        growth_factor=p["growth_factor"],
        backoff_factor=p["backoff_factor"],
        growth_interval=p["window"],
        policy=p["policy"],
        hysteresis=p["hyst"],
        consecutive_hysteresis=p["consec"] and deepspeed,
        min_scale=min_scale,
        max_scale=max_scale,
        raise_error_at_min_scale=p["raise_"] and min_scale is not None,
    )


def _run_plain_and_packed(p: dict, steps: list) -> dict[str, int]:
    config = _packed_config(p)
    plain, packed = _state_pair(config)
    seen = {"growths": 0, "backoffs": 0, "absorbed": 0, "interval_changes": 0, "raised": 0}
    scale = config.init_scale
    for overflow, interval, fold in steps:
        if interval is not None and interval != config.growth_interval:
            config = dataclasses.replace(config, growth_interval=interval)
            seen["interval_changes"] += 1
        error, now = _step_both(plain, packed, config, overflow, fold)
        if error is not None:
            seen["raised"] += 1
            return seen
        seen["growths"] += now.scale > scale
        seen["backoffs"] += now.scale < scale
        seen["absorbed"] += overflow and now.scale == scale
        scale = now.scale
    return seen


@settings(max_examples=150, deadline=None, derandomize=True)
@given(p=packed_params, steps=packed_steps)
def test_packed_update_equals_the_plain_update_step_for_step(p, steps):
    _run_plain_and_packed(p, steps)


def test_plain_vs_packed_exercised_every_branch():
    """Guard: the sequences above grow, back off, absorb, change the interval and raise."""
    seen: dict[str, int] = {}
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        d = torch.rand(8, generator=gen).tolist()
        p = {
            "policy": "deepspeed" if d[0] < 0.5 else "megatron",
            "init": 2.0 ** int(d[1] * 8),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "window": 1 + int(d[2] * 4),
            "hyst": 1 + int(d[3] * 3),
            "consec": d[4] < 0.5,
            "min_exp": int(d[5] * 3),
            "max_exp": None,
            "raise_": d[6] < 0.3,
        }
        draws = torch.rand(50, 3, generator=gen).tolist()
        steps = [(a < 0.35, 1 + int(b * 5) if b < 0.1 else None, c < 0.5) for a, b, c in draws]
        for key, n in _run_plain_and_packed(p, steps).items():
            seen[key] = seen.get(key, 0) + n
    assert all(n > 0 for n in seen.values()), seen


# ----------------------------------------------------------------------------- a fourth policy


class _CountdownPolicy(LossScalePolicy):
    """A toy rule defined only here: every ``growth_interval``-th update grows the scale (unless it
    overflowed); an overflow backs off, never below FLOOR."""

    name = "test_countdown"
    state_keys = ("updates_to_growth",)
    counter_ranges = {"updates_to_growth": (1, 2**31)}
    FLOOR = 4.0

    @classmethod
    def initial_state(cls, rule: ScaleRule) -> dict[str, int]:
        return {"updates_to_growth": rule.growth_interval}

    def update_(self, found_inf: torch.Tensor) -> None:
        r, scale, left = self.rule, self.scale, self.counters["updates_to_growth"]
        overflow, grow = found_inf > 0, left <= 1
        left.copy_(torch.where(grow, r.growth_interval, left - 1))
        backed_off = torch.minimum(scale, torch.clamp(scale * r.backoff_factor, min=self.FLOOR))
        scale.copy_(torch.where(overflow, backed_off, torch.where(grow, scale * 2.0, scale)))


@pytest.fixture
def countdown_policy():
    register_policy(_CountdownPolicy)
    yield _CountdownPolicy
    policies._REGISTRY.pop(_CountdownPolicy.name)


def test_a_fourth_policy_is_one_class_and_register_policy(countdown_policy):
    overflows = [False, True, False, False, True, True, True, False, False, False]
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=3, policy="test_countdown")
    step, stats = real_step_driver(scaler, "fused")
    scale, left = 16.0, 3  # the rule, in Python
    scales = []
    for i, overflow in enumerate(overflows):
        grow = left <= 1
        left = 3 if grow else left - 1
        scale = min(scale, max(scale * 0.5, 4.0)) if overflow else scale * 2 if grow else scale
        step(overflow)
        state = scaler.state_dict()
        assert (state["scale"], state["updates_to_growth"]) == (scale, left), f"step {i}"
        scales.append(scale)
    assert stats["skipped"] == stats["overflows"] == sum(overflows)  # guard: infs seen, skipped
    assert scales[5:7] == [4.0, 4.0] and max(scales) == 16.0  # guard: the floor held, it grew
    resumed = GradScaler("cpu", growth_interval=3, policy="test_countdown")
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match=r"use policy='deepspeed' or 'megatron'\), got: 2"):
        GradScaler("cpu", policy="test_countdown", hysteresis=2)
    with pytest.raises(ValueError, match=r"not taken .*got: .test_countdown."):
        register_policy(type("Other", (LossScalePolicy,), {"name": "test_countdown"}))


def test_register_policy_refuses_what_is_not_a_policy():
    with pytest.raises(TypeError, match="LossScalePolicy subclass"):
        register_policy(object)  # type: ignore[arg-type]
    mine = type("Mine", (LossScalePolicy,), {"name": "torch"})
    with pytest.raises(ValueError, match="got: 'torch'"):
        register_policy(mine)
    # The built-ins stay (other tests of the process, docs examples among them, may add more).
    names = policies.policy_names()
    assert names[: len(policies.POLICIES)] == policies.POLICIES
    assert get_policy("torch") is not mine


def test_hysteresis_counter_names_the_state_key_of_each_policy():
    counters = {n: get_policy(n).hysteresis_counter for n in policies.POLICIES}
    assert counters == {
        "torch": None,
        "deepspeed": "cur_hysteresis",
        "megatron": "hysteresis_tracker",
        "static": None,
    }


# ----------------------------------------------------------------------------- the rule's interface


def test_a_rule_must_define_update_and_nothing_else():
    assert LossScalePolicy.update_.__isabstractmethod__
    assert LossScalePolicy.__abstractmethods__ == frozenset({"update_"})
    no_update = type("NoUpdate", (LossScalePolicy,), {"name": "test_no_update"})
    with pytest.raises(TypeError, match=r"policy must define update_ .*got: NoUpdate"):
        register_policy(no_update)
    assert "test_no_update" not in policies.policy_names()  # refused before registering
    with pytest.raises(TypeError, match="abstract"):
        no_update(ScaleRule(), torch.ones(()), torch.zeros((), dtype=torch.int32), {})


def test_packing_is_the_rules_hook_and_a_subclass_with_its_own_update_runs_plainly():
    rule, device = ScaleRule(hysteresis=2), torch.device("cpu")
    counters = {n: policies.get_policy(n).initial_state(rule) for n in ("deepspeed", "megatron")}
    for name in ("torch", "static"):
        assert get_policy(name).packed_counters(rule, 0, {}, device) is None
    for name in ("deepspeed", "megatron"):
        cls = get_policy(name)
        packed = cls.packed_counters(rule, 0, counters[name], device)
        assert packed is not None and packed.policy is cls
        same_rule = type("Same", (cls,), {"name": f"test_{name}_same"})
        assert same_rule.packed_counters(rule, 0, counters[name], device).policy is same_rule
        own = {"name": f"test_{name}_own", "update_": lambda self, found_inf: None}
        own_rule = type("Own", (cls,), own)
        assert own_rule.packed_counters(rule, 0, counters[name], device) is None


def test_a_counter_of_another_policy_names_the_policies_that_keep_it():
    with pytest.raises(AttributeError, match=r"cur_iter exists for policy='deepspeed'; .*'torch'"):
        GradScaler("cpu").cur_iter  # noqa: B018
    with pytest.raises(AttributeError, match=r"cur_hysteresis exists for policy='deepspeed'"):
        GradScaler("cpu", policy="static").cur_hysteresis  # noqa: B018
