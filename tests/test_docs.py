"""Every Python example of README.md, CONTRIBUTING.md and docs/ runs (Sybil), on the CPU.

One test per page runs the page's ```` ```python ```` blocks in order, in one namespace (a later
block may use what an earlier one made), with the repository as the working directory; the
integration guides and pages that start a process group each in a fresh Python process (their
examples build Accelerate's, Lightning's, Transformers' or torch.distributed's process-wide state,
which the other tests must not inherit). A page's multi-rank example runs there as one rank on
gloo. An example
that needs GPUs or several ranks carries ``<!-- skip: next "reason" -->`` right above it: it is
not run, and ``test_doc_example_skipped`` reports it as skipped with that reason. Hidden setup
goes in ``<!-- invisible-code-block: python ... -->``. ``mkdocs build --strict`` (CI's docs stage)
checks the links and the API reference; this module checks that the examples work.
tests/test_doc_blocks.py accounts for every other block (the shell commands, run or marked
``<!-- not run: reason -->``) and runs the core pages' examples with the library alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import SkipTest

import pytest

sybil = pytest.importorskip("sybil", reason="the doc-example runner (the `test` extra)")
from sybil.evaluators.skip import Skipper  # noqa: E402
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

#: Pages whose examples run. docs/benchmarks/ holds reports that launch/bench.py writes.
PAGES = sorted(
    [p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md") if p.exists()]
    + [
        p
        for p in (ROOT / "docs").rglob("*.md")
        if "benchmarks" not in p.relative_to(ROOT).parts[1:-1]
    ]
)

#: Floors, so that the suite cannot pass by running nothing (a renamed fence, a lost page): the
#: Python examples found, and those that actually ran.
MIN_EXAMPLES = 20
MIN_RUN = 15

_SKIP = re.compile(r'^<!-- skip: next "(?P<reason>[^"]+)" -->\n```python', re.MULTILINE)
_FENCE = re.compile(r"^(```python\s*|<!-- invisible-code-block: python\s*)$", re.MULTILINE)

_SYBIL = sybil.Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _skipped() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _SKIP.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            found.append((_name(page), line, match["reason"]))
    return found


def _pages_with_examples() -> list[Path]:
    return [p for p in PAGES if _FENCE.search(p.read_text(encoding="utf-8"))]


def _run_page(page: Path) -> tuple[int, int]:
    """Runs the page's examples in order; returns (examples run, examples skipped)."""
    ran = skipped = 0
    document = _SYBIL.parse(page)
    for example in document:
        is_code = not isinstance(example.region.evaluator, Skipper)
        try:
            example.evaluate()
        except SkipTest:
            skipped += 1
            continue
        ran += is_code
    return ran, skipped


def _run_page_in_a_process(page: Path, cwd: Path) -> tuple[int, int]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "launch"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, str(page)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{_name(page)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    ran, skipped = json.loads(done.stdout.strip().splitlines()[-1])
    return ran, skipped


@pytest.mark.parametrize("page", _pages_with_examples(), ids=_name)
def test_doc_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # From a directory of their own, as a reader runs them: no file of the repository at hand.
    text = page.read_text(encoding="utf-8")
    if "integrations" in page.relative_to(ROOT).parts or "init_process_group(" in text:
        ran, skipped = _run_page_in_a_process(page, tmp_path)
    else:
        monkeypatch.chdir(tmp_path)
        ran, skipped = _run_page(page)
    found = len(_FENCE.findall(text))
    # Every fenced example was either run or skipped with a reason.
    assert ran + skipped == found, f"{_name(page)}: {found} examples, {ran} ran, {skipped} skipped"


@pytest.mark.parametrize(
    ("page", "line", "reason"), _skipped(), ids=[f"{p}:{n}" for p, n, _ in _skipped()]
)
def test_doc_example_skipped(page: str, line: int, reason: str) -> None:
    pytest.skip(f"{page}:{line}: {reason}")


def test_doc_examples_are_found() -> None:
    pages = _pages_with_examples()
    found = sum(len(_FENCE.findall(p.read_text(encoding="utf-8"))) for p in pages)
    assert found >= MIN_EXAMPLES, f"only {found} Python examples in {len(pages)} pages"
    assert found - len(_skipped()) >= MIN_RUN, f"only {found - len(_skipped())} examples run"
    assert _name(ROOT / "README.md") in {_name(p) for p in pages}


if __name__ == "__main__":  # one page, in the process test_doc_examples_run starts
    print(json.dumps(_run_page(Path(sys.argv[1]))))


_LINK = re.compile(r"\]\((?!https?://|mailto:)(?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]+))?\)")


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page, as MkDocs' toc writes them."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.MULTILINE):
        slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
        anchors.add(re.sub(r"[\s]+", "-", slug))
    return anchors


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md"])
def test_links_outside_the_site_resolve(page: str) -> None:
    """README.md and CONTRIBUTING.md are not part of the site, so mkdocs does not check their
    links: each relative link names an existing file and, for a docs page, an existing heading."""
    text = (ROOT / page).read_text(encoding="utf-8")
    links = list(_LINK.finditer(text))
    assert links, f"{page} links to nothing"
    broken = []
    for link in links:
        target = ROOT / link["path"] if link["path"] else ROOT / page
        if not target.exists():
            broken.append(link.group(0))
        elif link["anchor"] and target.suffix == ".md" and link["anchor"] not in _anchors(target):
            broken.append(link.group(0))
    assert broken == []
