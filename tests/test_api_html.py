"""The built API reference shows exactly the public API, rendered (not raw reStructuredText).

Builds the site once (``mkdocs build --strict``, about 10 s; or reuses the one at
``$DISTSCALER_DOCS_SITE``) and reads each API page (``docs/api/**.md``, one ``::: module`` each):

* every name of the module's ``__all__`` has its heading on the page;
* no other name does: a heading is the module, a name of ``__all__``, or a member of one (a public
  class's own members), never a private name;
* no Sphinx role is left as text (``:meth:`` and the like: mkdocstrings does not render them);
* nothing else that marks a docstring rendered wrong: a reStructuredText table border (``=====``),
  a quote block (a line of a docstring wrapped to start with ``>``), a private class in "Bases:",
  reStructuredText's literal markup (a double backquote, as in a parameter's type ``````"a"`` |
  ``"b"```````: Markdown shows it as it is);
* no private name: none in a rendered signature or value (a name with a leading underscore: a
  dataclass's private field, a value computed by a private function); no link, and no link title,
  to a module of ``distscaler`` that has no API page (an internal one) or a private object; in the
  text no ``distscaler._x`` or ``distscaler.<internal module>``, no private module of
  ``distscaler`` by name, no private attribute named after distscaler (``optimizer._distscaler``),
  no test helper (``tests/_x.py``). Private names of torch and of the frameworks (the
  ``Trainer._inner_training_loop`` an integration overrides) are theirs to name;
* ``GradScaler`` shows every public method of ``torch.amp.GradScaler``, the inherited ones too.

Skipped without mkdocs and mkdocstrings (the ``docs`` extra); under ``CI=true`` (CI installs the
extra, .ci/run) their absence fails instead. The tests share one build, on one xdist worker.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
API_DOCS = ROOT / "docs" / "api"

pytestmark = pytest.mark.xdist_group("docs_site")

ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj):")
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def _module_all(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (nothing imported: an integration's
    framework need not be installed)."""
    path = ROOT.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has an API page but no literal __all__")


def _pages() -> list[tuple[str, str]]:
    """(page path under docs/, module) for each API page with a ``::: module`` line."""
    found = []
    for page in sorted(API_DOCS.rglob("*.md")):
        for module in _DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            found.append((page.relative_to(ROOT / "docs").as_posix(), module))
    return found


PAGES = _pages()


class _Page(HTMLParser):
    """The headings mkdocstrings renders (``class="doc doc-heading"``, by id), the text of the
    article, the "Bases:" paragraphs, the rendered signatures and values (``doc-signature``, with
    the titles inside them), and every link target and title of the article."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.headings: list[str] = []
        self.text: list[str] = []
        self.bases: list[str] = []
        self.signatures: list[str] = []
        self.links: list[str] = []
        self.blockquotes = 0
        self._in_article = 0
        self._in_bases = 0
        self._signature_depth = 0  # open <div>s since a doc-signature's own, plus 1

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if "doc-heading" in classes and attributes.get("id"):
            self.headings.append(attributes["id"] or "")
        if tag == "article":
            self._in_article += 1
        if tag == "blockquote" and self._in_article:
            self.blockquotes += 1
        if tag == "p" and "doc-class-bases" in classes:
            self._in_bases = 1
            self.bases.append("")
        if tag == "div" and self._signature_depth:
            self._signature_depth += 1
        elif tag == "div" and "doc-signature" in classes:
            self._signature_depth = 1
            self.signatures.append("")
        if self._in_article:
            self.links += [v for k, v in attrs if k in ("href", "title") and v]
            if self._signature_depth and attributes.get("title"):
                self.signatures[-1] += f" [{attributes['title']}] "

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self._in_article -= 1
        if tag == "p":
            self._in_bases = 0
        if tag == "div" and self._signature_depth:
            self._signature_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._in_article:
            self.text.append(data)
        if self._in_bases:
            self.bases[-1] += data
        if self._signature_depth:
            self.signatures[-1] += data


def _site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reused = os.environ.get("DISTSCALER_DOCS_SITE")
    if reused:
        site = Path(reused)
        assert (site / "api" / "index.html").is_file(), f"no built site at {site}"
        return site
    missing = [m for m in ("mkdocs", "mkdocstrings_handlers.python", "material") if not _has(m)]
    if missing:
        message = (
            f"the docs extra is not installed (no {', '.join(missing)}): pip install -e '.[docs]'"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    site = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    return site


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _site_dir(tmp_path_factory)


def _read(site: Path, page: str) -> _Page:
    url = page.removesuffix(".md")
    url = url.removesuffix("index").rstrip("/")
    html = site / url / "index.html"
    assert html.is_file(), f"{page} was not built ({html})"
    parsed = _Page()
    parsed.feed(html.read_text(encoding="utf-8"))
    return parsed


def test_api_pages_found() -> None:
    modules = [m for _, m in PAGES]
    assert "distscaler" in modules and len(modules) >= 10, modules


@pytest.mark.parametrize(("page", "module"), PAGES, ids=[m for _, m in PAGES])
def test_api_page_shows_exactly_all(site: Path, page: str, module: str) -> None:
    exports = _module_all(module)
    parsed = _read(site, page)
    headings = [h for h in parsed.headings if h.startswith(module + ".")]
    foreign = [h for h in parsed.headings if h != module and not h.startswith(module + ".")]
    assert not foreign, f"{page}: headings of another module: {foreign}"
    top = {h[len(module) + 1 :].split(".")[0] for h in headings}
    missing = [name for name in exports if name not in top]
    assert not missing, f"{page}: names of {module}.__all__ not rendered: {missing}"
    extra = sorted(top - set(exports))
    assert not extra, f"{page}: rendered but not in {module}.__all__: {extra}"
    private = [
        h for h in headings if any(p.startswith("_") for p in h.split(".")[module.count(".") + 2 :])
    ]
    assert not private, f"{page}: private members rendered: {private}"


@pytest.mark.parametrize(("page", "module"), PAGES, ids=[m for _, m in PAGES])
def test_api_page_renders_docstrings(site: Path, page: str, module: str) -> None:
    parsed = _read(site, page)
    text = "".join(parsed.text)
    roles = sorted({text[max(0, m.start() - 30) : m.end() + 40] for m in ROLE.finditer(text)})
    assert not roles, f"{page}: Sphinx roles left as text: {roles}"
    assert "=====" not in text, f"{page}: a reStructuredText table left as text"
    assert not parsed.blockquotes, f"{page}: {parsed.blockquotes} quote block(s) (a wrapped '>'?)"
    private_bases = [b for b in parsed.bases if re.search(r"(^|[\s.,:])_\w", b)]
    assert not private_bases, f"{page}: private classes in Bases: {private_bases}"


#: The modules of distscaler that have an API page, and the packages that hold them
#: (``distscaler.integrations``); every other module of the package is internal.
PUBLIC_MODULES = {
    ".".join(module.split(".")[:i]) for _, module in PAGES for i in range(1, module.count(".") + 2)
}
#: Every module of the package, by dotted path.
MODULES = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "distscaler").rglob("*.py")
}
#: The package's private modules by name (``_packed``), which a page must not name either.
PRIVATE_MODULE_NAMES = {m.rsplit(".", 1)[-1] for m in MODULES if m.rsplit(".", 1)[-1][0] == "_"}
_PATH = re.compile(r"distscaler(?:\.[A-Za-z_]\w*)+")
_PRIVATE = re.compile(r"(?<![\w])_[A-Za-z]\w*")


def _internal(path: str) -> str | None:
    """The internal module or private name a dotted ``distscaler...`` path goes through, if any:
    its longest prefix that is a module of the package must have an API page, and no part of it
    may start with an underscore (dunders aside)."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.endswith("__"):
            return ".".join(parts[: i + 1])
    modules = [
        ".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES
    ]
    if modules and modules[0] not in PUBLIC_MODULES:
        return modules[0]
    return None


def _private_names(parsed: _Page) -> dict[str, list[str]]:
    """What of distscaler's private or internal names a built page shows, by where it shows it."""
    found: dict[str, list[str]] = {}
    for signature in parsed.signatures:
        names = [n for n in _PRIVATE.findall(signature) if not n.endswith("__")]
        names += [n for n in re.findall(r"\.(_[A-Za-z]\w*)", signature) if not n.endswith("__")]
        if names:
            found.setdefault("signatures and values", []).append(
                f"{sorted(set(names))} in {' '.join(signature.split())[:200]!r}"
            )
    for link in parsed.links:
        bad = [_internal(p) for p in _PATH.findall(link)]
        if any(bad):
            found.setdefault("links and link titles", []).append(f"{link} ({bad})")
    text = " ".join("".join(parsed.text).split())
    for m in _PATH.finditer(text):
        if _internal(m[0]):
            found.setdefault("text", []).append(text[max(0, m.start() - 60) : m.end() + 20])
    for pattern in (
        r"distscaler/_\w+",  # a private module's file
        r"tests/_\w+",  # a test helper
        r"\._\w*distscaler\w*",  # a private attribute distscaler attaches (optimizer._distscaler)
        r"(?<![\w.])(?:" + "|".join(sorted(PRIVATE_MODULE_NAMES)) + r")\b",
    ):
        for m in re.finditer(pattern, text):
            found.setdefault("text", []).append(text[max(0, m.start() - 60) : m.end() + 20])
    return found


@pytest.mark.parametrize(("page", "module"), PAGES, ids=[m for _, m in PAGES])
def test_api_page_shows_no_private_name(site: Path, page: str, module: str) -> None:
    found = _private_names(_read(site, page))
    assert not found, f"{page}: private or internal names: {found}"


@pytest.mark.parametrize(("page", "module"), PAGES, ids=[m for _, m in PAGES])
def test_api_page_has_no_literal_markup(site: Path, page: str, module: str) -> None:
    text = "".join(_read(site, page).text)
    literal = sorted({text[max(0, i - 40) : i + 40] for i in _finditer("``", text)})
    assert not literal, f"{page}: reStructuredText's double backquotes left as text: {literal}"


def _finditer(needle: str, text: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(needle), text)]


def test_the_private_name_checks_are_not_vacuous() -> None:
    """Each kind of leak the pages had is found (built from HTML as mkdocstrings writes it)."""
    page = _Page()
    page.feed(
        '<article><div class="doc-signature highlight"><pre><code>ReplicaLedger(checks: int = 0,'
        " _events: deque = deque())</code></pre></div>"
        '<div class="doc-signature"><pre><code>__version__: str = _version()</code></pre></div>'
        '<a title="GradScaler (distscaler._scaler.GradScaler)" href="#distscaler.GradScaler">x</a>'
        '<span title="distscaler._validation">V</span>'
        "<p>packed (distscaler._packed); see optimizer._distscaler and "
        "tests/_transformers_scenarios.py; the _packed rules</p></article>"
    )
    found = _private_names(page)
    assert len(found["signatures and values"]) == 2, found
    assert len(found["links and link titles"]) == 2, found
    assert len(found["text"]) >= 4, found
    clean = _Page()
    clean.feed(
        '<article><div class="doc-signature"><pre><code>GradScaler(device: str = "cuda")</code>'
        '</pre></div><a title="distscaler.policies.LossScalePolicy" href="#x">x</a>'
        "<p>Megatron's Trainer._inner_training_loop; __version__; distscaler.GradScaler</p>"
        "</article>"
    )
    assert _private_names(clean) == {}


def test_grad_scaler_shows_torch_methods(site: Path) -> None:
    page = _read(site, "api/distscaler.md")
    torch_methods = [
        name
        for name, value in vars(torch.amp.GradScaler).items()
        if not name.startswith("_") and callable(value)
    ]
    assert {"scale", "is_enabled", "unscale_", "step", "update"} <= set(torch_methods)
    missing = [n for n in torch_methods if f"distscaler.GradScaler.{n}" not in page.headings]
    assert not missing, f"GradScaler's page lacks torch.amp.GradScaler's {missing}"
