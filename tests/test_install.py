"""How distscaler is installed (docs/install.md): its version, its extras, its wheel.

``distscaler.__version__`` comes from the package metadata, and from pyproject.toml in a source
tree that is not installed. Every extra that an error message or a page tells the user to install
(``pip install 'distscaler[lightning]'``, ``".[docs]"``) exists in pyproject.toml. A wheel built
from the tree holds every module of the package and, installed outside the tree, imports with the
declared version and extras. CI also builds the sdist and the wheel with ``python -m build`` and
checks them with ``twine check`` (.ci/run).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import distscaler

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml (Python 3.11+)")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
EXTRAS = set(PYPROJECT["optional-dependencies"])

#: An extra named in a command or a message: distscaler[x], 'distscaler[x,y]', ".[x]", '.[x]'.
_EXTRA = re.compile(r"(?:\bdistscaler|(?<=[\"'])\.)\[(?P<names>[\w,\- ]+)\]")


def _import_in_subprocess(code: str, *, cwd: Path, pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip()


def test_version_is_in_all_and_is_pyprojects() -> None:
    assert "__version__" in distscaler.__all__
    assert distscaler.__version__ == PYPROJECT["version"]


def test_version_is_the_package_metadata_when_installed() -> None:
    try:
        installed = importlib.metadata.version("distscaler")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("distscaler is not installed here (the source tree's fallback is tested below)")
    assert distscaler.__version__ == installed


def test_version_falls_back_to_pyproject_in_a_source_tree_not_installed(tmp_path: Path) -> None:
    # No metadata: importlib.metadata.version raises, as in a tree that was never pip-installed.
    code = (
        "import importlib.metadata as m\n"
        "def version(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = version\n"
        "import distscaler\n"
        "print(distscaler.__version__, distscaler.__file__)\n"
    )
    version, where = _import_in_subprocess(code, cwd=tmp_path, pythonpath=str(ROOT)).split()
    assert Path(where).is_relative_to(ROOT)
    assert version == PYPROJECT["version"]
    # A copy of the package with no pyproject.toml beside it and no metadata: a placeholder.
    shutil.copytree(ROOT / "distscaler", tmp_path / "copy" / "distscaler")
    version, where = _import_in_subprocess(
        code, cwd=tmp_path, pythonpath=str(tmp_path / "copy")
    ).split()
    assert Path(where).is_relative_to(tmp_path / "copy")
    assert version == "0+unknown"


def _named_extras() -> dict[str, set[str]]:
    """Where each extra is named: the package's messages and comments, the pages, CI."""
    files = [
        *sorted((ROOT / "distscaler").rglob("*.py")),
        *sorted((ROOT / "docs").rglob("*.md")),
        *(ROOT / name for name in ("README.md", "CONTRIBUTING.md", ".ci/run")),
    ]
    named: dict[str, set[str]] = {}
    for path in files:
        if not path.is_file():
            continue
        for match in _EXTRA.finditer(path.read_text(encoding="utf-8")):
            for name in match["names"].split(","):
                named.setdefault(name.strip(), set()).add(path.relative_to(ROOT).as_posix())
    return named


def test_every_extra_named_exists() -> None:
    named = _named_extras()
    # The integrations' ImportErrors name their extra: the guard against finding nothing.
    assert {"lightning", "torchtitan", "transformers"} <= named.keys(), named
    missing = {name: sorted(where) for name, where in named.items() if name not in EXTRAS}
    assert missing == {}, f"extras named but not in pyproject.toml: {missing}"


def test_every_integration_has_its_extra() -> None:
    integrations = {
        p.stem for p in (ROOT / "distscaler" / "integrations").glob("*.py") if p.stem[0] != "_"
    }
    assert integrations == {
        "accelerate",
        "lightning",
        "transformers",
        "torchtitan",
        "megatron",
        "verl",
        "torchft",
        "nemo_rl",
        "areal",
        "slime",
        "roll",
    }
    assert integrations <= EXTRAS


def _setuptools_builds_offline() -> bool:
    # pyproject.toml's build requirement (setuptools>=77: the SPDX license string), if it is here.
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


@pytest.mark.slow
def test_wheel_holds_the_package_and_imports_outside_the_tree(tmp_path: Path) -> None:
    # Built from a copy of what a wheel is made of, so that the tree gets no build/ or egg-info.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "distscaler", source / "distscaler")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    isolation = ["--no-build-isolation"] if _setuptools_builds_offline() else []
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("distscaler-*.whl")
    assert wheel.name == f"distscaler-{PYPROJECT['version']}-py3-none-any.whl"

    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    packaged = {p.relative_to(site).as_posix() for p in (site / "distscaler").rglob("*.py")}
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "distscaler").rglob("*.py")}
    assert packaged == in_tree
    assert (site / "distscaler" / "py.typed").is_file()

    code = (
        "import importlib.metadata, distscaler\n"
        "meta = importlib.metadata.metadata('distscaler')\n"
        "print(distscaler.__file__)\n"
        "print(distscaler.__version__)\n"
        "print(','.join(sorted(meta.get_all('Provides-Extra'))))\n"
    )
    where, version, extras = _import_in_subprocess(code, cwd=tmp_path, pythonpath=str(site)).split()
    assert Path(where).is_relative_to(site)
    assert version == PYPROJECT["version"]
    # The wheel's metadata writes extras normalized (PEP 685: "nemo_rl" becomes "nemo-rl").
    assert {e.replace("-", "_") for e in extras.split(",")} == {e.replace("-", "_") for e in EXTRAS}
