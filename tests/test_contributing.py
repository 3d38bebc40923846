"""CONTRIBUTING.md's layer table is the code's: each module of ``distscaler/`` on the floor its
imports put it (floor 1 imports no other module of the package; a module stands one floor above
the highest it imports; a package inside it, ``integrations/``, ``_triton/`` or ``_replica/``,
counts as one module), computed here from the imports. On a failure the message holds the table to
paste."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "distscaler"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"


def _room(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) > 1:  # a package inside distscaler/: one room
        return f"{rel.parts[0]}/"
    return rel.with_suffix("").as_posix()


def _imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports (relative or absolute, any depth)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE)
    here = list(rel.parts[:-1])
    found: set[str] = set()
    typing_only = {  # imports under `if TYPE_CHECKING:` are for type hints, not layers
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                prefix = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "distscaler":
                prefix = node.module.split(".")[1:]
            else:
                continue
            names = ["/".join([*prefix, alias.name]) for alias in node.names] + ["/".join(prefix)]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".", 1)[1].replace(".", "/") for a in node.names
                     if a.name.startswith("distscaler.")]  # fmt: skip
        for name in names:
            target = PACKAGE / f"{name}.py"
            if target.exists():
                found.add(_room(target))
            elif (PACKAGE / name / "__init__.py").exists() and name:
                found.add(_room(PACKAGE / name / "__init__.py"))
    return found


def floors() -> dict[str, int]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        graph.setdefault(_room(path), set()).update(_imports(path))
    for room, deps in graph.items():
        deps.discard(room)
    memo: dict[str, int] = {}

    def floor(room: str, seen: tuple[str, ...] = ()) -> int:
        assert room not in seen, f"import circle: {' -> '.join([*seen, room])}"
        if room not in memo:
            memo[room] = 1 + max((floor(d, (*seen, room)) for d in graph[room]), default=0)
        return memo[room]

    return {room: floor(room) for room in graph}


def table() -> str:
    by_floor: dict[int, list[str]] = {}
    for room, f in floors().items():
        by_floor.setdefault(f, []).append(room)
    rows = ["| floor | modules |", "|---|---|"]
    for f in sorted(by_floor, reverse=True):
        rows.append(f"| {f} | {', '.join(f'`{m}`' for m in sorted(by_floor[f]))} |")
    return "\n".join(rows)


def test_contributing_layer_table_matches_the_imports():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert match, f"CONTRIBUTING.md has no {BEGIN} ... {END} block"
    expected = table()
    assert match.group(1).strip() == expected, f"paste into CONTRIBUTING.md:\n{expected}"


def test_contributing_map_names_every_module_and_no_other():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    layout = text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\b([a-z_]+)\.py\b", layout))
    modules = {p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
    elsewhere = {p.stem for d in ("launch", "tests") for p in (ROOT / d).rglob("*.py")}
    assert modules - named == set(), "modules the map does not name"
    assert named - modules - elsewhere == set(), "names in the map that are no module"
