"""Tests of the reference training job, ``launch/train.py`` and its modules ``launch/lm/``.

The jobs are real ``torchrun`` launches (gloo on CPU) of a tiny model (``configs/smoke.yaml``).
Starting processes is the expensive part, so each test groups several checks per launch. Every
launch gets its own rendezvous (``--standalone``, or a c10d endpoint on a port picked by binding to
0), so the tests run in parallel under ``pytest -n auto``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "launch" / "train.py"
# `python launch/train.py` puts launch/ on sys.path, which is how the script finds `lm`.
sys.path.insert(0, str(TRAIN.parent))

from lm.checkpoint import load_checkpoint  # noqa: E402
from lm.config import (  # noqa: E402
    DEFAULT_CONFIG,
    ConfigError,
    InjectInf,
    TrainConfig,
    load_config,
)
from lm.metrics import read_metrics  # noqa: E402
from lm.optim import lr_at  # noqa: E402

SMOKE = REPO / "configs" / "smoke.yaml"
DEFAULT = REPO / "configs" / "default.yaml"
JOB_TIMEOUT_S = 120
METRIC_KEYS = {"step", "loss", "scale", "skipped", "grad_norm", "tokens_per_s"}
# Set by an enclosing launcher or test runner; the jobs must get their own.
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


# ----------------------------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _torchrun(*launcher_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(TRAIN)]


def _standalone(nproc: int = 2) -> list[str]:
    return _torchrun("--standalone", f"--nproc-per-node={nproc}")


def _run_jobs(cmds: list[list[str]], logs: list[Path], timeout: float = JOB_TIMEOUT_S) -> None:
    """Runs ``cmds`` concurrently; fails (killing all of them) if one fails or times out."""
    procs = []
    timed_out = False
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO,
                        env=_env(),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # so that a kill reaches torchrun's workers too
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # the others would wait for it at the next collective
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    problems = [
        f"job {' '.join(cmd)} exited {p.returncode}"
        + (f" (killed after the {timeout} s timeout)" if timed_out else "")
        + ", log tail:\n"
        + "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-30:])
        for cmd, p, log in zip(cmds, procs, logs, strict=True)
        if p.returncode != 0
    ]
    assert not problems, "\n\n".join(problems)


def _job_args(
    out: Path, *, steps: int, config: Path, data: Path | None = None, resume: bool = False
) -> list[str]:
    args = ["--config", str(config), "--out", str(out), "--steps", str(steps)]
    if data is not None:
        args += ["--data", str(data)]
    if resume:
        args.append("--resume")
    return args


def _metrics(out: Path) -> list[dict[str, Any]]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _summary(out: Path) -> dict[str, Any]:
    with open(out / "summary.json") as f:
        return json.load(f)


def _check_run(out: Path, steps: list[int]) -> list[dict[str, Any]]:
    """The checks every finished run must pass; returns its metrics."""
    records = _metrics(out)
    assert [r["step"] for r in records] == steps
    for r in records:
        assert METRIC_KEYS <= r.keys(), r
        assert isinstance(r["skipped"], bool)
        assert r["scale"] > 0
        assert r["tokens_per_s"] > 0
        assert r["loss"] is not None and math.isfinite(r["loss"])
        if not r["skipped"]:
            assert r["grad_norm"] is not None and math.isfinite(r["grad_norm"])
    summary = _summary(out)
    assert summary["steps"] == steps[-1]
    assert summary["ranks_consistent"] is True
    assert math.isfinite(summary["eval_loss"])
    assert (out / "ckpt.pt").is_file()
    return records


@pytest.fixture
def small_text(tmp_path: Path) -> Path:
    """About 100 KB of real text: the source of argparse."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(Path(argparse.__file__).read_bytes())
    return path


def _smoke_config_with(tmp_path: Path, **changes: Any) -> Path:
    """configs/smoke.yaml with ``changes``, on the CPU (gloo) even where GPUs are visible."""
    cfg = yaml.safe_load(SMOKE.read_text())
    cfg.update({"device": "cpu", **changes})
    path = tmp_path / "smoke_cpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def smoke_cpu(tmp_path: Path) -> Path:
    return _smoke_config_with(tmp_path)


# ------------------------------------------------------------------------ config, in process


def test_default_yaml_matches_the_dataclass_defaults() -> None:
    assert load_config(DEFAULT) == TrainConfig()
    assert DEFAULT_CONFIG == DEFAULT
    load_config(SMOKE)  # the shipped smoke config is valid too


def test_cli_flags_override_yaml_which_overrides_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nout: from_yaml\nlr: 1e-3\ninject_inf: {steps: [2, 3]}\n")
    cfg = load_config(path, steps=9, out=None, data="corpus.txt")
    assert (cfg.steps, cfg.out, cfg.data) == (9, "from_yaml", "corpus.txt")
    assert cfg.lr == 1e-3  # PyYAML reads "1e-3" as a string; it is accepted as a number
    assert cfg.inject_inf == InjectInf(steps=[2, 3], rank=1)
    assert cfg.d_model == TrainConfig().d_model


def test_unknown_or_bad_yaml_keys_are_all_reported_by_name(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("stepz: 3\nn_layer: two\ninject_inf: {step: [1]}\n")
    with pytest.raises(ValueError, match="unknown config key 'stepz'") as e:
        load_config(path)
    assert "n_layer must be an integer, got: 'two'" in str(e.value)
    assert "inject_inf.step" in str(e.value)
    path.write_text("d_model: 30\nn_head: 4\nmin_lr: 1.0\n")
    with pytest.raises(ValueError, match="d_model must be a multiple of n_head") as e:
        load_config(path)
    assert "min_lr must be in [0, lr], got: 1.0" in str(e.value)


def test_config_values_are_strictly_typed_and_all_listed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    # YAML reads `yes` as true: a bool is neither an int nor a number here.
    path.write_text(
        "steps: yes\nlr: true\namp: 1\nblock_size: 2.0\ndevice: gpu\nout: 3\n"
        "inject_inf: {steps: [0], rank: -1}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert sorted(e.value.problems) == sorted(
        [
            "steps must be an integer, got: True",
            "lr must be a number, got: True",
            "amp must be true or false, got: 1",
            "block_size must be an integer, got: 2.0",
            "device must be one of 'auto', 'cpu' or 'cuda', got: 'gpu'",
            "out must be a string, got: 3",
            # InjectInf's own range checks, listed with the type errors of the outer config
            "inject_inf.steps must be >= 1, got: [0]",
            "inject_inf.rank must be >= 0, got: -1",
        ]
    )
    path.write_text("inject_inf: 5\nlr: 1e-2\nmin_lr: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert sorted(e.value.problems) == [
        "inject_inf must be a mapping, got: 5",
        "min_lr must be a number, got: 'abc'",
    ]
    path.write_text("lr: 1e-2\ninit_scale: 1024\n")
    cfg = load_config(path)
    assert (cfg.lr, cfg.init_scale) == (1e-2, 1024.0) and isinstance(cfg.init_scale, float)


def test_bad_config_exits_with_code_2_and_names_every_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("stepz: 3\nn_head: x\n")
    job = subprocess.run(
        [sys.executable, str(TRAIN), "--config", str(path), "--out", str(tmp_path / "out")],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert job.returncode == 2, job.stderr
    assert "unknown config key 'stepz'" in job.stderr
    assert "n_head must be an integer, got: 'x'" in job.stderr
    assert not (tmp_path / "out").exists()


def test_lr_warms_up_then_decays_to_min_lr() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    lrs = [lr_at(step, cfg) for step in range(1, 101)]
    assert lrs[9] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert lrs[:10] == sorted(lrs[:10]) and lrs[9:] == sorted(lrs[9:], reverse=True)
    fixed = TrainConfig(steps=100, warmup_steps=10, decay_steps=50, min_lr=1e-4)
    assert lr_at(50, fixed) == lr_at(80, fixed) == pytest.approx(1e-4)


def test_resume_reads_metrics_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step}) + "\n" for step in range(1, 9)]
    path.write_text("".join(lines) + '{"step": 9, "lo')  # torn by a kill mid-write
    assert [r["step"] for r in read_metrics(path, upto_step=6)] == [1, 2, 3, 4, 5, 6]
    unused: Any = None  # the missing file is reported before any of these is touched
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint at .*ckpt.pt"):
        load_checkpoint(
            tmp_path / "ckpt.pt",
            model=unused,
            optimizer=unused,
            scaler=unused,
            sampler=unused,
            cfg=unused,
            d=unused,
        )


# ------------------------------------------------------------------------------ torchrun jobs


@pytest.mark.slow
def test_two_ranks_write_metrics_and_resume_continues_bit_exact(
    tmp_path: Path, smoke_cpu: Path, small_text: Path
) -> None:
    first, straight = tmp_path / "first", tmp_path / "straight"
    _run_jobs(
        [
            _standalone() + _job_args(first, steps=6, config=smoke_cpu, data=small_text),
            _standalone() + _job_args(straight, steps=10, config=smoke_cpu, data=small_text),
        ],
        [tmp_path / "first.log", tmp_path / "straight.log"],
    )
    _check_run(first, list(range(1, 7)))
    reference = _check_run(straight, list(range(1, 11)))
    ckpt = torch.load(first / "ckpt.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 6
    saved_scale = ckpt["scaler"]["scale"]
    # The smoke config grows the scale every 3 clean steps, so the saved scale is not the initial.
    assert saved_scale != yaml.safe_load(SMOKE.read_text())["init_scale"]

    _run_jobs(
        [
            _standalone()
            + _job_args(first, steps=10, config=smoke_cpu, data=small_text, resume=True)
        ],
        [tmp_path / "resume.log"],
    )
    resumed = _check_run(first, list(range(1, 11)))
    assert resumed[6]["scale"] == saved_scale  # step 7 runs with the checkpointed scale
    # Model, optimizer, scaler, RNG and sampler state all came back: the same numbers as a run
    # that never stopped.
    for got, want in zip(resumed, reference, strict=True):
        for key in ("loss", "scale", "skipped", "grad_norm", "lr"):
            assert got[key] == want[key], (got["step"], key)
    assert _summary(first)["steps_this_run"] == 4


@pytest.mark.slow
def test_inf_on_one_rank_skips_step_on_every_rank(tmp_path: Path) -> None:
    # Default data (the stdlib sources): real input. The inf is written on rank 1 only, after
    # DDP's all-reduce, so only the scaler's own collective can make rank 0 skip as well.
    config = _smoke_config_with(tmp_path, inject_inf={"steps": [3], "rank": 1})
    out = tmp_path / "out"
    _run_jobs([_standalone() + _job_args(out, steps=5, config=config)], [tmp_path / "job.log"])
    records = _check_run(out, list(range(1, 6)))
    # Guard against a vacuous pass: the injected inf must have been seen.
    assert [r["step"] for r in records if r["skipped"]] == [3]
    assert records[2]["grad_norm"] is None
    assert records[3]["scale"] == records[2]["scale"] * 0.5
    summary = _summary(out)
    assert summary["skipped_steps"] == 1
    # Every rank skipped step 3 and ends with the same scale and bit-identical parameters.
    assert summary["ranks_consistent"] is True
    assert summary["world_size"] == 2
    # The run's plot, and the standalone plotting script on the same run.
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    replot = tmp_path / "replot.png"
    subprocess.run(
        [sys.executable, str(REPO / "launch" / "plot_metrics.py"), str(out), "-o", str(replot)],
        check=True,
        timeout=120,
    )
    assert replot.stat().st_size > 10_000


@pytest.mark.slow
def test_two_nodes_train_with_c10d_rendezvous(
    tmp_path: Path, smoke_cpu: Path, small_text: Path
) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    out = tmp_path / "out"
    cmds = [
        _torchrun(
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            # Both "nodes" are this host: say which one serves the rendezvous store.
            f"--rdzv-conf=is_host={node == 0}",
        )
        + _job_args(out, steps=4, config=smoke_cpu, data=small_text)
        for node in (0, 1)
    ]
    _run_jobs(cmds, [tmp_path / "node0.log", tmp_path / "node1.log"])
    _check_run(out, list(range(1, 5)))
    assert _summary(out)["world_size"] == 2


@pytest.mark.slow
def test_plain_python_runs_a_single_process(
    tmp_path: Path, smoke_cpu: Path, small_text: Path
) -> None:
    out = tmp_path / "out"
    _run_jobs(
        [[sys.executable, str(TRAIN), *_job_args(out, steps=3, config=smoke_cpu, data=small_text)]],
        [tmp_path / "job.log"],
    )
    _check_run(out, [1, 2, 3])
    summary = _summary(out)
    assert (summary["world_size"], summary["device"]) == (1, "cpu")
    assert "backend=none" in (tmp_path / "job.log").read_text()
