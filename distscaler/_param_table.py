"""``ParamTable``: a map from live tensors (parameters) to values, shared by the layouts and the
overflow report."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ParamTable"]


class ParamTable:
    """A map from live tensors to values.

    It holds the tensors strongly, as torch's optimizers hold their parameters: a weak reference
    to a parameter makes ``torch.utils.swap_tensors`` refuse it ("Cannot swap t1 because it has
    weakref associated with it"), and ``nn.Module.to()`` swaps FSDP2's DTensor parameters (a
    framework moving its model between training and rollout, to the CPU and back). An entry set
    with an ``owner`` (the module a registration came from) is dropped when that module is
    collected, so that a registration does not keep a model alive; the others live as long as
    the table (their tensors are an optimizer's parameters, which it holds anyway).

    Looked up once per gradient per step: a plain dict by ``id`` whose entries check that the id
    still names the same tensor.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, Any]] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            return None
        return entry[1]

    def set(self, tensor: torch.Tensor, value: Any, owner: object | None = None) -> None:
        key = id(tensor)
        self._entries[key] = (tensor, value)
        if owner is not None:
            weakref.finalize(owner, _forget, weakref.ref(self), key, value)


def _forget(table: weakref.ref[ParamTable], key: int, value: Any) -> None:
    # ``owner`` was collected: drop the entry it set, unless another set replaced it since.
    live = table()
    if live is not None:
        entry = live._entries.get(key)
        if entry is not None and entry[1] is value:
            del live._entries[key]
