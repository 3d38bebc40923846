"""The API reference's Returns and Yields tables have one row per value returned.

mkdocstrings (Google style, griffe) reads each line of a Returns section at the section's indent
as a new returned value: a description wrapped onto a second line at that indent renders as a
second row of the table, the type repeated. A continuation line is indented one level deeper. This
reads every public object of the API pages (``docs/api/**.md``: ``::: module``) with griffe, as the
site's build does; skipped without griffe (the ``docs`` extra, in the ``test`` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="reads the docstrings as the site does (docs extra)")

ROOT = Path(__file__).resolve().parent.parent


def _api_modules() -> list[str]:
    found = []
    for page in sorted((ROOT / "docs" / "api").rglob("*.md")):
        found += re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(encoding="utf-8"), re.M)
    return found


def _public_objects():
    package = griffe.load("distscaler", search_paths=[str(ROOT)], allow_inspection=False)
    seen = set()
    for module_path in _api_modules():
        module = (
            package[module_path.removeprefix("distscaler.")]
            if module_path != "distscaler"
            else package
        )
        for name in module.exports or []:
            try:
                obj = module[name].final_target if module[name].is_alias else module[name]
            except (griffe.AliasResolutionError, griffe.CyclicAliasError, KeyError):
                continue
            todo = [obj]
            if obj.is_class:
                todo += [
                    m for n, m in obj.members.items() if not n.startswith("_") and not m.is_alias
                ]
            for o in todo:
                if o.path not in seen:
                    seen.add(o.path)
                    yield o


def test_every_returns_section_is_one_row_per_value() -> None:
    rows = {}
    checked = 0
    for obj in _public_objects():
        if obj.docstring is None:
            continue
        for section in obj.docstring.parse(griffe.Parser.google, warn_unknown_params=False):
            if section.kind.value in ("returns", "yields"):
                checked += 1
                if len(section.value) > 1:
                    rows[obj.path] = [item.description for item in section.value]
    assert checked >= 5, f"only {checked} Returns sections found"
    assert rows == {}, "a wrapped line read as a second returned value (indent it one level)"
