"""The pages state the figures of docs/facts.yml, and no others.

README.md and docs/**/*.md may name a tested version of torch, accelerate, lightning,
transformers, trl, torchtitan, megatron-core, verl, deepspeed or mbridge only as docs/facts.yml
lists it, and a test count ("N passed, M skipped") only as one of its stages or runs: two pages
cannot disagree, and a page cannot drift from CI's output. Three-part versions only ("torch>=2.6",
"megatron-core 0.17 and later" are ranges). Pure text, no import of the packages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (the `train` extra)")

ROOT = Path(__file__).resolve().parent.parent
FACTS = yaml.safe_load((ROOT / "docs" / "facts.yml").read_text(encoding="utf-8"))
PACKAGES = (
    "torch",
    "accelerate",
    "lightning",
    "transformers",
    "trl",
    "torchtitan",
    "megatron-core",
    "verl",
    "deepspeed",
    "mbridge",
    "torchft",
)
# docs/benchmarks/ holds the reports launch/bench.py writes; docs/api/ only ::: directives.
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if p.relative_to(ROOT / "docs").parts[0] != "api"
)

# "torch 2.13.0", "megatron-core **0.19.2**", "torch==2.13.0" (a pip command), "torch 2.11.0+cu130".
_VERSION = re.compile(
    r"(?<![\w-])(?P<package>" + "|".join(map(re.escape, PACKAGES)) + r")"
    r"(?:\s+\**|==)(?P<version>\d+\.\d+\.\d+)(?![\d.]*\d)",
    re.IGNORECASE,
)
_COUNT = re.compile(r"(?<![\d,])(?P<passed>\d[\d,]*) passed(?:, (?P<skipped>\d[\d,]*) skipped)?")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _known_versions() -> dict[str, set[str]]:
    return {pkg: {str(v) for v in FACTS["versions"][pkg]} for pkg in PACKAGES}


def _known_counts() -> set[tuple[int, int | None]]:
    known: set[tuple[int, int | None]] = set()
    for table in ("test_counts", "other_counts"):
        for count in FACTS[table].values():
            known.add((count["passed"], count.get("skipped")))
            if count.get("skipped") == 0:
                known.add((count["passed"], None))  # "29 passed" says the same
    return known


def test_facts_name_every_package_and_date_the_ci_run() -> None:
    assert set(FACTS["versions"]) == set(PACKAGES)
    assert FACTS["ci_run"]["date"] and FACTS["ci_run"]["command"]


def test_pinned_versions_are_the_pyproject_pins() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for package, version in re.findall(r'"([\w-]+)==(\d+\.\d+\.\d+)', pyproject):
        if package in PACKAGES:
            assert version in _known_versions()[package], f"pyproject pins {package}=={version}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_states_only_the_versions_of_facts(page: Path) -> None:
    known = _known_versions()
    text = page.read_text(encoding="utf-8")
    wrong = [
        f"{_name(page)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()} "
        f"(docs/facts.yml: {sorted(known[m['package'].lower()])})"
        for m in _VERSION.finditer(text)
        if m["version"] not in known[m["package"].lower()]
    ]
    assert wrong == []


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_states_only_the_test_counts_of_facts(page: Path) -> None:
    known = _known_counts()
    text = page.read_text(encoding="utf-8")
    wrong = []
    for m in _COUNT.finditer(text):
        passed = int(m["passed"].replace(",", ""))
        skipped = int(m["skipped"].replace(",", "")) if m["skipped"] else None
        if (passed, skipped) not in known:
            line = text.count("\n", 0, m.start()) + 1
            wrong.append(f"{_name(page)}:{line}: {m.group(0)}")
    assert wrong == []


def test_the_checks_are_not_vacuous() -> None:
    """The patterns find what the pages state (a renamed table would otherwise pass)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    found = {m["package"].lower() for m in _VERSION.finditer(text)}
    assert {"torch", "transformers", "megatron-core", "verl"} <= found
    suite = FACTS["test_counts"]["suite (torch 2.13.0, pytest -n auto)"]
    assert f"{suite['passed']} passed, {suite['skipped']} skipped" in text
    assert _VERSION.search("a page on transformers 5.23.0")["version"] == "5.23.0"
    assert _VERSION.search("megatron-core 0.17 and later") is None
