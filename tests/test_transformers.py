"""Transformers Trainer / TRL integration (``distscaler.integrations.transformers``) against stock.

Two kinds of runs:

* In this process, one rank: stock ``Trainer(fp16=True, use_cpu=True)`` trains in fp32 with no
  scaler, ``install(trainer)`` makes fp16 real and says so once; the argument checks; the
  torchrun-on-CPU-without-``use_cpu`` refusal; uninstall.
* One ``torchrun`` of launch/train_transformers.py on 2 CPU processes.
* One spawn of 2 gloo ranks (tests/_transformers_scenarios.py, its docstring says what "stock" is
  and what the FSDP2 run sets up differently on the CPU): DDP with ``adamw_torch_fused``,
  ``max_grad_norm`` 1.0 and 0, gradient accumulation, a checkpoint and its resume, FSDP2 through
  the Trainer's FSDP settings, TRL's ``SFTTrainer``; an inf on the last rank at one step; stock
  next to ours where stock has something to show.
"""

from __future__ import annotations

import functools
import logging
import math

import _transformers_scenarios as S
import pytest
import torch
from _common import REPO, torchrun_summary
from _harness import spawn
from _torch_gaps import guarded

transformers = pytest.importorskip("transformers")  # the transformers extra; CI installs it

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from distscaler import GradScaler  # noqa: E402
from distscaler.integrations import transformers as T  # noqa: E402
from distscaler.integrations.accelerate import ScaledAcceleratedOptimizer  # noqa: E402

CLEAN = [False, True, False, False]  # the skip pattern of an inf at INJECT_STEP
assert S.INJECT_STEP == 1 and S.NUM_STEPS == 4


@pytest.fixture
def make_trainer(tmp_path):
    """A Trainer around the scenarios' tiny GPT-2, fresh Accelerate singletons for each."""

    def make(**kwargs) -> Trainer:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        args = dict(
            output_dir=str(tmp_path / "out"), fp16=True, use_cpu=True, max_steps=2,
            per_device_train_batch_size=2, report_to=[], disable_tqdm=True, save_strategy="no",
            optim="adamw_torch_fused",
        )  # fmt: skip
        args.update(kwargs)
        return Trainer(
            model=S._model(), args=TrainingArguments(**args), train_dataset=S._lm_data(8)
        )

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _mlp_dtypes(trainer: Trainer) -> list[torch.dtype]:
    """Train, recording the dtype of the first block's MLP output (fp16 under fp16 autocast)."""
    dtypes: list[torch.dtype] = []
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda m, i, o: dtypes.append(o.dtype)
    )
    trainer.train()
    return dtypes


# ----------------------------------------------------------------------- one process


def test_cpu_fp16_is_fp32_in_stock_and_real_fp16_said_once_with_install(
    make_trainer, caplog, monkeypatch
):
    stock = make_trainer()
    assert stock.accelerator.scaler is None and not stock.accelerator.native_amp
    assert set(_mlp_dtypes(stock)) == {torch.float32}  # fp16=True, silently fp32

    monkeypatch.setattr(T, "_said_cpu_fp16", False)
    caplog.set_level(logging.WARNING, logger="distscaler")
    ours = make_trainer()
    scaler = T.install(ours)
    assert T.installed_scaler(ours) is scaler and ours.accelerator.scaler is scaler
    assert set(_mlp_dtypes(ours)) == {torch.float16}
    assert type(ours.optimizer) is ScaledAcceleratedOptimizer
    assert scaler.skip_totals.num_updates == 2
    again = make_trainer()
    T.install(again)  # a second Trainer in the same process: not said again
    said = [r for r in caplog.records if "fp16=True on the CPU" in r.getMessage()]
    assert len(said) == 1


def test_logs_carry_scale_and_skips(make_trainer):
    trainer = make_trainer(logging_steps=1)
    T.install(trainer, GradScaler("cpu", init_scale=512.0))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["distscaler/scale"] for h in logs] == [512.0, 512.0]
    assert [h["distscaler/skipped"] for h in logs] == [0, 0]
    assert "distscaler/overflow_step" not in logs[-1]  # nothing overflowed


def test_install_checks_its_arguments(make_trainer):
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer .*, got: int"):
        T.install(3)  # type: ignore[arg-type]
    trainer = make_trainer()
    with pytest.raises(TypeError, match="log_metrics must be a bool, got: 1"):
        T.install(trainer, log_metrics=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scaler's device type must be"):
        T.install(trainer, GradScaler("cuda", enabled=False))
    assert T.installed_scaler(trainer) is None and trainer.accelerator.scaler is None
    T.install(trainer)
    with pytest.raises(RuntimeError, match="already installed"):
        T.install(trainer)
    fp32 = make_trainer(fp16=False)
    with pytest.raises(ValueError, match=r"needs TrainingArguments\(fp16=True\), got: "):
        T.install(fp32)
    T.install(fp32, GradScaler("cpu"))  # an explicit scaler agrees on inf/NaN without fp16


def test_torchrun_on_cpu_without_use_cpu_is_refused(make_trainer, monkeypatch):
    # What torchrun's environment gives a Trainer that runs one process (DistributedType.NO).
    trainer = make_trainer()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE is 2 .*use_cpu=True"):
        T.install(trainer)
    assert trainer.accelerator.scaler is None  # nothing changed


def test_uninstall_gives_back_the_stock_trainer(make_trainer):
    trainer = make_trainer()
    callbacks = list(trainer.callback_handler.callbacks)
    scaler = T.install(trainer)
    assert isinstance(trainer.callback_handler.callbacks[0], T.DistScalerCallback)
    assert T.uninstall(trainer) is scaler
    assert trainer.callback_handler.callbacks == callbacks
    assert trainer.accelerator.scaler is None and T.installed_scaler(trainer) is None
    with pytest.raises(RuntimeError, match="not installed"):
        T.uninstall(trainer)


# ----------------------------------------------------------------------- 2 gloo ranks


# Every test of the spawn on one xdist worker, so that the module fixture spawns once.
TWO_RANKS = pytest.mark.xdist_group("transformers2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("transformers")
    return guarded(spawn(functools.partial(S.everything, tmp=str(tmp / "work")), 2, tmp))


def _per_rank(runs, name, key):
    return [[s[key] for s in r[name]["steps"]] for r in runs]


def _assert_agreed_skip(runs, name):
    """Both ranks skip the inf step, hold the scheduler, back off alike, keep equal parameters."""
    assert runs[-1][name]["injected"] == [S.INJECT_STEP] and runs[0][name]["injected"] == []
    for r in runs:
        steps = r[name]["steps"]
        assert [s["skipped"] for s in steps] == CLEAN
        assert [s["sched"] for s in steps] == [1, 1, 2, 3]  # held at the skipped step
        assert steps[1]["params"] == steps[0]["params"]  # the skipped step changed nothing
        assert steps[1]["scale"] == steps[0]["scale"] / 2
    for key in ("scale", "params"):
        values = _per_rank(runs, name, key)
        assert values[0] == values[1], f"{name}: ranks disagree on {key}"


@TWO_RANKS
@pytest.mark.parametrize("name", ["ours", "ours-norm0", "ours-accum", "ours-sft"])
def test_inf_on_one_rank_is_skipped_on_both_and_the_scheduler_holds(runs, name):
    if name == "ours-sft" and runs[0].get("sft", "") is None:
        pytest.skip("trl does not import here")
    assert runs[0][name]["distributed_type"] == "DistributedType.MULTI_CPU"
    _assert_agreed_skip(runs, name)
    stock = runs[0][name.replace("ours", "stock").replace("-norm0", "")]
    # Same model, data and first step as stock: the same pre-clip norm. Rank 0 held no inf, yet
    # its norm of the inf step is not finite: the norm is the global one, from the collective
    # (max_grad_norm=0 included: the Trainer's measure-only max_norm=inf).
    norms = runs[0][name]["grad_norms"]
    assert norms[0] == pytest.approx(stock["grad_norms"][0], rel=1e-5)
    assert not math.isfinite(norms[1]) and all(math.isfinite(n) for n in norms[2:])


@TWO_RANKS
@pytest.mark.parametrize("name", ["stock", "stock-accum", "stock-sft"])
def test_stock_decides_per_rank_and_steps_the_scheduler_on_a_fused_skip(runs, name):
    if name == "stock-sft" and runs[0].get("sft", "") is None:
        pytest.skip("trl does not import here")
    first, last = (r[name]["steps"] for r in runs)
    assert runs[-1][name]["injected"] == [S.INJECT_STEP]
    # Guard: the last rank's torch scaler saw the inf (it backed off, its parameters held) ...
    assert last[1]["scale"] == last[0]["scale"] / 2 and last[1]["params"] == last[0]["params"]
    # ... the first rank did not: it stepped and kept its scale; the ranks now differ.
    assert first[1]["scale"] == first[0]["scale"] and first[1]["params"] != first[0]["params"]
    assert first[-1]["params"] != last[-1]["params"]
    # Accelerate misses the fused skip (accelerate 4242): the scheduler steps on both ranks.
    for steps in (first, last):
        assert [s["skipped"] for s in steps] == [False] * 4
        assert [s["sched"] for s in steps] == [1, 2, 3, 4]


@TWO_RANKS
def test_logs_carry_the_skip_and_the_overflow_report(runs):
    for r in runs:
        metrics = r["ours"]["metrics"]
        assert [m["distscaler/skipped"] for m in metrics] == [0, 1, 0, 0]
        assert [m["distscaler/scale"] for m in metrics] == _per_rank(runs, "ours", "scale")[0]
        # The report of the skipped step: the scaler's 2nd update, one tensor on one rank.
        assert metrics[1]["distscaler/overflow_step"] == 2
        assert metrics[1]["distscaler/overflow_tensors"] == 1
        assert "distscaler/overflow_step" not in metrics[0]
        assert r["ours"]["final_metrics"]["distscaler/skipped_total"] == 1


@TWO_RANKS
def test_checkpoint_carries_the_scaler_and_a_resume_continues_exactly(runs):
    for r in runs:
        full, resumed = r["ours-full"], r["ours-resumed"]
        assert "scaler.pt" in full["checkpoints"]["checkpoint-2"]
        # Guard: the checkpoint holds a skip and a scale that moved since the start.
        saved_at_2 = full["steps"][1]
        assert saved_at_2["skipped"] and saved_at_2["scale"] == 1024.0
        state = resumed["first_state"]  # right after resume_from_checkpoint loaded it
        assert state["scale"] == 1024.0 and state["num_skipped_steps"] == 1
        assert resumed["steps"] == full["steps"][2:]  # skips, scale, scheduler, parameters
        assert resumed["scaler_state"] == full["scaler_state"]
        assert resumed["final_metrics"]["distscaler/skipped_total"] == 1
        assert [m["distscaler/skipped"] for m in resumed["metrics"][-2:]] == [0, 0]


@TWO_RANKS
def test_fsdp2_through_trainer_settings_skips_on_both_ranks_and_holds_the_scheduler(runs):
    # Stock (torch's GradScaler, as Accelerate builds it for FSDP2): here the DTensor check does
    # skip the step on both ranks (parameters held, both scales backed off) ...
    for r in runs:
        steps = r["stock-fsdp2"]["steps"]
        assert steps[1]["params"] == steps[0]["params"]
        assert steps[1]["scale"] == steps[0]["scale"] / 2
        # ... but the Trainer never learns it (fused AdamW): the scheduler steps on the skip.
        assert [s["skipped"] for s in steps] == [False] * 4
        assert [s["sched"] for s in steps] == [1, 2, 3, 4]
    run = runs[0]["ours-fsdp2"]
    assert run["distributed_type"] == "DistributedType.FSDP" and run["grad_type"] == "DTensor"
    _assert_agreed_skip(runs, "ours-fsdp2")
    # The norm of the sharded gradients is the replicated model's (DDP run, same data).
    ddp = runs[0]["ours"]["grad_norms"]
    assert run["grad_norms"][0] == pytest.approx(ddp[0], rel=1e-4)


# ----------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_train_transformers_runs_with_torchrun_on_two_cpu_processes(tmp_path):
    """launch/train_transformers.py: an inf on rank 1 at step 3 is skipped on both ranks."""
    out = tmp_path / "run"

    def run(*extra: str) -> dict:
        return torchrun_summary(
            "train_transformers.py",
            *("--data", str(REPO / "launch" / "train.py"), "--block-size", "32"),
            *("--batch-size", "2", "--n-embd", "32", "--n-layer", "1", *extra),
            out=out,
        )

    summary = run("--steps", "4", "--inject-inf", "3", "--save-steps", "4")
    assert summary["distributed_type"] == "DistributedType.MULTI_CPU"
    assert summary["ranks_consistent"] and summary["steps"] == 4
    assert [r["skipped_steps"] for r in summary["ranks"]] == [[3], [3]]
    logs = [h for h in summary["log_history"] if "loss" in h]
    assert [h["distscaler/skipped"] for h in logs] == [0, 0, 1, 0]
    assert (out / "checkpoint-4" / "scaler.pt").is_file()
