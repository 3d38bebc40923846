"""The packages a script of ``launch/`` needs, checked before it starts a process or a step.

A job that finds out at its end that it cannot plot (or at its first step that it cannot show a
progress bar) has wasted the run: :func:`require` imports every package of a ``pyproject.toml``
extra up front and names all the missing ones, with the command that installs them, in one message.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["EXTRAS", "missing", "require"]

#: pyproject.toml's extras as {extra: {module to import: distribution to install}}; the library
#: and torch come with every one of them.
EXTRAS: dict[str, dict[str, str]] = {
    "train": {
        "torch": "torch",
        "distscaler": "distscaler",
        "tqdm": "tqdm",
        "yaml": "PyYAML",
        "pydantic": "pydantic",
        "numpy": "numpy",
        "matplotlib": "matplotlib",
    },
}
EXTRAS["accelerate"] = {**EXTRAS["train"], "accelerate": "accelerate"}
EXTRAS["transformers"] = {**EXTRAS["accelerate"], "transformers": "transformers"}
EXTRAS["torchtitan"] = {**EXTRAS["train"], "torchtitan": "torchtitan"}
EXTRAS["megatron"] = {**EXTRAS["train"], "megatron.core": "megatron-core"}
EXTRAS["verl"] = {**EXTRAS["train"], "verl": "verl", "transformers": "transformers"}
EXTRAS["areal"] = {**EXTRAS["train"], "areal": "areal", "transformers": "transformers"}


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` whose module does not import here (sorted, no duplicates)."""
    try:
        modules = EXTRAS[extra]
    except KeyError:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got: {extra!r}") from None
    absent = set()
    for module, distribution in modules.items():
        try:
            importlib.import_module(module)
        except ImportError:
            absent.add(distribution)
    return sorted(absent, key=str.lower)


def require(extra: str, script: str) -> None:
    """Exit with code 2 and one message if a package of ``extra`` is missing; return otherwise.

    Call it first thing in a script's ``main``, before any process group, file or step.
    """
    absent = missing(extra)
    if absent:
        print(
            f"{script} needs distscaler's '{extra}' extra; missing: {', '.join(absent)}.\n"
            f'Install it from the repository root with: pip install -e ".[{extra}]"',
            file=sys.stderr,
        )
        raise SystemExit(2)
