"""Loss-scale update rules ("policies"), applied on the device with no host read.

A policy turns the agreed ``found_inf`` of one iteration into the next loss scale. The scaler owns the
state tensors (so that ``state_dict`` stays torch-compatible); a policy only mutates them in place.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["ScalePolicy", "TorchPolicy", "get_policy"]


class ScalePolicy(Protocol):
    """The seam every update rule implements.

    ``update_`` must run entirely on the device of ``scale`` (no ``.item()``, no Python branching on
    tensor values), so that ``GradScaler.update()`` adds no host sync.
    """

    name: str

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
    ) -> None:
        """Update ``scale`` (0-dim float32) and ``growth_tracker`` (0-dim int32) in place.

        ``found_inf`` is a 0-dim float32 tensor on the same device, > 0 when the step overflowed.
        """
        ...


class TorchPolicy:
    """torch's rule, via the same kernel ``torch.amp.GradScaler.update`` uses (bit-identical).

    On overflow: ``scale *= backoff_factor`` and the growth tracker resets to 0. Otherwise the tracker
    counts clean steps; at ``growth_interval`` the scale is multiplied by ``growth_factor`` (only if the
    result is finite) and the tracker resets. Source: ``torch._amp_update_scale_``.
    """

    name = "torch"

    def update_(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        found_inf: torch.Tensor,
        *,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
    ) -> None:
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )


_POLICIES: dict[str, type] = {"torch": TorchPolicy}


def get_policy(name: str) -> ScalePolicy:
    """Return a fresh policy object by name. Raises ValueError for an unknown name."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(_POLICIES)}, got: {name!r}") from None
