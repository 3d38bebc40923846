"""MkDocs hook: every public name of an API page has a docstring, or the strict build fails.

The API pages (``docs/api/**.md``) each hold one ``::: module`` line; the public names of a module
are its ``__all__``, and of an exported class its public methods and properties defined in this
package. A name without a docstring is a warning, which ``mkdocs build --strict`` turns into a
failure. Read statically with griffe (nothing is imported).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe

log = logging.getLogger("mkdocs.hooks.public_api")

_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


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


def on_config(config, **kwargs):
    docs_dir = Path(config["docs_dir"])
    loader = griffe.GriffeLoader(search_paths=[str(docs_dir.parent)])
    loader.load("distscaler")
    loader.resolve_aliases(implicit=False, external=False)
    for path in _api_modules(docs_dir):
        module = loader.modules_collection[path]
        for name in _missing(module):
            log.warning("public name without a docstring: %s", name)
    return config
