"""AReaL integration (``distscaler.integrations.areal``) against stock AReaL 1.0.4, side by side.

One spawn of 2 gloo ranks (tests/_areal_scenarios.py: the engine, the RL step, what "stock" and
the fp32 reference are). AReaL's own ``FSDPPPOActor`` on a tiny Qwen2 in fp16, AReaL's GRPO step:

* (a) tiny gradients (advantages times 2**-20 at step 0): stock fp16 flushes every gradient to zero
  (norm 0, the fp32 reference's is not); scaled, they match the fp32 reference's;
* (b) an inf in rank 1's gradient shard at step 2: both skip on both ranks, the shards and AdamW's
  step count unchanged; stock steps the LR scheduler on the skip, ours holds it; ours backs the
  scale off 65536 -> 32768 on both ranks, in one collective per clean step (stock: 2);
* (c) a checkpoint (AReaL's recover format) after step 3 and resume: ours resumes with the scale
  and the parameters of the uninterrupted run, bit for bit; a stock checkpoint loads with a
  warning and the initial scale;
* (d) ``grad_norm`` is a float on every step, non-finite exactly on the skipped one;
* (e) a second ``optimizer_step`` in one iteration: stock steps again with the same gradients,
  ours raises ``CallOrderError`` on every rank and changes nothing; a second ``unscale_`` is
  refused with ``CallOrderError``.

AReaL 1.0.4 pins torch < 2.11 and transformers <= 5.3.0, which the suite's venv cannot hold: CI
installs it in a venv of its own (``.ci/run``'s AReaL stage, docs/integrations/areal.md);
elsewhere these tests skip, except under ``DISTSCALER_AREAL_STAGE=1``, where a missing AReaL fails.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import time

import pytest
from _common import torchrun_summary
from _harness import spawn

TESTED = "1.0.4"
try:
    FOUND: str | None = importlib.metadata.version("areal")  # importing AReaL takes ~20 s
except importlib.metadata.PackageNotFoundError:
    FOUND = None

needs_areal = pytest.mark.skipif(
    FOUND != TESTED,
    reason=f"AReaL {TESTED} (found {FOUND}): a venv of its own (docs/integrations/areal.md)",
)
TWO_RANKS = pytest.mark.xdist_group("areal2")


@pytest.mark.skipif(not os.environ.get("DISTSCALER_AREAL_STAGE"), reason="CI's AReaL stage only")
def test_the_areal_stage_has_the_tested_areal():
    assert FOUND == TESTED, f"CI's AReaL stage installs AReaL {TESTED}, found {FOUND}"


@needs_areal
def test_areals_default_attention_is_flash_attention_2_and_the_job_sets_sdpa():
    """docs/integrations/areal.md: AReaL's engines default to ``attn_impl="flash_attention_2"``;
    on a CPU the page, the job and these tests set ``"sdpa"``."""
    import inspect

    from areal.api.cli_args import PPOActorConfig
    from areal_job import actor_config

    assert PPOActorConfig.__dataclass_fields__["attn_impl"].default == "flash_attention_2"
    assert 'attn_impl="sdpa"' in inspect.getsource(actor_config)


def test_flash_attention_2_does_not_build_without_flash_attn():
    """What AReaL's default attention gives on a machine without flash-attn (a CPU): transformers
    refuses to build the model (measured with the suite's transformers and AReaL's)."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    config = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    with pytest.raises(ImportError, match="FlashAttention2"):
        transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="flash_attention_2"
        )
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


#: The spawn's results, once per test session: the first worker that asks spawns and writes them
#: where every xdist worker finds them (pytest 9.2 with xdist 3.8 ignores ``xdist_group``: xdist
#: renames ``item._nodeid``, pytest 9 reads ``item._id``, so the tests of a group can land on both
#: workers), the others wait for the file. The spawn takes minutes on 2 cores.
_SPAWNED: list[list[dict]] = []
SPAWN_WAIT_S = 1200


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import _areal_scenarios as S

    if _SPAWNED:
        return _SPAWNED[0]
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done, lock = shared / "areal-spawn.json", shared / "areal-spawn.lock"
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # another worker spawns
        deadline = time.monotonic() + SPAWN_WAIT_S
        while not done.exists():
            assert time.monotonic() < deadline, f"no {done} after {SPAWN_WAIT_S} s"
            time.sleep(1)
        found = json.loads(done.read_text())
        assert "__error__" not in found, f"the spawn failed in another worker:\n{found}"
    else:
        try:
            found = spawn(S.everything, 2, tmp_path_factory.mktemp("areal"))
        except BaseException as e:
            done.write_text(json.dumps({"__error__": repr(e)}))
            raise
        written = done.with_suffix(".tmp")
        written.write_text(json.dumps(found))
        written.replace(done)
    _SPAWNED.append(found)
    return found


def _scenarios():
    import _areal_scenarios as S

    return S


@needs_areal
@TWO_RANKS
def test_install_makes_ours_a_subclass_of_areals_engine(results):
    for r in results:
        assert r["stock_engine"] == "areal.engine.fsdp_engine.FSDPPPOActor"
        # After initialize (PPOTrainer's actor) and before it (the resumed engine).
        assert (
            r["ours_engine"] == r["resumed_engine"] == "distscaler.integrations.areal.FSDPPPOActor"
        )


@needs_areal
@TWO_RANKS
def test_a_tiny_gradients_underflow_in_stock_fp16_and_survive_the_scale(results):
    S = _scenarios()
    for r in results:
        fp32 = r["fp32"][S.TINY_STEP]["grads"]
        stock = r["stock"][S.TINY_STEP]["grads"]
        ours = r["ours"][S.TINY_STEP]["grads"]
        # The case: the fp32 reference's gradients are tiny but there (~10 % of the elements
        # are 0 there too: embedding rows of tokens absent from the batch).
        assert 0 < fp32["norm"] < 1e-4 and fp32["zero_fraction"] < 0.2
        # Stock fp16: every gradient element flushed to zero, the norm AReaL reports is 0.
        assert stock["zero_fraction"] == 1.0 and stock["norm"] == 0.0
        assert stock["rel_error"] == 1.0
        assert r["stock"][S.TINY_STEP]["stats"]["grad_norm"] == 0.0
        # Ours: the unscaled gradients are the fp32 reference's within fp16's rounding.
        assert ours["rel_error"] < 1e-2
        assert ours["zero_fraction"] == pytest.approx(fp32["zero_fraction"], abs=2e-3)
        norm = r["ours"][S.TINY_STEP]["stats"]["grad_norm"]
        assert norm == pytest.approx(fp32["norm"], rel=1e-2)
        assert norm == pytest.approx(ours["norm"], rel=1e-4)  # AReaL's grad_norm is unscaled


@needs_areal
@TWO_RANKS
def test_b_an_inf_on_one_rank_skips_on_every_rank_lr_held_scale_backed_off(results):
    S = _scenarios()
    k = S.INF_STEP
    for r in results:
        for name in ("stock", "ours"):
            steps = r[name]
            skipped = steps[k]
            assert math.isinf(skipped["stats"]["grad_norm"]), name  # the injected inf was seen
            assert skipped["stats"]["update_successful"] == 0.0, name
            assert not skipped["changed"], name  # the shards untouched
            assert skipped["adam_steps"] == steps[k - 1]["adam_steps"], name  # AdamW held
            assert all(s["stats"]["update_successful"] == 1.0 for s in steps if s["step"] != k)
            assert all(s["changed"] for s in steps[1:] if s["step"] != k), name
        stock, ours = r["stock"], r["ours"]
        # The LR scheduler: stock steps it on the skipped step, ours holds it (then lags by one).
        assert stock[k]["lr_after"] > stock[k - 1]["lr_after"]
        assert ours[k]["lr_after"] == ours[k - 1]["lr_after"]
        assert [s["lr_after"] for s in ours[k + 1 :]] == [s["lr_after"] for s in stock[k:-1]]
        assert (r["stock_lr_scheduler"], r["ours_lr_scheduler"]) == (S.SAVE_AFTER + 1, S.SAVE_AFTER)
        # The scale: none in stock; ours backs off once, equally on every rank.
        assert {s["scale"] for s in stock} == {None}
        assert [s["scale"] for s in ours] == [65536.0] * k + [32768.0] * (S.STEPS - k)
        # Collectives in optimizer_step: stock 2 all_reduces (the norm over the FSDP group, then
        # over the size-1 tensor-parallel group); ours 1, plus the report's all_gather at the skip.
        assert {s["collectives"] for s in stock} == {2}
        assert {s["collectives"] for s in ours if s["step"] != k} == {1}
        assert {kind for s in ours if s["step"] != k for kind in s["kinds"]} == {"c10d.allreduce_"}
        assert ours[k]["kinds"] == ["c10d._allgather_base_", "c10d.allreduce_"]
        # Ours: 2 float64 (the flag and the sum of squares; FSDP2's shards: nothing replicated,
        # so no replica check); stock: one float32 per all_reduce (the norm).
        assert {tuple(s["all_reduce_bytes"]) for s in ours} == {(16,)}
        assert {tuple(s["all_reduce_bytes"]) for s in stock} == {(4, 4)}
        # Host reads in optimizer_step (the optimizer's own aside), clean steps after the first:
        # stock 6; ours 4 (the norm AReaL returns, the scaler's metrics, and on a CPU, where a
        # read costs no sync, this rank's norm before the collective and the flag).
        assert {s["host_reads"] for s in stock} == {6}
        assert {s["host_reads"] for s in ours[1:] if s["step"] != k} == {4}
    # Every rank reports the same norms, scales, skips, LR and counts.
    assert results[0]["ours"] == results[1]["ours"]
    assert results[0]["stock"] == results[1]["stock"]


@needs_areal
@TWO_RANKS
def test_b_the_step_reports_the_scale_the_skip_and_the_overflow(results):
    S = _scenarios()
    for r in results:
        stats = [s["stats"] for s in r["ours"]]
        assert [m["distscaler/skipped"] for m in stats] == [
            float(s["step"] == S.INF_STEP) for s in r["ours"]
        ]
        assert [m["distscaler/scale"] for m in stats] == [s["scale"] for s in r["ours"]]
        assert stats[-1]["distscaler/skipped_total"] == 1.0
        assert stats[-1]["distscaler/updates"] == float(S.STEPS)
        # The skipped step is the 3rd update; one tensor held the inf: rank 1's first shard.
        assert stats[S.INF_STEP]["distscaler/overflow_step"] == float(S.INF_STEP + 1)
        assert stats[S.INF_STEP]["distscaler/overflow_tensors"] == 1.0
        assert r["ours_overflow"] == [[1, "model.embed_tokens.weight"]]
        assert r["param_names"][0] == "model.embed_tokens.weight"
        assert "inf in `model.embed_tokens.weight` on rank 1" in r["ours_overflow_text"]
        assert all(not any(k.startswith("distscaler/") for k in s["stats"]) for s in r["stock"])


@needs_areal
@TWO_RANKS
def test_c_resume_keeps_the_scale_and_matches_the_uninterrupted_run(results):
    S = _scenarios()
    ours_files = {f"distscaler_world_size_2_rank_{rank}.pt" for rank in (0, 1)}
    for r in results:  # the listings: right after save() returned
        assert ours_files.isdisjoint(r["stock_listing"])
        assert set(r["ours_listing"]) == set(r["stock_listing"]) | ours_files
        assert r["ours_resumed_scale"] == r["ours"][S.SAVE_AFTER]["scale"] == 32768.0
        # Norms, scales, LR, skips, collectives (host reads aside: a fresh scaler's first step
        # reads once more; the overflow report is not part of the checkpoint).
        assert _comparable(r["ours_resumed"]) == _comparable(r["ours"][S.SAVE_AFTER + 1 :])
        assert r["ours_resumed_final"] == r["ours_final"]  # the shards, bit for bit
        # A stock checkpoint: the initial scale, and a warning naming the missing file.
        assert r["ours_from_stock_scale"] == 65536.0
        (warning,) = r["ours_from_stock_warnings"]
        assert "no distscaler state" in warning and "distscaler_world_size_2_rank_" in warning


def _comparable(steps):
    drop = {"host_reads", "stats"}
    overflow = ("distscaler/overflow_step", "distscaler/overflow_tensors")
    return [
        {
            **{k: v for k, v in s.items() if k not in drop},
            "stats": {k: v for k, v in s["stats"].items() if k not in overflow},
        }
        for s in steps
    ]


@needs_areal
@TWO_RANKS
def test_d_grad_norm_is_a_float_on_every_step(results):
    S = _scenarios()
    for r in results:
        for name in ("stock", "ours", "ours_resumed"):
            for s in r[name]:
                norm = s["stats"]["grad_norm"]
                assert isinstance(norm, float), (name, s["step"])
                assert math.isfinite(norm) == (s["step"] != S.INF_STEP), (name, s["step"])


@needs_areal
@TWO_RANKS
def test_e_a_second_optimizer_step_or_unscale_in_one_iteration_is_refused(results):
    for r in results:
        stock = r["stock_second_step"]
        # Stock: the same gradients stepped twice; AdamW counts one more step.
        assert stock["error"] is None and stock["changed"] and stock["adam_steps_added"] == 1
        assert stock["stats"]["update_successful"] == 1.0
        ours = r["ours_second_step"]
        assert ours["error"].startswith(
            "CallOrderError: optimizer_step() needs a scaled backward since the last "
            "optimizer_step()"
        )
        assert not ours["changed"] and ours["adam_steps_added"] == 0 and ours["stats"] is None
        twice = r["ours_unscale_twice"]
        assert twice["error"] == (
            "CallOrderError: unscale_() has already been called on this optimizer since the "
            "last update()."
        )
        assert twice["grads_unchanged_by_the_refused_call"]
        # The step after one explicit unscale_ runs (the norm from the unscaled gradients).
        assert twice["stats"]["update_successful"] == 1.0
        assert math.isfinite(twice["stats"]["grad_norm"])


@needs_areal
@pytest.mark.slow
@pytest.mark.xdist_group("areal-job")
def test_train_areal_grpo_job_with_an_inf_on_one_rank(tmp_path):
    # Ours only: stock's side of every figure is in the spawn above (a stock job costs another
    # minute of AReaL's start-up; docs/integrations/areal.md measures both).
    summary = torchrun_summary(
        "train_areal.py", "--steps", "6", "--inject-inf", "3", out=tmp_path, timeout=600
    )
    assert summary["engine"] == "distscaler.integrations.areal.FSDPPPOActor"
    assert summary["ranks_agree"] and summary["skipped_steps"] == [3]
    assert all(math.isfinite(n) for i, n in enumerate(summary["grad_norms"]) if i != 2)
    assert math.isinf(summary["grad_norms"][2])
    assert summary["scales"] == [65536.0] * 2 + [32768.0] * 4


# ----------------------------------------------------------------------------- in this process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from areal_job import save_tiny_qwen2

    return save_tiny_qwen2(str(tmp_path_factory.mktemp("areal-model")))


def _actor(model_dir, **changes):
    """AReaL's FSDPPPOActor, constructed (no process group, not initialized)."""
    import dataclasses

    from areal.api.cli_args import OptimizerConfig, PPOActorConfig
    from areal.engine import FSDPPPOActor

    fsdp = changes.pop("fsdp", {})
    optimizer = changes.pop("optimizer", {})
    config = PPOActorConfig(
        experiment_name="x",
        trial_name="t",
        path=model_dir,
        dtype=changes.pop("dtype", "float16"),
        optimizer=None if optimizer is None else OptimizerConfig(**optimizer),
        **changes,
    )
    config.fsdp = dataclasses.replace(config.fsdp, **fsdp)
    return FSDPPPOActor(config=config)


def _untouched(engine) -> bool:
    from areal.engine import FSDPPPOActor

    return type(engine) is FSDPPPOActor and not hasattr(engine, "distscaler")


@needs_areal
def test_install_refuses_what_it_does_not_cover_before_changing_anything(model_dir):
    from distscaler.integrations.areal import install

    cases = [
        ({"dtype": "bfloat16"}, ValueError, r"engine.config.dtype must be 'float16' for a loss "
         r"scale, got: 'bfloat16' \(bfloat16 and float32 train without one\)"),
        ({"dtype": "float32"}, ValueError, "got: 'float32'"),
        ({"optimizer": None}, ValueError, r"engine has no optimizer \(config.optimizer is None"),
        ({"optimizer": {"gradient_clipping": 0.0}}, ValueError,
         r"gradient_clipping must be a number > 0 \(math.inf: no clipping\), got: 0.0"),
        ({"fsdp": {"per_layer_optim_step": True}}, NotImplementedError, "per_layer_optim_step"),
        ({"fsdp": {"offload_params": True}}, NotImplementedError, "offload_params=True"),
    ]  # fmt: skip
    for changes, error, message in cases:
        engine = _actor(model_dir, **changes)
        with pytest.raises(error, match=message):
            install(engine)
        assert _untouched(engine), changes


@needs_areal
def test_install_refuses_other_engines_and_single_controller_mode(model_dir):
    from areal.infra.controller.train_controller import TrainController

    from distscaler.integrations.areal import install

    with pytest.raises(
        TypeError,
        match=r"engine must be AReaL's FSDP engine in this process "
        r"\(areal.engine.fsdp_engine.FSDPEngine or a subclass\), got: builtins.object$",
    ):
        install(object())

    class PPOActorController(TrainController):  # what single-controller mode's trainer.actor is
        def __init__(self) -> None:
            pass

    with pytest.raises(TypeError, match=r"single-controller mode.*AREAL_SPMD_MODE=1"):
        install(PPOActorController())


@needs_areal
def test_install_takes_the_scaler_argument_every_integration_takes(model_dir):
    import torch

    from distscaler import GradScaler, ScalerConfig
    from distscaler.integrations.areal import AREAL_SCALER, install, scaler_of

    engine = _actor(model_dir)
    assert scaler_of(engine) is None
    scaler = install(engine)  # the default: torch's settings
    assert engine.distscaler is scaler and scaler_of(engine) is scaler
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (65536.0, 2000)
    assert AREAL_SCALER == ScalerConfig()
    assert type(engine).__module__ == "distscaler.integrations.areal"
    assert isinstance(engine, __import__("areal.engine", fromlist=["x"]).FSDPPPOActor)
    assert install(engine) is scaler  # idempotent
    with pytest.raises(ValueError, match=r"engine already has distscaler's scaler"):
        install(engine, scaler=ScalerConfig())
    assert engine.distscaler is scaler

    assert install(_actor(model_dir), ScalerConfig(init_scale=1024.0)).get_scale() == 1024.0
    ds = {"fp16": {"enabled": True, "initial_scale_power": 12}}  # DeepSpeed's semantics
    assert install(_actor(model_dir), ds).get_scale() == 2.0**12
    mine = GradScaler("cpu", init_scale=8.0)
    assert install(_actor(model_dir), mine) is mine
    assert not torch.cuda.is_available()  # AReaL's device here: "cpu"
    for bad, error, message in [
        (42, TypeError, "scaler must be None, a distscaler.GradScaler"),
        (GradScaler("meta"), ValueError, r"scaler's device type must be AReaL's device "
         r"\(current_platform.device_type\) \('cpu'\), got: 'meta'"),
    ]:  # fmt: skip
        engine = _actor(model_dir)
        with pytest.raises(error, match=message):
            install(engine, bad)
        assert _untouched(engine)
