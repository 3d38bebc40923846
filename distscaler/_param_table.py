"""``ParamTable``: a map from live tensors (parameters) to values that holds them weakly, shared
by the layouts and the overflow report."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ParamTable"]


class ParamTable:
    """A map from live tensors to values that holds the tensors weakly.

    Looked up once per gradient per step, so it avoids ``WeakIdKeyDictionary``'s per-lookup
    object creation: a plain dict by ``id`` whose entries check that the id still names the same
    tensor, and drop themselves when it dies.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]

    def set(self, tensor: torch.Tensor, value: Any) -> None:
        key = id(tensor)
        entries = self._entries

        def forget(ref: weakref.ref, key: int = key) -> None:
            if key in entries and entries[key][0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(tensor, forget), value)
