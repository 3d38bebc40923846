"""The pages state the figures of docs/facts.yml, and no others; the code does what it says.

README.md and docs/**/*.md may name a tested version of torch, accelerate, lightning,
transformers, trl, torchtitan, megatron-core, verl, deepspeed or mbridge only as docs/facts.yml
lists it, and a test count ("N passed, M skipped") only as one of its stages or runs: two pages
cannot disagree, and a page cannot drift from CI's output. Three-part versions only ("torch>=2.6",
"megatron-core 0.17 and later" are ranges). Pure text, no import of the packages.

The step's collective (``step_collective``) is measured: on 2 gloo ranks (DDP) and 4 (HSDP 2 x 2),
each setting's every step has one collective, the all_reduce whose values, reduce op and dtype
facts.yml lists (tests/_facts_scenarios.py). A page's "N bytes", "N float32" or "N float64" about
that all_reduce is one of the measured sizes of the settings its sentence names (the defaults
unless it says ``replica_check=False``), "at most N bytes" their largest, and "N float32 ... with
MAX" a measured pair; the overflow report's all_gather is measured in the same run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
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


# ---------------------------------------------------------------------- lists kept in step


def _integration_extras() -> list[str]:
    """The extras of pyproject.toml named after an integration module (``distscaler.integrations.X``
    with an extra ``X``; an integration without one is tests/test_install.py's to find)."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.MULTILINE))
    modules = {p.stem for p in (ROOT / "distscaler" / "integrations").glob("*.py")}
    return sorted(extras & modules)


def test_every_integration_extra_is_named_where_the_extras_are_listed() -> None:
    """Getting started names every integration's extra; Install has a row for each."""
    extras = _integration_extras()
    assert {"accelerate", "torchft", "verl"} <= set(extras), extras
    started = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    (listed,) = re.findall(r"Each integration has its extra \(([^)]*)\)", started)
    assert sorted(re.findall(r"`([\w-]+)`", listed)) == extras
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    rows = set(re.findall(r'^\| `([\w-]+)` \|.*pip install "\.\[', install, re.MULTILINE))
    assert set(extras) <= rows, sorted(set(extras) - rows)


def test_api_index_lists_every_api_page() -> None:
    api = ROOT / "docs" / "api"
    modules = sorted(
        m
        for page in api.rglob("*.md")
        for m in re.findall(r"^:::\s+([\w.]+)", page.read_text(encoding="utf-8"), re.M)
    )
    index = (api / "index.md").read_text(encoding="utf-8")
    rows = sorted(re.findall(r"^\| \[`([\w.]+)`\]\(", index, re.MULTILINE))
    assert rows == modules
    assert "distscaler.integrations.torchft" in rows


# ---------------------------------------------------------------------- the step's collective

COLLECTIVE = FACTS["step_collective"]
#: A sentence (or a table row) is about the scaler's step collective when it names an all-reduce;
#: torchft's cross-replica ``manager.allreduce`` is another collective (docs/integrations/torchft.md).
_ABOUT_ALL_REDUCE = re.compile(r"all[_-]?reduce|collective", re.IGNORECASE)
_OTHER_COLLECTIVE = re.compile(r"manager\.allreduce|cross-replica")
#: A figure after a plural ("3 all_reduces, 32 bytes") is about someone else's collectives (torch's).
_PLURAL = re.compile(r"(?:all[_-]?reduce|collective)s\b[^|]*$", re.IGNORECASE)
_NUMBER = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "eight": 8}
_HOW_MANY = r"(\d+|one|two|three|four|five|six|eight)"
_BYTES = re.compile(r"(?P<most>at most )?(?P<n>\d+) bytes\b")
_FLOATS = re.compile(
    r"(?P<most>at most )?" + _HOW_MANY + r"(?: 0-dim)? (?P<dtype>float32|float64)\b"
    r"(?:[^.;|]{0,60}?\b(?:reduced )?with (?P<op>MAX|SUM)\b)?"
)
#: Groups of measured settings a sentence may speak of, and what names them. A sentence that names
#: none speaks of the defaults, on layouts with replicated gradients (DDP, HSDP).
#: Bytes per value of the collective's dtypes.
_ITEMSIZE = {"float32": 4, "float64": 8}
_GROUPS = {
    "replica check off": re.compile(
        r"replica_check=False|nothing (?:is )?replicated|no replica check"
    ),
    "parameter check": re.compile(r"param_check_interval|parameter check"),
}


def _group(name: str) -> set[tuple[int, str, str]]:
    """(values, op, dtype) of one group of measured settings, over its layouts and optimizers."""
    layouts = COLLECTIVE["layouts"]
    if name == "replica check off":
        picked = [
            opt
            for layout, per_setting in layouts.items()
            for setting, opt in per_setting.items()
            if "replica_check=False" in setting or layout.startswith("nothing replicated")
        ]
    else:
        word = "param_check" if name == "parameter check" else "defaults"
        picked = [
            opt
            for layout, per_setting in layouts.items()
            if not layout.startswith("nothing replicated")
            for setting, opt in per_setting.items()
            if setting.startswith(word)
        ]
    return {(count, op, dtype) for opt in picked for count, op, dtype in opt.values()}


def _groups_named(unit: str) -> list[str]:
    return ["defaults"] + [name for name, pattern in _GROUPS.items() if pattern.search(unit)]


def _units(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each sentence of prose and each table row (outside code blocks)."""
    in_code = False
    paragraph: list[tuple[int, str]] = []

    def flush() -> Iterator[tuple[int, str]]:
        if paragraph:
            joined = " ".join(line for _, line in paragraph)
            for sentence in re.split(r"(?<=[.;])\s+", joined):
                yield paragraph[0][0], sentence
            paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            yield from flush()
            continue
        if in_code:
            continue
        if line.lstrip().startswith("|"):
            yield from flush()
            yield number, line
        elif line.strip():
            paragraph.append((number, line.strip()))
        else:
            yield from flush()
    yield from flush()


def _collective_problems(text: str, name: str) -> list[str]:
    problems = []
    gather_bytes = FACTS["overflow_report"]["all_gather_bytes_per_rank"]
    for line, unit in _units(text):
        if "all_gather" in unit:
            stated = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) bytes", unit)]
            if any(n != gather_bytes for n in stated):
                problems.append(
                    f"{name}:{line}: {unit.strip()[:160]!r}: the overflow report's "
                    f"all_gather is {gather_bytes} bytes per rank"
                )
            continue
        if not _ABOUT_ALL_REDUCE.search(unit) or _OTHER_COLLECTIVE.search(unit):
            continue
        groups = {g: _group(g) for g in _groups_named(unit)}
        measured = set().union(*groups.values())
        sizes = {c * _ITEMSIZE[d] for c, _, d in measured}
        largest = {max(c * _ITEMSIZE[d] for c, _, d in g) for g in groups.values()}
        where = f"{name}:{line}: {unit.strip()[:160]!r} (measured for {sorted(groups)})"
        for m in _BYTES.finditer(unit):
            if _PLURAL.search(unit[: m.start()]):
                continue
            n = int(m["n"])
            if m["most"] and n not in largest:
                problems.append(f"{where}: {m[0]!r}, measured at most {sorted(largest)} bytes")
            elif not m["most"] and n not in sizes:
                problems.append(f"{where}: {m[0]!r}, measured {sorted(sizes)} bytes")
        for m in _FLOATS.finditer(unit):
            if _PLURAL.search(unit[: m.start()]):
                continue
            n, dtype = _NUMBER.get(m[2]) or int(m[2]), m["dtype"]
            counts = {c for c, _, d in measured if d == dtype}
            if m["most"]:
                most = {
                    max((c for c, _, d in g if d == dtype), default=None) for g in groups.values()
                }
                if n not in most:
                    problems.append(f"{where}: {m[0]!r}, measured at most {sorted(most - {None})}")
            elif n not in counts:
                problems.append(f"{where}: {m[0]!r}, measured {sorted(counts)} {dtype}")
            elif m["op"] and (n, m["op"], dtype) not in measured:
                problems.append(f"{where}: {m[0]!r}, measured {sorted(measured)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_states_only_the_measured_collective(page: Path) -> None:
    assert _collective_problems(page.read_text(encoding="utf-8"), _name(page)) == []


def test_the_collective_check_is_not_vacuous() -> None:
    """It finds a stale figure, in prose and in a table, and takes the settings a sentence names."""
    largest = max(c * _ITEMSIZE[d] for c, _, d in _group("defaults"))
    off = max(c * _ITEMSIZE[d] for c, _, d in _group("replica check off"))
    assert _collective_problems(f"One all_reduce of at most {largest} bytes per step.", "x") == []
    assert _collective_problems(f"One all_reduce of at most {largest + 8} bytes.", "x")
    assert _collective_problems(f"One all_reduce of at most {off} bytes per step.", "x")
    assert not _collective_problems(
        f"With `replica_check=False`, at most {off} bytes per all_reduce.", "x"
    )
    assert _collective_problems("| fused | 1 `all_reduce` of 7 float32 |", "x")
    assert _collective_problems("One all_reduce of one 0-dim float32, reduced with MAX.", "x")
    assert not _collective_problems(
        "With `replica_check=False`, the all_reduce is one float32 reduced with MAX.", "x"
    )
    assert not _collective_problems("torch's scaler: 3 all_reduces, 32 bytes in all.", "x")
    assert _collective_problems("The report's one all_gather of 9 bytes per rank.", "x")
    assert _collective_problems("```\none all_reduce of 7 float32\n```", "x") == []
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    stated = [u for _, u in _units(text) if _ABOUT_ALL_REDUCE.search(u) and _BYTES.search(u)]
    assert len(stated) >= 3, stated


#: Each spawn: its world size and the layouts (keys of step_collective.layouts) it measures.
SPAWNS = {
    "ddp": (2, ["DDP (2 ranks)", 'nothing replicated (2 ranks, grad_layout="sharded")']),
    "hsdp": (4, ["HSDP (2 x 2 ranks)"]),
}


def _yaml_row(setting: str, per_optimizer: dict[str, list]) -> str:
    cells = ", ".join(f"{o}: [{c}, {op}, {d}]" for o, (c, op, d) in per_optimizer.items())
    return f"      {setting}: {{{cells}}}"


@pytest.mark.parametrize("spawn_name", sorted(SPAWNS))
def test_the_step_collective_is_the_one_of_facts(spawn_name: str, tmp_path: Path) -> None:
    import _facts_scenarios as scenarios
    from _harness import spawn

    world_size, layouts = SPAWNS[spawn_name]
    assert set(layouts) <= set(COLLECTIVE["layouts"])
    results = spawn(getattr(scenarios, spawn_name), world_size, tmp_path)
    assert all(r == results[0] for r in results[1:]), "the ranks measured differently"
    report = results[0].pop("overflow report", None)
    assert sorted(results[0]) == sorted(layouts)
    wrong = []
    for layout, per_setting in results[0].items():
        measured: dict[str, dict[str, list]] = {}
        for setting, steps in per_setting.items():
            assert len(steps) == 2 * scenarios.STEPS, steps  # fused, then foreach
            assert not any(s["skipped"] for s in steps), steps  # clean: no report's all_gather
            for i, s in enumerate(steps):
                # a run's first replica check is preceded by its key's one broadcast (each
                # optimizer's run has a scaler of its own)
                first = COLLECTIVE["first_check_broadcasts"] if i % scenarios.STEPS == 0 else 0
                checked = "replica_check=False" not in setting and "nothing" not in layout
                extra = first if checked else 0
                assert s["collectives"] == COLLECTIVE["collectives_per_step"] + extra, (setting, s)
                assert len(s["all_reduce"]) == COLLECTIVE["collectives_per_step"], (setting, s)
                ((dtype, count, op),) = s["all_reduce"]
                seen = measured.setdefault(setting, {}).setdefault(
                    s["optimizer"], [count, op, dtype]
                )
                assert seen == [count, op, dtype], f"{layout}, {setting}: the steps differ: {steps}"
        facts = {
            setting: {o: list(v) for o, v in per_optimizer.items()}
            for setting, per_optimizer in COLLECTIVE["layouts"][layout].items()
        }
        if measured != facts:
            rows = "\n".join(_yaml_row(k, v) for k, v in measured.items())
            wrong.append(f"    {layout}:\n{rows}")
    assert not wrong, "docs/facts.yml's step_collective, as measured:\n" + "\n".join(wrong)
    if report is not None:
        assert report == FACTS["overflow_report"], f"overflow_report, as measured: {report}"
