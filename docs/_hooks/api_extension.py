"""Griffe extension for the API reference (mkdocs.yml: mkdocstrings' ``extensions``).

A page shows exactly its module's ``__all__`` (the ``members`` list that ``public_api.py`` adds to
each ``::: module``), and of a class its members without a leading underscore (``filters``). This
extension adds what the package's own source does not hold:

* ``distscaler.GradScaler`` subclasses ``torch.amp.GradScaler``; the methods it inherits unchanged
  (``scale``, ``is_enabled``) are added to it, with torch's signature (read from the installed
  torch's ``torch/amp/grad_scaler.py``, one file parsed, torch not imported) and a docstring that
  says what they do here (``TORCH_METHODS``). Loading torch itself for ``inherited_members`` would
  take about 45 s per build and render torch's reStructuredText docstrings raw;
* ``OptState``, torch's enum re-exported by ``distscaler``, is documented from the same file;
* an attribute documented by ``#:`` comment lines right above it (the package's convention for
  constants and class attributes: ``__version__``, ``MIN_SCALE_MESSAGE``,
  ``LossScalePolicy.name``...) gets them as its docstring, which griffe does not read itself;

and hides what would show a private name in a rendered signature or value:

* a parameter whose name starts with an underscore (a dataclass's private field, such as
  ``ReplicaLedger._events``, is a parameter of its generated ``__init__``);
* an attribute's value, or a parameter's default, that names a private object
  (``__version__ = _version()``, ``view = _MainGrads(...)``, ``V.check_bool`` of
  ``distscaler._validation``): the attribute shows its name and annotation, the parameter
  ``...`` as its default.

A public method of torch's GradScaler that GradScaler neither overrides nor ``TORCH_METHODS``
documents (a newer torch) is a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

import griffe

log = logging.getLogger("mkdocs.plugins.distscaler_api")

#: The class that inherits from torch (found through the package's export, wherever it is
#: defined), and where torch's class and enum are defined.
SCALER = "distscaler.GradScaler"
TORCH_MODULE = "torch.amp.grad_scaler"

#: What each inherited method does on a ``distscaler.GradScaler`` (Google style, as ours).
TORCH_METHODS = {
    "scale": """Multiply ("scale") a tensor or an iterable of tensors by the loss scale.

Inherited from `torch.amp.GradScaler`, unchanged: call `scaler.scale(loss).backward()` as with
torch's scaler. The first call creates the scale (and the policy's counters) on the device of
`outputs` ([`materialize`][distscaler.GradScaler.materialize] does it on a rank that never scales
a loss). No collective, no host read: the scale stays on the device. Disabled: `outputs` is
returned unchanged.

Args:
    outputs (Tensor | Iterable[Tensor]): the loss, or several outputs (lists and tuples keep
        their type; each tensor is multiplied on its own device).

Returns:
    The scaled outputs, of the type of `outputs`.
""",
    "is_enabled": """Whether this scaler is enabled.

Inherited from `torch.amp.GradScaler`, unchanged. False when built with `enabled=False`, and when
built for `"cuda"` on a machine without CUDA (torch's warning, then disabled). A disabled scaler
only clips: `clip_grad_norm_` is `torch.nn.utils.clip_grad_norm_` over the optimizer's parameters,
`step` calls `optimizer.step()`, every other method is a no-op; no collective, no host read.

Returns:
    Whether the scaler scales, checks and updates.
""",
}

OPT_STATE_DOC = """torch's `torch.amp.grad_scaler.OptState`, re-exported: an optimizer's stage in this iteration.

`READY` until [`unscale_`][distscaler.GradScaler.unscale_] or
[`clip_grad_norm_`][distscaler.GradScaler.clip_grad_norm_] makes it `UNSCALED`, then `STEPPED`
after [`step`][distscaler.GradScaler.step]; [`update`][distscaler.GradScaler.update] starts the
next iteration at `READY`. The same enum as torch's, for code that compares stages.
"""


@functools.cache
def _torch_module() -> griffe.Module | None:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        log.warning("torch is not installed: GradScaler's inherited methods cannot be documented")
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "amp" / "grad_scaler.py"
    return griffe.visit(TORCH_MODULE, filepath=path, code=path.read_text(encoding="utf-8"))


def _docstring(text: str, parent: griffe.Object, like: griffe.Docstring | None) -> griffe.Docstring:
    # Parsed as the package's own docstrings are (mkdocs.yml's docstring_style and options).
    return griffe.Docstring(
        text.strip(),
        parent=parent,
        parser=like.parser if like else None,
        parser_options=like.parser_options if like else None,
    )


def _private(name: str) -> bool:
    """A name with a leading underscore, not a dunder (``_x``, ``distscaler._packed``)."""
    return any(p.startswith("_") and not p.endswith("__") for p in name.split("."))


def _names_private(value: object) -> bool:
    """Whether a value or default (a griffe expression, or its source text) names a private
    object: a name with a leading underscore, or one that resolves into a private module."""
    if value is None:
        return False
    if isinstance(value, str):
        return bool(re.search(r"(?<![\w.])_[A-Za-z]\w*|\._[A-Za-z]", value))
    for part in value.iterate(flat=True) if isinstance(value, griffe.Expr) else ():
        if isinstance(part, griffe.ExprName):
            try:
                path = part.canonical_path
            except Exception:  # noqa: BLE001 - an unresolvable name: judge it by its own
                path = part.name
            if _private(part.name) or (path.startswith("distscaler") and _private(path)):
                return True
    return False


def _hide_private(obj: griffe.Object) -> None:
    """Hide private parameters, and values and defaults that name private objects, in ``obj``
    and its members (aliases left alone: they are documented where they are defined)."""
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        if isinstance(member, griffe.Attribute) and _names_private(member.value):
            member.value = None
        if isinstance(member, griffe.Function):
            kept = [p for p in member.parameters if not _private(p.name) or p.name.endswith("__")]
            for parameter in kept:
                if _names_private(parameter.default):
                    parameter.default = "..."
            member.parameters = griffe.Parameters(*kept)
        if isinstance(member, (griffe.Module, griffe.Class)):
            _hide_private(member)


def _exported(pkg: griffe.Module) -> dict[str, str]:
    """Where each name ``distscaler`` exports is defined -> its public path (``distscaler.X``)."""
    public: dict[str, str] = {}
    for name in pkg.exports or ():
        name = name if isinstance(name, str) else name.name
        member = pkg.members.get(name)
        if member is not None and member.is_alias:
            try:
                public[member.final_target.path] = f"{pkg.path}.{name}"
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
    return public


def _public_bases(obj: griffe.Object, public: dict[str, str]) -> None:
    """Each class's bases as the page shows them: the public path of a class ``distscaler``
    exports (``distscaler.GradScaler``, not the module it is defined in), else the full path
    (``extra["distscaler"]["bases"]``, read by templates/python/material/class.html.jinja)."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Class):
            shown = []
            for base in member.bases:
                path = base.canonical_path if isinstance(base, griffe.Expr) else str(base)
                shown.append(public.get(path, path))
            member.extra["distscaler"]["bases"] = shown
        if isinstance(member, (griffe.Module, griffe.Class)):
            _public_bases(member, public)


class DistscalerAPI(griffe.Extension):
    """Documents GradScaler's methods inherited from torch, OptState, and ``#:`` attributes;
    hides private parameters and values that name private objects."""

    def on_attribute_instance(
        self, *, attr: griffe.Attribute, agent: griffe.Visitor | griffe.Inspector, **kwargs: Any
    ) -> None:
        if attr.docstring is not None or not attr.lineno or not isinstance(agent, griffe.Visitor):
            return
        lines = agent.code.split("\n")
        above = attr.lineno - 2  # the line above the assignment, 0-based
        comment: list[str] = []
        while above >= 0 and lines[above].lstrip().startswith("#:"):
            comment.insert(0, lines[above].lstrip()[2:].strip())
            above -= 1
        if comment:
            attr.docstring = griffe.Docstring(
                "\n".join(comment),
                lineno=above + 2,
                endlineno=attr.lineno - 1,
                parent=attr,
                parser=agent.docstring_parser,
                parser_options=agent.docstring_options,
            )

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "distscaler":
            return
        # Dataclasses get their generated __init__ now (griffe's own extension runs after this
        # one and leaves a class that has one), so that their private fields can be hidden.
        griffe.DataclassesExtension().on_package(pkg=pkg)
        _hide_private(pkg)
        _public_bases(pkg, _exported(pkg))
        torch_module = _torch_module()
        if torch_module is None:
            return
        ours = pkg["GradScaler"]
        if ours.is_alias:
            ours = ours.final_target
        scaler_module = ours.parent
        theirs = torch_module["GradScaler"]
        added = set()
        for name, member in list(theirs.members.items()):
            if name.startswith("_") or name in ours.members:
                continue
            if name not in TORCH_METHODS:
                log.warning(
                    "torch.amp.GradScaler.%s is inherited by %s without a docstring here: add "
                    "it to TORCH_METHODS in docs/_hooks/api_extension.py",
                    name,
                    SCALER,
                )
                continue
            if isinstance(member, griffe.Function):
                member.overloads = None  # one signature: torch's implementation's
            member.docstring = _docstring(TORCH_METHODS[name], member, ours.docstring)
            ours.set_member(name, member)
            added.add(name)
        for name in sorted(set(TORCH_METHODS) - added):
            log.warning("TORCH_METHODS documents %s, which %s no longer inherits", name, SCALER)
        if "OptState" in scaler_module.members and scaler_module.members["OptState"].is_alias:
            opt_state = torch_module["OptState"]
            opt_state.docstring = _docstring(OPT_STATE_DOC, opt_state, ours.docstring)
            scaler_module.set_member("OptState", opt_state)
