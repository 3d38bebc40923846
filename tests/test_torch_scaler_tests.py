"""launch/torch_scaler_tests.py, the runner of torch's own GradScaler tests on distscaler.

torch's test file is not in this repository (reference material: docs/testing.md says how its
grad-scaler tests were run). Here the runner runs a small file of our own, written the way torch's
tests are (a test builds ``torch.amp.GradScaler`` / ``torch.cpu.amp.GradScaler`` and checks what it
got): with the swap every scaler those names build is distscaler's, with ``--stock`` torch's; a test
whose name is not a grad-scaler test is left out; a failing test fails the run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TORCH_STYLE_TESTS = """
import warnings
import torch
import distscaler


def test_grad_scaling_builds_the_scaler_under_test():
    expected = torch.amp.grad_scaler.__dict__["GradScaler"]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert type(scaler) is expected and type(torch.GradScaler("cpu")) is expected
    assert isinstance(scaler, distscaler.GradScaler) == SWAPPED
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([float("inf"), 1.0])
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 and torch.equal(p.detach(), torch.ones(2))


def test_gradscaler_deprecated_name_warns_and_is_on_the_cpu():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scaler = torch.cpu.amp.GradScaler(init_scale=8.0)
    assert any(issubclass(w.category, FutureWarning) for w in seen)
    assert scaler.get_scale() == 8.0 and scaler._device == "cpu"


def test_grad_scaling_that_fails():
    assert FAIL is False


def test_not_a_scaler_test():
    raise AssertionError("selected by mistake")
"""


def _run(tmp_path: Path, *, stock: bool = False, fail: bool = False) -> subprocess.CompletedProcess:
    prelude = f"SWAPPED = {not stock}\nFAIL = {fail}\n"
    args = ["--stock"] if stock else []
    path = tmp_path / "test_torch_style.py"
    path.write_text(prelude + TORCH_STYLE_TESTS)
    return subprocess.run(
        [sys.executable, str(REPO / "launch" / "torch_scaler_tests.py"), str(path), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.parametrize("stock", [False, True], ids=["distscaler", "stock"])
def test_runner_swaps_the_scaler_and_keeps_only_grad_scaler_tests(tmp_path, stock):
    run = _run(tmp_path, stock=stock)
    assert run.returncode == 0, run.stdout + run.stderr
    # three grad-scaler tests ran (the fourth test is not one, and would fail if it ran)
    assert "3 passed, 0 failed" in run.stdout, run.stdout
    if not stock:
        assert "distscaler.GradScaler as torch.GradScaler, torch.amp.GradScaler" in run.stdout


def test_runner_fails_when_a_grad_scaler_test_fails(tmp_path):
    run = _run(tmp_path, fail=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 passed, 1 failed" in run.stdout, run.stdout
    assert "FAILED" in run.stdout and "test_grad_scaling_that_fails" in run.stdout
