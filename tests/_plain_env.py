"""A fresh venv that holds torch and nothing else of this environment: torch and what it requires,
linked from this interpreter (no network, no wheel unpacked), for the tests of a plain install
(tests/test_plain_install.py, tests/test_doc_blocks.py)."""

from __future__ import annotations

import re
from pathlib import Path


def link_torch(site: Path) -> None:
    """torch and what it requires, linked from this interpreter into ``site``: no network, and
    nothing else of this environment (no extra, no test package; numpy neither, which torch does
    not require)."""
    import importlib.metadata as metadata

    names, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in names:
            continue
        names.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists() and top != "..":
                (site / top).symlink_to(source)
