"""The ranks that must agree on every step: the scaler's process group, looked up at each step.

:class:`ScalerGroup` resolves the group a step's one collective runs over
(:func:`distscaler.inf_check.run` issues it) and its size, which decides whether the collective is
needed and how the layouts weigh gradients. Nothing is cached: a group whose membership changes
(torchft's managed process group) gives its current size at every step, and a ``process_group``
passed without ``init_process_group`` is used as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ScalerGroup"]


class ScalerGroup:
    """The process group a scaler agrees over.

    Args:
        process_group: the ranks that must agree; None: the default group (WORLD) once
            ``torch.distributed`` is initialized, else this process alone.

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
        group at every call (a C++ lookup, no collective)."""
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
