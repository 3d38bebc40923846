"""verl integration (``distscaler.integrations.verl``) against stock verl 0.9.1, side by side.

One spawn of 2 gloo ranks per FSDP version (tests/_verl_scenarios.py: the engine, the batch, what
"stock" is; launch/common/verl_cpu.py: the CPU stand-ins, each with why). verl's actor engine,
built by verl's registry, a tiny Qwen2 in fp16, verl's PPO loss, an inf in rank 1's gradient shard
at step 1:

* (a) both skip on both ranks, the shards unchanged by the skip; stock's ``optimizer_step`` runs 2
  (FSDP1) or 3 (FSDP2) collectives, ours 1; the same norms as stock up to the skip;
* (b) fused AdamW: stock crashes at the first step (torch issue 140514), ours runs and skips;
* (c) the LR scheduler: stock advances on the skipped step, ours holds it; ``lr_on_skip="step"``
  gives stock's schedule;
* (d) checkpoint after step 2 and resume: ours resumes with the scale and parameters of the
  uninterrupted run; stock restarts its scale from 65536;
* the ``distscaler/*`` metrics, the overflow report after the skip.

The verl tests need verl 0.9.1, which pins transformers < 5.11: CI installs it in a venv of its
own (``.ci/run``'s verl stage, ``pip install -e ".[verl]"``); elsewhere they skip, except under
``DISTSCALER_VERL_STAGE=1``, where a missing verl fails.
"""

from __future__ import annotations

import math
import os

import pytest
from _common import torchrun_summary
from _harness import spawn

TESTED = "0.9.1"
try:
    import verl

    FOUND: str | None = verl.__version__
except ImportError:
    FOUND = None

needs_verl = pytest.mark.skipif(
    FOUND != TESTED,
    reason=f"verl {TESTED} (found {FOUND}): `pip install -e '.[verl]'` in a venv of its own "
    "(docs/integrations/verl.md)",
)

TWO_RANKS = pytest.mark.xdist_group("verl2")
STRATEGIES = ["fsdp", "fsdp2"]
#: Collectives in stock verl's ``optimizer_step`` (``unscale_``'s flag, FSDP's norm; FSDP2's norm
#: is two functional all_reduces: ``fsdp2_clip_grad_norm_`` over DTensors, then its total).
STOCK_COLLECTIVES = {"fsdp": 2, "fsdp2": 3}


@pytest.mark.skipif(not os.environ.get("DISTSCALER_VERL_STAGE"), reason="CI's verl stage only")
def test_the_verl_stage_has_the_tested_verl():
    assert FOUND == TESTED, f"CI's verl stage installs verl {TESTED}, found {FOUND}"


@pytest.fixture(scope="module", params=STRATEGIES)
def runs(request, tmp_path_factory):
    import _verl_scenarios as S

    tmp = tmp_path_factory.mktemp(f"verl-{request.param}")
    scenarios = S.fsdp1 if request.param == "fsdp" else S.fsdp2
    return request.param, spawn(scenarios, 2, tmp)


@needs_verl
@TWO_RANKS
def test_the_registry_builds_ours_once_imported_and_stock_otherwise(runs):
    _, results = runs
    for r in results:
        assert r["stock_engine"] == "verl.workers.engine.fsdp.transformer_impl"
        assert r["ours_engine"] == "distscaler.integrations.verl"


@needs_verl
@TWO_RANKS
def test_an_inf_on_one_rank_skips_on_both_in_one_collective(runs):
    strategy, results = runs
    for r in results:
        for name in ("stock", "ours"):
            steps = r[name]
            assert math.isinf(steps[1]["grad_norm"]), name  # the injected inf was seen
            assert not steps[1]["changed"], name  # skipped: the shard is untouched
            assert all(s["changed"] for s in steps[2:]), name
            assert [s["scale"] for s in steps] == [65536.0] + [32768.0] * 4, name
        # The same step as stock up to the skip (the LR schedules part after it, see below).
        for ours, stock in zip(r["ours"][:3], r["stock"][:3]):
            assert ours["grad_norm"] == pytest.approx(stock["grad_norm"], rel=1e-5, abs=0)
        assert {s["collectives"] for s in r["stock"]} == {STOCK_COLLECTIVES[strategy]}
        assert {s["collectives"] for s in r["ours"]} == {1}
        assert {kind for s in r["ours"] for kind in s["kinds"]} == {"c10d.allreduce_"}
        # Host reads in optimizer_step, the optimizer's own left out, after the first step: the
        # norm verl returns, and on a CPU, where a read costs no sync, this rank's norm before
        # the collective (its float32 norms are taken again in float64 where it is not finite)
        # and the flag.
        assert all(s["host_reads"] == 3 for s in r["ours"][1:])
        assert all(s["host_reads"] >= 3 for s in r["stock"])
    # Every rank reports the same norms, scales, skips, LR and counts.
    assert results[0]["ours"] == results[1]["ours"]
    assert results[0]["stock"] == results[1]["stock"]


@needs_verl
@TWO_RANKS
def test_metrics_carry_the_scale_the_skip_and_the_overflow_report(runs):
    _, results = runs
    for r in results:
        metrics = [s["metrics"] for s in r["ours"]]
        assert [m["distscaler/skipped"] for m in metrics] == [0.0, 1.0, 0.0, 0.0, 0.0]
        assert [m["distscaler/scale"] for m in metrics] == [s["scale"] for s in r["ours"]]
        # The report of the skipped step: the 2nd update, one tensor (one element of rank 1's).
        assert metrics[1]["distscaler/overflow_step"] == 2.0
        assert metrics[1]["distscaler/overflow_tensors"] == 1.0
        assert all("distscaler/overflow_step" not in m for m in metrics[2:])
        assert all(s["metrics"] == {} for s in r["stock"])


@needs_verl
@TWO_RANKS
def test_fused_adamw_crashes_stock_and_runs_with_ours(runs):
    _, results = runs
    for r in results:
        assert r["stock_fused_error"] == (
            "RuntimeError: output with shape [] doesn't match the broadcast shape [1]"
        )
        assert r["ours_fused_is_fused"]
        steps = r["ours_fused"]
        assert math.isinf(steps[1]["grad_norm"]) and not steps[1]["changed"]
        assert steps[2]["changed"] and [s["scale"] for s in steps] == [65536.0, 32768.0, 32768.0]
        assert {s["collectives"] for s in steps} == {1}
        # The same norms as the foreach run: the fused step gets grad_scale, not rewritten grads.
        for fused, foreach in zip(steps, r["ours"]):
            assert fused["grad_norm"] == pytest.approx(foreach["grad_norm"], rel=1e-5)


@needs_verl
@TWO_RANKS
def test_the_lr_scheduler_is_held_on_a_skipped_step(runs):
    _, results = runs
    for r in results:
        stock = [s["lr"] for s in r["stock"]]
        ours = [s["lr"] for s in r["ours"]]
        step_option = [s["lr"] for s in r["ours_lr_step"]]
        # Warmup: the LR grows at every scheduler step that stock takes.
        assert stock == sorted(set(stock)) and len(stock) == 5
        assert ours == [stock[0], stock[0], stock[1], stock[2], stock[3]]  # held at the skip
        assert step_option == stock[:3]  # lr_on_skip="step": verl's stock schedule


@needs_verl
@TWO_RANKS
def test_resume_keeps_the_scale_and_matches_the_uninterrupted_run(runs):
    _, results = runs
    for r in results:
        assert r["ours_resumed_scale"] == 32768.0
        # Norms, scales, LR, metrics, collectives (host reads aside: a fresh scaler's first step
        # reads once more).
        assert _without_reads(r["ours_resumed"]) == _without_reads(r["ours"][3:])
        assert r["ours_resumed_final"] == r["ours_final"]  # the shards, bit for bit
        # Stock: the scale is not in verl's checkpoint, the resumed run starts from 65536.
        assert r["stock_resumed_scale"] == 65536.0
        assert [s["scale"] for s in r["stock_resumed"]] == [65536.0, 65536.0]
        assert [s["scale"] for s in r["stock"][3:]] == [32768.0, 32768.0]


@needs_verl
@TWO_RANKS
def test_save_checkpoint_returns_when_every_ranks_scaler_file_exists(runs):
    import _verl_scenarios as S

    assert S.SLOW_WRITE_S > 0  # guard: the last rank writes its file late
    verl_files = {
        f"{kind}_world_size_2_rank_{rank}.pt"
        for kind in ("model", "optim", "extra_state")
        for rank in (0, 1)
    }
    ours_files = {f"distscaler_world_size_2_rank_{rank}.pt" for rank in (0, 1)}
    _, results = runs
    for r in results:  # results[0]: rank 0's listing right after save_checkpoint returned
        # Stock: verl's own files all exist when its save returns (its closing barrier).
        assert verl_files <= set(r["stock_listing"])
        # Ours: the same, plus every rank's scaler file (one more barrier after writing it).
        assert set(r["ours_listing"]) == set(r["stock_listing"]) | ours_files


@needs_verl
@TWO_RANKS
def test_the_overflow_warning_names_the_parameter_by_its_module_path(runs):
    strategy, results = runs
    for r in results:
        # The inf went into rank 1's first gradient shard: the embedding's (FSDP1: the flat
        # parameter that holds it).
        ((rank, param),) = r["ours_overflow"]
        assert rank == 1 and not param.startswith("param_groups"), param
        if strategy == "fsdp2":
            assert param == "model.embed_tokens.weight" == r["param_names"][0]
        assert f"inf in `{param}` on rank 1" in r["ours_overflow_text"]


def _without_reads(steps):
    return [{k: v for k, v in s.items() if k != "host_reads"} for s in steps]


@needs_verl
@pytest.mark.slow
@pytest.mark.xdist_group("verl-job")
def test_train_verl_grpo_job_with_an_inf_on_one_rank(tmp_path):
    args = ("--steps", "8", "--inject-inf", "3")
    ours = torchrun_summary("train_verl.py", *args, out=tmp_path / "ours")
    stock = torchrun_summary("train_verl.py", *args, "--stock", out=tmp_path / "stock")
    assert ours["engine"] == "distscaler.integrations.verl.FSDPEngineWithLMHead"
    assert stock["engine"] == "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    for summary in (ours, stock):
        assert summary["ranks_agree"] and summary["skipped_steps"] == [3]
        assert summary["scales"] == [65536.0] * 2 + [32768.0] * 6
        assert all(math.isfinite(n) for i, n in enumerate(summary["grad_norms"]) if i != 2)
    # Up to the skip the two runs are the same run.
    assert ours["mean_reward"][:3] == stock["mean_reward"][:3]


# ----------------------------------------------------------------------------- in this process


@pytest.fixture
def ds_verl(monkeypatch):
    import distscaler.integrations.verl as module

    monkeypatch.setattr(module, "_options", None)
    monkeypatch.delenv("DISTSCALER_VERL_SCALER", raising=False)
    monkeypatch.delenv("DISTSCALER_VERL_LR_ON_SKIP", raising=False)
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # verl registers its FSDP engines for cuda/npu
    yield module
    module.install()


@needs_verl
def test_install_and_uninstall_swap_every_fsdp_entry_of_the_registry(ds_verl):
    from verl.workers.engine import fsdp as stock
    from verl.workers.engine.base import EngineRegistry

    assert ds_verl.install() == 0  # the import installed it already: idempotent
    for model_type, backend in [
        ("language_model", "fsdp"),
        ("language_model", "fsdp2"),
        ("value_model", "fsdp"),
        ("value_model", "fsdp2"),
    ]:
        assert ds_verl.installed(model_type, backend)
        cls = EngineRegistry.get_engine_cls(model_type, backend)
        assert issubclass(cls, ds_verl.DistScalerFSDPEngine) and cls.__module__ == ds_verl.__name__
    ours = EngineRegistry.get_engine_cls("value_model", "fsdp2")
    assert issubclass(ours, stock.transformer_impl.FSDPEngineWithValueHead)
    restored = ds_verl.uninstall()
    assert restored >= 8  # 2 model types x 2 backends x (cuda, npu)
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is stock.FSDPEngineWithLMHead
    assert not ds_verl.installed("language_model", "fsdp2")
    # The turbo engine is verl's in both states: it builds no scaler (docs: not covered).
    assert ds_verl.install() == restored


@needs_verl
def test_configure_validates_before_it_changes_anything(ds_verl):
    with pytest.raises(
        ValueError, match=r"lr_on_skip must be one of \('hold', 'step'\), got: 'skip'"
    ):
        ds_verl.configure(lr_on_skip="skip")
    with pytest.raises(TypeError, match="scaler must be None, a distscaler.GradScaler"):
        ds_verl.configure(scaler=42)
    assert ds_verl._options is None  # nothing kept
    options = ds_verl.configure(scaler={"fp16": {"enabled": True, "initial_scale_power": 12}})
    assert options.lr_on_skip == "hold" and ds_verl.options() is options
    assert ds_verl._new_scaler("cpu").get_scale() == 2.0**12  # DeepSpeed's semantics


@needs_verl
def test_configure_refuses_a_missing_deepspeed_config_path_with_a_valueerror(ds_verl, tmp_path):
    from distscaler import ScalerConfig

    missing = tmp_path / "missing.json"
    # ScalerConfig.from_deepspeed alone raises FileNotFoundError; configure's error is a
    # ValueError, as documented, and still a FileNotFoundError.
    with pytest.raises(FileNotFoundError):
        ScalerConfig.from_deepspeed(missing)
    for given in (missing, str(missing)):
        with pytest.raises(
            ValueError,
            match=r"scaler must be a path to a DeepSpeed config JSON "
            r"file when it is a path, got: '.*missing.json' \(no such file\)",
        ):
            ds_verl.configure(scaler=given)
        with pytest.raises(FileNotFoundError):
            ds_verl.configure(scaler=given)
    assert ds_verl._options is None  # nothing kept


@needs_verl
def test_configure_checks_the_scalers_device_against_this_process(ds_verl, monkeypatch):
    import torch
    from verl.utils import device

    from distscaler import GradScaler

    assert not torch.cuda.is_available()  # this test's premise: a CPU-only process
    # verl names "cuda" here (its default platform); torch disables GradScaler("cuda") without
    # CUDA, so fp16 would train with no scale. Refused when configured, not at the engine build.
    assert device.get_device_name() == "cuda"
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling."):
        cuda = GradScaler("cuda")
    assert not cuda.is_enabled()
    with pytest.raises(
        ValueError,
        match=r"scaler's device type must be available in this process, got: 'cuda' "
        r"\(torch.cuda.is_available\(\) is False",
    ):
        ds_verl.configure(scaler=cuda)
    # A device type other than verl's.
    with pytest.raises(
        ValueError,
        match=r"scaler's device type must be verl's device \(get_device_name\(\)\) \('cuda'\), "
        r"got: 'cpu'",
    ):
        ds_verl.configure(scaler=GradScaler("cpu"))
    assert ds_verl._options is None  # nothing kept
    # On verl's CPU platform (the spawned tests' launch/common/verl_cpu.py), a CPU scaler is kept.
    monkeypatch.setattr(device, "get_device_name", lambda: "cpu")
    scaler = GradScaler("cpu")
    assert ds_verl.configure(scaler=scaler).scaler is scaler


@needs_verl
def test_the_environment_sets_the_options(ds_verl, monkeypatch, tmp_path):
    import json

    assert ds_verl.options() == ds_verl.VerlScalerOptions()
    scaler = ds_verl._new_scaler("cpu")  # verl's own settings by default
    assert scaler.get_scale() == 65536.0 and scaler.get_growth_interval() == 400
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"fp16": {"enabled": True, "initial_scale_power": 10}}))
    monkeypatch.setenv("DISTSCALER_VERL_SCALER", str(config))
    monkeypatch.setenv("DISTSCALER_VERL_LR_ON_SKIP", "step")
    assert ds_verl.options().lr_on_skip == "step"
    assert ds_verl._new_scaler("cpu").get_scale() == 2.0**10
    monkeypatch.setenv("DISTSCALER_VERL_LR_ON_SKIP", "never")
    with pytest.raises(ValueError, match="DISTSCALER_VERL_LR_ON_SKIP must be one of"):
        ds_verl.options()


@needs_verl
def test_the_megatron_engine_asks_for_megatrons_standard_fp16_optimizer(ds_verl):
    from types import SimpleNamespace

    # verl turns the precision-aware optimizer on in fp16 unless its override says otherwise.
    for override in (None, {}, {"use_precision_aware_optimizer": True}):
        with pytest.raises(NotImplementedError, match="use_precision_aware_optimizer=False"):
            ds_verl._check_standard_fp16_optimizer(
                SimpleNamespace(override_optimizer_config=override)
            )
    ds_verl._check_standard_fp16_optimizer(
        SimpleNamespace(override_optimizer_config={"use_precision_aware_optimizer": False})
    )


@pytest.mark.skipif(not os.environ.get("DISTSCALER_VERL_STAGE"), reason="CI's verl stage only")
def test_the_verl_stage_can_build_verls_megatron_engine():
    import test_verl_megatron as M

    assert (M.VERL, M.MCORE, M.MBRIDGE) == (TESTED, "0.19.2", True), (
        "CI's verl stage installs megatron-core 0.19.2 and mbridge beside verl: "
        "tests/test_verl_megatron.py must not skip there"
    )
