"""Where the library meets a torch that moved: the one place that compares torch versions.

Each caller names what differs and on which versions it was checked; nothing else in
``distscaler`` reads ``torch.__version__``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["torch_at_least"]


@functools.cache
def _release() -> tuple[int, int]:
    # "2.13.0+cpu", "2.6.0+cu124", "2.16.0a0+git..." -> (2, 13)
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is release ``major.minor`` or newer (pre-releases count as it)."""
    return _release() >= (major, minor)
