"""MkDocs hook: an API page shows exactly its module's public names, each with a docstring.

The API pages (``docs/api/**.md``) each hold one ``::: module`` line; the public names of a module
are its ``__all__``, and of an exported class its public methods and properties defined in this
package. mkdocstrings filters a module's members by name only (a leading underscore), so this hook
gives each ``::: module`` an explicit ``members`` list, its ``__all__`` (``__version__`` included,
nothing else). A name without a docstring is a warning, which ``mkdocs build --strict`` turns into
a failure, as is a module without ``__all__``. Read statically with griffe (nothing is imported).
tests/test_api_html.py checks the built pages.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe

log = logging.getLogger("mkdocs.hooks.public_api")

_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
#: A ``::: module`` line, and its ``options:`` line if it has one.
_DIRECTIVE_OPTIONS = re.compile(r"^:::\s+([\w.]+)[ \t]*(\n    options:[ \t]*)?$", re.MULTILINE)


def _api_modules(docs_dir: Path) -> list[str]:
    names: list[str] = []
    for page in sorted((docs_dir / "api").rglob("*.md")):
        names += _DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    return names


def _missing(module: griffe.Module) -> list[str]:
    missing: list[str] = []
    if not module.docstring:
        missing.append(module.path)
    exports = module.exports if module.exports is not None else []
    for name in exports:
        name = name if isinstance(name, str) else name.name
        if name.startswith("__"):
            continue
        obj = module[name]
        if obj.is_alias:
            try:
                obj = obj.final_target
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue  # defined outside this package
        if obj.is_attribute:
            continue  # constants: their meaning is in the module's docstring or a comment
        if not obj.docstring:
            missing.append(obj.path)
        if obj.is_class:
            for member in obj.members.values():
                if member.is_alias or member.name.startswith("_"):
                    continue
                if (member.is_function or "property" in member.labels) and not member.docstring:
                    missing.append(member.path)
    return missing


#: module path -> its ``__all__``, for the pages' ``members`` lists (set by ``on_config``).
_EXPORTS: dict[str, list[str]] = {}


def _exports(module: griffe.Module) -> list[str]:
    return [n if isinstance(n, str) else n.name for n in module.exports or ()]


def on_config(config, **kwargs):
    docs_dir = Path(config["docs_dir"])
    loader = griffe.GriffeLoader(search_paths=[str(docs_dir.parent)])
    loader.load("distscaler")
    loader.resolve_aliases(implicit=False, external=False)
    _EXPORTS.clear()
    for path in _api_modules(docs_dir):
        module = loader.modules_collection[path]
        if not module.exports:
            log.warning("API page of %s: the module has no __all__", path)
        _EXPORTS[path] = _exports(module)
        for name in _missing(module):
            log.warning("public name without a docstring: %s", name)
    return config


def _with_members(match: re.Match) -> str:
    path = match[1]
    members = ", ".join(f'"{name}"' for name in _EXPORTS.get(path, []))
    if match[2]:  # the page sets options of its own: add the list to them
        return f"{match[0]}\n      members: [{members}]"
    return f"::: {path}\n    options:\n      members: [{members}]"


def on_page_markdown(markdown, page, **kwargs):
    if not page.file.src_uri.startswith("api/"):
        return markdown
    return _DIRECTIVE_OPTIONS.sub(_with_members, markdown)
