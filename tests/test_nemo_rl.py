"""NeMo-RL integration (``distscaler.integrations.nemo_rl``) against stock NeMo-RL, side by side.

Three layers, each saying what it runs:

* **NeMo-RL's own worker** (tests/_nemo_rl_scenarios.py, one spawn of 2 gloo ranks): NeMo-RL's
  ``DTensorPolicyWorkerV2Impl`` and distscaler's subclass, each built by its own ``__init__`` and
  trained by its own ``train()`` (NeMo-RL's GRPO loss, a tiny Qwen2, ``precision: "float16"``),
  the CPU stand-ins of launch/common/nemo_rl_cpu.py. NeMo-RL is not on PyPI (``nemo-rl`` there is
  a 0.0.0 placeholder) and CI installs from PyPI only: these run where NeMo-RL's source at
  ``TESTED_COMMIT`` and its worker's dependencies are importable (docs/integrations/nemo_rl.md,
  "Running the tests"), and skip elsewhere, except under ``DISTSCALER_NEMO_RL_STAGE=1``, where a
  missing NeMo-RL fails.
* **A stand-in of the worker** (tests/_nemo_rl_standin.py, one spawn of 2 gloo ranks, everywhere,
  CI included): what the integration relies on of NeMo-RL's worker, written as NeMo-RL writes it
  (the decorated ``train``, the module-global clip, FSDP2 with NeMo-RL's mixed precision).
* **In this process**: the options, the rebinding of ``train``'s names, the refusals, and
  ``policy_factory`` against a stand-in of NeMo-RL's ``Policy``.

The scenarios, stock vs ours: tiny gradients (stock fp16's norm is 0: every gradient underflowed;
ours matches fp32); an inf in rank 1's gradient shard at step 1 (stock steps on it and its weights
turn NaN; ours skips on both ranks, the weights untouched, the scale halved, the LR held); a
genuine fp16 overflow (huge advantages on rank 1); a checkpoint and NeMo-RL's resume (ours resumes
the scale and the uninterrupted run bit for bit); a second ``unscale_`` or ``optimizer.step()`` in
one step (refused).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import types

import pytest
from _harness import spawn

TESTED = "0.6.0"
try:
    import nemo_rl

    FOUND: str | None = nemo_rl.__version__
    from nemo_rl.models.policy.workers import dtensor_policy_worker_v2  # noqa: F401
except ImportError:
    FOUND = None

needs_nemo_rl = pytest.mark.skipif(
    FOUND is None or not FOUND.startswith(TESTED),
    reason=f"NeMo-RL {TESTED} (found {FOUND}) is not on PyPI: its source at "
    "distscaler.integrations.nemo_rl.TESTED_COMMIT and its worker's dependencies on the path "
    "(docs/integrations/nemo_rl.md, 'Running the tests')",
)

TWO_RANKS = pytest.mark.xdist_group("nemo_rl2")


@pytest.mark.skipif(not os.environ.get("DISTSCALER_NEMO_RL_STAGE"), reason="the NeMo-RL venv only")
def test_the_nemo_rl_stage_has_the_tested_nemo_rl():
    assert FOUND is not None and FOUND.startswith(TESTED), (TESTED, FOUND)


# ----------------------------------------------------------------------------- NeMo-RL's worker


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    import _nemo_rl_scenarios as S

    return spawn(S.everything, 2, tmp_path_factory.mktemp("nemo-rl"))


@needs_nemo_rl
@TWO_RANKS
def test_the_worker_is_nemo_rls_class_with_ours_on_top(real):
    from nemo_rl.models.policy.workers.dtensor_policy_worker_v2 import DTensorPolicyWorkerV2Impl

    import distscaler.integrations.nemo_rl as ds

    for r in real:
        assert r["stock_class"] == (
            "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2Impl"
        )
        assert r["ours_class"] == "distscaler.integrations.nemo_rl.DTensorPolicyWorkerV2Impl"
    assert issubclass(ds.DTensorPolicyWorkerV2Impl, DTensorPolicyWorkerV2Impl)
    # NeMo-RL's module is not changed: its train still calls Automodel's clip.
    stock = sys.modules["nemo_rl.models.policy.workers.dtensor_policy_worker_v2"]
    assert stock.scale_grads_and_clip_grad_norm.__module__.startswith("nemo_automodel")


@needs_nemo_rl
@TWO_RANKS
def test_tiny_gradients_underflow_in_stock_fp16_and_not_with_ours(real):
    for r in real:
        (fp32,), (stock,), (ours,) = r["tiny_fp32"], r["tiny_stock"], r["tiny_ours"]
        assert 0 < fp32["grad_norm"] < 1e-6  # the reference: tiny, not zero
        assert stock["grad_norm"] == 0.0  # every gradient underflowed in the fp16 backward
        assert ours["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-3)
        assert ours["metrics"]["distscaler/scale"] == 65536.0


@needs_nemo_rl
@TWO_RANKS
def test_an_inf_on_one_rank_stock_steps_on_it_and_ours_skips_everywhere(real):
    for rank, r in enumerate(real):
        stock, ours = r["stock"], r["ours"]
        assert math.isinf(stock[1]["grad_norm"]) and math.isinf(ours[1]["grad_norm"])
        # Stock: the step is taken; rank 1's shard (the inf's) is NaN at once, every rank's soon.
        assert stock[1]["changed"] and stock[1]["finite"] == (rank != 1)
        assert not any(s["finite"] for s in stock[3:])
        assert all(math.isnan(s["grad_norm"]) for s in stock[3:])
        # Ours: skipped on both ranks, the shard untouched, then training goes on, finite.
        assert not ours[1]["changed"] and all(s["finite"] for s in ours)
        assert all(s["changed"] for s in ours[2:]) and ours[0]["changed"]
        assert [s["metrics"]["distscaler/scale"] for s in ours] == [65536.0] + [32768.0] * 4
        assert [s["metrics"]["distscaler/skipped"] for s in ours] == [0.0, 1.0, 0.0, 0.0, 0.0]
        assert all(math.isfinite(s["grad_norm"]) for i, s in enumerate(ours) if i != 1)
        # The same step as stock before the inf (fp16 rounding of the scaled backward aside).
        assert ours[0]["grad_norm"] == pytest.approx(stock[0]["grad_norm"], rel=1e-4)
        assert ours[0]["loss"] == stock[0]["loss"]  # the loss value is NeMo-RL's, unscaled
        # One collective in the clip, as stock's (Automodel's DTensor norm).
        assert {s["clip_collectives"] for s in stock + ours} == {1}
    # Every rank reports the same norms, scales, skips and LR.
    for name in ("ours", "stock"):
        drop = ("changed", "finite", "seconds")
        one, two = ([{k: v for k, v in s.items() if k not in drop} for s in r[name]] for r in real)
        assert one == two, name


@needs_nemo_rl
@TWO_RANKS
def test_the_overflow_report_names_the_parameter_and_the_rank(real):
    for r in real:
        assert r["ours_overflow"] == [[1, "model.embed_tokens.weight"]]
        assert "inf in `model.embed_tokens.weight` on rank 1" in r["ours_overflow_text"]
        assert r["ours"][1]["metrics"]["distscaler/overflow_tensors"] == 1.0


@needs_nemo_rl
@TWO_RANKS
def test_the_lr_is_held_on_a_skipped_step(real):
    for r in real:
        stock = [s["lr"] for s in r["stock"]]
        ours = [s["lr"] for s in r["ours"]]
        assert stock == sorted(set(stock)) and len(stock) == 5  # warmup: grows at every step
        assert ours == [stock[0], stock[0], stock[1], stock[2], stock[3]]  # held at the skip
        assert [s["lr"] for s in r["ours_lr_step"]] == stock[:3]  # lr_on_skip="step"


@needs_nemo_rl
@TWO_RANKS
def test_a_genuine_fp16_overflow(real):
    for r in real:
        stock, ours = r["stock_huge"], r["ours_huge"]
        assert math.isnan(stock[1]["grad_norm"]) and not stock[1]["finite"]
        assert not any(s["finite"] for s in stock[1:])
        assert not math.isfinite(ours[1]["grad_norm"]) and not ours[1]["changed"]
        assert all(s["finite"] for s in ours) and ours[2]["changed"]
        assert math.isfinite(ours[2]["grad_norm"])
        assert ours[1]["metrics"]["distscaler/scale"] == 32768.0


@needs_nemo_rl
@TWO_RANKS
def test_resume_keeps_the_scale_and_matches_the_uninterrupted_run(real):
    for r in real:
        assert r["ours_listing"] == [
            "distscaler_world_size_2_rank_0.pt",
            "distscaler_world_size_2_rank_1.pt",
            "optim",
        ]
        assert r["stock_listing"] == ["optim"]
        assert r["ours_resumed_scale"] == 32768.0
        drop = ("seconds",)
        resumed = [{k: v for k, v in s.items() if k not in drop} for s in r["ours_resumed"]]
        assert resumed == [{k: v for k, v in s.items() if k not in drop} for s in r["ours"][3:]]
        assert r["ours_resumed_final"] == r["ours_final"]  # the shards, bit for bit
        assert r["ours_loaded_scale"] == 32768.0  # load_checkpoint, on a worker at 1024
        # A checkpoint saved without distscaler: a warning, the initial scale.
        assert r["ours_from_stock_scale"] == 65536.0
        (warning,) = r["ours_from_stock_warnings"]
        assert "no distscaler state (a checkpoint saved without distscaler)" in warning


@needs_nemo_rl
@TWO_RANKS
def test_a_second_unscale_or_step_is_refused(real):
    for r in real:
        assert r["refused_unscale"] == (
            "CallOrderError: unscale_() has already been called on this optimizer since the "
            "last update()."
        )
        assert r["refused_step"].startswith(
            "CallOrderError: optimizer.step() without the gradient clip before it"
        )


@needs_nemo_rl
@pytest.mark.slow
@pytest.mark.xdist_group("nemo-rl-job")
def test_train_nemo_rl_grpo_job_with_an_inf_on_one_rank(tmp_path):
    from _common import torchrun_summary

    args = ("--steps", "8", "--inject-inf", "3", "--lr", "1e-2")
    ours = torchrun_summary("train_nemo_rl.py", *args, out=tmp_path / "ours")
    stock = torchrun_summary("train_nemo_rl.py", *args, "--stock", out=tmp_path / "stock")
    assert ours["worker"] == "distscaler.integrations.nemo_rl.DTensorPolicyWorkerV2Impl"
    assert stock["worker"].startswith("nemo_rl.models.policy.workers.dtensor_policy_worker_v2.")
    assert ours["ranks_agree"] and ours["skipped_steps"] == [3] and ours["sampling_failed"] is None
    assert ours["scales"] == [65536.0] * 2 + [32768.0] * 6 and all(ours["weights_finite"])
    assert all(math.isfinite(n) for i, n in enumerate(ours["grad_norms"]) if i != 2)
    # Stock: the step on the inf is taken; the weights are NaN from it on, and sampling stops.
    assert math.isinf(stock["grad_norms"][2]) and stock["weights_finite"][2:] == [False] * (
        len(stock["weights_finite"]) - 2
    )
    assert stock["sampling_failed"] is not None
    # Up to the skip the two runs are the same run (the same samples, hence rewards).
    assert ours["mean_reward"][:3] == stock["mean_reward"][:3]


# ----------------------------------------------------------------------------- the stand-in


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    import _nemo_rl_standin as S

    return spawn(S.everything, 2, tmp_path_factory.mktemp("nemo-rl-standin"))


@TWO_RANKS
def test_standin_tiny_gradients(standin):
    for r in standin:
        (fp32,), (stock,), (ours,) = r["tiny_fp32"], r["tiny_stock"], r["tiny_ours"]
        assert 0 < fp32["grad_norm"] < 1e-7
        assert stock["grad_norm"] == 0.0 and not stock["changed"]  # underflow: no update at all
        assert ours["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-3) and ours["changed"]


@TWO_RANKS
def test_standin_inf_skip_lr_and_resume(standin):
    for r in standin:
        stock, ours = r["stock"], r["ours"]
        assert math.isinf(stock[1]["grad_norm"]) and stock[1]["changed"]
        assert r["stock_warnings"] == [math.inf]  # NeMo-RL's warning, and the step taken
        assert not any(s["finite"] for s in stock[2:])
        assert math.isinf(ours[1]["grad_norm"]) and not ours[1]["changed"]
        assert all(s["finite"] for s in ours) and all(s["changed"] for s in ours[2:])
        assert [s["metrics"]["distscaler/scale"] for s in ours] == [65536.0] + [32768.0] * 4
        assert r["ours_warnings"] == []  # NeMo-RL's inf warning is replaced by the report
        lrs = [s["lr"] for s in stock]
        assert [s["lr"] for s in ours] == [lrs[0], lrs[0], lrs[1], lrs[2], lrs[3]]
        assert [s["lr"] for s in r["ours_lr_step"]] == lrs[:3]
        assert r["listing"] == [
            "distscaler_world_size_2_rank_0.pt",
            "distscaler_world_size_2_rank_1.pt",
            "optim_0.pt",
            "optim_1.pt",
        ]
        assert r["resumed_scale"] == 32768.0
        assert r["resumed"] == ours[3:] and r["resumed_final"] == r["ours_final"]
        assert r["module_untouched"]
        # docs/integrations/nemo_rl.md: the save needs NeMo-RL's `checkpointing_cfg`.
        assert r["save_without_cfg"] == (
            "checkpointing_cfg must be provided when saving checkpoint; written: False"
        )


@TWO_RANKS
def test_standin_two_global_batches_one_skipped_the_lr_steps(standin):
    for r in standin:
        first, _ = r["two_batches"]
        # One of the call's two optimizer steps was skipped: the schedule steps (not all were).
        assert first["metrics"]["distscaler/skipped"] == 1.0 and first["changed"]
        assert first["lr"] == standin[0]["stock"][0]["lr"]


@TWO_RANKS
def test_standin_refusals_and_the_norm_without_clipping(standin):
    for r in standin:
        assert r["refused_unscale"].startswith("CallOrderError: unscale_() has already been")
        assert r["refused_step"].startswith("CallOrderError: optimizer.step() without the")
        # max_grad_norm None: stock reports 0.0; ours measures the norm (and does not clip).
        assert r["noclip_stock"][0]["grad_norm"] == 0.0
        assert r["noclip_ours"][0]["grad_norm"] == pytest.approx(r["ours"][0]["grad_norm"])


# ----------------------------------------------------------------------------- in this process


def test_options_from_config_validates_before_anything_is_built(tmp_path):
    from distscaler import GradScaler, ScalerConfig
    from distscaler.integrations import nemo_rl as ds

    assert ds.options_from_config({}) == ds.NemoRLScalerOptions()
    assert ds.options_from_config({"distscaler": None}) == ds.NemoRLScalerOptions()
    got = ds.options_from_config({"distscaler": {"lr_on_skip": "step"}})
    assert got == ds.NemoRLScalerOptions(lr_on_skip="step")
    config = ScalerConfig(init_scale=1024.0)
    assert ds.options_from_config({"distscaler": {"scaler": config}}).scaler is config
    with pytest.raises(ValueError, match=r"unknown keys \['scale'\]; valid keys"):
        ds.options_from_config({"distscaler": {"scale": 2.0}})
    with pytest.raises(ValueError, match=r"lr_on_skip must be one of \('hold', 'step'\), got: 'x'"):
        ds.options_from_config({"distscaler": {"lr_on_skip": "x"}})
    with pytest.raises(TypeError, match="must be a mapping"):
        ds.options_from_config({"distscaler": "hold"})
    with pytest.raises(TypeError, match="not a GradScaler instance"):
        ds.options_from_config({"distscaler": {"scaler": GradScaler("cpu")}})
    with pytest.raises(TypeError, match="scaler must be None, a distscaler.GradScaler"):
        ds.options_from_config({"distscaler": {"scaler": 3}})
    with pytest.raises(ValueError, match="no such file"):
        ds.options_from_config({"distscaler": {"scaler": str(tmp_path / "missing.json")}})


def test_rebinding_leaves_the_module_and_the_decorator_as_they_are():
    import _nemo_rl_standin as S

    from distscaler.integrations import nemo_rl as ds

    calls = []
    train, core = ds._rebound(
        S.StandInWorkerImpl.train, {"scale_grads_and_clip_grad_norm": lambda *a, **k: calls}
    )
    assert core is S.StandInWorkerImpl.train.__closure__[0].cell_contents  # the undecorated one
    assert (
        train is not S.StandInWorkerImpl.train
        and train.__code__ is S.StandInWorkerImpl.train.__code__
    )
    inner = train.__closure__[0].cell_contents
    assert inner.__globals__["scale_grads_and_clip_grad_norm"]() is calls
    assert S.scale_grads_and_clip_grad_norm.__module__ == S.__name__  # the module's own
    assert ds._rebound(S.StandInWorkerImpl.train, {"absent_name": None}) == (
        S.StandInWorkerImpl.train,
        None,
    )


def _bare(base, **attrs):
    worker = object.__new__(base)
    worker.__dict__.update(attrs)
    return worker


def test_uncovered_paths_are_refused_when_the_worker_is_built():
    import _nemo_rl_standin as S
    import torch

    from distscaler.integrations import nemo_rl as ds

    cls = ds.worker_class(S.StandInWorkerImpl)
    assert ds.worker_class(S.StandInWorkerImpl) is cls  # built once
    assert cls.__name__ == "StandInWorkerImpl" and cls.__module__ == ds.__name__
    options = ds.NemoRLScalerOptions()
    common = dict(dtype=torch.float16, optimizer=object(), model=torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        _bare(cls, moe_mesh=object(), cpu_offload=False, **common)._distscaler_setup(options)
    with pytest.raises(NotImplementedError, match="cpu_offload"):
        _bare(cls, moe_mesh=None, cpu_offload=True, **common)._distscaler_setup(options)
    # bf16, fp32, or no optimizer: NeMo-RL's worker unchanged.
    for dtype, optimizer in (
        (torch.bfloat16, object()),
        (torch.float32, object()),
        (torch.float16, None),
    ):
        worker = _bare(cls, dtype=dtype, optimizer=optimizer, moe_mesh=object())
        worker._distscaler_setup(options)
        assert worker._distscaler_scaler is None

    class NoClip(S.StandInWorkerImpl):
        def train(self, data, loss_fn, eval_mode=False):
            return {}

    with pytest.raises(NotImplementedError, match=r"NoClip.train does not call scale_grads"):
        _bare(
            ds.worker_class(NoClip), moe_mesh=None, cpu_offload=False, **common
        )._distscaler_setup(options)
    with pytest.raises(TypeError, match="base must be a NeMo-RL worker class"):
        ds.worker_class(object)


@pytest.fixture
def fake_policy(monkeypatch):
    """NeMo-RL's ``Policy`` (its signature) and actor registry, as stand-ins, when NeMo-RL is not
    installed; NeMo-RL's own otherwise."""
    built = []
    if FOUND is None:

        class Policy:
            def __init__(
                self,
                cluster,
                config,
                tokenizer,
                name_prefix="lm_policy",
                workers_per_node=None,
                init_optimizer=True,
                weights_path=None,
                optimizer_path=None,
                init_reference_model=True,
                processor=None,
                worker_extension_cls_fqn=None,
                skip_weight_load=False,
            ):
                built.append((config, worker_extension_cls_fqn))

        registry = {
            "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2": "am",
        }
        for name, attrs in (
            ("nemo_rl", {}),
            ("nemo_rl.models", {}),
            ("nemo_rl.models.policy", {}),
            ("nemo_rl.models.policy.lm_policy", {"Policy": Policy}),
            ("nemo_rl.distributed", {}),
            (
                "nemo_rl.distributed.ray_actor_environment_registry",
                {"ACTOR_ENVIRONMENT_REGISTRY": registry},
            ),
        ):
            monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    else:
        from nemo_rl.distributed import ray_actor_environment_registry as R
        from nemo_rl.models.policy import lm_policy

        registry = R.ACTOR_ENVIRONMENT_REGISTRY

        class Policy(lm_policy.Policy):  # records instead of starting Ray workers
            __signature__ = inspect.signature(lm_policy.Policy)

            def __init__(self, *args, **kwargs):
                bound = self.__signature__.bind(*args, **kwargs)
                arguments = bound.arguments
                built.append((arguments["config"], arguments.get("worker_extension_cls_fqn")))

        monkeypatch.setattr(lm_policy, "Policy", Policy)
    return built, registry


def test_policy_factory_builds_ours_in_fp16_and_stock_otherwise(fake_policy):
    from distscaler import ScalerConfig
    from distscaler.integrations import nemo_rl as ds

    built, registry = fake_policy
    fp16 = {"precision": "float16", "dtensor_cfg": {"enabled": True, "_v2": True}}
    ds.policy_factory(cluster=None, config=fp16, tokenizer=None, init_optimizer=True)
    config, fqn = built[-1]
    assert fqn == ds.WORKER == "distscaler.integrations.nemo_rl.DTensorPolicyWorkerV2"
    assert config["distscaler"] == {"scaler": None, "lr_on_skip": "hold"}
    assert "distscaler" not in fp16  # the caller's config is not changed
    assert registry[ds.WORKER] == registry[ds.STOCK_WORKER]
    # Keywords fill what the config leaves out; the config wins.
    scaler = ScalerConfig(init_scale=8.0)
    ds.policy_factory(
        None, {**fp16, "distscaler": {"lr_on_skip": "step"}}, None, scaler=scaler, lr_on_skip="hold"
    )
    assert built[-1][0]["distscaler"] == {"lr_on_skip": "step", "scaler": scaler}
    # bf16: NeMo-RL's stock Policy, untouched.
    bf16 = {"precision": "bfloat16", "dtensor_cfg": {"enabled": True, "_v2": False}}
    ds.policy_factory(None, bf16, None)
    assert built[-1] == (bf16, None)


def test_policy_factory_refuses_what_it_does_not_cover(fake_policy):
    from distscaler.integrations import nemo_rl as ds

    built, _ = fake_policy
    with pytest.raises(NotImplementedError, match="Megatron backend"):
        ds.policy_factory(None, {"precision": "float16", "megatron_cfg": {"enabled": True}}, None)
    with pytest.raises(NotImplementedError, match=r"dtensor_cfg._v2=true"):
        ds.policy_factory(None, {"precision": "float16", "dtensor_cfg": {"enabled": True}}, None)
    fp16 = {"precision": "float16", "dtensor_cfg": {"_v2": True}}
    with pytest.raises(ValueError, match="worker_extension_cls_fqn must be left out"):
        ds.policy_factory(None, fp16, None, worker_extension_cls_fqn="x.Y")
    with pytest.raises(ValueError, match="lr_on_skip must be one of"):
        ds.policy_factory(None, fp16, None, lr_on_skip="never")
    assert built == []  # nothing built
