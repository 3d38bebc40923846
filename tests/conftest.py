from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tiny tensors: intra-op threads only contend with the other xdist worker on a 2-core runner.
torch.set_num_threads(1)
# inductor compiles in this process (read when torch._inductor is first imported; spawned ranks
# inherit it): its default, a pool of compile subprocesses per core, would start in every xdist
# worker and every spawned rank that compiles. tests/test_compile.py took as long either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores or 1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores or 1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core. xdist's own count asks psutil, which counts the
    host's cores, not the container's: on a 2-core runner in a large host that would start dozens of
    workers, each spawning ranks."""
    return _usable_cores()


#: The torch-compatibility subset (``pytest -m compat``), which CI runs on the floor of the declared
#: torch range and on the newest torch (docs/torch-versions.md): every test of
#: a file, or one test by its ``file::name`` prefix, and why it is in. Kept here, in one place, so
#: that the test files themselves stay free of it.
COMPAT: dict[str, str] = {
    "test_api.py": "the drop-in: torch's semantics, errors and state_dict, both ways",
    "test_inf_check.py": "the per-rank kernels (torch's check kernel, fp32 norms of fp16 gradients)",
    "test_parity.py": "torch.amp.GradScaler as the oracle, bit for bit",
    "test_policies.py": "DeepSpeed's DynamicLossScaler and Megatron's rule as oracles, on 2 ranks too",
    "test_layouts.py": "every layout (DDP, FSDP1, FSDP2, HSDP, FSDP2 x TP, PP) on gloo ranks",
    "test_attribution.py": "the overflow report, per layout and across ranks",
    "test_compile.py": "torch.compile of the scaler phase, compiled equals eager",
    "test_traced_step.py": "the fused step a compiled phase traces, against torch's, eager and compiled",
    "test_layout_costs.py": "the job's model laid out in every layout under torchrun",
    "test_train.py::test_inf_on_one_rank_skips_step_on_every_rank": "the reference job, end to end",
    "test_teardown.py": "gloo's teardown, which hangs before torch 2.8 unless done in order",
    "test_replica_check.py": "the replica check: integer views and sums, DDP and HSDP on gloo",
}

#: Tests of a compat file that the compat subset leaves out (``file::name`` prefix: why): they
#: exercise no torch, or repeat at length a path that tests of the subset already take; the
#: README's ``pytest -n auto`` runs them on the suite's torch.
NOT_COMPAT: dict[str, str] = {
    "test_replica_check.py::test_coefficients_sum_to_zero": "Python integers only",
    "test_replica_check.py::test_limbs_keep_every_partial_sum": "Python integers only",
    "test_replica_check.py::test_offsets_keep_a_clean_set": "Python integers only",
    "test_replica_check.py::test_ten_thousand_random_pairs": (
        "10,000 random pairs through the checksum path that test_every_single_bit_flip_is_caught "
        "and test_constructed_cancelling_pairs_are_all_caught take on every compat torch (23 s)"
    ),
}


#: What a plain ``pytest`` (the README's ``pytest -n auto``) leaves out, so that it fits 15 minutes
#: on a 2-core CPU without fp16 units (docs/testing.md); CI runs them as stages of their own,
#: ``pytest -n auto -m "(slow or integration) and not multihost"`` and, the tests on the
#: multi-host testbed (root), ``pytest -n 2 -m multihost`` (.ci/run). ``slow``: whole jobs launched
#: (torchrun, ``accelerate launch``, a wheel built and installed); ``integration``: a framework's
#: own code run against distscaler's integration of it (every ``test_<integration>*.py`` of a
#: module of ``distscaler/integrations/``, and the integration guides' examples in
#: tests/test_docs.py). They run whenever the command line selects tests itself: a ``-m`` or ``-k``
#: expression, or a test file or test named (``pytest tests/test_transformers.py``).
LEFT_OUT_BY_DEFAULT = ("slow", "integration")
INTEGRATIONS = sorted(
    p.stem
    for p in (Path(__file__).resolve().parent.parent / "distscaler" / "integrations").glob("*.py")
    if not p.stem.startswith("_")
)


def _is_integration_test(item: pytest.Item) -> bool:
    stem = item.path.stem
    if any(stem == f"test_{n}" or stem.startswith(f"test_{n}_") for n in INTEGRATIONS):
        return True
    return item.path.name == "test_docs.py" and "docs/integrations/" in item.name


def _selects_itself(config: pytest.Config) -> bool:
    """Whether the command line chose the tests: a ``-m``/``-k`` expression, or a file or a test
    named (a folder, such as ``tests``, chooses nothing)."""
    if config.option.markexpr or config.option.keyword:
        return True
    here = config.invocation_params.dir
    return any("::" in arg or not (here / arg).is_dir() for arg in config.args)


def pytest_report_header(config: pytest.Config) -> str | None:
    if _selects_itself(config):
        return None
    return (
        "distscaler: slow and integration tests left out (a plain pytest); "
        '`pytest -n auto -m "slow or integration"` runs them'
    )


#: On GPU CI runners: the number of GPUs the machine must show, so that the GPU tests cannot pass
#: by skipping (a runner whose container lost its GPUs fails instead of going green).
REQUIRE_GPUS_ENV = "DISTSCALER_REQUIRE_GPUS"


def _required_gpus() -> int:
    value = os.environ.get(REQUIRE_GPUS_ENV, "").strip()
    if not value:
        return 0
    try:
        required = int(value)
    except ValueError:
        required = -1
    if required < 0:
        raise pytest.UsageError(
            f"{REQUIRE_GPUS_ENV} must be a non-negative integer (number of GPUs), got: {value!r}"
        )
    return required


def _module_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped fixtures of the item's own test module that it uses (a spawn, mostly),
    each with its parameter's index where the fixture is parametrized."""
    module = getattr(item, "module", None)
    info = getattr(item, "_fixtureinfo", None)
    if module is None or info is None:
        return []
    callspec = getattr(item, "callspec", None)
    names = []
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs or defs[-1].scope != "module":
            continue
        if getattr(defs[-1].func, "__module__", None) != module.__name__:
            continue
        index = callspec.indices.get(name) if callspec is not None else None
        names.append(name if index is None else f"{name}[{index}]")
    return names


def _group_module_fixtures(items: list[pytest.Item]) -> None:
    """Give every test that uses a module-scoped fixture of its module (a spawn of ranks, mostly) an
    ``xdist_group``: the tests of one fixture run on one xdist worker, which sets it up once.
    Without it, ``--dist loadgroup`` deals them out one by one and each worker spawns the same
    ranks (measured: a third of the compat subset's time). A fixture whose tests name a group
    already keeps it; fixtures that one test uses together share a group."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    used = {}
    for item in items:
        keys = [(item.path.name, name) for name in _module_fixtures(item)]
        used[item] = keys
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
    named: dict[tuple[str, str], str] = {}
    for item, keys in used.items():
        mark = item.get_closest_marker("xdist_group")
        if keys and mark is not None:
            named.setdefault(find(keys[0]), mark.args[0] if mark.args else mark.kwargs["name"])
    for item, keys in used.items():
        if keys and item.get_closest_marker("xdist_group") is None:
            root = find(keys[0])
            group = named.get(root, f"{Path(root[0]).stem}.{root[1]}")
            item.add_marker(pytest.mark.xdist_group(group))


def _xdist_ignores_groups() -> str | None:
    """Why ``xdist_group`` is ignored by the installed pytest and pytest-xdist, or None: xdist
    3.8 writes a test's group into ``item._nodeid``, which pytest 9.2 no longer reads (it reads
    ``item._id``), so ``--dist loadgroup`` deals a group's tests out one by one."""
    from importlib.metadata import version

    from packaging.version import Version

    pytest_version, xdist_version = Version(version("pytest")), Version(version("pytest-xdist"))
    if pytest_version >= Version("9.2") and xdist_version <= Version("3.8"):
        return f"pytest {pytest_version} with pytest-xdist {xdist_version}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n`` with ``--dist loadgroup`` (pyproject.toml's addopts): refuse a pytest that
    ignores ``xdist_group``, rather than run every spawn once per worker, silently slower."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if config.getoption("dist", None) != "loadgroup":
        return
    broken = _xdist_ignores_groups()
    if broken:
        raise pytest.UsageError(
            f"{broken} ignores xdist_group: the tests of one spawn would run on every worker, "
            "each spawning its ranks; install the test extra's pytest: pip install 'pytest<9.2'"
        )


# tryfirst: xdist's worker hook, registered after this file, would otherwise read the groups first.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    required = _required_gpus()
    if num_gpus < required:
        raise pytest.UsageError(
            f"{REQUIRE_GPUS_ENV}={required} but torch sees {num_gpus} CUDA GPU(s) "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); with Docker, pass --gpus all"
        )
    for item in items:
        name = f"{item.path.name}::{item.name}"  # test_x.py::test_y[params]
        if any(key in (item.path.name, name) or name.startswith(f"{key}[") for key in COMPAT):
            if not any(name.startswith(key) for key in NOT_COMPAT):
                item.add_marker(pytest.mark.compat)
        if _is_integration_test(item):
            item.add_marker(pytest.mark.integration)
        if "cuda" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))
    _group_module_fixtures(items)
    if not _selects_itself(config):
        kept, left_out = [], []
        for item in items:
            marked = any(item.get_closest_marker(m) for m in LEFT_OUT_BY_DEFAULT)
            (left_out if marked else kept).append(item)
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
