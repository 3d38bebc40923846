"""Tests of the reference training job, ``launch/train.py`` and its modules ``launch/lm/``.

The jobs are real ``torchrun`` launches (gloo on CPU) of a tiny model (``configs/smoke.yaml``).
Starting processes is the expensive part, so each test groups several checks per launch. Every
launch gets its own rendezvous (``--standalone``, or a c10d endpoint on a port picked by binding to
0), so the tests run in parallel under ``pytest -n auto``. One launch loses a worker to SIGKILL
and must come back, under ``torchrun --max-restarts`` and ``--resume auto``, exactly where an
undisturbed run would be.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from distscaler import ScalerConfig
from lm.checkpoint import load_checkpoint
from lm.config import (
    DEFAULT_CONFIG,
    DEFAULT_SCALER,
    ConfigError,
    InjectInf,
    TrainConfig,
    load_config,
)
from lm.metrics import read_metrics
from lm.optim import lr_at

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "launch" / "train.py"
SMOKE = REPO / "configs" / "smoke.yaml"
DEFAULT = REPO / "configs" / "default.yaml"
GPU = REPO / "configs" / "gpu.yaml"
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


def _run_jobs(
    cmds: list[list[str]],
    logs: list[Path],
    timeout: float = JOB_TIMEOUT_S,
    *,
    tolerate: Callable[[str], str | None] | None = None,
) -> dict[int, str]:
    """Runs ``cmds`` concurrently; fails (killing all of them) if one fails or times out.

    ``tolerate`` maps a failed job's log to a reason not to fail (None: fail); such jobs are
    returned (index -> reason) and the others run on.
    """
    procs = []
    timed_out = False
    tolerated: dict[int, str] = {}

    def failed(i: int, p: subprocess.Popen) -> bool:
        if p.returncode in (None, 0):
            return False
        if i not in tolerated and tolerate is not None:
            reason = tolerate(logs[i].read_text(errors="replace"))
            if reason is not None:
                tolerated[i] = reason
        return i not in tolerated

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
            if any(failed(i, p) for i, p in enumerate(procs)):
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
        for i, (cmd, p, log) in enumerate(zip(cmds, procs, logs, strict=True))
        if failed(i, p)
    ]
    assert not problems, "\n\n".join(problems)
    return tolerated


def _job_args(
    out: Path,
    *,
    steps: int,
    config: Path,
    data: Path | None = None,
    resume: bool | str = False,
) -> list[str]:
    """``resume``: True for ``--resume``, a string for ``--resume VALUE`` (``"auto"``)."""
    args = ["--config", str(config), "--out", str(out), "--steps", str(steps)]
    if data is not None:
        args += ["--data", str(data)]
    if resume:
        args += ["--resume"] if resume is True else ["--resume", str(resume)]
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


def test_summary_digests_are_one_per_replica_group_in_replica_order() -> None:
    from lm.agreement import RankView, params_digests, ranks_agree

    # 2 pipeline stages x 2 replicas: ranks 0, 2 hold stage 0, ranks 1, 3 stage 1.
    views = [RankView(rank=r, skipped_steps=(3,), scale=8.0, params_digest=f"stage{r % 2}",
                      replica=r % 2) for r in (1, 0, 3, 2)]  # fmt: skip
    assert ranks_agree(views) == []
    assert params_digests(views) == ["stage0", "stage1"]
    assert params_digests(views[:1]) == ["stage1"]


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
    path.write_text("lr: 1e-2\nscaler: {init_scale: 1024, min_scale: 1e-2}\n")
    cfg = load_config(path)
    assert (cfg.lr, cfg.scaler.init_scale, cfg.scaler.min_scale) == (1e-2, 1024.0, 0.01)
    assert isinstance(cfg.scaler.init_scale, float)


def test_scaler_section_changes_the_jobs_scaler_and_distscaler_validates_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scaler: {growth_interval: 7, policy: megatron, hysteresis: 2}\n")
    scaler = load_config(path).scaler
    # The keys given change; the others keep the job's defaults, not the library's.
    assert (scaler.growth_interval, scaler.policy, scaler.hysteresis) == (7, "megatron", 2)
    assert scaler.init_scale == DEFAULT_SCALER.init_scale == 2.0**20
    path.write_text("scaler: {init_scale: -1.0, growth_intervall: 3}\nn_layer: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    valid = ", ".join(f.name for f in dataclasses.fields(ScalerConfig))
    assert sorted(e.value.problems) == [
        "n_layer must be an integer, got: 'x'",
        f"unknown config key 'scaler.growth_intervall'; valid keys: {valid}",
    ]
    path.write_text("scaler: {init_scale: -1.0, growth_factor: 0.5}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    # distscaler.ScalerConfig's own messages (one per problem), under the section's name.
    bad_init, bad_growth = e.value.problems
    assert bad_init.startswith("scaler: init_scale") and "-1.0" in bad_init
    assert bad_growth.startswith("scaler: growth_factor") and "0.5" in bad_growth
    path.write_text("scaler: 3\n")
    with pytest.raises(ConfigError, match="scaler must be a mapping, got: 3"):
        load_config(path)


def test_gpu_config_is_a_100m_parameter_model_with_a_context_of_512() -> None:
    from lm.model import ByteGPT

    cfg = load_config(GPU)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in ByteGPT(cfg).parameters())
    assert 50e6 <= num_params <= 150e6, num_params
    assert cfg.block_size == 512 and cfg.device == "auto"


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
    assert saved_scale != yaml.safe_load(SMOKE.read_text())["scaler"]["init_scale"]

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
def test_the_default_command_shows_the_scaler_at_work_within_five_minutes(tmp_path: Path) -> None:
    """The newcomer's command as the README gives it (default config, stdlib data, 2 ranks):
    the loss falls by at least 15%, the scale grows at least once, and at least one overflow is
    skipped on both ranks and followed by a backoff, all read back from metrics.jsonl."""
    out = tmp_path / "out"
    _run_jobs([_standalone() + ["--out", str(out)]], [tmp_path / "job.log"], timeout=300)
    default = yaml.safe_load(DEFAULT.read_text())
    records = _check_run(out, list(range(1, default["steps"] + 1)))
    first = statistics.fmean(r["loss"] for r in records[:10])
    last = statistics.fmean(r["loss"] for r in records[-10:])
    assert last <= 0.85 * first, (first, last)
    pairs = list(zip(records, records[1:]))
    growths = [b["step"] for a, b in pairs if b["scale"] > a["scale"]]
    backoffs = [a["step"] for a, b in pairs if a["skipped"] and b["scale"] == a["scale"] * 0.5]
    assert growths and backoffs, (growths, backoffs)
    summary = _summary(out)
    assert summary["world_size"] == 2
    skipped = sum(r["skipped"] for r in records)
    assert summary["skipped_per_rank"] == [skipped, skipped]
    assert (summary["num_growths"], summary["num_backoffs"]) == (len(growths), len(backoffs))


@pytest.mark.slow
def test_inf_on_one_rank_skips_step_on_every_rank(tmp_path: Path) -> None:
    # Default data (the stdlib sources): real input. The inf is written on rank 1 only, after
    # DDP's all-reduce, so only the scaler's own collective can make rank 0 skip as well.
    # And at step 4 one bit flipped on rank 1 (--inject-bitflip): silent data corruption, which
    # the replica check catches on the same collective.
    config = _smoke_config_with(tmp_path, inject_inf={"steps": [3], "rank": 1})
    out = tmp_path / "out"
    args = _job_args(out, steps=5, config=config) + ["--inject-bitflip", "4:1"]
    _run_jobs([_standalone() + args], [tmp_path / "job.log"])
    records = _check_run(out, list(range(1, 6)))
    # Guard against a vacuous pass: the injected inf and the flipped bit must have been seen.
    assert [r["step"] for r in records if r["skipped"]] == [3, 4]
    assert records[3]["replica_mismatch"] == {"step": 4, "what": "gradients", "ranks": [0, 1]}
    assert records[4]["scale"] == records[3]["scale"]  # a mismatch is not an overflow: no backoff
    assert math.isfinite(records[3]["grad_norm"])  # the corrupted value was finite
    log = (tmp_path / "job.log").read_text(errors="replace")
    # The inf written on rank 1 alone after the reduce made the replicas differ too.
    assert records[2]["replica_mismatch"]["ranks"] == [0, 1]
    assert "5 update(s) compared across replicas, 2 mismatch(es)" in log
    assert "step 4: gradients of rank(s) [0, 1] differed, skipped" in log
    assert records[2]["grad_norm"] is None
    # The overflow report names the rank and the parameter the fault was written into: the first
    # parameter of the model (lm.faults), by its name in the unwrapped model.
    from lm.config import TrainConfig
    from lm.model import ByteGPT

    first = next(iter(ByteGPT(TrainConfig(d_model=8, n_layer=1, n_head=1)).named_parameters()))[0]
    assert records[2]["overflow"] == [{"rank": 1, "param": first, "kind": "inf"}]
    assert all("overflow" not in r for r in records if r["step"] != 3)
    assert records[3]["scale"] == records[2]["scale"] * 0.5
    summary = _summary(out)
    assert summary["skipped_steps"] == 2
    assert summary["replica_checks"] == 5
    assert summary["replica_mismatches"] == [records[2]["replica_mismatch"],
                                             records[3]["replica_mismatch"]]  # fmt: skip
    # Every rank skipped steps 3 and 4 and ends with the same scale and bit-identical parameters.
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
def test_plain_python_runs_a_single_process_and_keeps_its_results_when_the_plot_fails(
    tmp_path: Path, smoke_cpu: Path, small_text: Path
) -> None:
    out = tmp_path / "out"
    # matplotlib imports, but drawing fails: the run's metrics and summary must survive that.
    cmd = _python_without(["matplotlib.pyplot"], tmp_path)
    cmd += [str(TRAIN), *_job_args(out, steps=3, config=smoke_cpu, data=small_text)]
    _run_jobs([cmd], [tmp_path / "job.log"])
    _check_run(out, [1, 2, 3])
    summary = _summary(out)
    assert (summary["world_size"], summary["device"]) == (1, "cpu")
    log = (tmp_path / "job.log").read_text()
    assert "backend=none" in log
    assert "could not draw" in log and "launch/plot_metrics.py" in log
    assert not (out / "metrics.png").exists()


def test_missing_packages_are_named_before_anything_starts(tmp_path: Path) -> None:
    # torchrun's variables without a rendezvous (no MASTER_ADDR): had the job tried to create the
    # process group, it would fail with another error (or hang, with a store).
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    cmd = _python_without(["matplotlib", "tqdm"], tmp_path)
    cmd += [str(TRAIN), "--config", str(SMOKE), "--out", str(tmp_path / "out")]
    job = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert job.returncode == 2, job.stderr
    assert "needs distscaler's 'train' extra; missing: matplotlib, tqdm." in job.stderr
    assert 'pip install -e ".[train]"' in job.stderr
    assert "MASTER_ADDR" not in job.stderr
    assert not (tmp_path / "out").exists()


_WITHOUT = """\
import importlib.abc, os, runpy, sys

hidden = sys.argv[1].split(",")


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _python_without(modules: list[str], tmp_path: Path) -> list[str]:
    """A command prefix: Python running the script that follows with ``modules`` (and their
    submodules) impossible to import, as if they were not installed."""
    runner = tmp_path / "without.py"
    runner.write_text(_WITHOUT)
    return [sys.executable, str(runner), ",".join(modules)]


# ------------------------------------------------------------------ a worker lost to SIGKILL

KILL_STEPS = 200
KILL_CKPT_INTERVAL = 25
KILL_AFTER = 60  # lines of metrics.jsonl seen before the kill (the run is then past step 50)


def _worker_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker of global rank ``rank`` (Linux: /proc), or None."""
    for children in Path(f"/proc/{launcher.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
    return None


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers in /proc"
)
def test_a_worker_killed_mid_run_is_restarted_and_resumes_where_it_left_off(
    tmp_path: Path, small_text: Path
) -> None:
    """``torchrun --max-restarts=1 ... --resume auto``, rank 0 SIGKILLed after step 50: every
    step's loss, scale and skip flag equal an undisturbed run's, each step logged exactly once."""
    config = _smoke_config_with(
        tmp_path,
        steps=KILL_STEPS,
        decay_steps=KILL_STEPS,
        ckpt_interval=KILL_CKPT_INTERVAL,
        # An inf on rank 1 before and after the restart point: the skip flag and the backoff are
        # part of what must come back. The scale also grows every 3 steps until fp16 overflows.
        inject_inf={"steps": [40, 150], "rank": 1},
    )
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    job = _torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1")
    job += _job_args(killed, steps=KILL_STEPS, config=config, data=small_text, resume="auto")
    straight = _standalone() + _job_args(
        reference, steps=KILL_STEPS, config=config, data=small_text
    )
    logs = [tmp_path / "killed.log", tmp_path / "reference.log"]
    with open(logs[0], "w") as f:
        launcher = subprocess.Popen(
            job, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while _lines(killed / "metrics.jsonl") < KILL_AFTER:
            assert launcher.poll() is None, logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "the job did not reach the kill point"
            time.sleep(0.02)
        victim = _worker_pid(launcher, rank=0)
        assert victim is not None, "no worker of rank 0 under torchrun"
        os.kill(victim, signal.SIGKILL)
        seen_at_kill = _lines(killed / "metrics.jsonl")
        _run_jobs([straight], [logs[1]])  # meanwhile, the undisturbed run
        launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    log = logs[0].read_text(errors="replace")
    assert launcher.returncode == 0, log[-4000:]
    # Guards: the kill happened mid-run, and torchrun restarted the workers once.
    assert seen_at_kill < KILL_STEPS
    assert "exitcode: -9" in log, log[-4000:]
    summary = _summary(killed)
    resumed = summary["resumed_from"]
    assert resumed["restart"] == 1
    assert resumed["step"] % KILL_CKPT_INTERVAL == 0
    assert KILL_AFTER - KILL_CKPT_INTERVAL <= resumed["step"] <= seen_at_kill
    assert summary["steps_this_run"] == KILL_STEPS - resumed["step"]

    got = _check_run(killed, list(range(1, KILL_STEPS + 1)))  # every step exactly once
    want = _check_run(reference, list(range(1, KILL_STEPS + 1)))
    skipped = {r["step"] for r in want if r["skipped"]}
    assert {40, 150} <= skipped  # the faults were seen (fp16 overflows add their own skips)
    assert any(step > resumed["step"] for step in skipped)
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "scale", "skipped", "grad_norm", "lr"):
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
