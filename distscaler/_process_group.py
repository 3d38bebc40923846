"""The ranks that must agree on every step: the scaler's process group, looked up at each step.

`ScalerGroup` resolves the group a step's one collective runs over (`distscaler._inf_check.run()`
issues it) and its size, which decides whether the collective is needed and how the layouts weigh
gradients. Nothing is cached: a group whose membership changes (torchft's managed process group)
gives its current size at every step, and a ``process_group`` passed without ``init_process_group``
is used as it is (a ``torch.distributed.ProcessGroup`` built on a store, with its backend
registered, as torchft builds its groups).

**Groups whose membership changes** (`has_dynamic_membership()`): torchft's process groups
(``torchft.process_group``: ``ManagedProcessGroup``, its reconfigurable gloo/NCCL groups) and any
group that says so with a ``dynamic_membership = True`` attribute. For them the collective is issued
at **every** step, even when a size read says 1 (`needs_collective()`): the size is a snapshot of a
quorum that the collective itself may see change (a rejoining replica group's first step reads 1
participant while its peers read 2; skipping the collective there would hang them), and torchft's
managed all-reduce copes with one participant and zeroes a healing replica's contribution. The cost
is one all-reduce of at most two float32 on steps where the group really has one rank.

Nothing here is asked from a host read (``get_scale``, ``state_dict``): those read
`ScalerGroup.last_world_size`, written by the step path, so that torchft's quorum thread can call
``state_dict()`` while the group is being reconfigured.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["ScalerGroup", "World", "has_dynamic_membership", "needs_collective"]

#: Modules whose process groups change membership between steps (checked by name: importing
#: torchft here would make it a dependency).
_DYNAMIC_MODULES = ("torchft.",)
#: has_dynamic_membership's answer per group class (the class decides; asked at every collective).
_dynamic_types: dict[type, bool] = {}


def has_dynamic_membership(group: object) -> bool:
    """Whether ``group``'s membership may change between steps: a ``dynamic_membership = True``
    attribute, or a class defined in torchft (``torchft.process_group.ManagedProcessGroup`` and its
    reconfigurable groups). No collective, no host read; the class answer is cached per class."""
    if group is None:
        return False
    flag = getattr(group, "dynamic_membership", None)
    if flag is not None:
        return bool(flag)
    kind = type(group)
    known = _dynamic_types.get(kind)
    if known is None:
        known = any(c.__module__.startswith(_DYNAMIC_MODULES) for c in kind.__mro__)
        _dynamic_types[kind] = known
    return known


def needs_collective(group: dist.ProcessGroup | None, world_size: int) -> bool:
    """Whether a step's found_inf must be all-reduced over ``group``: it has more than one rank, or
    its membership changes (`has_dynamic_membership()`: issued even at a size of 1)."""
    return world_size > 1 or has_dynamic_membership(group)


class World(NamedTuple):
    """The ranks of one step, resolved once when its plan is built.

    Attributes:
        group: the process group (None: the default one, or this process alone).
        size: its number of ranks (torchft's: the replica group's).
        collective: whether the step issues its collective (`needs_collective()`).
        dynamic: whether the group's membership changes (`has_dynamic_membership()`).
    """

    group: dist.ProcessGroup | None
    size: int
    collective: bool
    dynamic: bool = False


class ScalerGroup:
    """The process group a scaler agrees over.

    Args:
        process_group: the ranks that must agree; None: the default group (WORLD) once
            ``torch.distributed`` is initialized, else this process alone. Used as given, also
            without ``init_process_group``; one whose membership changes
            (`has_dynamic_membership()`) is all-reduced at every step.

    No reference to the default group is kept: one kept past ``destroy_process_group()`` would be
    torn down at interpreter exit, which aborts gloo ("terminate called without an active
    exception").
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        #: The world size the last step saw (1 before any): for log lines, which must not ask the
        #: group (a host read may run on another thread while the group is busy: torchft's quorum).
        self.last_world_size = 1

    def __getstate__(self) -> dict[str, Any]:
        # A ProcessGroup cannot be pickled: the copy agrees over the default group.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None)  # type: ignore[misc]

    def resolve(self) -> tuple[dist.ProcessGroup | None, int]:
        """(process group, world size) for this step; the group is None for the default one, and
        (None, 1) while ``torch.distributed`` is not initialized and no group was given. Asks the
        group at every call (a C++ lookup, no collective; for torchft's managed group, the current
        number of participants, which waits for the step's quorum)."""
        group = self.process_group
        if group is not None:
            world_size = group.size()
        elif dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = 1
        if not torch.compiler.is_compiling():  # no attribute written while traced (recompiles)
            self.last_world_size = world_size
        return group, world_size

    def world(self) -> World:
        """`resolve()` as a `World`, with whether the step needs its collective: asked once per
        step, when its plan is built."""
        group, size = self.resolve()
        dynamic = has_dynamic_membership(group)
        return World(group, size, size > 1 or dynamic, dynamic)
