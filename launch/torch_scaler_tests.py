"""Run torch's own GradScaler unit tests against ``distscaler.GradScaler``.

Runs pytest on a torch test file, keeping only the grad-scaler tests (the tests whose name matches
``grad_scal`` or ``gradscaler``, any case: ``test_grad_scaling_*``, ``test_grad_scale_*``,
``test_grad_scaler_*``, ``test_pickle_gradscaler``), after replacing torch's GradScaler by
distscaler's everywhere the tests reach it: ``torch.amp.GradScaler``,
``torch.amp.grad_scaler.GradScaler``, ``torch.GradScaler``, and the deprecated
``torch.cpu.amp.GradScaler`` / ``torch.cuda.amp.GradScaler`` (no ``device`` argument; their
replacements are distscaler subclasses fixed to ``"cpu"`` / ``"cuda"`` that warn as torch's do).
``--stock`` runs the same tests on torch's own GradScaler, the baseline.

torch's test file is not in this repository: take ``test/test_torch.py`` from the torch source at
the installed version's tag (``git clone -b v<torch.__version__ without +local> pytorch/pytorch``),
or an excerpt of it holding the ``TestTorchDeviceType`` grad-scaler tests. Its helpers
(``torch.testing._internal``) come with the torch wheel and import ``expecttest``
(``pip install expecttest``). ::

    OMP_NUM_THREADS=1 python launch/torch_scaler_tests.py path/to/test_torch.py --stock
    OMP_NUM_THREADS=1 python launch/torch_scaler_tests.py path/to/test_torch.py
    python launch/torch_scaler_tests.py path/to/test_torch.py -- -x -q   # more pytest arguments

The tests are selected by test name in a collection hook rather than with ``-k``: ``-k`` also
matches the module's and classes' names, so a file named ``test_torch_gradscaler.py`` would select
all of its tests. Device-generic tests are collected for every device torch's test framework
finds; ``--device cpu`` (the default) sets ``PYTORCH_TESTING_DEVICE_ONLY_FOR`` accordingly. Runs
in this process, without xdist or pytest's cache. Prints ``N passed, M failed`` (errors count as
failures; then skips, if any) and exits 1 on any failure or when no test ran.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

import distscaler

GRAD_SCALER_TESTS = r"grad_?scal"


class _DeprecatedGradScaler(distscaler.GradScaler):
    """distscaler's stand-in for ``torch.<device>.amp.GradScaler``: no ``device`` argument, and
    torch's FutureWarning."""

    device_type = "cuda"

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        device = self.device_type
        warnings.warn(
            f"`torch.{device}.amp.GradScaler(args...)` is deprecated. "
            f"Please use `torch.amp.GradScaler('{device}', args...)` instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )


class CpuGradScaler(_DeprecatedGradScaler):
    """Replaces ``torch.cpu.amp.GradScaler``."""

    device_type = "cpu"


class CudaGradScaler(_DeprecatedGradScaler):
    """Replaces ``torch.cuda.amp.GradScaler``."""

    device_type = "cuda"


def swap_in_distscaler() -> list[str]:
    """Point every public name of torch's GradScaler at distscaler's; returns the names replaced."""
    targets = {
        "torch": distscaler.GradScaler,  # torch >= 2.3
        "torch.amp": distscaler.GradScaler,
        "torch.amp.grad_scaler": distscaler.GradScaler,
        "torch.cpu.amp": CpuGradScaler,
        "torch.cpu.amp.grad_scaler": CpuGradScaler,
        "torch.cuda.amp": CudaGradScaler,
        "torch.cuda.amp.grad_scaler": CudaGradScaler,
    }
    replaced = []
    for name, scaler in targets.items():
        module = importlib.import_module(name)
        if hasattr(module, "GradScaler"):
            module.GradScaler = scaler
            replaced.append(f"{name}.GradScaler")
    return replaced


class GradScalerTests:
    """pytest plugin: keeps the grad-scaler tests and counts their outcomes."""

    def __init__(self, match: str = GRAD_SCALER_TESTS) -> None:
        self.selected = re.compile(match, re.IGNORECASE)
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.skipped: list[str] = []

    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep = [item for item in items if self.selected.search(item.name)]
        dropped = [item for item in items if not self.selected.search(item.name)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)
        elif report.skipped and report.nodeid not in self.skipped:
            self.skipped.append(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.append(report.nodeid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Arguments after -- go to pytest."
    )
    parser.add_argument("test_file", type=Path, help="a torch test file, e.g. test/test_torch.py")
    parser.add_argument(
        "--stock", action="store_true", help="run on torch's own GradScaler (the baseline)"
    )
    parser.add_argument(
        "--device", default="cpu", help="device type(s) to instantiate tests for (default: cpu)"
    )
    parser.add_argument(
        "--match",
        default=GRAD_SCALER_TESTS,
        help=f"regex (any case) a test's name must contain (default: {GRAD_SCALER_TESTS!r})",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"no such file: {args.test_file}")

    os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = args.device
    if args.stock:
        print("GradScaler: torch's own (--stock)")
    else:
        print("GradScaler: distscaler.GradScaler as " + ", ".join(swap_in_distscaler()))

    sys.argv[1:] = []  # torch's test helpers parse sys.argv when imported
    tests = GradScalerTests(args.match)
    code = pytest.main(
        [
            str(args.test_file),
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-rfE",
            *pytest_args,
        ],
        plugins=[tests],
    )
    summary = f"{len(tests.passed)} passed, {len(tests.failed)} failed"
    if tests.skipped:
        summary += f", {len(tests.skipped)} skipped"
    print(summary)
    for nodeid in tests.failed:
        print(f"FAILED {nodeid}")
    return 0 if code == pytest.ExitCode.OK and tests.passed and not tests.failed else 1


if __name__ == "__main__":
    sys.exit(main())
