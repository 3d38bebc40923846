"""A newcomer's first hour on a plain install: torch and distscaler, nothing else (no numpy).

A fresh virtual environment gets torch (this suite's own, linked with what it requires:
tests/_plain_env.py) and then the package, built from this tree as ``pip install .`` builds it,
with no extra. numpy is then not importable, and torch's ``Tensor.numpy()`` raises
``RuntimeError: Numpy is not available``, which once killed both ranks of the Recipes page's DDP
example at its first replica mismatch (naming the ranks pickled through ``all_gather_object``).
In that environment, from a directory outside the tree:

* README.md's drop-in example runs as it is (``python``);
* examples/ddp.py (an inf written on rank 1 after DDP's reduce: a replica mismatch and an
  overflow) and examples/skip_account.py (an overflow, then a flipped bit on rank 1 after the
  reduce: a replica mismatch) run under ``torchrun`` on 2 gloo ranks, exit 0 on both ranks and
  print what tests/test_examples.py checks: the mismatch named, each step skipped (the examples
  check that the ranks' parameters are equal at the end).

Slow: the examples run under torchrun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _plain_env import link_torch
from test_examples import LAUNCHER_ENV, RUNS, SUMMARY

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300


def _readme_drop_in() -> str:
    """The first Python block of README.md's "Drop-in" section."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Drop-in") :]
    match = re.search(r"^```python\n(.*?)^```$", section, re.M | re.S)
    assert match, "README.md's Drop-in section has no Python block"
    return match.group(1)


def _env() -> dict[str, str]:
    # Nothing of this checkout or of the suite's environment: the venv's own packages only.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV | {"PYTHONPATH"}}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    )
    return done


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A fresh venv with torch (linked) and the package's wheel (built from this tree), nothing
    else; returns its python."""
    tmp = tmp_path_factory.mktemp("plain")
    # The wheel `pip install .` would build, from a copy of what a wheel is made of (no build/ or
    # egg-info left in the tree), built with this environment's setuptools when it is new enough
    # (pyproject.toml's build requirement), else in pip's isolated build environment.
    source = tmp / "source"
    shutil.copytree(ROOT / "distscaler", source / "distscaler")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    from test_install import _setuptools_builds_offline

    isolation = ["--no-build-isolation"] if _setuptools_builds_offline() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp / "dist"),
          str(source)], tmp, INSTALL_TIMEOUT_S)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("distscaler-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp, INSTALL_TIMEOUT_S)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    link_torch(Path(_run([str(python), "-c", purelib], tmp, RUN_TIMEOUT_S).stdout.strip()))
    pip = [str(python), "-m", "pip", "install", "--no-compile", "--no-cache-dir", "-q"]
    # Its requirements resolved, offline: torch (linked) meets them, nothing else is installed.
    _run([*pip, "--no-index", str(wheel)], tmp, INSTALL_TIMEOUT_S)
    return python


@pytest.mark.slow
@pytest.mark.xdist_group("examples")
def test_the_plain_install_has_no_numpy_and_imports_the_installed_package(plain, tmp_path):
    code = (
        "import importlib.util, distscaler\n"
        "print(importlib.util.find_spec('numpy') is None)\n"
        "print(distscaler.__file__)\n"
    )
    out = _run([str(plain), "-c", code], tmp_path, RUN_TIMEOUT_S).stdout.split()
    assert out[0] == "True", "numpy is importable: the environment is not a plain install"
    assert Path(out[1]).is_relative_to(plain.parent.parent), out[1]


@pytest.mark.slow
@pytest.mark.xdist_group("examples")
def test_the_readme_drop_in_example_runs_on_a_plain_install(plain, tmp_path):
    script = tmp_path / "drop_in.py"
    script.write_text(_readme_drop_in(), encoding="utf-8")
    _run([str(plain), str(script)], tmp_path, RUN_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.xdist_group("examples")
@pytest.mark.parametrize("name", ["ddp", "skip_account"])
def test_the_ddp_recipes_name_the_fault_and_skip_on_a_plain_install(plain, tmp_path, name):
    nproc, expected = RUNS[name]
    torchrun = [str(plain), "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, f"--nproc-per-node={nproc}", str(ROOT / "examples" / f"{name}.py")]
    done = _run(cmd, tmp_path, RUN_TIMEOUT_S)  # every rank exits 0: torchrun's exit code
    assert len(SUMMARY.findall(done.stdout)) == 1, done.stdout
    for pattern in (expected,) if isinstance(expected, str) else expected or ():
        assert re.search(pattern, done.stdout, re.M), f"{pattern!r} not in:\n{done.stdout}"
    if name == "ddp":  # the defaults: the overflow only rank 1 saw is named (no replica check
        # at step 8: with torch's kernels it runs every 32nd update)
        assert "inf/NaN gradients at step 8" in done.stderr, done.stderr[-4000:]
        return
    # the replica check (every update here) named the mismatch (rank 0 logs it), and every rank
    # skipped that step
    assert "replica mismatch at step" in done.stderr, done.stderr[-4000:]
    assert "the step is skipped on every rank" in done.stderr
