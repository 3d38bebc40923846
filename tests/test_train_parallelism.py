"""``launch/train.py --parallelism fsdp1|fsdp2|hsdp|tp|pp``: real torchrun jobs on gloo (CPU).

Every job trains the tiny smoke model for a few steps with an inf written into one gradient on
rank 1 only (after the gradients are reduced), so only the scaler's agreement can make the other
ranks skip. Checked per layout: every rank skipped exactly that step and backed off, ranks agree
(skips, scale, full parameters gathered per replica), the scaler phase issued exactly one
collective (CommDebugMode, measured by the job itself). Across layouts, the runs that compute the
same training (same function, same batches: data parallel over 2 replicas) must produce the same
losses and the same global gradient norms as each other: FSDP1 (registered flat parameters),
FSDP2 (DTensor shards) and FSDP2 x TP on 2 x 2 ranks (2-D DTensors, replicated norms) take the
norm from different layouts, so a replica counted twice or a shard missed shows up as a
mismatch. ``ddp`` is covered by tests/test_train.py. The fsdp2 run's sharded checkpoint (DCP)
resumes twice: on 2 ranks (bit exact), and on 1 rank (the scaler's state carries over, the data
order changes).

Launches are grouped: the 2-rank jobs run concurrently, then the 4-rank ones; each gets its own
rendezvous (``--standalone``: a free port per launch).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _torch_gaps import GapMap, gap_in
from test_train import (  # the launch helpers of the DDP job's tests
    JOB_TIMEOUT_S,
    REPO,
    SMOKE,
    TRAIN,
    _env,
    _job_args,
    _metrics,
    _run_jobs,
    _standalone,
    _summary,
)

from lm.config import TrainConfig
from lm.parallel import check_parallelism
from lm.pipeline import stage_blocks

pytestmark = pytest.mark.xdist_group("train_parallelism")

INJECT_STEP = 3
STEPS = 5
RESUME_STEPS = 8
# (name, --parallelism, ranks)
JOBS_2 = [("fsdp1", "fsdp1", 2), ("fsdp2", "fsdp2", 2), ("tp", "tp", 2), ("pp", "pp", 2)]
JOBS_4 = [("hsdp4", "hsdp", 4), ("tp4", "tp", 4), ("pp4", "pp", 4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every job of this module, run once: name -> output folder (reading the name of a job torch
    itself could not run skips the test)."""
    tmp = tmp_path_factory.mktemp("parallelism")
    corpus = tmp / "corpus.txt"
    corpus.write_bytes(Path(os.__file__).read_bytes())  # ~40 KB of real text
    cfg = yaml.safe_load(SMOKE.read_text())
    cfg.update(
        device="cpu",
        eval_windows=6,  # not a multiple of the replicas x batch: the padded last batch runs
        inject_inf={"steps": [INJECT_STEP], "rank": 1},
    )
    config = tmp / "smoke.yaml"
    config.write_text(yaml.safe_dump(cfg))
    one_rank = tmp / "smoke_1rank.yaml"  # no rank 1 to inject on (the inf was before the resume)
    one_rank.write_text(yaml.safe_dump({**cfg, "inject_inf": None}))

    def job(
        name: str, parallelism: str, nproc: int, steps: int, cfg: Path = config, **kw: Any
    ) -> list[str]:
        return (
            _standalone(nproc)
            + _job_args(tmp / name, steps=steps, config=cfg, data=corpus, **kw)
            + ["--parallelism", parallelism]
        )

    groups = [
        [(name, job(name, par, n, STEPS)) for name, par, n in JOBS_2]
        + [("fsdp2_straight", job("fsdp2_straight", "fsdp2", 2, RESUME_STEPS))],
        [(name, job(name, par, n, STEPS)) for name, par, n in JOBS_4],
        # fsdp2 stopped at STEPS (its checkpoint, DCP), continued to RESUME_STEPS on 2 ranks and
        # on 1 ("--resume auto": it finds the checkpoint)
        [
            ("fsdp2_resumed", job("fsdp2", "fsdp2", 2, RESUME_STEPS, resume=True)),
            ("fsdp2_on1", job("fsdp2_on1", "fsdp2", 1, RESUME_STEPS, one_rank, resume="auto")),
        ],
    ]
    # A job torch itself cannot run here (FSDP2 on an old torch's CPU, tests/_torch_gaps.py) does
    # not stop the others; the tests that read it skip with the proof.
    gaps: dict[str, str] = {}
    for group in groups:
        names = [name for name, _ in group]
        if "fsdp2_resumed" in names:  # the first fsdp2 run's outputs, before the resumes rewrite
            if "fsdp2" in gaps:
                gaps.update(dict.fromkeys(("fsdp2_resumed", "fsdp2_on1"), gaps["fsdp2"]))
                continue
            shutil.copytree(tmp / "fsdp2", tmp / "fsdp2_on1")
            shutil.copytree(
                tmp / "fsdp2", tmp / "fsdp2_first", ignore=shutil.ignore_patterns("ckpt*")
            )
        tolerated = _run_jobs(
            [cmd for _, cmd in group], [tmp / f"{name}.log" for name in names], tolerate=gap_in
        )
        gaps.update({names[i]: reason for i, reason in tolerated.items()})
    outputs = {name: tmp / name for name, _, _ in JOBS_2 + JOBS_4}
    outputs["fsdp2"] = tmp / "fsdp2_first"
    outputs["fsdp2_resumed"] = tmp / "fsdp2"
    outputs["fsdp2_straight"] = tmp / "fsdp2_straight"
    outputs["fsdp2_on1"] = tmp / "fsdp2_on1"
    return GapMap(outputs, gaps)


@pytest.mark.slow
@pytest.mark.parametrize("name,parallelism,nproc", JOBS_2 + JOBS_4, ids=lambda v: str(v))
def test_inf_on_one_rank_skips_step_on_every_rank_with_one_collective(
    runs: dict[str, Path], name: str, parallelism: str, nproc: int
) -> None:
    records = _metrics(runs[name])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Guard: the injected inf was seen (this model never overflows by itself at this scale).
    assert [r["step"] for r in records if r["skipped"]] == [INJECT_STEP]
    assert records[INJECT_STEP - 1]["grad_norm"] is None
    assert records[INJECT_STEP]["scale"] == records[INJECT_STEP - 1]["scale"] * 0.5
    # The overflow report: the inf on rank 1, in its first local gradient, named without wrappers.
    (entry,) = records[INJECT_STEP - 1]["overflow"]
    assert (entry["rank"], entry["kind"]) == (1, "inf")
    assert not entry["param"].startswith(("param_groups", "module.", "_fsdp_wrapped_module"))
    for r in records:
        assert math.isfinite(r["loss"])
        assert r["skipped"] or math.isfinite(r["grad_norm"])
    summary = _summary(runs[name])
    assert summary["parallelism"] == parallelism
    assert summary["world_size"] == nproc
    # Every rank skipped the same steps, holds the same scale and the same full parameters.
    assert summary["ranks_consistent"] is True
    # Measured by the job with CommDebugMode on one step: clip_grad_norm_ + step + update.
    assert summary["scaler_collectives"] == {"c10d.allreduce_": 1}
    assert summary["scaler_collectives_per_step"] == 1
    assert summary["scaler_phase_ms_median"] > 0
    assert math.isfinite(summary["eval_loss"])


@pytest.mark.slow
def test_data_parallel_layouts_train_identically(runs: dict[str, Path]) -> None:
    """FSDP1, FSDP2 (2 ranks) and FSDP2 x TP (2 x 2 ranks) are one training run: 2 replicas,
    the same batches and the same function; their losses and global norms must agree."""
    reference = _metrics(runs["fsdp2"])
    for name in ("fsdp1", "tp4"):
        for got, want in zip(_metrics(runs[name]), reference, strict=True):
            assert got["skipped"] == want["skipped"]
            assert got["scale"] == want["scale"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (name, got["step"])
            if not want["skipped"]:
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3), (
                    name,
                    got["step"],
                )
    assert _summary(runs["tp4"])["layout"] == "FSDP2 x tensor parallel, mesh (dp=2, tp=2)"


@pytest.mark.slow
def test_pipeline_trains_like_data_parallel(runs: dict[str, Path]) -> None:
    """pp on 2 x 2 ranks sees the batches of the 2-replica runs and starts from the same function;
    only its untied head (a copy of the embedding) makes it drift, slightly. A stage that got no
    gradient from the next one would leave the loss far behind (0.09 at step 5 when it happened)."""
    pp, reference = _metrics(runs["pp4"]), _metrics(runs["fsdp2"])
    assert pp[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-6)
    assert pp[-1]["loss"] == pytest.approx(reference[-1]["loss"], abs=0.01)
    assert _summary(runs["pp4"])["layout"].endswith("x DDP over 2 replicas, 2 micro-batches")


@pytest.mark.slow
def test_fsdp2_resume_from_dcp_continues_bit_exact(runs: dict[str, Path]) -> None:
    resumed, straight = _metrics(runs["fsdp2_resumed"]), _metrics(runs["fsdp2_straight"])
    assert [r["step"] for r in resumed] == list(range(1, RESUME_STEPS + 1))
    for got, want in zip(resumed, straight, strict=True):
        for key in ("loss", "scale", "skipped", "grad_norm", "lr"):
            assert got[key] == want[key], (got["step"], key)
    assert _summary(runs["fsdp2_resumed"])["steps_this_run"] == RESUME_STEPS - STEPS
    assert len(list((runs["fsdp2_resumed"] / "ckpt_dcp").iterdir())) == 1  # older ones removed


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_another_world_size_with_the_scalers_state(
    runs: dict[str, Path],
) -> None:
    """fsdp2's DCP checkpoint of 2 ranks, resumed on 1: DCP reshards model and optimizer; the
    scale, growth tracker and skip counts carry over, and a warning says the data order changes."""
    out = runs["fsdp2_on1"]
    summary = _summary(out)
    assert summary["world_size"] == 1 and summary["steps_this_run"] == RESUME_STEPS - STEPS
    # It started from the 2-rank checkpoint of step STEPS: 1 skip so far (the inf).
    resumed = summary["resumed_from"]
    assert resumed["step"] == STEPS and resumed["num_skipped_steps"] == 1
    records, straight = _metrics(out), _metrics(runs["fsdp2_straight"])
    assert [r["step"] for r in records] == list(range(1, RESUME_STEPS + 1))
    # The smoke model never overflows by itself, so the scale does not depend on the data: with
    # the scale and growth tracker restored, it follows the 2-rank run's step for step, and both
    # end in the same scaler state.
    assert resumed["scale"] == straight[STEPS]["scale"]
    assert [(r["scale"], r["skipped"]) for r in records] == [
        (r["scale"], r["skipped"]) for r in straight
    ]
    ends = [
        torch.load(run / "ckpt.pt", map_location="cpu", weights_only=True)
        for run in (out, runs["fsdp2_straight"])
    ]
    assert [e["world_size"] for e in ends] == [1, 2]
    for key in ("scale", "_growth_tracker", "num_skipped_steps", "num_updates"):
        assert ends[0]["scaler"][key] == ends[1]["scaler"][key], key
    log = (out.parent / "fsdp2_on1.log").read_text()
    assert "saved by 2 rank(s), on 1" in log and "the data order changes" in log


# ---------------------------------------------------------------- invalid combinations


@pytest.mark.parametrize(
    "changes,world_size,message",
    [
        ({"parallelism": "hsdp"}, 2, "needs a world size that is a multiple of hsdp_shard_size=2"),
        ({"parallelism": "hsdp", "hsdp_shard_size": 1}, 2, None),
        ({"parallelism": "tp"}, 3, "multiple of tp_size=2, got: 3"),
        ({"parallelism": "tp", "n_head": 3, "d_model": 48}, 2, "n_head must be a multiple"),
        ({"parallelism": "pp"}, 3, "multiple of pp_stages=2"),
        ({"parallelism": "pp", "pp_stages": 4}, 2, "multiple of pp_stages=4"),
        ({"parallelism": "pp"}, 4, None),
    ],
)
def test_layouts_that_do_not_fit_the_world_size_are_named(
    changes: dict[str, Any], world_size: int, message: str | None
) -> None:
    problems = check_parallelism(TrainConfig(**changes), world_size, launched=True)
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and message in problems[0], problems


def test_pipeline_stages_split_blocks_evenly_and_may_hold_none() -> None:
    assert [list(stage_blocks(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_blocks(1, 2, s)) for s in range(2)] == [[0], []]
    with pytest.raises(ValueError, match="batch_size must be a multiple of pp_microbatches"):
        TrainConfig(parallelism="pp", batch_size=5, pp_microbatches=2)


def test_bad_layout_exits_with_code_2_before_any_process_group(tmp_path: Path) -> None:
    # torchrun's variables without a rendezvous (no MASTER_ADDR): had the job tried to create the
    # process group, it would fail with another error and code 1 (or hang, with a store).
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    job = subprocess.run(
        [
            sys.executable,
            str(TRAIN),
            "--config",
            str(SMOKE),
            "--out",
            str(tmp_path / "out"),
            "--parallelism",
            "pp",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert job.returncode == 2, job.stderr
    assert "parallelism 'pp' needs a world size that is a multiple of pp_stages=2" in job.stderr
    assert "MASTER_ADDR" not in job.stderr
    assert not (tmp_path / "out").exists()
